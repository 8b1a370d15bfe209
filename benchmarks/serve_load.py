"""Load test of ``crosskd serve`` on loopback: throughput and latency under capacity, then the
queue bound and 429s under overload, with every request answered or refused exactly once.

    python benchmarks/serve_load.py [--teacher zoo:smollm2] [--clients 4] [--requests 48]
        [--overload-clients 32] [--overload-requests 256] [--length 128] [--sequences 2]
        [--max-batch-tokens 2048] [--max-queue-tokens 4096] [--deadline-s 900]
        [--device cuda] [--dtype bfloat16] [--init zoo:qwen3 [--init-shape JSON] [--init-dir DIR]]

It starts one ``crosskd serve`` process (``127.0.0.1``, a free port, a random bearer token, K = 128,
``--device`` and ``--dtype``: float32 on CPU by default; ``--init``: a random-init teacher on that
tokenizer instead of ``--teacher``, as in ``benchmarks/teacher.py``) and, over a pool of
benchmark-corpus texts tokenized by the teacher's tokenizer (``--length`` tokens each; a request
holds ``--sequences`` of them):

1. **Capacity**: ``--clients`` threads, each with one request outstanding (a closed loop),
   send ``--requests`` requests in all. Reported: tokens/s over the phase's wall time, the
   requests' p50 / p99 latency (send to answer read), and the mean requests and tokens per
   model batch (the server's ``crosskd_serve_batch_*`` histograms): dynamic batching at work.
   Each answer is kept as the reference of its sequences.
2. **Overload**: ``--overload-clients`` threads start together and send
   ``--overload-requests`` requests in all, never retrying, while a thread reads
   ``/metrics`` every 20 ms. Reported: how many were answered (200) and refused (429 / 503,
   with ``Retry-After``), the most queued tokens the server reported against
   ``--max-queue-tokens``, and the checks: every request got exactly one answer or refusal
   (none lost, no other status), and every answer holds exactly its request's sequences (row
   count, lengths, and the same values as the capacity phase's answer for those sequences:
   in float32 top-K ids equal and log probs within 1e-4 nats, since other batch shapes may move
   the last bits; in a 16-bit ``--dtype``, where another batch shape can move a log prob by
   1e-2 and swap near-tied ids, the same top-1 id at 90% of the positions and log probs within
   0.05 nats on average: another sequence's answer is far from both).
3. **Drain**: SIGTERM; the server must exit 0.

The run stops by itself: a bounded number of requests, every wait bounded by
``--deadline-s``; the server is killed if anything fails. It exits 1 when a check fails.
Nothing leaves the machine (loopback only).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from inputs import add_init_options, device_name, init_teacher

from crosskd.alignment.corpus import benchmark_corpus
from crosskd.serve.protocol import JSON, ScoreRequest
from crosskd.teacher.storage import SampleSignal, decode
from crosskd.tokenization import load_tokenizer

K = 128
TOLERANCE = 1e-4
"""float32: the largest difference of a log prob between two answers for one sequence, nats."""
LOOSE_MEAN, LOOSE_TOP1 = 0.05, 0.9
"""16-bit dtypes: the largest mean difference of the log probs, nats, and the least share of
positions with the same top-1 id."""


@dataclass
class Answer:
    """One request's outcome: HTTP ``status``, ``seconds`` from send to answer read, its
    ``signals`` (200 only) and ``retry_after`` (429 / 503)."""

    status: int
    seconds: float
    signals: list[SampleSignal] | None = None
    retry_after: str | None = None


class Server:
    """A ``crosskd serve`` subprocess on loopback (killed by :meth:`close` unless it exited)."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.token = secrets.token_urlsafe(24)
        port_file = work / "port"
        self.log = (work / "serve.log").open("w")
        command = [
            sys.executable,
            "-m",
            "crosskd.cli",
            "serve",
            f"teacher={args.teacher}",
            f"k={K}",
            f"device={args.device}",
            f"dtype={args.dtype}",
            "host=127.0.0.1",
            "port=0",
            f"port_file={port_file}",
            f"max_batch_tokens={args.max_batch_tokens}",
            f"max_queue_tokens={args.max_queue_tokens}",
            f"max_request_tokens={args.length * args.sequences}",
        ]
        env = {**os.environ, "CROSSKD_SERVE_TOKEN": self.token}
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + args.deadline_s
        while not port_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                sys.exit(f"crosskd serve did not start; its log:\n{self.tail()}")
            time.sleep(0.2)
        self.port = int(port_file.read_text())

    def connection(self, timeout: float) -> http.client.HTTPConnection:
        """A new keep-alive connection to the server."""
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def metrics(self) -> str:
        """The ``/metrics`` text."""
        conn = self.connection(10)
        try:
            conn.request("GET", "/metrics")
            return conn.getresponse().read().decode()
        finally:
            conn.close()

    def tail(self) -> str:
        """The last lines of the server's log."""
        self.log.flush()
        return "\n".join(Path(self.log.name).read_text().splitlines()[-20:])

    def close(self) -> None:
        """Kill the process if it still runs."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.log.close()


def metric(text: str, name: str) -> float:
    """The value of the unlabelled sample ``name`` in a ``/metrics`` text (0 if absent)."""
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def send(
    server: Server, conn: http.client.HTTPConnection, sequences: list[np.ndarray]
) -> tuple[Answer, http.client.HTTPConnection]:
    """Post one score request on ``conn`` (reopened when the server closed it); returns the
    answer and the connection to use next."""
    body = ScoreRequest(sequences=sequences, k=K).to_json()
    headers = {"Content-Type": JSON, "Authorization": f"Bearer {server.token}"}
    start = time.perf_counter()
    try:
        conn.request("POST", "/v1/score", body, headers)
        response = conn.getresponse()
    except (ConnectionError, http.client.HTTPException):
        conn.close()
        conn = server.connection(conn.timeout)
        conn.request("POST", "/v1/score", body, headers)
        response = conn.getresponse()
    payload = response.read()
    seconds = time.perf_counter() - start
    if response.will_close:
        conn.close()
        conn = server.connection(conn.timeout)
    if response.status != 200:
        return Answer(response.status, seconds, retry_after=response.getheader("Retry-After")), conn
    signals = [signal for _, signal in decode(payload, "lossless", K)]
    return Answer(200, seconds, signals), conn


def run_clients(
    server: Server, requests: list[list[int]], pool: list[np.ndarray], clients: int, deadline: float
) -> list[Answer | None]:
    """Send ``requests`` (each a list of indices into ``pool``) from ``clients`` threads, each
    with one request outstanding, all starting together; the answers in request order."""
    answers: list[Answer | None] = [None] * len(requests)
    lock, barrier = threading.Lock(), threading.Barrier(clients)
    queue = list(range(len(requests)))[::-1]

    def client() -> None:
        conn = server.connection(deadline)
        barrier.wait()
        while True:
            with lock:
                if not queue:
                    break
                index = queue.pop()
            answers[index], conn = send(server, conn, [pool[i] for i in requests[index]])
        conn.close()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(deadline)
    return answers


def same_signal(got: SampleSignal, want: SampleSignal, strict: bool) -> bool:
    """``strict`` (float32): equal ids and log probs within :data:`TOLERANCE`; else the same
    top-1 id at :data:`LOOSE_TOP1` of the positions and log probs within :data:`LOOSE_MEAN` on
    average (the top K's sorted values and the realized ones)."""
    if got.length != want.length:
        return False
    if strict:
        return (
            bool((got.ids == want.ids).all())
            and float(np.abs(got.log_probs - want.log_probs).max()) <= TOLERANCE
            and float(np.abs(got.realized - want.realized).max(initial=0.0)) <= TOLERANCE
        )
    rows = np.arange(got.length)
    best = [s.ids[rows, s.log_probs.argmax(axis=1)] for s in (got, want)]  # ids ascend per row
    top1 = float((best[0] == best[1]).mean()) if got.length else 1.0
    values = np.abs(np.sort(got.log_probs, axis=1) - np.sort(want.log_probs, axis=1)).mean()
    realized = np.abs(got.realized - want.realized).mean() if got.length > 1 else 0.0
    return top1 >= LOOSE_TOP1 and float(values) <= LOOSE_MEAN and float(realized) <= LOOSE_MEAN


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", default="zoo:smollm2")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--overload-clients", type=int, default=32)
    parser.add_argument("--overload-requests", type=int, default=256)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--sequences", type=int, default=2)
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--max-queue-tokens", type=int, default=4096)
    parser.add_argument("--deadline-s", type=float, default=900.0)
    parser.add_argument("--device", default="cpu", help="the server's device: cpu or cuda")
    parser.add_argument("--dtype", default="float32", help="the server's dtype")
    add_init_options(parser)
    args = parser.parse_args()
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="crosskd-serve-load-") as tmp:
        args.teacher = init_teacher(args, Path(tmp) / "teacher") or args.teacher
        server = Server(args, Path(tmp))
        try:
            failures = load_test(server, args)
            server.process.send_signal(signal.SIGTERM)
            code = server.process.wait(args.deadline_s)
            print(f"drain: SIGTERM, the server exited {code}")
            if code != 0:
                failures.append(f"the server exited {code} after SIGTERM:\n{server.tail()}")
        finally:
            server.close()
    for failure in failures:
        print(f"FAILED: {failure}")
    sys.exit(1 if failures else 0)


