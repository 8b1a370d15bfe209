"""``crosskd serve`` as a real process on loopback (``python -m crosskd.cli serve``, port 0 and
``port_file``) with a tiny random-init Llama teacher and its own tiny BPE.

Exactness: the server's answers are compared for equality, bit for bit, with
:func:`~crosskd.teacher.scoring.score_all` in this process over the same sequences with the
server's token budget, because the server scores a batch's sequences exactly so (model batches
from :func:`~crosskd.teacher.scoring.budget_batches`, longest first). A sequence's signal may
depends on the model batch it is in (the other rows, the padding width) in the last bits, where
kernels are chosen by shape (the eight requests below, scored with budgets of 1, 32, 96 and 1000
tokens: the same ids, log probs apart by up to 4.8e-7 nats, one float32 ulp), so each reference
is built from the batch the server is known to have scored, which makes equality a guarantee:
a request alone (``max_wait_ms: 0``, one request at a time), or a batch filled exactly (a long
``max_wait_ms`` and requests whose tokens add up to ``max_batch_tokens``; all lengths differ, so
the model batches and their row order do not depend on the order the requests arrived in).
Both processes run torch on one thread (``OMP_NUM_THREADS``, set by ``conftest.py``).

Nothing here waits on time: the held servers keep a batch open until it fills or the drain
starts, and the drain is held open by a request whose body the test has not sent yet
(``Expect: 100-continue``: the server takes the request before asking for its body).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from train_inputs import tiny_model

from crosskd.alignment.core import tokenize
from crosskd.cli import main
from crosskd.serve.batcher import Batcher, BatchFailed, ServeMetrics
from crosskd.serve.protocol import PARQUET, RequestError, ScoreRequest, ServerInfo, answer_tokens
from crosskd.teacher.model import load_teacher
from crosskd.teacher.scoring import score_all, score_sequences
from crosskd.teacher.storage import SampleSignal, decode, encode
from crosskd.tokenization import load_tokenizer

TOKEN = "test-token-5b1e"
K, TAU, V = 8, 2.0, 300
POSITIONS = 40
"""The teacher's ``max_position_embeddings`` (set below the request limit, to be refused)."""
TEXTS = [
    "The quick brown fox jumps over the lazy dog. ",
    "Pack my box with five dozen liquor jugs, 12 of them.",
    "def add(a, b):\n    return a + b\n",
] * 8
FAST = (
    "max_wait_ms=0",
    "max_batch_tokens=32",
    "max_request_tokens=64",
    "max_queue_tokens=64",
    "max_body_bytes=2048",
)
"""A server that scores each request at once, in model batches of at most 32 padded tokens."""
HELD = ("max_wait_ms=600000", "max_batch_tokens=96", "max_request_tokens=48")
"""A server whose batches wait to fill (96 tokens) or for the drain."""


