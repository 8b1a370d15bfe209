"""Prometheus metrics of the pipeline's batch steps: teacher scoring and data preparation.

Each step's pod serves them on one port while it runs (the step functions in
:mod:`crosskd.steps` take ``metrics_port``); the scoring PodMonitor in ``manifests/monitoring``
scrapes that port number on pods labelled ``app.kubernetes.io/component`` ``score-teacher`` or
``prepare``. Every metric is listed in ``docs/metrics.md``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from crosskd.errors import CrosskdError
from crosskd.metrics.serving import MetricsServer

log = logging.getLogger(__name__)

SHARD_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 3600)
"""Buckets of ``crosskd_scoring_shard_seconds`` (seconds)."""
CLIP_REASONS = ("text", "turns", "message")
"""Why a prepared row was clipped: a text cut to the longest prefix every model holds
(``text``), a conversation's later turns left out (``turns``), or a message's text cut
(``message``)."""


class ScoringMetrics(MetricsServer):
    """The metrics of one scoring process, which scores one teacher (``teacher``: its name in
    the prepared data and the training metrics, ``teacher0``, ...)."""

    def __init__(self, teacher: str) -> None:
        super().__init__(CollectorRegistry())
        labels = {"teacher": teacher}

        def counter(name: str, text: str) -> Counter:
            return Counter(name, text, ["teacher"], registry=self.registry).labels(**labels)

        def gauge(name: str, text: str) -> Gauge:
            return Gauge(name, text, ["teacher"], registry=self.registry).labels(**labels)

        self.samples = counter("crosskd_scoring_samples", "Samples scored")
        self.tokens = counter("crosskd_scoring_tokens", "Teacher tokens scored")
        self.bytes = counter("crosskd_scoring_bytes_written", "Cache bytes written")
        self.shards_done = gauge(
            "crosskd_scoring_shards_done", "Shards of this pod's range that are complete"
        )
        self.shards = gauge("crosskd_scoring_shards", "Shards in this pod's range")
        self.shard_seconds = Histogram(
            "crosskd_scoring_shard_seconds",
            "Wall seconds per shard scored",
            ["teacher"],
            buckets=SHARD_BUCKETS,
            registry=self.registry,
        ).labels(**labels)


class PrepareMetrics(MetricsServer):
    """The metrics of one preparation process (both splits)."""

    def __init__(self) -> None:
        super().__init__(CollectorRegistry())
        self._rows = Counter(
            "crosskd_prepare_rows", "Rows read and prepared", ["split"], registry=self.registry
        )
        self._clipped = Counter(
            "crosskd_prepare_clipped_rows",
            "Rows clipped to fit, by reason",
            ["split", "reason"],
            registry=self.registry,
        )

    def row(self, split: str, clip_reason: str | None) -> None:
        """Count one prepared row of ``split``, clipped for ``clip_reason`` (None: whole)."""
        self._rows.labels(split=split).inc()
        if clip_reason is not None:
            self._clipped.labels(split=split, reason=clip_reason).inc()


@contextlib.contextmanager
def served(
    server: MetricsServer, port: int | None, what: str, final_scrape_s: float = 30.0
) -> Iterator[MetricsServer]:
    """Serve ``server`` on ``port`` (0: a free one; None: not served) for the body of the
    ``with``, then close it (:meth:`MetricsServer.close`). ``what`` names the step in logs."""
    if port is not None:
        try:
            chosen = server.serve(port)
        except OSError as exc:
            raise CrosskdError(
                f"{what}: metrics_port {port}: cannot serve /metrics ({exc}); "
                f"choose a free port (0: any) or -1 for none."
            ) from exc
        log.info("%s serves /metrics on port %d", what, chosen)
    try:
        yield server
    finally:
        server.close(final_scrape_s)