def load_test(server: Server, args: argparse.Namespace) -> list[str]:
    """Both phases against ``server``; returns the failed checks."""
    conn = server.connection(30)
    conn.request("GET", "/v1/info", headers={"Authorization": f"Bearer {server.token}"})
    info = json.loads(conn.getresponse().read())
    conn.close()
    tok = load_tokenizer(args.teacher, vocab_size=info["vocab_size"])
    pool = []
    for text in benchmark_corpus(400_000, document_bytes=8 * args.length):
        ids = tok.hf(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= args.length:
            pool.append(np.asarray(ids[: args.length], dtype=np.int64))
    size = args.sequences
    n_seq = args.requests * size
    if len(pool) < n_seq:
        sys.exit(f"the corpus gave {len(pool)} texts of {args.length} tokens; {n_seq} needed")
    pool = pool[:n_seq]
    print(
        f"teacher {info['teacher']} (V = {info['vocab_size']}) in {args.dtype} on "
        f"{device_name(args.device)}, K = {K}, requests of {size} x "
        f"{args.length} tokens; batches of at most {args.max_batch_tokens} tokens, queue bound "
        f"{args.max_queue_tokens} tokens"
    )
    failures = []

    # 1. capacity
    requests = [list(range(r * size, (r + 1) * size)) for r in range(args.requests)]
    before = server.metrics()
    start = time.perf_counter()
    answers = run_clients(server, requests, pool, args.clients, args.deadline_s)
    wall = time.perf_counter() - start
    after = server.metrics()
    ok = [a for a in answers if a is not None and a.status == 200]
    if len(ok) != len(requests):
        statuses = Counter(None if a is None else a.status for a in answers)
        failures.append(f"capacity: not every request was answered 200: {dict(statuses)}")
    reference = {}
    for request, answer in zip(requests, answers, strict=True):
        if answer is not None and answer.status == 200:
            reference.update(zip(request, answer.signals, strict=True))
    latencies = sorted(a.seconds for a in ok)
    batches = metric(after, "crosskd_serve_batch_requests_count") - metric(
        before, "crosskd_serve_batch_requests_count"
    )
    per_batch = metric(after, "crosskd_serve_batch_requests_sum") - metric(
        before, "crosskd_serve_batch_requests_sum"
    )
    batch_tokens = metric(after, "crosskd_serve_batch_tokens_sum") - metric(
        before, "crosskd_serve_batch_tokens_sum"
    )
    tokens = len(ok) * size * args.length
    print(
        f"capacity  {args.clients} clients, {len(requests)} requests: {tokens / wall:.0f} "
        f"tokens/s, latency p50 {statistics.median(latencies):.2f} s, p99 "
        f"{latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]:.2f} s; "
        f"{per_batch / max(batches, 1):.1f} requests and {batch_tokens / max(batches, 1):.0f} "
        f"tokens per model batch ({batches:.0f} batches)"
    )

    # 2. overload
    rng = np.random.default_rng(0)
    overload = [
        sorted(rng.choice(n_seq, size, replace=False).tolist())
        for _ in range(args.overload_requests)
    ]
    peaks, stop = [], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peaks.append(metric(server.metrics(), "crosskd_serve_queue_tokens"))
            stop.wait(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start = time.perf_counter()
    answers = run_clients(server, overload, pool, args.overload_clients, args.deadline_s)
    wall = time.perf_counter() - start
    stop.set()
    watcher.join()
    statuses = Counter(None if a is None else a.status for a in answers)
    refused = [a for a in answers if a is not None and a.status in (429, 503)]
    wrong = 0
    strict = args.dtype == "float32"
    for request, answer in zip(overload, answers, strict=True):
        if answer is None or answer.status != 200:
            continue
        if len(answer.signals) != len(request) or not all(
            same_signal(got, reference[i], strict)
            for i, got in zip(request, answer.signals, strict=True)
        ):
            wrong += 1
    print(
        f"overload  {args.overload_clients} clients, {len(overload)} requests in {wall:.1f} s: "
        f"{statuses.get(200, 0)} answered, {statuses.get(429, 0)} refused 429, "
        f"{statuses.get(503, 0)} refused 503; most queued tokens seen {max(peaks, default=0):.0f} "
        f"(bound {args.max_queue_tokens}); answers that are not their request's: {wrong}"
    )
    if statuses.get(None) or set(statuses) - {200, 429, 503}:
        failures.append(f"overload: requests lost or answered otherwise: {dict(statuses)}")
    if not statuses.get(429):
        failures.append("overload: no request was refused 429; raise --overload-clients")
    if any(a.retry_after is None for a in refused):
        failures.append("overload: a refusal without Retry-After")
    if max(peaks, default=0) > args.max_queue_tokens:
        failures.append(f"overload: the queue held {max(peaks):.0f} tokens, over the bound")
    if wrong:
        failures.append(f"overload: {wrong} answer(s) do not hold their request's sequences")
    return failures


if __name__ == "__main__":
    main()