@pytest.fixture(scope="module")
def teacher_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama (V = 300) with its own BPE, positions cut to :data:`POSITIONS`."""
    folder = tiny_model(tmp_path_factory.mktemp("serve") / "teacher", TEXTS, V, seed=5)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"max_position_embeddings": POSITIONS}))
    return str(folder)


@pytest.fixture(scope="module")
def reference(teacher_folder: str):
    """The teacher loaded in this process as the server loads it."""
    return load_teacher(teacher_folder, device="cpu", dtype="float32")


@dataclass
class Server:
    """A ``crosskd serve`` process."""

    proc: subprocess.Popen
    port: int
    log: Path

    def call(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        *,
        token: str | None = TOKEN,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, http.client.HTTPResponse, bytes]:
        """One request on its own connection: (status, response, body)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        sent = {"Authorization": f"Bearer {token}"} if token else {}
        conn.request(method, path, body=body, headers=sent | (headers or {}))
        response = conn.getresponse()
        data = response.read()
        conn.close()
        return response.status, response, data

    def score(self, request: ScoreRequest, **kw) -> tuple[int, http.client.HTTPResponse, bytes]:
        return self.call("POST", "/v1/score", request.to_json(), **kw)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` scraped: ``name{label="value"}`` -> value."""
        status, _, text = self.call("GET", "/metrics", token=None)
        assert status == 200
        out = {}
        for family in text_string_to_metric_families(text.decode()):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
        return out

    def stop(self) -> int:
        """SIGTERM, then the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=120)


def start(tmp: Path, teacher: str, *overrides: str, token: str | None = TOKEN) -> Server:
    """A server on a free loopback port, once it has written its port file (ready)."""
    tmp.mkdir(parents=True, exist_ok=True)
    port_file, log = tmp / "port", tmp / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "CROSSKD_SERVE_TOKEN"}
    if token is not None:
        env["CROSSKD_SERVE_TOKEN"] = token
    command = [
        *(sys.executable, "-m", "crosskd.cli", "serve", f"teacher={teacher}"),
        *(f"k={K}", f"tau={TAU}", "device=cpu", "dtype=float32", "host=127.0.0.1", "port=0"),
        f"port_file={port_file}",
        *overrides,
    ]
    with log.open("wb") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"crosskd serve did not start:\n{log.read_text()}")
        time.sleep(0.05)
    return Server(proc, int(port_file.read_text()), log)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, teacher_folder: str):
    """The fast server, shared by the module's tests of single requests."""
    running = start(tmp_path_factory.mktemp("fast"), teacher_folder, *FAST)
    yield running
    assert running.stop() == 0


@pytest.fixture
def launch(tmp_path: Path, teacher_folder: str):
    """``launch(*overrides, token=...)`` starts a server of the test's own; one still running
    when the test ends (it failed part way) is killed."""
    started: list[Server] = []

    def go(*overrides: str, token: str | None = TOKEN) -> Server:
        started.append(start(tmp_path / str(len(started)), teacher_folder, *overrides, token=token))
        return started[-1]

    yield go
    for running in started:
        if running.proc.poll() is None:
            running.proc.kill()
            running.proc.wait()


def sequences(*lengths: int, seed: int = 0) -> list[np.ndarray]:
    """Token ids ``[n]`` for each length (int64, below V)."""
    gen = np.random.default_rng(seed)
    return [gen.integers(0, V, n) for n in lengths]


def signals(payload: bytes, count: int, encoding: str = "lossless") -> list[SampleSignal]:
    """An answer decoded as the cache reader does; its ids are ``0 .. count - 1``."""
    decoded = decode(payload, encoding, K)
    assert [name for name, _ in decoded] == [str(i) for i in range(count)]
    return [signal for _, signal in decoded]


def assert_identical(got: list[SampleSignal], want: list[SampleSignal]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        for name in ("ids", "log_probs", "realized", "realized_t1"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name


def test_info_names_the_teacher_and_what_every_answer_has(server, teacher_folder, reference):
    status, response, body = server.call("GET", "/v1/info")
    assert status == 200 and response.getheader("Content-Type") == "application/json"
    info = ServerInfo.from_json(body, "test")
    tokenizer = load_tokenizer(teacher_folder, vocab_size=V)
    assert info == ServerInfo(
        teacher=teacher_folder,
        model_fingerprint=reference.fingerprint,
        tokenizer_fingerprint=tokenizer.fingerprint,
        vocab_size=V,
        k=K,
        tau=TAU,
        encoding="lossless",
        max_request_tokens=64,
    )


def test_an_answer_is_what_scoring_gives_in_process(server, reference):
    """Four sequences (three model batches of at most 32 padded tokens), answered in request
    order, identical to :func:`score_all` with the same budget."""
    seqs = sequences(17, 5, 1, 12, seed=1)
    request = ScoreRequest(seqs, k=K, tau=TAU)
    status, response, payload = server.score(request)
    assert status == 200 and response.getheader("Content-Type") == PARQUET
    got = signals(payload, 4)
    assert_identical(got, score_all(reference, seqs, k=K, tau=TAU, token_budget=32))
    assert [s.length for s in got] == [17, 5, 1, 12]


def test_texts_are_tokenized_with_the_teachers_tokenizer(server, teacher_folder, reference):
    """No special tokens added, and one written in the text stays text (as ``crosskd prepare``
    tokenizes); the answer carries the tokens beside their signals."""
    texts = ["The lazy fox.", "def mul(a, b): <|endoftext|>"]
    tokenizer = load_tokenizer(teacher_folder, vocab_size=V)
    want_tokens = [t.ids for t in tokenize(tokenizer, texts)]
    endoftext = tokenizer.hf.convert_tokens_to_ids("<|endoftext|>")
    assert all(endoftext not in t for t in want_tokens)
    status, _, payload = server.score(ScoreRequest(texts=texts))
    assert status == 200
    got_tokens = answer_tokens(payload)
    assert [t.tolist() for t in got_tokens] == [t.tolist() for t in want_tokens]
    want = score_all(reference, want_tokens, k=K, tau=TAU, token_budget=32)
    assert_identical(signals(payload, 2), want)


@pytest.mark.parametrize(
    ("token", "header", "words"),
    [
        (None, None, "no bearer token"),
        ("wrong-token", None, "the bearer token is wrong"),
        (None, f"Basic {TOKEN}", "no bearer token"),
        (None, f"Bearer {TOKEN}x", "the bearer token is wrong"),
    ],
)
def test_the_api_needs_the_token(server, token, header, words):
    headers = {"Authorization": header} if header else {}
    for method, path, body in (
        ("GET", "/v1/info", None),
        ("POST", "/v1/score", ScoreRequest(sequences(3)).to_json()),
    ):
        status, response, data = server.call(method, path, body, token=token, headers=headers)
        assert status == 401 and response.getheader("WWW-Authenticate") == "Bearer"
        assert words in json.loads(data)["error"]
        assert TOKEN not in data.decode()


def test_probes_and_metrics_need_no_token(server):
    for path, want in (("/healthz", "ok"), ("/readyz", "ready")):
        status, _, body = server.call("GET", path, token=None)
        assert (status, json.loads(body)["status"]) == (200, want)
    status, response, _ = server.call("GET", "/metrics", token=None)
    assert status == 200 and response.getheader("Content-Type").startswith("text/plain")


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (b"{not json", 400, "the body is not JSON"),
        (b"[]", 400, "the body is not a JSON object"),
        (b'{"sequences": [[1]], "extra": 1}', 400, "unknown key(s) extra"),
        (b'{"sequences": [[1]], "texts": ["a"]}', 400, "send exactly one of"),
        (b'{"sequences": [[1, "2"]]}', 400, "sequences[0] must be a non-empty list of integer"),
        (b'{"texts": [""]}', 400, "texts[0] must be a non-empty string"),
        (b'{"sequences": [[1]], "k": 16}', 400, "k is 16; this server answers with k = 8"),
        (b'{"sequences": [[1]], "tau": 1.0}', 400, "tau is 1.0; this server answers with tau"),
        (b'{"texts": ["a"], "tokenizer_fingerprint": "abc"}', 400, "tokenizer_fingerprint is"),
        (b'{"sequences": [[1], [2, 300]]}', 400, "sequences[1] holds token ids from 2 to 300"),
        (
            json.dumps({"sequences": [[1] * (POSITIONS + 1)]}).encode(),
            400,
            f"sequences[0] holds {POSITIONS + 1} tokens; the teacher takes at most {POSITIONS}",
        ),
        (
            json.dumps({"sequences": [[1] * 30, [2] * 30, [3] * 5]}).encode(),
            413,
            "the request holds 65 tokens; this server takes at most 64 per request",
        ),
        (
            json.dumps({"texts": ["fox " * 70]}).encode(),
            413,
            "this server takes at most 64 per request",
        ),
    ],
)
def test_bad_requests_get_their_reason(server, body, status, words):
    got, response, data = server.call("POST", "/v1/score", body)
    assert (got, response.getheader("Content-Type")) == (status, "application/json")
    assert words in json.loads(data)["error"]


def test_a_body_over_the_limit_is_refused_unread(server):
    """413 before the body is read (``max_body_bytes`` 2048), and the connection closes."""
    body = ScoreRequest(sequences(600)).to_json()
    assert len(body) > 2048
    status, response, data = server.call("POST", "/v1/score", body)
    assert status == 413 and response.getheader("Connection") == "close"
    assert f"the body is {len(body)} bytes; this server reads at most 2048" in data.decode()


def test_a_body_without_its_length_is_refused(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.putrequest("POST", "/v1/score")
    conn.putheader("Authorization", f"Bearer {TOKEN}")
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 411
    assert "no Content-Length" in json.loads(response.read())["error"]
    conn.close()
    status, _, data = server.call("POST", "/v1/score", b"{}", headers={"Content-Length": "2x"})
    assert status == 400 and "Content-Length is '2x'" in data.decode()


def test_unknown_endpoints_and_methods(server):
    for method, path in (("GET", "/v1/nothing"), ("POST", "/score"), ("GET", "/")):
        status, _, data = server.call(method, path, b"{}" if method == "POST" else None)
        assert status == 404 and f"no endpoint {path}" in data.decode()
    status, response, _ = server.call("GET", "/v1/score")
    assert (status, response.getheader("Allow")) == (405, "POST")
    status, response, _ = server.call("POST", "/v1/info", b"{}")
    assert (status, response.getheader("Allow")) == (405, "GET")


def test_metrics_count_what_was_answered(server):
    """Scraped over HTTP: one more 200 and one more 400, the tokens scored, one more batch of
    one request; nothing held after the answer; ready."""
    before = server.metrics()
    assert server.score(ScoreRequest(sequences(9, 4, seed=3)))[0] == 200
    assert server.score(ScoreRequest(sequences(2), k=3))[0] == 400
    after = server.metrics()

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert moved('crosskd_serve_requests_total{code="200"}') == 1
    assert moved('crosskd_serve_requests_total{code="400"}') == 1
    assert moved("crosskd_serve_tokens_total") == 13
    assert moved("crosskd_serve_batch_requests_count") == 1
    assert moved("crosskd_serve_batch_tokens_sum") == 13
    assert moved("crosskd_serve_request_seconds_count") == 1
    assert after["crosskd_serve_queue_requests"] == after["crosskd_serve_queue_tokens"] == 0
    assert after["crosskd_serve_ready"] == 1


def test_every_metric_served_is_in_docs_metrics_md(server):
    names = {key.partition("{")[0] for key in server.metrics()}
    families = {re.sub(r"(_total|_bucket|_sum|_count|_created)$", "", n) for n in names}
    page = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    documented = {re.sub(r"_total$", "", n) for n in re.findall(r"`(crosskd_serve_[a-z_]+)`", page)}
    assert families == documented
    assert len(families) == 8


def test_requests_from_many_threads_share_a_batch(launch, reference):
    """Eight clients at once (``auth: none``, no token sent) whose tokens fill one 96-token
    batch exactly: each gets its own sequences' signals, identical to scoring all 96 tokens in
    process with the same budget (in the lossy encoding: as that encoded and decoded); the batch
    held 8 requests, scored as two model batches. Then a drain that cannot finish within
    ``drain_timeout_s`` exits 143."""
    held = launch(*HELD, "auth=none", "drain_timeout_s=0.5", "encoding=lossy", token=None)
    status, _, info = held.call("GET", "/v1/info", token=None)
    assert (status, ServerInfo.from_json(info, "test").encoding) == (200, "lossy")
    lengths = [(3, 20), (4,), (5, 9), (6,), (7, 10), (8,), (11,), (13,)]
    requests = [sequences(*n, seed=10 + i) for i, n in enumerate(lengths)]
    assert sum(map(sum, lengths)) == 96
    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(lambda r: held.score(ScoreRequest(r), token=None), requests))
    flat = [s for r in requests for s in r]
    want = score_all(reference, flat, k=K, tau=TAU, token_budget=96)
    start_at = 0
    for request, (status, _, payload) in zip(requests, answers, strict=True):
        assert status == 200
        mine = want[start_at : start_at + len(request)]
        names = [str(i) for i in range(len(request))]
        lossy = signals(encode(names, mine, "lossy"), len(request), "lossy")
        assert_identical(signals(payload, len(request), "lossy"), lossy)
        start_at += len(request)
    metrics = held.metrics()
    assert metrics["crosskd_serve_batch_requests_count"] == 1
    assert metrics["crosskd_serve_batch_requests_sum"] == 8
    assert metrics["crosskd_serve_batch_tokens_count"] == 2  # 20+13+11+10, then 9+8+...+3
    assert metrics["crosskd_serve_batch_tokens_sum"] == 96
    assert metrics['crosskd_serve_requests_total{code="200"}'] == 9  # with /v1/info
    assert metrics["crosskd_serve_request_seconds_count"] == 8
    assert "auth: none: /v1/ requests need no token" in held.log.read_text()
    # A request taken whose body never comes holds the drain past drain_timeout_s: exit 143.
    sock = take_without_body(held.port, ScoreRequest(sequences(5)).to_json(), token=None)
    assert held.stop() == 143
    sock.close()
    assert "exiting with 143" in held.log.read_text()


def _head(sock: socket.socket) -> bytes:
    """Bytes up to the end of an answer's headers."""
    data = b""
    while not data.endswith(b"\r\n\r\n"):
        byte = sock.recv(1)
        assert byte, f"the connection closed after {data!r}"
        data += byte
    return data


def take_without_body(port: int, body: bytes, token: str | None = TOKEN) -> socket.socket:
    """A ``/v1/score`` request the server has taken (it answered ``100 Continue``) whose body is
    not sent yet."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    sock.sendall(
        (
            f"POST /v1/score HTTP/1.1\r\nHost: test\r\n{auth}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Expect: 100-continue\r\n\r\n"
        ).encode()
    )
    assert _head(sock).startswith(b"HTTP/1.1 100")
    return sock


def finish(sock: socket.socket, body: bytes) -> tuple[int, bytes]:
    """Send the body of a request taken by :func:`take_without_body`; (status, answer)."""
    sock.sendall(body)
    head = _head(sock).decode()
    status = int(head.split()[1])
    length = int(next(h for h in head.split("\r\n") if h.lower().startswith("content-length"))[15:])
    payload = b""
    while len(payload) < length:
        payload += sock.recv(length - len(payload))
    sock.close()
    return status, payload


def test_a_full_queue_refuses_and_sigterm_drains(launch, reference):
    """A request held in a filling batch (30 tokens of a 64-token queue bound): one of 40 more
    is refused at once with 429 and Retry-After. A second request is taken, its body not yet
    sent: with two in flight (``max_in_flight``) a third gets 429 too. SIGTERM: the held batch
    is scored at once and answered; while the second request is still open, ``/readyz`` and new
    requests answer 503 with Retry-After, ``/healthz`` 200 and the ready gauge is 0; the second
    request, once sent, is answered; the process exits 0."""
    held = launch(*HELD, "max_queue_tokens=64", "max_in_flight=2", "retry_after_s=7")
    first = sequences(20, 10, seed=20)
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(held.score, ScoreRequest(first))
        while held.metrics()["crosskd_serve_queue_requests"] < 1:
            assert not answer.done(), answer.result()
            time.sleep(0.01)
        assert held.metrics()["crosskd_serve_queue_tokens"] == 30
        status, response, data = held.score(ScoreRequest(sequences(20, 20, seed=21)))
        assert (status, response.getheader("Retry-After")) == (429, "7")
        assert "the queue is full (30 tokens held, this request 40, bound 64)" in data.decode()
        second = sequences(15, seed=22)
        body = ScoreRequest(second).to_json()
        sock = take_without_body(held.port, body)
        status, response, data = held.score(ScoreRequest(sequences(3)))
        assert (status, response.getheader("Retry-After")) == (429, "7")
        assert "2 requests are in flight, this server's max_in_flight" in data.decode()
        held.proc.send_signal(signal.SIGTERM)
        status, _, payload = answer.result()
    assert status == 200
    assert_identical(
        signals(payload, 2), score_all(reference, first, k=K, tau=TAU, token_budget=96)
    )
    status, response, _ = held.call("GET", "/readyz", token=None)
    assert (status, response.getheader("Retry-After")) == (503, "7")
    status, response, data = held.score(ScoreRequest(sequences(5)))
    assert (status, response.getheader("Retry-After")) == (503, "7")
    assert "draining" in json.loads(data)["error"]
    assert held.call("GET", "/healthz", token=None)[0] == 200
    metrics = held.metrics()
    assert metrics["crosskd_serve_ready"] == 0
    assert metrics['crosskd_serve_requests_total{code="429"}'] == 2
    assert metrics['crosskd_serve_requests_total{code="503"}'] == 1
    status, payload = finish(sock, body)
    assert status == 200
    assert_identical(
        signals(payload, 1), score_all(reference, second, k=K, tau=TAU, token_budget=96)
    )
    assert held.proc.wait(timeout=120) == 0
    assert "drained: every request taken was answered" in held.log.read_text()


def test_a_failed_batch_fails_only_its_requests(reference):
    """The batcher in process with the real teacher: a batch holding an id the model's
    embedding does not have (the server refuses it before; here nothing does) fails both of
    its requests with the model's reason; the next batch is scored."""
    metrics = ServeMetrics()
    batcher = Batcher(
        lambda seqs: score_sequences(reference, seqs, k=K, tau=TAU),
        max_batch_tokens=20,
        max_wait_s=600.0,
        max_queue_tokens=100,
        retry_after_s=1,
        metrics=metrics,
    )
    bad = np.array([1, 2, V])
    failed = [batcher.submit(sequences(7, seed=30)), batcher.submit([*sequences(10), bad])]
    for future in failed:
        with pytest.raises(BatchFailed, match="IndexError: index out of range"):
            future.result(timeout=120)
    batcher.drain()
    good = sequences(6, 9, seed=31)
    assert_identical(
        batcher.submit(good).result(timeout=120),
        score_all(reference, good, k=K, tau=TAU, token_budget=20),
    )
    assert batcher.close(timeout=120)
    registry = metrics.registry
    assert registry.get_sample_value("crosskd_serve_batch_requests_count") == 2
    assert registry.get_sample_value("crosskd_serve_batch_requests_sum") == 3
    assert registry.get_sample_value("crosskd_serve_tokens_total") == 15
    assert registry.get_sample_value("crosskd_serve_queue_tokens") == 0
    with pytest.raises(RequestError, match="shutting down") as caught:
        batcher.submit(good)
    assert caught.value.status == 503


def test_the_server_refuses_to_start_without_its_token(monkeypatch, capsys):
    monkeypatch.delenv("CROSSKD_SERVE_TOKEN", raising=False)
    assert main(["serve", "teacher=/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("crosskd: error: CROSSKD_SERVE_TOKEN is not set;")
    assert "auth: none" in err


def test_without_auth_no_token_is_needed(monkeypatch, capsys, tmp_path):
    """``auth: none`` goes past the token (to the teacher, missing here)."""
    monkeypatch.delenv("CROSSKD_SERVE_TOKEN", raising=False)
    missing = tmp_path / "none"
    assert main(["serve", f"teacher={missing}", "auth=none", "host=127.0.0.1", "port=0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"teacher '{missing}' is not a folder" in err


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("max_queue_tokens=100", "max_queue_tokens is 100, below max_request_tokens (32768)"),
        ("auth=basic", "auth is 'basic'; choose one of bearer, none"),
        ("encoding=fp8", "encoding is 'fp8'; choose one of lossless, lossy"),
        ("port=70000", "port is 70000; it must be an integer 0 .. 65535"),
        ("max_wait_ms=-1", "max_wait_ms is -1; it must be a finite number >= 0"),
        ("drain_timeout_s=.inf", "drain_timeout_s is inf; it must be a finite number >= 0"),
        ("tau=0", "tau is 0; it must be a finite number > 0"),
        ("k=0", "k is 0; it must be an integer >= 1"),
        ("max_batch_tokens=true", "max_batch_tokens is True; it must be an integer >= 1"),
    ],
)
def test_bad_config_values_are_refused_naming_the_key(monkeypatch, capsys, override, words):
    monkeypatch.setenv("CROSSKD_SERVE_TOKEN", TOKEN)
    assert main(["serve", "teacher=/nonexistent", override]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err


def test_a_k_over_the_vocabulary_and_a_taken_port_are_refused(monkeypatch, capsys, teacher_folder):
    monkeypatch.setenv("CROSSKD_SERVE_TOKEN", TOKEN)
    args = ["serve", f"teacher={teacher_folder}", "host=127.0.0.1", "device=cpu"]
    assert main([*args, "port=0", f"k={V + 1}"]) == 2
    err = capsys.readouterr().err
    assert f"k is {V + 1}; teacher {teacher_folder} has {V} output rows" in err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main([*args, f"port={port}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot listen on 127.0.0.1:{port}" in err


def test_a_keep_alive_connection_carries_several_requests(server):
    """Two requests on one keep-alive connection are both answered (HTTP/1.1)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    for seed in (40, 41):
        seqs = sequences(4, seed=seed)
        conn.request(
            "POST",
            "/v1/score",
            ScoreRequest(seqs).to_json(),
            {"Authorization": f"Bearer {TOKEN}"},
        )
        response = conn.getresponse()
        assert response.status == 200 and len(signals(response.read(), 1)) == 1
    conn.close()
