"""``crosskd serve``: the teacher server (the endpoints of :mod:`crosskd.serve.protocol`).

One HTTP/1.1 port (the standard library's threading server, a thread per connection, keep-alive)
answers the API, ``/healthz``, ``/readyz`` and ``/metrics``. It listens at once and answers
``/healthz`` while the teacher loads (a liveness probe does not kill a slow load); ``/readyz``
and the API answer 503 until the teacher is loaded, then the port is logged and written to
``port_file``. A ``/v1/score`` request goes through, in order: the token (401), the drain (503)
and the requests in flight (429 beyond ``max_in_flight``: with the queue bound, what bounds the
server's memory), ``Content-Length`` (411; more than ``max_body_bytes``: 413, refused before the
body is read, so a client that sent ``Expect: 100-continue`` never uploads it), the body (400),
the request's own checks against the server (400, 413; texts are tokenized here with the
teacher's tokenizer, no special tokens added and specials in the text kept as text, as
``crosskd prepare`` does), a sequence longer than the teacher's positions (400), the queue (429,
:class:`~crosskd.serve.batcher.Batcher`), then it waits for its batch and is answered with the
Parquet of its signals (a failed batch: 500 with the reason). An error answer to a request whose
body was not read closes the connection.

SIGTERM (or SIGINT) drains: ``/readyz`` and new ``/v1/score`` requests answer 503 at once (with
``Retry-After``), the requests already taken are scored without waiting for batches to fill and
answered, then the process exits 0; if that takes more than ``drain_timeout_s`` it exits 143.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import fsspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from crosskd.alignment.core import tokenize
from crosskd.artifacts import write_whole
from crosskd.errors import ConfigError, CrosskdError
from crosskd.serve.batcher import Batcher, BatchFailed, ServeMetrics
from crosskd.serve.config import ServeConfig
from crosskd.serve.protocol import (
    JSON,
    PARQUET,
    RequestError,
    ScoreRequest,
    ServerInfo,
    error_body,
    with_tokens,
)
from crosskd.teacher.model import LoadedTeacher, load_teacher
from crosskd.teacher.scoring import score_sequences
from crosskd.teacher.storage import encode
from crosskd.tokenization import LoadedTokenizer, load_tokenizer

log = logging.getLogger(__name__)

TOKEN_ENV = "CROSSKD_SERVE_TOKEN"
"""The environment variable that holds the server's bearer token (from a Secret)."""
SOCKET_TIMEOUT_S = 120.0
"""Seconds a connection may stay silent (an idle keep-alive connection, a body that stops
arriving) before the server closes it."""
DRAIN_EXIT = 143
"""Exit status when the drain does not finish within ``drain_timeout_s``."""


