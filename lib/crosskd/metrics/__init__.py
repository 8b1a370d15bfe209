"""Training metrics: a Prometheus exporter per rank and a JSONL log (:mod:`.exporter`)."""

from crosskd.metrics.exporter import JsonlLog, MetricsExporter

__all__ = ["JsonlLog", "MetricsExporter"]
