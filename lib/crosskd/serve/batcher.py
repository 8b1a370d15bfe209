"""Dynamic batching of ``crosskd serve``: requests from many clients scored together.

Requests wait in one FIFO queue bounded by tokens: :meth:`Batcher.submit` refuses at once (429)
a request that would take the tokens held (waiting or being scored) past ``max_queue_tokens``,
so memory stays bounded whatever the load. One worker thread takes requests in order until
their tokens reach ``max_batch_tokens`` (or the next one would pass it), waiting at most
``max_wait_s`` after the first for more to fill the batch, and scores all their sequences
together: sequences of different requests share model batches
(:func:`crosskd.teacher.scoring.budget_batches`, each model batch at most ``max_batch_tokens``
padded tokens, longest first). Each request gets its own sequences' signals back, in order. An
exception while scoring fails the requests of that batch only (their futures raise
:class:`BatchFailed`) and the worker goes on with the next. :meth:`Batcher.drain` stops the
waiting to fill (no more requests are coming); :meth:`Batcher.close` refuses new requests,
lets the worker finish what is queued and joins it.

A sequence's signal may depend on the model batch it shares (the other rows, the padding width)
in the last bits, where kernels are chosen by shape; the same sequences in the same model batch
give identical signals (``docs/serving.md``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from crosskd.serve.protocol import RequestError
from crosskd.teacher.scoring import budget_batches
from crosskd.teacher.storage import SampleSignal

log = logging.getLogger(__name__)

ScoreBatch = Callable[[list[np.ndarray]], list[SampleSignal]]
"""Scores one model batch: sequences (int ``[L_i]``) -> their signals, in order
(:func:`crosskd.teacher.scoring.score_sequences` with the teacher, K and tau bound)."""

SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
"""Buckets of ``crosskd_serve_request_seconds``."""
TOKEN_BUCKETS = tuple(2**i for i in range(4, 18))
"""Buckets of ``crosskd_serve_batch_tokens`` (16 .. 131072)."""
REQUEST_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Buckets of ``crosskd_serve_batch_requests``."""


class BatchFailed(Exception):
    """Scoring the batch a request was in raised; the message is the reason."""