class _InFlight:
    """The ``/v1/score`` requests taken and not answered yet (at most ``limit``); once
    draining, none is taken."""

    def __init__(self, limit: int, retry_after_s: int) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.count = 0
        self.draining = False
        self._changed = threading.Condition()

    def enter(self) -> None:
        """Take a request.

        Raises:
            RequestError: 503 once draining; 429 when ``limit`` requests are taken already.
        """
        with self._changed:
            if self.draining:
                raise RequestError("the server is draining; send it to another replica.", 503)
            if self.count >= self.limit:
                raise RequestError(
                    f"{self.count} requests are in flight, this server's max_in_flight; retry "
                    f"after {self.retry_after_s} s or send it to another replica.",
                    429,
                )
            self.count += 1

    def leave(self) -> None:
        """A taken request is answered."""
        with self._changed:
            self.count -= 1
            self._changed.notify_all()

    def stop(self) -> None:
        """Take no more requests."""
        with self._changed:
            self.draining = True

    def wait(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until every taken request is answered; returns
        whether they were."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self.count and time.monotonic() < deadline:
                self._changed.wait(deadline - time.monotonic())
            return self.count == 0


class _Loaded:
    """What the server answers with once the teacher is loaded."""

    def __init__(self, config: ServeConfig, metrics: ServeMetrics) -> None:
        self.teacher: LoadedTeacher = load_teacher(
            config.teacher,
            device=config.device,
            dtype=config.dtype,
            trust_remote_code=config.trust_remote_code,
        )
        teacher = self.teacher
        if config.k > teacher.vocab_size:
            raise ConfigError(
                f"k is {config.k}; teacher {config.teacher} has {teacher.vocab_size} output "
                f"rows, so k must be at most {teacher.vocab_size}."
            )
        self.tokenizer: LoadedTokenizer = load_tokenizer(
            str(teacher.folder), vocab_size=teacher.vocab_size
        )
        self.tokenizing = threading.Lock()
        """Held while a texts request is tokenized: the transformers tokenizer may set its
        backend's options on a call, which another thread's call must not see half done."""
        self.positions: int | None = getattr(teacher.model.config, "max_position_embeddings", None)
        self.info = ServerInfo(
            teacher=config.teacher,
            model_fingerprint=teacher.fingerprint,
            tokenizer_fingerprint=self.tokenizer.fingerprint,
            vocab_size=teacher.vocab_size,
            k=config.k,
            tau=float(config.tau),
            encoding=config.encoding,
            max_request_tokens=config.max_request_tokens,
        )
        self.batcher = Batcher(
            lambda sequences: score_sequences(teacher, sequences, k=config.k, tau=config.tau),
            max_batch_tokens=config.max_batch_tokens,
            max_wait_s=config.max_wait_ms / 1000,
            max_queue_tokens=config.max_queue_tokens,
            retry_after_s=config.retry_after_s,
            metrics=metrics,
        )


class TeacherServer(ThreadingHTTPServer):
    """The HTTP server and its state: ``config``, the bearer ``token`` (None: ``auth: none``),
    ``metrics``, and once :meth:`load` has run the teacher, its tokenizer, the
    :class:`~crosskd.serve.protocol.ServerInfo` and the batcher."""

    daemon_threads = True

    def __init__(self, config: ServeConfig, token: str | None) -> None:
        self.config = config
        self.token = token
        self.metrics = ServeMetrics()
        self.in_flight = _InFlight(config.max_in_flight, config.retry_after_s)
        self.loaded: _Loaded | None = None
        # the listen backlog (socketserver's default is 5): past it, connections that arrive
        # together are dropped and retried by the client's TCP a second or more later, or reset
        # (benchmarks/serve_load.py saw a reset at 32 clients); beyond max_in_flight: 429
        self.request_queue_size = config.max_in_flight
        try:
            super().__init__((config.host, config.port), _Handler)
        except OSError as exc:
            raise CrosskdError(
                f"cannot listen on {config.host}:{config.port} ({exc.strerror or exc}); choose "
                f"another host or port (port: 0 takes a free one)."
            ) from None

    @property
    def port(self) -> int:
        """The port it listens on."""
        return self.server_address[1]

    @property
    def ready(self) -> bool:
        """The teacher is loaded and the server is not draining."""
        return self.loaded is not None and not self.in_flight.draining

    def load(self) -> None:
        """Load the teacher, its tokenizer and the batcher; the server is ready after."""
        self.loaded = _Loaded(self.config, self.metrics)
        self.metrics.ready.set(1)

    def drain(self) -> int:
        """(Once loaded.) Stop taking ``/v1/score`` requests, answer those taken, stop the
        batcher (at most ``drain_timeout_s`` in all); returns the exit status (0, or
        :data:`DRAIN_EXIT`)."""
        self.metrics.ready.set(0)
        timeout = self.config.drain_timeout_s
        log.info("draining: answering the requests taken (at most %.0f s)", timeout)
        deadline = time.monotonic() + timeout
        batcher = self.loaded.batcher
        self.in_flight.stop()
        batcher.drain()
        done = self.in_flight.wait(timeout)
        done = batcher.close(max(deadline - time.monotonic(), 0.0)) and done
        if not done:
            log.error(
                "drain: requests were still unanswered after drain_timeout_s = %.0f s; exiting "
                "with %d",
                timeout,
                DRAIN_EXIT,
            )
            return DRAIN_EXIT
        log.info("drained: every request taken was answered")
        return 0


class _Handler(BaseHTTPRequestHandler):
    """One connection's requests (module docstring)."""

    server: TeacherServer
    protocol_version = "HTTP/1.1"
    timeout = SOCKET_TIMEOUT_S

    def handle_expect_100(self) -> bool:
        """Defer ``100 Continue`` until the headers are checked (:meth:`do_POST`)."""
        return True

    def log_message(self, format: str, *args: object) -> None:
        """Requests are logged at DEBUG (``crosskd -v serve``), not on stderr each."""
        log.debug("%s %s", self.address_string(), format % args)

    def do_GET(self) -> None:
        """``/healthz``, ``/readyz``, ``/metrics``, ``/v1/info``."""
        server = self.server
        if self.path == "/healthz":
            self._json(200, {"status": "ok"})
        elif self.path == "/readyz":
            if server.ready:
                self._json(200, {"status": "ready"})
            else:
                self._error(RequestError("not ready (loading the teacher, or draining).", 503))
        elif self.path == "/metrics":
            self._send(200, generate_latest(server.metrics.registry), CONTENT_TYPE_LATEST)
        elif self.path == "/v1/info":
            try:
                self._authorize()
                self._send(200, self._loaded().info.to_json(), JSON)
            except RequestError as exc:
                self._error(exc)
        elif self.path == "/v1/score":
            self._error(RequestError("/v1/score takes POST.", 405), allow="POST")
        else:
            self._error(RequestError(f"no endpoint {self.path}; see docs/serving.md.", 404))

    def do_POST(self) -> None:
        """``/v1/score``."""
        received = time.monotonic()
        self._read = False
        if self.path != "/v1/score":
            if self.path == "/v1/info":
                self._error(RequestError("/v1/info takes GET.", 405), allow="GET")
            else:
                self._error(RequestError(f"no endpoint {self.path}; see docs/serving.md.", 404))
            return
        try:
            self._authorize()
            loaded = self._loaded()
            self.server.in_flight.enter()
        except RequestError as exc:
            self._error(exc)
            return
        try:
            payload = self._score(loaded)
        except RequestError as exc:
            self._error(exc)
        except BatchFailed as exc:
            self._error(RequestError(f"scoring failed: {exc}; retry, and report it.", 500))
        else:
            self._send(200, payload, PARQUET)
            self.server.metrics.request_seconds.observe(time.monotonic() - received)
        finally:
            self.server.in_flight.leave()

    def _score(self, loaded: _Loaded) -> bytes:
        """The answer to the request being read (module docstring for the order of checks)."""
        request = ScoreRequest.from_json(self._body())
        request.check(loaded.info)
        sequences = request.sequences
        if sequences is None:
            with loaded.tokenizing:
                sequences = [t.ids for t in tokenize(loaded.tokenizer, request.texts)]
            for i, seq in enumerate(sequences):
                if not len(seq):
                    raise RequestError(f"texts[{i}] gives no teacher tokens; send text.")
            ScoreRequest(sequences).check(loaded.info)
        if loaded.positions is not None:
            for i, seq in enumerate(sequences):
                if len(seq) > loaded.positions:
                    raise RequestError(
                        f"{'sequences' if request.texts is None else 'texts'}[{i}] holds "
                        f"{len(seq)} tokens; the teacher takes at most {loaded.positions} "
                        f"positions: cut it."
                    )
        signals = loaded.batcher.submit(sequences).result()
        config = self.server.config
        payload = encode([str(i) for i in range(len(signals))], signals, config.encoding)
        if request.texts is not None:
            payload = with_tokens(payload, sequences)
        return payload

    def _body(self) -> bytes:
        """The request body, once ``Content-Length`` is checked (``100 Continue`` sent first
        when the client asked for it)."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise RequestError("chunked bodies are not read; send Content-Length.", 411)
        length = self.headers.get("Content-Length")
        if length is None:
            raise RequestError("the request has no Content-Length; send one.", 411)
        if not length.strip().isdigit():
            raise RequestError(f"Content-Length is {length!r}; send the body's size in bytes.")
        size, limit = int(length), self.server.config.max_body_bytes
        if size > limit:
            raise RequestError(
                f"the body is {size} bytes; this server reads at most {limit}: split the request.",
                413,
            )
        if self.headers.get("Expect", "").lower() == "100-continue":
            self.send_response_only(100)
            self.end_headers()
        body = self.rfile.read(size)
        if len(body) < size:
            raise RequestError(f"the body ended after {len(body)} of {size} bytes.")
        self._read = True
        return body

    def _authorize(self) -> None:
        """Refuse (401) a ``/v1/`` request without the server's bearer token."""
        token = self.server.token
        if token is None:
            return
        given = self.headers.get("Authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() != "bearer" or not value:
            raise RequestError(
                "no bearer token; send Authorization: Bearer <the server's token>.", 401
            )
        if not hmac.compare_digest(value.strip().encode(), token.encode()):
            raise RequestError("the bearer token is wrong; send the server's token.", 401)

    def _loaded(self) -> _Loaded:
        """The loaded teacher; 503 while it loads."""
        loaded = self.server.loaded
        if loaded is None:
            raise RequestError("the teacher is still loading; retry shortly.", 503)
        return loaded

    def _error(self, exc: RequestError, allow: str | None = None) -> None:
        """Answer ``exc`` as JSON ``{"error": ...}`` (``Retry-After`` on 429 and 503,
        ``WWW-Authenticate`` on 401, ``Allow`` on 405); the connection closes when a POST body
        was left unread."""
        headers = {}
        if exc.status in (429, 503):
            headers["Retry-After"] = str(self.server.config.retry_after_s)
        if exc.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        if allow is not None:
            headers["Allow"] = allow
        close = self.command == "POST" and not getattr(self, "_read", False)
        self._send(exc.status, error_body(str(exc)), JSON, headers, close=close)

    def _json(self, status: int, value: dict) -> None:
        self._send(status, json.dumps(value).encode(), JSON)

    def _send(
        self,
        status: int,
        body: bytes,
        content_type: str,
        headers: dict[str, str] | None = None,
        *,
        close: bool = False,
    ) -> None:
        """Write one answer (counted in ``crosskd_serve_requests_total`` for ``/v1/`` paths)."""
        if self.path.startswith("/v1/"):
            self.server.metrics.requests.labels(code=str(status)).inc()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError as exc:
            log.info("%s went away before its answer was written (%s)", self.client_address, exc)
            self.close_connection = True


def serve(config: ServeConfig) -> int:
    """Run the teacher server until SIGTERM or SIGINT, then drain (module docstring); returns
    the exit status: 0, or 143 when the drain timed out.

    Raises:
        CrosskdError: A bad config, no ``CROSSKD_SERVE_TOKEN`` under ``auth: bearer``, an address
            that cannot be bound, a teacher or tokenizer that cannot be loaded.
    """
    config.check()
    token = None
    if config.auth == "bearer":
        token = os.environ.get(TOKEN_ENV, "").strip()
        if not token:
            raise ConfigError(
                f"{TOKEN_ENV} is not set; the server answers only requests with its bearer "
                f"token: set {TOKEN_ENV} (from a Secret), or set auth: none on a network you "
                f"trust."
            )
    else:
        log.warning("auth: none: /v1/ requests need no token; serve only on a network you trust")
    server = TeacherServer(config, token)
    listener = threading.Thread(target=server.serve_forever, name="crosskd-serve-http")
    listener.start()
    stop = threading.Event()
    handlers = {}
    try:
        log.info("listening on %s:%d; loading teacher %s", config.host, server.port, config.teacher)
        server.load()
        for number in (signal.SIGTERM, signal.SIGINT):
            handlers[number] = signal.signal(number, lambda *_: stop.set())
        if config.port_file:
            fs, path = fsspec.core.url_to_fs(config.port_file)
            write_whole(fs, path, f"{server.port}\n".encode())
        info = server.loaded.info
        log.info(
            "top-%d at tau %g, %s; batches of %d tokens (waiting %g ms to fill), queue bound %d "
            "tokens, at most %d requests in flight and %d tokens per request; auth: %s",
            info.k,
            info.tau,
            info.encoding,
            config.max_batch_tokens,
            config.max_wait_ms,
            config.max_queue_tokens,
            config.max_in_flight,
            config.max_request_tokens,
            config.auth,
        )
        log.info("serving %s on http://%s:%d", config.teacher, config.host, server.port)
        stop.wait()
        return server.drain()
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
        server.shutdown()
        server.server_close()
        listener.join()
