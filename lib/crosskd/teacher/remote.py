"""A client of a ``crosskd serve`` teacher server (:mod:`crosskd.serve.protocol`): the teacher
signal of token sequences scored over HTTP, for a ``teachers:`` entry ``http://...`` or
``https://...`` of a training run.

:func:`connect` reads ``/v1/info`` and refuses a server that does not score what the run needs
(the prepared data's teacher tokenizer fingerprint, K, tau, long enough requests; another
protocol version), in one line naming the server, the field and both values.
:meth:`TeacherClient.score` posts ``/v1/score``: a call is cut into consecutive requests of at
most the server's ``max_request_tokens`` (and into at least ``concurrency`` of them when it has
that many sequences, so that the replicas behind a Service score its parts at once), sent by a
pool of ``concurrency`` threads, each keeping one keep-alive connection; the Parquet answers are
decoded as a cache shard is (:func:`crosskd.teacher.storage.decode`) and checked (one row per
sequence in order, each the length of its sequence, K ids per token).

Failures: connection errors, timeouts, 408, 429, 503 and other 5xx answers are retried with
exponential backoff and jitter (a ``Retry-After`` is waited for, capped at ``backoff_max_s``)
until ``retry_s`` seconds have passed since the request's first attempt; then
:class:`TeacherUnavailable`, which is not a :class:`~crosskd.errors.CrosskdError` (the job is
restarted and resumes). Any other answer (400 a malformed request or another K / tau /
tokenizer, 401 a wrong token, 404 not a teacher server, 413 too long a request) and an answer
that does not match its request are a :class:`~crosskd.errors.CrosskdError` with the server's
reason (exit 2: retrying would not help).

The bearer token comes from the environment variable ``CROSSKD_TEACHER_TOKEN`` only (a Secret
in Kubernetes); it is sent in each request's ``Authorization`` header and never logged.
"""

from __future__ import annotations

import http.client
import logging
import math
import os
import random
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

import numpy as np
import pyarrow as pa

from crosskd.errors import ConfigError, CrosskdError
from crosskd.serve.protocol import JSON, VERSION, ScoreRequest, ServerInfo, error_message
from crosskd.teacher.storage import SampleSignal, decode

log = logging.getLogger(__name__)

TOKEN_ENV = "CROSSKD_TEACHER_TOKEN"
"""The environment variable the client's bearer token comes from."""
SCHEMES = ("http", "https")
RETRIED = (408, 429)
"""Statuses below 500 that are retried (every 5xx is)."""


def is_remote(ref: str) -> bool:
    """Whether a ``teachers:`` entry names a teacher server (``http://`` or ``https://``)."""
    return ref.startswith(("http://", "https://"))


class TeacherUnavailable(RuntimeError):
    """The teacher server did not answer a request within ``retry_s`` seconds of retries
    (connection refused or reset, timeouts, 429 / 503 / 5xx answers).

    Deliberately not a :class:`~crosskd.errors.CrosskdError`: nothing is wrong with the run's
    inputs, the server is away (restarted, rescheduled, overloaded). Raised on the trainer's
    input thread, it makes the step fail on every rank as an unclassified error
    (:class:`~crosskd.errors.InputFailed`), ``crosskd train --nproc-per-node N`` exits 200
    (retryable, :mod:`crosskd.train.launch`), and the restarted job resumes from its latest
    checkpoint once the server is back.
    """


@dataclass(frozen=True)
class ClientOptions:
    """How a :class:`TeacherClient` talks to its server."""

    connect_timeout_s: float = 10.0
    """Seconds to open a connection (TCP and TLS) before the attempt counts as failed."""
    read_timeout_s: float = 300.0
    """Seconds to wait for the server's next bytes (of an answer that may wait in its queue)
    before the attempt counts as failed."""
    retry_s: float = 600.0
    """Seconds from a request's first attempt during which failed attempts are retried; then
    :class:`TeacherUnavailable`."""
    concurrency: int = 4
    """Requests in flight at once (one thread and one keep-alive connection each)."""
    backoff_s: float = 0.5
    """The first retry waits between half this and this many seconds; each next one twice as
    long (full range: half to all of it, at random)."""
    backoff_max_s: float = 30.0
    """The longest wait between two attempts, ``Retry-After`` included."""

    def check(self) -> None:
        """Refuse values that cannot work, naming the field."""
        for key in ("connect_timeout_s", "read_timeout_s", "retry_s", "backoff_s", "backoff_max_s"):
            value = getattr(self, key)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ConfigError(f"{key} is {value!r}; it must be a finite number > 0.")
        if (
            isinstance(self.concurrency, bool)
            or not isinstance(self.concurrency, int)
            or self.concurrency < 1
        ):
            raise ConfigError(f"concurrency is {self.concurrency!r}; it must be an integer >= 1.")


