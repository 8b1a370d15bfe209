"""One process's ``/metrics`` endpoint over its own ``CollectorRegistry``.

A pod that ends stops being scraped, so the last values a step or a run reaches would be lost
between two scrapes. :meth:`MetricsServer.close` therefore waits (at most ``final_scrape_s``)
for one more scrape after the last update, but only where a scraper has come before: a run with
no Prometheus watching stops at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)


class _ScrapeCounter(Collector):
    """Counts the collections of its registry (one per scrape); exports nothing."""

    def __init__(self) -> None:
        self.count = 0
        self.changed = threading.Condition()

    def collect(self) -> Iterator[Metric]:
        with self.changed:
            self.count += 1
            self.changed.notify_all()
        return iter(())


class MetricsServer:
    """Serves ``registry`` over HTTP; ``serve(port)`` starts it (port 0: a free one, then
    :attr:`port`), ``close()`` waits for a final scrape (module docstring) and stops it."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.port: int | None = None
        self._scrapes = _ScrapeCounter()
        registry.register(self._scrapes)
        self._server = None

    @property
    def scrapes(self) -> int:
        """How many times the endpoint has been read."""
        return self._scrapes.count

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on ``host:port`` (port 0: a free one); returns the port.

        Raises:
            OSError: The address cannot be bound (the port is taken, the host is not local).
        """
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        self.port = self._server.server_port
        return self.port

    def close(self, final_scrape_s: float = 60.0) -> None:
        """Stop the endpoint; if it has been scraped before, first wait up to
        ``final_scrape_s`` seconds for one more scrape, which reads the final values."""
        if self._server is None:
            return
        with self._scrapes.changed:
            seen = self._scrapes.count
            if seen and final_scrape_s > 0:
                deadline = time.monotonic() + final_scrape_s
                while self._scrapes.count == seen and time.monotonic() < deadline:
                    self._scrapes.changed.wait(deadline - time.monotonic())
                if self._scrapes.count == seen:
                    log.warning(
                        "/metrics on port %s: no final scrape within %.0f s",
                        self.port,
                        final_scrape_s,
                    )
        self._server.shutdown()
        self._server.server_close()
        self._server = None
