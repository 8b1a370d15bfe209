"""The teacher server's client (:mod:`crosskd.teacher.remote`) and training on a teacher
server, against servers on loopback.

:class:`FakeTeacherServer` (a stdlib HTTP server, not crosskd's) answers ``/v1/info`` with a
given body and ``/v1/score`` with the signals of :func:`fake_signal`, or with what a test
scripts (statuses with ``Retry-After``, a slow answer, a closed connection, an answer that
does not match its request), and records every request: the client's splitting, concurrency,
keep-alive, retries, permanent errors, :class:`TeacherUnavailable` and the ``/v1/info`` checks.
A real ``crosskd serve`` process (:func:`_serve`) teaches a training run that must equal the
cached run, is refused when it serves another K or tokenizer, and is killed mid-run under
``crosskd train --nproc-per-node 1`` (exit 200, then a resume once it is back).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from train_inputs import train_config

from crosskd.errors import ConfigError, CrosskdError
from crosskd.loss import LossConfig, TeacherLossConfig
from crosskd.serve.protocol import PARQUET, ScoreRequest, ServerInfo, error_body
from crosskd.teacher.remote import (
    TOKEN_ENV,
    ClientOptions,
    TeacherUnavailable,
    connect,
    request_groups,
)
from crosskd.teacher.storage import SampleSignal, encode
from crosskd.train import TrainConfig, Trainer
from crosskd.train.launch import EXIT_RETRYABLE

K, V = 4, 100
INFO = ServerInfo(
    teacher="fake-teacher",
    model_fingerprint="m" * 64,
    tokenizer_fingerprint="t" * 64,
    vocab_size=V,
    k=K,
    tau=1.0,
    encoding="lossless",
    max_request_tokens=10,
)
FAST = ClientOptions(backoff_s=0.01, backoff_max_s=0.05, retry_s=30.0, concurrency=1)


def fake_signal(seq: np.ndarray, k: int = K) -> SampleSignal:
    """A signal that depends on every token of ``seq`` (so a row in the wrong place shows)."""
    seq = np.asarray(seq, dtype=np.int64)
    ids = np.sort((seq[:, None] + np.arange(k)) % V, axis=1).astype(np.int32)
    values = (-np.arange(k)[None, :] - 0.01 * seq[:, None]).astype(np.float32)
    realized = (-0.01 * seq[1:]).astype(np.float32)
    return SampleSignal(ids, values, realized, 2 * realized)


class FakeTeacherServer:
    """A stand-in teacher server on loopback: ``/v1/info`` answers ``info`` (bytes),
    ``/v1/score`` takes the next item of ``script`` (then ``"ok"``): ``"ok"`` (the
    :func:`fake_signal` of each sequence), ``(status, retry_after)`` (an error answer),
    ``("sleep", s)`` (answer ok after ``s`` seconds), ``"drop"`` (close without answering),
    ``"rows"`` / ``"length"`` / ``"k"`` (an answer with a row missing, a row one token short,
    K + 1 per token). ``close_after_answer``: close each connection after its answer (without
    saying so, as a server closing an idle keep-alive connection does). ``barrier``: score
    answers wait until that many requests are in flight. ``tls``: (certificate, key) files to
    serve HTTPS with. ``info_unready``: ``/v1/info`` answers 503 that many times first (a
    server still loading its teacher). Records every request."""

    def __init__(
        self,
        info: bytes,
        script: list | None = None,
        *,
        token: str | None = None,
        barrier: int | None = None,
        close_after_answer: bool = False,
        tls: tuple[Path, Path] | None = None,
        info_unready: int = 0,
    ) -> None:
        self.info, self.script, self.token = info, list(script or []), token
        self.barrier = threading.Barrier(barrier, timeout=30) if barrier else None
        self.close_after_answer = close_after_answer
        self.info_unready = info_unready
        self.requests: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        scheme = "http"
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def score_requests(self) -> list[dict]:
        return [r for r in self.requests if r["path"] == "/v1/score"]

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _answer(self, status: int, body: bytes, kind: str, retry_after=None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                if retry_after is not None:
                    self.send_header("Retry-After", str(retry_after))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:  # the client gave up waiting (a timeout test)
                    self.close_connection = True
                    return
                self.close_connection = fake.close_after_answer

            def do_GET(self) -> None:
                self._record(b"")
                if not self._authorized():
                    return
                with fake.lock:
                    loading = fake.info_unready > 0
                    fake.info_unready -= loading
                if loading:
                    self._answer(503, error_body("loading the teacher"), "application/json", 0)
                else:
                    self._answer(200, fake.info, "application/json")

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                self._record(body)
                if not self._authorized():
                    return
                with fake.lock:
                    item = fake.script.pop(0) if fake.script else "ok"
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    self._score(item, body)
                finally:
                    with fake.lock:
                        fake.in_flight -= 1

            def _record(self, body: bytes) -> None:
                with fake.lock:
                    fake.requests.append(
                        {
                            "path": self.path,
                            "port": self.client_address[1],
                            "authorization": self.headers.get("Authorization"),
                            "body": body,
                        }
                    )

            def _authorized(self) -> bool:
                if fake.token is None or self.headers.get("Authorization") == (
                    f"Bearer {fake.token}"
                ):
                    return True
                self._answer(401, error_body("missing or wrong bearer token"), "application/json")
                return False

            def _score(self, item, body: bytes) -> None:
                if fake.barrier is not None:
                    fake.barrier.wait()
                if item == "drop":
                    self.close_connection = True
                    return
                if isinstance(item, tuple) and item[0] == "sleep":
                    time.sleep(item[1])
                elif isinstance(item, tuple):
                    status, retry_after = item
                    message = error_body(f"scripted {status}")
                    self._answer(status, message, "application/json", retry_after)
                    return
                sequences = ScoreRequest.from_json(body).sequences
                signals = [fake_signal(s, K + (item == "k")) for s in sequences]
                if item == "rows":
                    signals = signals[:-1]
                if item == "length":
                    signals[0] = fake_signal(sequences[0][:-1])
                payload = encode([str(i) for i in range(len(signals))], signals, "lossless")
                self._answer(200, payload, PARQUET)

        return Handler


@pytest.fixture
def fake():
    """Start a :class:`FakeTeacherServer` (``fake(info=..., script=..., ...)``); every one is
    closed after the test."""
    servers = []

    def start(info: bytes = INFO.to_json(), script=None, **kw) -> FakeTeacherServer:
        servers.append(FakeTeacherServer(info, script, **kw))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _connect(url: str, options: ClientOptions = FAST, **kw):
    wanted = {"tokenizer_fingerprint": INFO.tokenizer_fingerprint, "k": K, "tau": 1.0} | kw
    return connect(url, options=options, **wanted)


def _sequences(lengths: list[int]) -> list[np.ndarray]:
    return [np.arange(n, dtype=np.int64) * 7 % V + i for i, n in enumerate(lengths)]


def _same(got: list[SampleSignal], sequences: list[np.ndarray]) -> None:
    assert len(got) == len(sequences)
    for sig, seq in zip(got, sequences, strict=True):
        want = fake_signal(seq)
        for name in ("ids", "log_probs", "realized", "realized_t1"):
            np.testing.assert_array_equal(getattr(sig, name), getattr(want, name), err_msg=name)


def _waits(caplog) -> list[float]:
    return [float(w) for w in re.findall(r"retrying in ([0-9.]+) s", caplog.text)]


def test_request_groups_cut_calls_in_order_within_the_bound():
    # Within 10 tokens per request, at least 3 requests: consecutive, about equal.
    assert request_groups([3, 4, 5, 2, 6, 1], 10, 3) == [[0, 1], [2, 3], [4, 5]]
    assert request_groups([3, 4, 5, 2, 6, 1], 10, 1) == [[0, 1], [2, 3], [4, 5]]
    assert request_groups([9, 9, 9], 10, 1) == [[0], [1], [2]]
    assert request_groups([1, 1, 1, 1], 100, 1) == [[0, 1, 2, 3]]
    assert request_groups([1, 1, 1, 1], 100, 8) == [[0], [1], [2], [3]]
    assert request_groups([], 10, 4) == []
    with pytest.raises(CrosskdError, match=r"sequence 1 holds 11 tokens; .* at most 10"):
        request_groups([3, 11], 10, 1)


def test_score_splits_a_call_in_order_over_one_keep_alive_connection(fake, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    server = fake(token="s3cret")
    sequences = _sequences([3, 4, 5, 2, 6, 1])
    with _connect(server.url) as client:
        _same(client.score(sequences), sequences)
        _same(client.score(sequences[:2]), sequences[:2])
    scored = server.score_requests()
    sent = [ScoreRequest.from_json(r["body"]) for r in scored]
    assert [[len(s) for s in r.sequences] for r in sent] == [[3, 4], [5, 2], [6, 1], [3, 4]]
    # Each request says what it expects, so a replica scoring otherwise refuses it.
    assert {(r.k, r.tau, r.tokenizer_fingerprint) for r in sent} == {
        (K, 1.0, INFO.tokenizer_fingerprint)
    }
    assert {r["authorization"] for r in server.requests} == {"Bearer s3cret"}
    assert len({r["port"] for r in scored}) == 1  # one connection, kept alive


def test_requests_are_in_flight_together_up_to_the_concurrency(fake):
    """Six requests of 5 tokens with concurrency 3: the fake answers only once 3 are in
    flight (a client sending one at a time would wait 30 s for the barrier and fail), and
    never more than 3 are."""
    server = fake(
        info=ServerInfo(**(asdict(INFO) | {"max_request_tokens": 5})).to_json(), barrier=3
    )
    sequences = _sequences([5] * 6)
    options = ClientOptions(backoff_s=0.01, concurrency=3, retry_s=1.0)
    with _connect(server.url, options) as client:
        _same(client.score(sequences), sequences)
    assert len(server.score_requests()) == 6 and server.max_in_flight == 3
    assert len({r["port"] for r in server.score_requests()}) == 3  # a connection per thread


def test_failures_that_may_pass_are_retried_with_backoff_and_retry_after(fake, caplog):
    """503 with Retry-After 0.2 s (waited for, plus jitter under backoff_s), 500 (the second
    attempt's backoff: half to all of 2 x backoff_s), 429 with Retry-After 3600 s (capped at
    backoff_max_s), then the answer."""
    caplog.set_level(logging.WARNING, "crosskd.teacher.remote")
    server = fake(script=[(503, "0.2"), (500, None), (429, 3600)])
    options = ClientOptions(backoff_s=0.01, backoff_max_s=0.5, retry_s=30.0, concurrency=1)
    sequences = _sequences([3, 2])
    with _connect(server.url, options) as client:
        _same(client.score(sequences), sequences)
    assert len(server.score_requests()) == 4
    waits = _waits(caplog)
    assert len(waits) == 3
    assert 0.2 <= waits[0] <= 0.21 and 0.01 <= waits[1] <= 0.02 and waits[2] == 0.5
    assert "HTTP 503: scripted 503" in caplog.text


def test_a_timeout_is_retried_and_a_closed_keep_alive_connection_reopened(fake, caplog):
    caplog.set_level(logging.WARNING, "crosskd.teacher.remote")
    slow = fake(script=[("sleep", 3.0)])
    options = ClientOptions(read_timeout_s=0.3, backoff_s=0.01, retry_s=30.0, concurrency=1)
    sequences = _sequences([3])
    with _connect(slow.url, options) as client:
        _same(client.score(sequences), sequences)
    assert len(slow.score_requests()) == 2
    assert "TimeoutError" in caplog.text and len(_waits(caplog)) == 1
    caplog.clear()
    # The server closes each connection after its answer: the next request on the kept-alive
    # one finds it closed and is sent again at once on a new one (not a failed attempt).
    closing = fake(close_after_answer=True)
    with _connect(closing.url) as client:
        for _ in range(3):
            _same(client.score(sequences), sequences)
    assert len(closing.score_requests()) == 3
    assert len({r["port"] for r in closing.requests}) == 4  # info, then one per request
    assert _waits(caplog) == []


def test_connect_waits_for_a_server_that_is_still_loading(fake, caplog):
    caplog.set_level(logging.WARNING, "crosskd.teacher.remote")
    server = fake(info_unready=3)
    _connect(server.url).close()
    assert [r["path"] for r in server.requests] == ["/v1/info"] * 4
    assert caplog.text.count("HTTP 503: loading the teacher") == 3


def test_a_dropped_connection_is_retried(fake, caplog):
    caplog.set_level(logging.WARNING, "crosskd.teacher.remote")
    server = fake(script=["drop"])
    sequences = _sequences([4])
    with _connect(server.url) as client:
        _same(client.score(sequences), sequences)
    assert len(server.score_requests()) == 2 and len(_waits(caplog)) == 1
    assert "RemoteDisconnected" in caplog.text


@pytest.mark.parametrize("status", [400, 404, 413])
def test_a_refused_request_is_permanent_with_the_servers_reason(fake, status):
    server = fake(script=[(status, None)])
    refused = rf"refused /v1/score \({status}: scripted"
    with _connect(server.url) as client, pytest.raises(CrosskdError, match=refused):
        client.score(_sequences([3]))
    assert len(server.score_requests()) == 1  # not retried


def test_a_wrong_or_missing_token_is_permanent_and_never_shown(fake, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    server = fake(token="right-token")
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(CrosskdError, match=rf"refused /v1/info \(401: .*\); set {TOKEN_ENV}"):
        _connect(server.url)
    monkeypatch.setenv(TOKEN_ENV, "wrong-token")
    with pytest.raises(CrosskdError, match=rf"check {TOKEN_ENV}") as raised:
        _connect(server.url)
    assert len(server.requests) == 2
    assert "wrong-token" not in str(raised.value) and "wrong-token" not in caplog.text


def test_a_server_that_stays_away_is_retryable_not_a_crosskd_error(fake, caplog):
    caplog.set_level(logging.WARNING, "crosskd.teacher.remote")
    server = fake(script=[(503, 0)] * 1000)
    options = ClientOptions(backoff_s=0.01, backoff_max_s=0.05, retry_s=0.5, concurrency=1)
    failed = r"POST /v1/score failed \d+ time\(s\)"
    client = _connect(server.url, options)
    with client, pytest.raises(TeacherUnavailable, match=failed) as e:
        client.score(_sequences([3]))
    assert not isinstance(e.value, CrosskdError)
    assert "last: HTTP 503: scripted 503" in str(e.value) and "retry_s = 0.5" in str(e.value)
    assert len(server.score_requests()) >= 2
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    with pytest.raises(TeacherUnavailable, match=r"GET /v1/info .*ConnectionRefusedError"):
        _connect(closed, options)


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("rows", r"it has 1 rows for 2 sequences"),
        ("length", r"row 0 is '0' with shapes \(\(2, 4\), .* sequence 0 of 3 tokens needs"),
        ("k", r"it is not a lossless answer of K = 4"),
    ],
)
def test_an_answer_that_does_not_match_its_request_is_refused(fake, item, message):
    server = fake(script=[item])
    with _connect(server.url) as client, pytest.raises(CrosskdError, match=message):
        client.score(_sequences([3, 2]))


def test_connect_refuses_a_server_that_scores_otherwise(fake):
    server = fake()
    for field, value in (("tokenizer_fingerprint", "u" * 64), ("k", 8), ("tau", 2.0)):
        with pytest.raises(ConfigError) as raised:
            _connect(server.url, **{field: value})
        served = getattr(INFO, field)
        assert str(raised.value).startswith(
            f"teacher server {server.url} (fake-teacher) answers with {field} {served!r}; "
            f"this run needs {value!r}"
        )
        assert "\n" not in str(raised.value)
    with pytest.raises(ConfigError, match=r"max_request_tokens 10; .* longest teacher sample is"):
        _connect(server.url, longest=11)
    _connect(server.url, longest=10).close()
    newer = fake(info=json.dumps(asdict(INFO) | {"version": 2}).encode())
    with pytest.raises(CrosskdError, match=r"speaks protocol version 2; this crosskd speaks 1"):
        _connect(newer.url)
    other = fake(info=b"<html>hello</html>")
    with pytest.raises(CrosskdError, match=r"/v1/info is not a crosskd teacher server's answer"):
        _connect(other.url)


def test_https_needs_a_trusted_certificate(fake, tmp_path, monkeypatch):
    """A self-signed certificate for 127.0.0.1: refused (permanent, not retried) until
    SSL_CERT_FILE trusts it, then the answers come over TLS."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    command = "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1"
    names = ["-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(
        [*command.split(), "-keyout", str(key), "-out", str(cert), *names],
        check=True,
        capture_output=True,
    )
    server = fake(tls=(cert, key))
    assert server.url.startswith("https://")
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    with pytest.raises(CrosskdError, match=r"TLS certificate is not trusted .* SSL_CERT_FILE"):
        _connect(server.url)
    assert server.requests == []
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    sequences = _sequences([3, 2])
    with _connect(server.url) as client:
        _same(client.score(sequences), sequences)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("ftp://host/x", r"not an http:// or https:// URL"),
        ("http://user:pw@host:1", rf"holds credentials; .* set {TOKEN_ENV}"),
        ("http://host:1/?a=b", r"has a query or fragment"),
    ],
)
def test_bad_urls_are_refused(url, message):
    with pytest.raises(ConfigError, match=message):
        _connect(url)


