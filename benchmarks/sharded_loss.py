"""Benchmark: the vocabulary-parallel (TP2) loss against the unsharded loss at the same global
shape, per-rank time and peak memory, in one run.

The batch is the loss benchmark's: ``--rows`` packed rows of ``--length`` Llama-3 tokens of
benchmark text (V = 128,256) against a Qwen3 teacher (top-128 signal of random logits biased
towards the realized tokens), real tables, float32 student logits. Each measurement runs in
its own forked process(es) with one thread each, so peak memory is per process:

* ``unsharded``: :func:`crosskd.loss.compute_loss` (CE + CSD) forward + backward in one process;
* ``tp2``: two processes (gloo on loopback), each holding half the vocabulary of the logits,
  :func:`crosskd.loss.parallel.sharded_loss` forward + backward (the collectives included).

Seconds are the median of ``--repeat`` steps after one warm-up; peak memory is the rise of the
process's peak resident set above its resident set before the step (its logits already there).
Expect about half the memory per rank; the time per rank is half the vocabulary work plus the
collectives (``O(rows + events)`` numbers, never ``O(rows x V)``).

    python benchmarks/sharded_loss.py [--repeat 3] [--rows 4] [--length 512]

Zoo tokenizers are built into ``$CROSSKD_CACHE_DIR`` (default ``~/.cache/crosskd``).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from inputs import csd_plan, measure, real_batch, teacher_logits, zoo_pair

from crosskd.loss import compute_loss
from crosskd.loss.parallel import ParallelConfig, build_loss_groups, reduce_counts, sharded_loss
from crosskd.teacher import signal_from_logits

STUDENT, TEACHER, K = "llama3", "qwen3", 128


def _unsharded(logits, plan, config, repeat, out: Path) -> None:
    torch.set_num_threads(1)
    local = logits.clone().requires_grad_(True)

    def step() -> None:
        compute_loss(local, plan, config).loss.backward()
        local.grad = None

    seconds, peak = measure(step, repeat)
    out.write_text(json.dumps({"seconds": seconds, "peak": peak}))
    os._exit(0)


def _tp_rank(rank, port, logits, plan, config, repeat, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = build_loss_groups(ParallelConfig(tp=2))
    part = logits.shape[-1] // 2
    local = logits[..., rank * part : (rank + 1) * part].clone().requires_grad_(True)
    counts = reduce_counts(plan.counts, mesh)

    def step() -> None:
        sharded_loss(local, plan, config, counts, mesh).loss.backward()
        local.grad = None

    seconds, peak = measure(step, repeat)
    out.write_text(json.dumps({"seconds": seconds, "peak": peak}))
    dist.destroy_process_group()
    os._exit(0)


def _run(target, arg_sets: list[tuple]) -> None:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=target, args=args) for args in arg_sets]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"a benchmark process failed (exit code {proc.exitcode})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    student, teacher, pair = zoo_pair(STUDENT, TEACHER)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        batch = real_batch(STUDENT, TEACHER, args.rows, args.length, work)
        s_ids, t_ids = batch.models["student"].input_ids, batch.models["teacher0"].input_ids
        gen = torch.Generator().manual_seed(0)
        signal = signal_from_logits(
            teacher_logits(t_ids, teacher.vocab_size, gen), t_ids, k=K, tau=1.0
        )
        config, plan = csd_plan(batch, signal, pair, K, student.vocab_size)
        logits = torch.randn(*s_ids.shape, student.vocab_size, generator=gen)
        _run(_unsharded, [(logits, plan, config, args.repeat, work / "unsharded.json")])
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        _run(
            _tp_rank,
            [
                (rank, port, logits, plan, config, args.repeat, work / f"tp{rank}.json")
                for rank in (0, 1)
            ],
        )
        base = json.loads((work / "unsharded.json").read_text())
        ranks = [json.loads((work / f"tp{r}.json").read_text()) for r in (0, 1)]
    print(
        f"shape {tuple(s_ids.shape)} x V={student.vocab_size}, top-{K}, "
        f"{plan.counts.chunks[0]} chunks"
    )
    print(f"{'layout':12} {'s/rank':>8} {'x':>6} {'peak MB/rank':>13} {'x':>6}")
    print(f"{'unsharded':12} {base['seconds']:8.3f} {1:6.2f} {base['peak'] / 2**20:13.0f} {1:6.2f}")
    seconds = max(r["seconds"] for r in ranks)
    peak = max(r["peak"] for r in ranks)
    print(
        f"{'tp2':12} {seconds:8.3f} {seconds / base['seconds']:6.2f} {peak / 2**20:13.0f} "
        f"{peak / base['peak']:6.2f}"
    )


if __name__ == "__main__":
    main()
