"""Training metrics: a Prometheus exporter per rank and a JSONL log (:mod:`.exporter`)."""

from crosskd.metrics.exporter import JsonlLog, MetricsExporter, read_jsonl_log

__all__ = ["JsonlLog", "MetricsExporter", "read_jsonl_log"]