@dataclass(frozen=True)
class _Endpoint:
    """Where a server is: ``https``, host, port and the path prefix its endpoints are under."""

    https: bool
    host: str
    port: int
    prefix: str

    @classmethod
    def parse(cls, url: str) -> _Endpoint:
        parts = urlsplit(url)
        if parts.scheme not in SCHEMES or not parts.hostname:
            raise ConfigError(
                f"teacher server {url!r} is not an http:// or https:// URL with a host; give "
                f"http://HOST:PORT of a crosskd serve teacher server."
            )
        if parts.username or parts.password:
            raise ConfigError(
                f"teacher server URL for host {parts.hostname} holds credentials; remove them "
                f"and set {TOKEN_ENV} in the environment instead."
            )
        if parts.query or parts.fragment:
            raise ConfigError(
                f"teacher server {url}: the URL has a query or fragment; give "
                f"http://HOST:PORT[/PREFIX] only."
            )
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as exc:
            raise ConfigError(f"teacher server {url}: {exc}; give a port number.") from None
        return cls(parts.scheme == "https", parts.hostname, port, parts.path.rstrip("/"))


class TeacherClient:
    """A connection to one teacher server: :meth:`score` token sequences; :meth:`close` when
    done. Safe to call from several threads (each has its own keep-alive connection)."""

    def __init__(self, url: str, options: ClientOptions) -> None:
        options.check()
        self.url = url.rstrip("/")
        self.options = options
        self._endpoint = _Endpoint.parse(url)
        self._token = os.environ.get(TOKEN_ENV) or None
        self._random = random.Random()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: list[http.client.HTTPConnection] = []
        self._pool = ThreadPoolExecutor(options.concurrency, thread_name_prefix="crosskd-teacher")
        self.info: ServerInfo | None = None

    def __enter__(self) -> TeacherClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the request threads and close every connection."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for conn in self._connections:
                conn.close()
            self._connections.clear()

    def read_info(self) -> ServerInfo:
        """``GET /v1/info`` (retried like every request), kept as :attr:`info`."""
        self.info = ServerInfo.from_json(self._exchange("GET", "/v1/info", None), self.url)
        return self.info

    def score(self, sequences: list[np.ndarray]) -> list[SampleSignal]:
        """The signal of each token sequence (teacher ids, int ``[L_i]``), in order: top-K ids
        int32 ``[L_i, K]``, log probs at tau float32 ``[L_i, K]``, realized log probs at tau and
        at 1 float32 ``[L_i - 1]``, as the server scored them (each sequence in its own
        context).

        Raises:
            TeacherUnavailable: The server did not answer within ``retry_s`` (retryable).
            CrosskdError: A sequence longer than the server's ``max_request_tokens``, a
                request the server refused (its reason), an answer that does not match.
        """
        info = self._info()
        lengths = [len(s) for s in sequences]
        groups = request_groups(lengths, info.max_request_tokens, self.options.concurrency)
        log.debug(
            "teacher server %s: scoring %d sequences (%d tokens) in %d requests",
            self.url,
            len(sequences),
            sum(lengths),
            len(groups),
        )
        futures = [self._pool.submit(self._score_group, [sequences[i] for i in g]) for g in groups]
        signals: list[SampleSignal] = []
        try:
            for future in futures:
                signals.extend(future.result())
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        return signals

    def _info(self) -> ServerInfo:
        """The server's :class:`ServerInfo` (read now if :func:`connect` has not)."""
        return self.info if self.info is not None else self.read_info()

    def _score_group(self, sequences: list[np.ndarray]) -> list[SampleSignal]:
        """One ``/v1/score`` request and its checked answer."""
        info = self._info()
        request = ScoreRequest(
            sequences=sequences,
            k=info.k,
            tau=info.tau,
            tokenizer_fingerprint=info.tokenizer_fingerprint,
        )
        payload = self._exchange("POST", "/v1/score", request.to_json())
        return self._check_answer(payload, sequences)

    def _check_answer(self, payload: bytes, sequences: list[np.ndarray]) -> list[SampleSignal]:
        """The decoded rows of a score answer, each checked against its sequence."""
        info = self._info()
        try:
            rows = decode(payload, info.encoding, info.k)
        except (pa.ArrowException, ValueError, KeyError, IndexError) as exc:
            raise self._bad_answer(
                f"it is not a {info.encoding} answer of K = {info.k} ({exc})"
            ) from None
        if len(rows) != len(sequences):
            raise self._bad_answer(f"it has {len(rows)} rows for {len(sequences)} sequences")
        for i, ((sample_id, sig), seq) in enumerate(zip(rows, sequences, strict=True)):
            shapes = (sig.ids.shape, sig.log_probs.shape, sig.realized.shape, sig.realized_t1.shape)
            n = len(seq)
            want = ((n, info.k), (n, info.k), (n - 1,), (n - 1,))
            if sample_id != str(i) or shapes != want:
                raise self._bad_answer(
                    f"row {i} is {sample_id!r} with shapes {shapes}; sequence {i} of {n} "
                    f"tokens needs {want}"
                )
        return [sig for _, sig in rows]

    def _bad_answer(self, what: str) -> CrosskdError:
        return CrosskdError(
            f"teacher server {self.url}: a /v1/score answer does not match its request: {what}; "
            f"it is not a crosskd {VERSION} teacher server, or something between changed the "
            f"answer."
        )

    def _exchange(self, method: str, path: str, body: bytes | None) -> bytes:
        """The body of a 200 answer to ``method path``, retrying what may pass (module
        docstring) until ``retry_s`` after the first attempt."""
        started = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            retry_after = None
            try:
                status, retry_after, payload = self._send(method, path, body)
            except ssl.SSLCertVerificationError as exc:
                raise CrosskdError(
                    f"teacher server {self.url}: its TLS certificate is not trusted ({exc}); "
                    f"give the CA bundle in SSL_CERT_FILE."
                ) from None
            except (OSError, http.client.HTTPException) as exc:
                reason = f"{type(exc).__name__}: {exc}"
            else:
                if status == 200:
                    return payload
                message = " ".join(error_message(payload).split())
                if status < 500 and status not in RETRIED:
                    raise self._refused(path, status, message)
                reason = f"HTTP {status}: {message}"
            wait = self._wait(attempt, retry_after)
            elapsed = time.monotonic() - started
            if elapsed + wait > self.options.retry_s:
                raise TeacherUnavailable(
                    f"teacher server {self.url}: {method} {path} failed {attempt} time(s) in "
                    f"{elapsed:.1f} s (last: {reason}); giving up after retry_s = "
                    f"{self.options.retry_s} s (retryable: the job restarts and resumes from "
                    f"its latest checkpoint)."
                )
            log.warning(
                "teacher server %s: %s %s attempt %d failed (%s); retrying in %.3f s",
                self.url,
                method,
                path,
                attempt,
                reason,
                wait,
            )
            time.sleep(wait)

    def _wait(self, attempt: int, retry_after: float | None) -> float:
        """Seconds before attempt ``attempt + 1``: ``Retry-After`` when the server gave one
        (plus up to ``backoff_s`` of jitter), else half to all of ``backoff_s * 2 **
        (attempt - 1)``; at most ``backoff_max_s``."""
        cap = self.options.backoff_max_s
        if retry_after is not None:
            wait = retry_after + self._random.uniform(0, self.options.backoff_s)
        else:
            step = self.options.backoff_s * 2.0 ** min(attempt - 1, 60)
            wait = self._random.uniform(step / 2, step)
        return min(wait, cap)

    def _refused(self, path: str, status: int, message: str) -> CrosskdError:
        if status == 401:
            where = f"set {TOKEN_ENV}" if self._token is None else f"check {TOKEN_ENV}"
            return CrosskdError(
                f"teacher server {self.url} refused {path} (401: {message}); {where}: it must "
                f"hold the server's token (the Secret behind its CROSSKD_SERVE_TOKEN)."
            )
        return CrosskdError(f"teacher server {self.url} refused {path} ({status}: {message}).")

    def _send(self, method: str, path: str, body: bytes | None) -> tuple[int, float | None, bytes]:
        """One attempt on this thread's connection: ``(status, Retry-After seconds or None,
        body)``. A kept-alive connection the server has closed meanwhile is reopened and the
        request sent again at once (scoring is idempotent)."""
        headers = {"Accept": "*/*"}
        if body is not None:
            headers["Content-Type"] = JSON
        if self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        target = f"{self._endpoint.prefix}{path}"
        conn, reused = self._connection()
        try:
            conn.request(method, target, body, headers)
            response = conn.getresponse()
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            self._drop(conn)
            if not reused:
                raise
            conn, _ = self._connection()
            try:
                conn.request(method, target, body, headers)
                response = conn.getresponse()
            except BaseException:
                self._drop(conn)
                raise
        except BaseException:
            self._drop(conn)
            raise
        try:
            payload = response.read()
        except BaseException:
            self._drop(conn)
            raise
        if response.will_close:
            self._drop(conn)
        return response.status, _seconds(response.getheader("Retry-After")), payload

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's open connection, and whether it was open before this call."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn, True
        end = self._endpoint
        kind = http.client.HTTPSConnection if end.https else http.client.HTTPConnection
        conn = kind(end.host, end.port, timeout=self.options.connect_timeout_s)
        conn.connect()
        conn.sock.settimeout(self.options.read_timeout_s)
        self._local.conn = conn
        with self._lock:
            self._connections.append(conn)
        return conn, False

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        """Close this thread's connection (the next attempt opens another)."""
        conn.close()
        self._local.conn = None
        with self._lock:
            if conn in self._connections:
                self._connections.remove(conn)