class ServeMetrics:
    """The metrics of one ``crosskd serve`` process, in their own registry (``docs/metrics.md``,
    "Teacher server")."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "crosskd_serve_requests",
            "/v1/ requests answered, by HTTP status code",
            ["code"],
            registry=registry,
        )
        self.request_seconds = Histogram(
            "crosskd_serve_request_seconds",
            "Seconds from receipt to answer of a /v1/score request answered 200",
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        self.batch_tokens = Histogram(
            "crosskd_serve_batch_tokens",
            "Tokens (without padding) per model batch",
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.batch_requests = Histogram(
            "crosskd_serve_batch_requests",
            "Requests scored together in one batch",
            buckets=REQUEST_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter(
            "crosskd_serve_tokens", "Tokens scored (in batches that succeeded)", registry=registry
        )
        self.queue_requests = Gauge(
            "crosskd_serve_queue_requests",
            "Requests held: waiting or being scored",
            registry=registry,
        )
        self.queue_tokens = Gauge(
            "crosskd_serve_queue_tokens",
            "Tokens of the requests held (the max_queue_tokens bound)",
            registry=registry,
        )
        self.ready = Gauge(
            "crosskd_serve_ready",
            "1 while the server takes requests (0: loading or draining)",
            registry=registry,
        )


@dataclass
class _Job:
    """One request in the queue."""

    sequences: list[np.ndarray]
    tokens: int
    future: Future = field(default_factory=Future)


class Batcher:
    """The queue and its worker (module docstring). ``score``: one model batch's scoring;
    ``max_batch_tokens``: tokens per batch (padded, per model batch); ``max_wait_s``: seconds a
    batch waits to fill; ``max_queue_tokens``: the bound on tokens held; ``retry_after_s``: said
    in the 429 message."""

    def __init__(
        self,
        score: ScoreBatch,
        *,
        max_batch_tokens: int,
        max_wait_s: float,
        max_queue_tokens: int,
        retry_after_s: int,
        metrics: ServeMetrics,
    ) -> None:
        self._score = score
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_s
        self.max_queue_tokens = max_queue_tokens
        self.retry_after_s = retry_after_s
        self.metrics = metrics
        self._queue: deque[_Job] = deque()
        self._held_tokens = 0
        self._held_requests = 0
        self._draining = False
        self._closed = False
        self._changed = threading.Condition()
        self._worker = threading.Thread(target=self._run, name="crosskd-serve-batcher", daemon=True)
        self._worker.start()

    def submit(self, sequences: list[np.ndarray]) -> Future:
        """Queue a request's sequences (int ``[L_i]`` each); the future's result is their
        signals in order, or it raises :class:`BatchFailed`.

        Raises:
            RequestError: 429 when the request would take the tokens held past
                ``max_queue_tokens``; 503 after :meth:`close`.
        """
        tokens = sum(len(s) for s in sequences)
        with self._changed:
            if self._closed:
                raise RequestError("the server is shutting down; send it to another replica.", 503)
            if self._held_tokens + tokens > self.max_queue_tokens:
                raise RequestError(
                    f"the queue is full ({self._held_tokens} tokens held, this request "
                    f"{tokens}, bound {self.max_queue_tokens}); retry after "
                    f"{self.retry_after_s} s or send it to another replica.",
                    429,
                )
            job = _Job(sequences, tokens)
            self._queue.append(job)
            self._hold(1, tokens)
            self._changed.notify_all()
        return job.future

    def drain(self) -> None:
        """Stop waiting for batches to fill: what is queued is scored at once."""
        with self._changed:
            self._draining = True
            self._changed.notify_all()

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new requests, let the worker score what is queued, and wait for it (at most
        ``timeout`` seconds); returns whether it finished."""
        with self._changed:
            self._draining = self._closed = True
            self._changed.notify_all()
        self._worker.join(timeout)
        return not self._worker.is_alive()

    def _hold(self, requests: int, tokens: int) -> None:
        """Count requests and tokens held (negative: released); under the lock."""
        self._held_requests += requests
        self._held_tokens += tokens
        self.metrics.queue_requests.set(self._held_requests)
        self.metrics.queue_tokens.set(self._held_tokens)

    def _run(self) -> None:
        while True:
            batch = self._take()
            if not batch:
                return
            self._answer(batch)

    def _take(self) -> list[_Job]:
        """The next batch (empty once closed and the queue is empty): requests in order until
        their tokens reach ``max_batch_tokens`` or the next one would pass it, waiting up to
        ``max_wait_s`` after the first for more (not while draining)."""
        with self._changed:
            while not self._queue and not self._closed:
                self._changed.wait()
            if not self._queue:
                return []
            batch = [self._queue.popleft()]
            tokens = batch[0].tokens
            deadline = time.monotonic() + self.max_wait_s
            while tokens < self.max_batch_tokens:
                if self._queue:
                    if tokens + self._queue[0].tokens > self.max_batch_tokens:
                        break
                    batch.append(self._queue.popleft())
                    tokens += batch[-1].tokens
                    continue
                left = deadline - time.monotonic()
                if self._draining or left <= 0:
                    break
                self._changed.wait(left)
            return batch

    def _answer(self, batch: list[_Job]) -> None:
        """Score a batch's sequences together and hand each request its own signals (the
        metrics and the tokens held are updated first, so an answered client sees them)."""
        sequences = [s for job in batch for s in job.sequences]
        lengths = [len(s) for s in sequences]
        signals: list = [None] * len(sequences)
        failed = None
        try:
            for group in budget_batches(lengths, self.max_batch_tokens):
                scored = self._score([sequences[i] for i in group])
                for i, signal in zip(group, scored, strict=True):
                    signals[i] = signal
                self.metrics.batch_tokens.observe(sum(lengths[i] for i in group))
        except Exception as exc:
            # the batch's requests get the reason (500); the worker goes on with the next batch
            log.exception("scoring a batch of %d requests failed", len(batch))
            failed = BatchFailed(f"{type(exc).__name__}: {exc}")
        else:
            self.metrics.tokens.inc(sum(lengths))
        self.metrics.batch_requests.observe(len(batch))
        with self._changed:
            self._hold(-len(batch), -sum(job.tokens for job in batch))
        start = 0
        for job in batch:
            if failed is None:
                job.future.set_result(signals[start : start + len(job.sequences)])
            else:
                job.future.set_exception(failed)
            start += len(job.sequences)
