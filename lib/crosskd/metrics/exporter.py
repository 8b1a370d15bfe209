"""Prometheus metrics of a training run (one exporter per rank) and the JSONL log.

Every rank serves ``/metrics`` from its own ``CollectorRegistry`` (never the process-global
default one; :class:`~crosskd.metrics.serving.MetricsServer`). The process labels its series
with ``rank`` and, where it makes sense, ``teacher`` and ``shape``; the scrape adds ``job``,
``namespace`` and ``pod`` (the PodMonitors in ``manifests/monitoring``), so the process never
exports a ``job`` label of its own. The step is a value (``crosskd_train_step``), never a label,
so series do not multiply. Every metric is listed in ``docs/metrics.md``.
"""

from __future__ import annotations

import json
import math
import time

import fsspec
from fsspec.implementations.local import LocalFileSystem
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from crosskd.loss.metrics import SHAPES
from crosskd.metrics.serving import MetricsServer

STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
"""Buckets of ``crosskd_train_step_seconds`` (seconds)."""
CHECKPOINT_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
"""Buckets of ``crosskd_train_checkpoint_seconds`` (seconds)."""


class MetricsExporter(MetricsServer):
    """The training metrics of one rank. The step's values are complete (reduced over all
    ranks), so the counters ``crosskd_train_tokens_total`` and ``crosskd_train_chunks_total``
    are counted by one rank only (``count_totals``): summing them over ranks gives the run's
    totals. ``teachers``: the teachers' names (the ``teacher`` label of the KD terms)."""

    def __init__(
        self, rank: int, teachers: list[str], *, planned_steps: int, count_totals: bool = True
    ) -> None:
        super().__init__(CollectorRegistry())
        self.count_totals = count_totals
        self._rank = str(rank)
        registry = self.registry

        def gauge(name: str, text: str) -> Gauge:
            return Gauge(name, text, ["rank"], registry=registry).labels(rank=self._rank)

        def counter(name: str, text: str) -> Counter:
            return Counter(name, text, ["rank"], registry=registry).labels(rank=self._rank)

        self.loss = gauge("crosskd_train_loss", "Total loss of the last optimizer step")
        self.ce = gauge(
            "crosskd_train_ce_loss", "Student cross-entropy of the last step, nats per token"
        )
        self._kd = Gauge(
            "crosskd_train_kd_loss",
            "Each teacher's CSD KD term of the last step (before kd_scale)",
            ["rank", "teacher"],
            registry=registry,
        )
        self.kd = {name: self._kd.labels(rank=self._rank, teacher=name) for name in teachers}
        self.kd_scale = gauge("crosskd_train_kd_scale", "kd_scale of the last micro-batch")
        self.lr = gauge("crosskd_train_learning_rate", "Learning rate of the last step")
        self.grad_norm = gauge(
            "crosskd_train_grad_norm", "L2 norm of the gradient before clipping, last step"
        )
        self.step = gauge("crosskd_train_step", "Optimizer steps done in the run")
        self.planned = gauge("crosskd_train_planned_steps", "The run's configured steps")
        self.planned.set(planned_steps)
        self.steps = counter("crosskd_train_steps", "Optimizer steps done by this process")
        # Exported from the first evaluation on (a run without held-out data has no series,
        # rather than a misleading 0).
        self.heldout = Gauge(
            "crosskd_train_heldout_bits_per_byte",
            "Student bits per byte on the held-out data, last evaluation",
            ["rank"],
            registry=registry,
        )
        self.checkpoint = gauge(
            "crosskd_train_last_checkpoint_step", "Step of the last complete checkpoint"
        )
        self.checkpoint_seconds = Histogram(
            "crosskd_train_checkpoint_seconds",
            "Wall seconds to write one checkpoint",
            ["rank"],
            buckets=CHECKPOINT_BUCKETS,
            registry=registry,
        ).labels(rank=self._rank)
        self.nonfinite = counter(
            "crosskd_train_nonfinite_stops", "Runs stopped by a NaN or infinite loss term"
        )
        self.resumed = gauge(
            "crosskd_train_resumed_step", "The step this process resumed from (0: a fresh start)"
        )
        self.started = gauge(
            "crosskd_train_start_time_seconds", "Unix time this process started training"
        )
        self.tokens = counter(
            "crosskd_train_tokens", "Student CE tokens trained on (counted by rank 0 only)"
        )
        self._chunks = Counter(
            "crosskd_train_chunks",
            "KD chunks counted, by teacher and shape (counted by rank 0 only)",
            ["rank", "teacher", "shape"],
            registry=registry,
        )
        self.input_wait = counter(
            "crosskd_train_input_wait_seconds",
            "Wall seconds the steps waited for their inputs (data read, collated, planned)",
        )
        self.seconds = Histogram(
            "crosskd_train_step_seconds",
            "Wall seconds per optimizer step",
            ["rank"],
            buckets=STEP_BUCKETS,
            registry=registry,
        ).labels(rank=self._rank)

    def start(self, resumed_step: int) -> None:
        """Mark the start of training in this process, resumed from ``resumed_step``."""
        self.resumed.set(resumed_step)
        self.step.set(resumed_step)
        self.started.set(time.time())

    def record(self, step: int, metrics: dict[str, float], seconds: float) -> None:
        """Update every metric from one step's values (``loss``, ``ce``, ``kd/{teacher}``,
        ``kd_scale``, ``lr``, ``grad_norm``, ``tokens``, ``{teacher}/{shape}/valid`` chunk
        counts, ``input_wait_s``, and ``heldout_bits_per_byte`` on a step that evaluated)."""
        self.loss.set(metrics["loss"])
        self.ce.set(metrics["ce"])
        for name, gauge in self.kd.items():
            gauge.set(metrics.get(f"kd/{name}", math.nan))
        self.kd_scale.set(metrics["kd_scale"])
        self.lr.set(metrics["lr"])
        self.grad_norm.set(metrics.get("grad_norm", math.nan))
        self.step.set(step)
        self.steps.inc()
        self.seconds.observe(seconds)
        self.input_wait.inc(metrics.get("input_wait_s", 0.0))
        if "heldout_bits_per_byte" in metrics:
            self.heldout.labels(rank=self._rank).set(metrics["heldout_bits_per_byte"])
        if not self.count_totals:
            return
        self.tokens.inc(metrics["tokens"])
        for key, value in metrics.items():
            parts = key.split("/")
            if len(parts) == 3 and parts[2] == "valid" and parts[1] in SHAPES:
                self._chunks.labels(rank=self._rank, teacher=parts[0], shape=parts[1]).inc(value)

    def stopped_by(self, term: str, value: float) -> None:
        """A non-finite ``term`` (``loss``, ``ce``, ``kd`` or ``grad_norm``) stopped the run:
        the term's gauges (the loss gauge too for a loss term) show the value and
        ``crosskd_train_nonfinite_stops_total`` counts the stop."""
        gauges = {
            "ce": [self.loss, self.ce],
            "kd": [self.loss, *self.kd.values()],
            "grad_norm": [self.grad_norm],
        }.get(term, [self.loss])
        for gauge in gauges:
            gauge.set(value)
        self.nonfinite.inc()