def test_the_training_config_checks_the_client_keys():
    base = {"student": "s", "data": "d", "output": "o"}
    with pytest.raises(ConfigError, match=r"teacher_retry_s is 0; it must be > 0"):
        TrainConfig(**base, teacher_retry_s=0)
    with pytest.raises(ConfigError, match=r"teacher_read_timeout_s is nan; it must be a finite"):
        TrainConfig(**base, teacher_read_timeout_s=float("nan"))
    with pytest.raises(ConfigError, match=r"teacher_concurrency is 0; it must be an integer >= 1"):
        TrainConfig(**base, teacher_concurrency=0)


# --- against a real `crosskd serve` process on loopback --------------------------------------

SERVE_TOKEN = "loopback-serve-token"


def _serve(tmp_path: Path, teacher: str, name: str, **keys) -> tuple[subprocess.Popen, str]:
    """``crosskd serve`` of ``teacher`` on a free loopback port (its log in
    ``tmp_path/NAME.log``); returns the process and its URL once it is ready."""
    port_file = tmp_path / f"{name}.port"
    settings = {"teacher": teacher, "host": "127.0.0.1", "port": 0, "port_file": port_file}
    command = [sys.executable, "-m", "crosskd.cli", "serve"]
    command += [f"{key}={value}" for key, value in (settings | keys).items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CROSSKD_SERVE_TOKEN": SERVE_TOKEN}
    with open(tmp_path / f"{name}.log", "w") as log_file:
        proc = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while not port_file.exists():
        if proc.poll() is not None:
            pytest.fail((tmp_path / f"{name}.log").read_text()[-3000:])
        assert time.monotonic() < deadline, "the teacher server did not become ready"
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{int(port_file.read_text())}"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def served(train_inputs, tmp_path_factory):
    """Teacher A served at K 16, tau 1 (what the session's cache of ``data`` holds)."""
    proc, url = _serve(tmp_path_factory.mktemp("serve"), train_inputs["teacher"], "a", k=16)
    yield url
    _stop(proc)


def _run(config) -> tuple[list[dict], Trainer]:
    trainer = Trainer(config, progress=False)
    trainer.setup()
    try:
        return trainer.train(), trainer
    finally:
        trainer.close()


def _scored_tokens(url: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "crosskd_serve_tokens":
            return sum(s.value for s in family.samples if s.name == "crosskd_serve_tokens_total")
    raise AssertionError("no crosskd_serve_tokens_total")


def test_training_on_the_server_equals_training_on_the_cache(
    train_inputs, served, tmp_path, monkeypatch, caplog
):
    """Three steps of the student with the signal from the server and from the lossless cache
    of the same teacher, K and tau: the same losses (up to float32 rounding of the teacher's
    forward pass in other batch shapes, as for `online:REF`), the server scored exactly the
    teacher tokens of the steps' samples (each once), and every micro-batch was scored from the
    trainer's input thread, never in the training step."""
    monkeypatch.setenv(TOKEN_ENV, SERVE_TOKEN)
    caplog.set_level(logging.DEBUG, "crosskd.teacher.remote")
    before = _scored_tokens(served)
    cached, _ = _run(train_config(train_inputs, tmp_path / "cache", steps=3))
    remote, trainer = _run(
        train_config(train_inputs, tmp_path / "remote", steps=3, teachers=[served])
    )
    for got, want in zip(remote, cached, strict=True):
        for key in ("loss", "ce", "kd"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-8), key
        assert got["kd_scale"] == pytest.approx(want["kd_scale"], rel=1e-3)
        for key in ("tokens", "teacher0/1:1/chunks", "teacher0/n:1/chunks"):
            assert got[key] == want[key], key
    tokens = sum(
        len(sample["teacher0_ids"])
        for step in range(3)
        for micro in trainer.step_micro_batches(step)
        for row in trainer.read_rows(micro)[0]
        for sample in row
    )
    assert _scored_tokens(served) - before == tokens
    calls = [r for r in caplog.records if r.getMessage().startswith(f"teacher server {served}: sc")]
    micro_batches = sum(len(trainer.step_micro_batches(step)) for step in range(3))
    assert len(calls) == micro_batches > 0
    assert {r.threadName for r in calls} == {"crosskd-input"}


def test_a_server_of_another_k_or_tokenizer_is_refused_at_setup(
    train_inputs, served, tmp_path, monkeypatch
):
    monkeypatch.setenv(TOKEN_ENV, SERVE_TOKEN)
    loss = LossConfig(
        teachers=[
            TeacherLossConfig(
                k=8, student_to_teacher=train_inputs["s2t"], teacher_to_student=train_inputs["t2s"]
            )
        ]
    )
    config = train_config(train_inputs, tmp_path / "k", teachers=[served], loss=loss)
    with pytest.raises(ConfigError) as raised:
        Trainer(config, progress=False).setup()
    message = str(raised.value)
    assert message.startswith(f"teacher server {served} (") and "\n" not in message
    assert "answers with k 16; this run needs 8" in message
    proc, other = _serve(tmp_path, train_inputs["teacher_b"], "b", k=16)
    try:
        config = train_config(train_inputs, tmp_path / "tok", teachers=[other])
        with pytest.raises(ConfigError, match=r"answers with tokenizer_fingerprint '[0-9a-f]+'"):
            Trainer(config, progress=False).setup()
    finally:
        _stop(proc)


def test_a_server_killed_mid_run_fails_the_step_as_retryable(train_inputs, tmp_path):
    """`crosskd train --nproc-per-node 1` on a server that is killed (SIGKILL) after two steps:
    the requests of the next step are retried for teacher_retry_s, then the pod exits 200
    (retryable) and counts the failure; a restart with the server back resumes from the
    checkpoint and completes."""
    proc, url = _serve(tmp_path, train_inputs["teacher"], "a", k=16)
    run = tmp_path / "run"
    config = tmp_path / "train.yaml"
    values = dataclasses.asdict(
        train_config(
            train_inputs,
            run,
            teachers=[url],
            steps=5000,
            checkpoint_every=2,
            teacher_retry_s=2.0,
        )
    )
    config.write_text(yaml.safe_dump(values))
    env = {**os.environ, "OMP_NUM_THREADS": "1", TOKEN_ENV: SERVE_TOKEN}
    command = [sys.executable, "-m", "crosskd.cli", "train", "--config", str(config)]
    agent = subprocess.Popen(
        [*command, "--nproc-per-node", "1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log_path = run / "metrics-rank0.jsonl"
    deadline = time.monotonic() + 300
    while not log_path.exists() or len(log_path.read_text().splitlines()) < 2:
        assert agent.poll() is None, agent.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "no training progress"
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    output, _ = agent.communicate(timeout=300)
    assert agent.returncode == EXIT_RETRYABLE, output[-3000:]
    assert "retrying in" in output and "could not read their inputs" in output
    assert f"teacher server {url}: POST /v1/score failed" in output
    assert "giving up after retry_s = 2.0 s" in output
    assert json.loads((run / "restarts" / "node-0.json").read_text())["count"] == 1
    done = json.loads((run / "checkpoints" / "latest.json").read_text())["step"]
    assert done >= 2
    # The server is back (on another port: the config says where); the run resumes.
    proc, url = _serve(tmp_path, train_inputs["teacher"], "again", k=16)
    try:
        values |= {"teachers": [url], "steps": done + 1}
        config.write_text(yaml.safe_dump(values))
        again = subprocess.run(
            [*command, "--nproc-per-node", "1"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=300,
        )
    finally:
        _stop(proc)
    assert again.returncode == 0, again.stdout[-3000:]
    steps = [json.loads(line)["step"] for line in log_path.read_text().splitlines()]
    assert steps[-1] == done + 1
    assert json.loads((run / "final" / "crosskd-model.json").read_text())["step"] == done + 1
