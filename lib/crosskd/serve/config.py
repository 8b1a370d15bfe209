"""What ``crosskd serve`` does: :class:`ServeConfig` (YAML keys, ``key=value`` overrides and
``--option`` flags, as every command's config)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from crosskd.config import require_positive_ints
from crosskd.errors import ConfigError
from crosskd.teacher.storage import ENCODINGS

AUTH = ("bearer", "none")
"""``auth`` values: a bearer token from ``CROSSKD_SERVE_TOKEN``, or none (trusted networks)."""


@dataclass
class ServeConfig:
    """What ``crosskd serve`` does: the teacher it answers with, where it listens, how it
    batches and how much it holds (``docs/serving.md``)."""

    teacher: str
    """The teacher model: HF folder, ``zoo:NAME``, fsspec URI of a folder, or cached hub id;
    its folder's tokenizer tokenizes ``texts`` requests and gives the tokenizer fingerprint."""
    k: int = 128
    """Top-K size of every answer (>= 1, at most the teacher's vocabulary)."""
    tau: float = 1.0
    """Temperature of the answered top-K log probs (the training config must use the same)."""
    encoding: str = "lossless"
    """``lossless`` (exact float32) or ``lossy`` (8-bit quantised log probs) answers."""
    device: str | None = None
    """``cpu``, ``cuda``, ``cuda:1``, ... (default: CUDA when available)."""
    dtype: str | None = None
    """``float32``, ``bfloat16``, ... (default: bfloat16 on GPU, float32 on CPU)."""
    trust_remote_code: bool = False
    """Passed to transformers; off unless you trust the model's code."""
    host: str = "0.0.0.0"
    """Address to listen on (``127.0.0.1``: this machine only)."""
    port: int = 8080
    """Port of the API, ``/healthz``, ``/readyz`` and ``/metrics`` (0: a free one)."""
    port_file: str | None = None
    """A local file the port number is written to (atomically) once the server is ready."""
    max_batch_tokens: int = 8192
    """Token budget of one model batch: padded tokens (sequences x the longest) per forward
    pass, and the most tokens of requests the worker gathers into one batch."""
    max_wait_ms: float = 5.0
    """Milliseconds a batch waits for more requests to fill it once its first request is taken
    (0: score what is queued at once)."""
    max_queue_tokens: int = 262144
    """The bound on tokens held (waiting or being scored): a request that would pass it is
    refused at once with 429 and ``Retry-After``. At least ``max_request_tokens``."""
    max_request_tokens: int = 32768
    """The most tokens (summed over the sequences) one request may hold; more: 413."""
    max_body_bytes: int = 16 * 1024 * 1024
    """The largest request body read, bytes; larger: 413 before it is read."""
    max_in_flight: int = 256
    """The most ``/v1/score`` requests taken at once (their bodies being read, queued, scored or
    answered); more: 429 at once. With ``max_body_bytes`` it bounds the bodies held."""
    retry_after_s: int = 1
    """``Retry-After`` seconds of a 429 (queue full) or 503 (draining, not ready yet)."""
    drain_timeout_s: float = 60.0
    """On SIGTERM, seconds to finish the requests already taken before exiting anyway with
    status 143 (exit 0 when they are all answered in time)."""
    auth: str = "bearer"
    """``bearer``: ``/v1/`` requests need ``Authorization: Bearer $CROSSKD_SERVE_TOKEN``, and
    the server refuses to start without that variable; ``none``: no token (logged as a
    warning; only on a network you trust)."""

    def check(self) -> None:
        """Refuse bad values naming the key (:class:`~crosskd.errors.ConfigError`)."""
        require_positive_ints(
            self,
            (
                "k",
                "max_batch_tokens",
                "max_queue_tokens",
                "max_request_tokens",
                "max_body_bytes",
                "max_in_flight",
                "retry_after_s",
            ),
        )
        if not _number(self.tau) or self.tau <= 0:
            raise ConfigError(f"tau is {self.tau!r}; it must be a finite number > 0.")
        if self.encoding not in ENCODINGS:
            raise ConfigError(
                f"encoding is {self.encoding!r}; choose one of {', '.join(ENCODINGS)}."
            )
        if self.auth not in AUTH:
            raise ConfigError(f"auth is {self.auth!r}; choose one of {', '.join(AUTH)}.")
        if (
            isinstance(self.port, bool)
            or not isinstance(self.port, int)
            or not 0 <= self.port < 65536
        ):
            raise ConfigError(f"port is {self.port!r}; it must be an integer 0 .. 65535.")
        for key in ("max_wait_ms", "drain_timeout_s"):
            value = getattr(self, key)
            if not _number(value) or value < 0:
                raise ConfigError(f"{key} is {value!r}; it must be a finite number >= 0.")
        if self.max_queue_tokens < self.max_request_tokens:
            raise ConfigError(
                f"max_queue_tokens is {self.max_queue_tokens}, below max_request_tokens "
                f"({self.max_request_tokens}): a request of the largest size could never be "
                f"queued; raise max_queue_tokens or lower max_request_tokens."
            )


def _number(value: object) -> bool:
    """Whether ``value`` is a finite int or float (a bool is not a number here)."""
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