class JsonlLog:
    """One JSON object per step, for ``uri`` (any fsspec URI; read back with
    :func:`read_jsonl_log`).

    On a local filesystem each record is appended to ``uri`` at once. An object store has no
    append, and rewriting the whole log each step would cost its size per step: there records go
    into part objects ``<uri>.parts/part-NNNNNN.jsonl`` (numbered on from the parts already
    there, so a resumed run adds parts). The open part is written when ``flush_s`` seconds have
    passed since its last write, on :meth:`flush` (the trainer flushes at every checkpoint, so
    the log holds every step a resume does not redo) and on :meth:`close`; after
    ``part_records`` records it is written a last time and a new part begins. A write costs at
    most one part, never the whole log."""

    def __init__(self, uri: str, *, flush_s: float = 30.0, part_records: int = 1000) -> None:
        self.uri = uri
        self.fs, self.path = fsspec.core.url_to_fs(uri)
        self.local = isinstance(self.fs, LocalFileSystem)
        self.flush_s = flush_s
        self.part_records = part_records
        self.lines: list[bytes] = []
        self.written = time.monotonic()
        self.part = None if self.local else len(self.fs.glob(f"{self.path}.parts/part-*.jsonl"))
        self.fs.makedirs(self.path.rsplit("/", 1)[0], exist_ok=True)

    def write(self, record: dict) -> None:
        """Append ``record`` as one line (module docstring: at once, or with the open part)."""
        line = (json.dumps(record, sort_keys=True) + "\n").encode()
        if self.local:
            with self.fs.open(self.path, "ab") as fh:
                fh.write(line)
            return
        self.lines.append(line)
        if len(self.lines) >= self.part_records:
            self.flush()
            self.lines, self.part = [], self.part + 1
        elif time.monotonic() - self.written >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        """Write the open part (object stores; nothing to do locally or with no records)."""
        if self.local or not self.lines:
            return
        self.fs.pipe_file(f"{self.path}.parts/part-{self.part:06d}.jsonl", b"".join(self.lines))
        self.written = time.monotonic()

    def close(self) -> None:
        """Write what is not written yet."""
        self.flush()


def read_jsonl_log(uri: str) -> list[dict]:
    """Every record of the log :class:`JsonlLog` writes at ``uri``: the lines of ``uri`` itself
    (a local log), then those of its parts in order (an object store's); empty when there is
    none."""
    fs, path = fsspec.core.url_to_fs(uri)
    files = [path] if fs.exists(path) else []
    files += sorted(fs.glob(f"{path}.parts/part-*.jsonl"))
    return [
        json.loads(line)
        for file in files
        for line in fs.cat_file(file).decode().splitlines()
        if line
    ]