def _seconds(value: str | None) -> float | None:
    """A ``Retry-After`` of seconds (an HTTP date, or garbage, counts as none)."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and math.isfinite(seconds) and seconds >= 0 else None


def request_groups(lengths: list[int], max_tokens: int, parts: int) -> list[list[int]]:
    """Sequence indices in consecutive groups of at most ``max_tokens`` tokens each, and at
    least ``parts`` groups where there are that many sequences (of about equal tokens), so a
    call spreads over the replicas behind a Service.

    Raises:
        CrosskdError: A sequence longer than ``max_tokens`` (it must be scored whole).
    """
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise CrosskdError(
                f"sequence {i} holds {n} tokens; the teacher server takes at most {max_tokens} "
                f"per request: start it with max_request_tokens >= the prepared data's teacher "
                f"capacity."
            )
    total = sum(lengths)
    count = max(math.ceil(total / max_tokens), min(parts, len(lengths)), 1)
    target = min(max_tokens, math.ceil(total / count))
    groups: list[list[int]] = []
    tokens = 0
    for i, n in enumerate(lengths):
        left = len(lengths) - i
        if groups and tokens + n <= target and left > count - len(groups):
            groups[-1].append(i)
            tokens += n
        else:
            groups.append([i])
            tokens = n
    return groups


def connect(
    url: str,
    *,
    tokenizer_fingerprint: str,
    k: int,
    tau: float,
    longest: int | None = None,
    options: ClientOptions | None = None,
) -> TeacherClient:
    """A client of the teacher server at ``url``, after checking its ``/v1/info`` against what
    the run needs: the teacher tokenizer's fingerprint the data was prepared with, ``k``,
    ``tau``, and requests of at least ``longest`` tokens (the prepared teacher capacity).

    Raises:
        ConfigError: The server scores another tokenizer, K or tau, or takes shorter requests
            (one line naming the server, the field and both values).
        CrosskdError: Not a teacher server, another protocol version, a refused token.
        TeacherUnavailable: No answer within ``options.retry_s``.
    """
    client = TeacherClient(url, options or ClientOptions())
    try:
        info = client.read_info()
        wanted = {"tokenizer_fingerprint": tokenizer_fingerprint, "k": k, "tau": float(tau)}
        for key, want in wanted.items():
            served = getattr(info, key)
            if served != want:
                raise ConfigError(
                    f"teacher server {client.url} ({info.teacher}) answers with {key} "
                    f"{served!r}; this run needs {want!r}: serve the teacher the data was "
                    f"prepared for, with the K and tau of the training config."
                )
        if longest is not None and info.max_request_tokens < longest:
            raise ConfigError(
                f"teacher server {client.url} takes max_request_tokens {info.max_request_tokens}"
                f"; this run's longest teacher sample is {longest} tokens: start it with "
                f"max_request_tokens >= {longest}."
            )
    except BaseException:
        client.close()
        raise
    log.info(
        "teacher server %s: %s (K %d, tau %g, %s, up to %d tokens per request)",
        client.url,
        info.teacher,
        info.k,
        info.tau,
        info.encoding,
        info.max_request_tokens,
    )
    return client
