"""Prometheus metrics of a training run (one exporter per rank) and the JSONL log.

Every rank serves ``/metrics`` from its own ``CollectorRegistry`` (never the process-global
default one), with labels ``job``, ``rank`` and, where it makes sense, ``teacher`` and ``shape``;
the step is a value (``crosskd_train_step``), never a label, so series do not multiply. Metric
names: ``crosskd_train_loss``, ``crosskd_train_kd_loss``, ``crosskd_train_ce_loss``,
``crosskd_kd_scale``, ``crosskd_learning_rate``, ``crosskd_train_step``, ``crosskd_tokens_total``,
``crosskd_chunks_total{teacher, shape}``, ``crosskd_step_seconds`` (histogram),
``crosskd_heldout_bits_per_byte`` (the last held-out evaluation) and
``crosskd_last_checkpoint_step``.
"""

from __future__ import annotations

import json

import fsspec
from fsspec.implementations.local import LocalFileSystem
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from crosskd.loss.metrics import SHAPES


class MetricsExporter:
    """The metrics of one rank; ``serve(port)`` starts the HTTP endpoint (port 0: any free
    port; the chosen one is :attr:`port`). The step's values are complete (reduced over all
    ranks), so the counters ``crosskd_tokens_total`` and ``crosskd_chunks_total`` are counted
    by one rank only (``count_totals``), and summing them over ranks gives the run's totals."""

    def __init__(self, job: str, rank: int, *, count_totals: bool = True) -> None:
        self.count_totals = count_totals
        self.registry = CollectorRegistry()
        labels = {"job": job, "rank": str(rank)}
        self._labels = labels
        names = list(labels)

        def gauge(name: str, text: str) -> Gauge:
            return Gauge(name, text, names, registry=self.registry).labels(**labels)

        self.loss = gauge("crosskd_train_loss", "Total loss of the last step")
        self.kd = gauge("crosskd_train_kd_loss", "KD term of the last step (before kd_scale)")
        self.ce = gauge("crosskd_train_ce_loss", "Student CE of the last step")
        self.kd_scale = gauge("crosskd_kd_scale", "kd_scale of the last micro-batch")
        self.lr = gauge("crosskd_learning_rate", "Learning rate of the last step")
        self.step = gauge("crosskd_train_step", "Optimizer steps done")
        self.heldout = gauge("crosskd_heldout_bits_per_byte",
                             "Student bits per byte on the held-out data, last evaluation")
        self.checkpoint = gauge("crosskd_last_checkpoint_step",
                                "Step of the last complete checkpoint")  # fmt: skip
        self.tokens = Counter("crosskd_tokens_total", "Student CE tokens trained on", names,
                              registry=self.registry).labels(**labels)  # fmt: skip
        self._chunks = Counter("crosskd_chunks_total", "Counted KD chunks by teacher and shape",
                               [*names, "teacher", "shape"], registry=self.registry)  # fmt: skip
        self.seconds = Histogram(
            "crosskd_step_seconds", "Wall seconds per optimizer step", names,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120), registry=self.registry,
        ).labels(**labels)  # fmt: skip
        self.port: int | None = None
        self._server = None

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on ``host:port`` (port 0: a free one); returns the port."""
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        self.port = self._server.server_port
        return self.port

    def close(self) -> None:
        """Stop the HTTP endpoint."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def record(self, step: int, metrics: dict[str, float], seconds: float) -> None:
        """Update every metric from one step's values (``loss``, ``ce``, ``kd``, ``kd_scale``,
        ``lr``, ``tokens``, ``{teacher}/{shape}/valid`` chunk counts, and
        ``heldout_bits_per_byte`` on a step that evaluated)."""
        self.loss.set(metrics["loss"])
        self.ce.set(metrics["ce"])
        self.kd.set(metrics["kd"])
        self.kd_scale.set(metrics["kd_scale"])
        self.lr.set(metrics["lr"])
        self.step.set(step)
        self.seconds.observe(seconds)
        if "heldout_bits_per_byte" in metrics:
            self.heldout.set(metrics["heldout_bits_per_byte"])
        if not self.count_totals:
            return
        self.tokens.inc(metrics["tokens"])
        for key, value in metrics.items():
            parts = key.split("/")
            if len(parts) == 3 and parts[2] == "valid" and parts[1] in SHAPES:
                self._chunks.labels(**self._labels, teacher=parts[0], shape=parts[1]).inc(value)


class JsonlLog:
    """Appends one JSON object per step to ``uri`` (any fsspec URI)."""

    def __init__(self, uri: str) -> None:
        self.uri = uri

    def write(self, record: dict) -> None:
        """Append ``record`` as one line (object stores have no append: there the file is
        rewritten, which costs its size per step)."""
        fs, path = fsspec.core.url_to_fs(self.uri)
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        if isinstance(fs, LocalFileSystem):
            with fs.open(path, "ab") as fh:
                fh.write(line)
            return
        old = fs.cat_file(path) if fs.exists(path) else b""
        fs.pipe_file(path, old + line)
