"""Training processes the tests start: fresh interpreters (``spawn``), never a fork of a pytest
process that has already run a Trainer (its threads and process-group state would be copied
half-way). Not collected as tests.

Each target writes what it saw as JSON into ``out`` and exits with ``os._exit`` so no pytest
machinery runs in the child.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import random
import socket
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

from crosskd.train import TrainConfig

SPAWN = multiprocessing.get_context("spawn")


@contextlib.contextmanager
def worker_exit(rank: int, out: Path) -> Iterator[None]:
    """The end of a worker process started by :func:`run_ranks`: exit 0 after the block, or,
    when it raises, its traceback to ``out/error<rank>.txt`` and exit 1 (``os._exit``: no
    pytest machinery runs in the child)."""
    try:
        yield
    except BaseException:
        (out / f"error{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


_PORTS = random.SystemRandom()
"""Draws ports from the OS's entropy: a test that seeds the module-level ``random`` cannot make
two workers draw the same ports."""


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out on its own (to port-0 binds and outgoing
    connections): 32768 unless ``ip_local_port_range`` says otherwise."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int = 1) -> int:
    """The first of ``count`` consecutive TCP ports free on loopback and on every interface
    now, chosen below the kernel's ephemeral range: a port a test hands to a process it starts
    stays free until that process binds it, because no outgoing connection or port-0 bind (a
    Prometheus scrape, a gloo store, another test's server) can take it in between."""
    top = _ephemeral_low() - count
    while True:
        base = _PORTS.randrange(10_000, top)
        if all(_bindable(base + i) for i in range(count)):
            return base


def free_port() -> int:
    """A TCP port free on loopback now (see :func:`free_ports`)."""
    return free_ports(1)


def _bindable(port: int) -> bool:
    for host in ("127.0.0.1", "0.0.0.0"):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True


def _quiet() -> None:
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


def train_hanging_at(config: TrainConfig, hang_step: int) -> None:
    """Train, hanging before 0-based step ``hang_step`` (after the previous step's metrics and
    checkpoint are written) until killed."""
    _quiet()
    from crosskd.train import Trainer

    real = Trainer.train_step

    def slow(self, step, *inputs):
        if step == hang_step:
            time.sleep(600)
        return real(self, step, *inputs)

    Trainer.train_step = slow
    trainer = Trainer(config, progress=False)
    trainer.setup()
    trainer.train()
    os._exit(0)


def train_hanging_in_checkpoint(config: TrainConfig, hang_step: int) -> None:
    """Train, hanging inside the checkpoint write of step ``hang_step``: after this rank's
    where-file is written into the temporary folder, before its tensors."""
    _quiet()
    from crosskd.train import Trainer, checkpoint

    real = checkpoint.save
    calls = []

    def slow(tensors):
        calls.append(1)
        if len(calls) == hang_step // config.checkpoint_every:
            time.sleep(600)
        return real(tensors)

    checkpoint.save = slow
    trainer = Trainer(config, progress=False)
    trainer.setup()
    trainer.train()
    os._exit(0)


def _ddp_worker(rank: int, world: int, port: int, runs: list, out: Path) -> None:
    with worker_exit(rank, out):
        os.environ.update(
            {
                "WORLD_SIZE": str(world),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
        )
        _quiet()
        import torch.distributed as dist

        from crosskd.train import Trainer

        for name, config, stop_after in runs:
            trainer = Trainer(config, progress=False)
            trainer.setup()
            history = trainer.train(stop_after=stop_after)
            if stop_after is None:
                trainer.save()
            seen = [trainer.step_micro_batches(s) for s in range(config.steps)]
            (out / f"{name}-rank{rank}.json").write_text(
                json.dumps(
                    {
                        "history": history,
                        "micro_batches": seen,
                        "start": trainer.start,
                        "state_bytes": trainer.state_bytes,
                        "gradient_peak": trainer.student.gradient_peak,
                    }
                )
            )
            trainer.close()
        dist.destroy_process_group()


def run_ddp(
    runs: list[tuple[str, TrainConfig, int | None]], out: Path, world: int = 2, timeout: float = 600
) -> None:
    """Run each ``(name, config, stop_after)`` in turn in ``world`` fresh gloo processes (the
    student saved to ``final/`` when the run is not stopped early); rank r's history,
    micro-batches and state bytes go to ``out/<name>-rank<r>.json``. Raises with the ranks'
    tracebacks when one fails, or kills them and says so when they are not done in
    ``timeout`` seconds (a hang)."""
    run_ranks(_ddp_worker, (runs, out), out, world, timeout)


def run_ranks(target, args: tuple, out: Path, world: int, timeout: float = 600) -> None:
    """``target(rank, world, port, *args)`` in ``world`` fresh processes (a target writes its
    traceback to ``out/error<rank>.txt`` and exits 1 when it fails): raises with the ranks'
    tracebacks when one fails, or kills them and says so when they are not done in
    ``timeout`` seconds (a hang)."""
    port = free_port()
    procs = [SPAWN.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(timeout=max(deadline - time.monotonic(), 0))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if hung:
        raise TimeoutError(f"ranks {hung} were still running after {timeout} s")
    errors = [f.read_text() for f in sorted(out.glob("error*.txt"))]
    if any(p.exitcode != 0 for p in procs):
        raise AssertionError("a training rank failed:\n" + "\n".join(errors))


def tiny_llama(**config):
    """A random-init Llama of 64 tokens, hidden 16, 2 layers, tied (``config`` overrides)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    values = {
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "tie_word_embeddings": True,
    } | config
    return LlamaForCausalLM(LlamaConfig(**values))


def _join(rank: int, world: int, port: int) -> None:
    """Join a gloo process group of ``world`` processes on loopback ``port`` as ``rank``."""
    os.environ.update(
        {
            "WORLD_SIZE": str(world),
            "RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    _quiet()
    import torch.distributed as dist

    dist.init_process_group("gloo")


def sync_copies_worker(rank: int, world: int, port: int, layouts: list[dict], out: Path) -> None:
    """For each layout: a tiny Llama spread over it, every gradient set to ``rank + 1``, then
    :meth:`ParallelStudent.sync_copies`; writes ``{layout index: {parameter: the values its
    local gradient holds}}`` to ``out/sync-rank<r>.json`` (and under cp, ``"<index>-unmasked"``:
    the error of a forward pass without the window's mask)."""
    with worker_exit(rank, out):
        _join(rank, world, port)
        import torch
        import torch.distributed as dist

        from crosskd.parallel.layout import ParallelLayout
        from crosskd.parallel.mesh import build_parallel_mesh
        from crosskd.parallel.parallelize import local_part, parallelize

        seen = {}
        for i, parallel in enumerate(layouts):
            mesh = build_parallel_mesh(ParallelLayout.from_mapping(parallel), torch.device("cpu"))
            torch.manual_seed(0)
            model = tiny_llama()
            student = parallelize(model, mesh)
            for _, param in student.named_parameters():
                param.grad = torch.full_like(param, float(rank + 1))
            student.sync_copies()
            seen[i] = {
                name: sorted(set(local_part(param.grad).flatten().tolist()))
                for name, param in student.named_parameters()
            }
            if mesh.layout.cp > 1:  # without the window's mask: refused, not a wrong window
                try:
                    model(input_ids=torch.zeros(1, 4, dtype=torch.long))
                except ValueError as exc:
                    seen[f"{i}-unmasked"] = str(exc)
        (out / f"sync-rank{rank}.json").write_text(json.dumps(seen))
        dist.destroy_process_group()


def gather_failure_worker(rank: int, world: int, port: int, out: Path) -> None:
    """A tiny Llama under FSDP2 on every rank, gathered by :func:`save_gathered` into a folder
    of rank 0 that does not exist, one file per tensor (so the first write fails with most
    gathers still to come); writes what each rank raised to ``out/gather-rank<r>.json``."""
    with worker_exit(rank, out):
        _join(rank, world, port)
        import torch
        import torch.distributed as dist

        from crosskd.parallel.layout import ParallelLayout
        from crosskd.parallel.mesh import build_parallel_mesh
        from crosskd.parallel.parallelize import parallelize
        from crosskd.train.export import save_gathered

        mesh = build_parallel_mesh(ParallelLayout(dp_shard=world), torch.device("cpu"))
        student = parallelize(tiny_llama(), mesh)
        raised = None
        try:
            save_gathered(student, out / "missing" if rank == 0 else None, max_file_bytes=1)
        except Exception as exc:
            raised = type(exc).__name__
        dist.barrier()  # every rank got here: none is left in a gather
        (out / f"gather-rank{rank}.json").write_text(json.dumps({"raised": raised}))
        dist.destroy_process_group()


def input_failure_worker(
    rank: int, world: int, port: int, configs: list[TrainConfig], out: Path
) -> None:
    """Train ``configs[rank]`` (the ranks may read different copies of the data) as one of
    ``world`` gloo ranks; the error the run stops with goes to ``out/outcome<rank>.json`` (its
    type, message and exit code)."""
    with worker_exit(rank, out):
        os.environ.update(
            {
                "WORLD_SIZE": str(world),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
        )
        _quiet()
        from crosskd.train import Trainer

        trainer = Trainer(configs[rank], progress=False)
        trainer.setup()
        try:
            trainer.train()
            outcome = {"type": None}
        except Exception as exc:
            outcome = {
                "type": type(exc).__name__,
                "message": str(exc),
                "exit_code": getattr(exc, "exit_code", None),
            }
        (out / f"outcome{rank}.json").write_text(json.dumps(outcome))
        trainer.close()
