"""Running the sharded loss in several real processes (gloo on CPU) for the tests.

Not collected as tests. :func:`run_layout` forks one process per rank (fork: the children
inherit the inputs, nothing is pickled), each joins a gloo process group on loopback, builds the
mesh, takes its slice of the logits (its data-parallel rows, sequence window and vocabulary
slice), runs :func:`crosskd.loss.parallel.sharded_loss` and ``backward``, and writes its
gradient slice (safetensors) and its results (JSON): complete metrics, ``kd_scale``, its loss
share and the bytes its collectives moved (every ``torch.distributed.all_reduce`` call is
counted, including those in the differentiable collectives' backward passes).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from crosskd.loss import LossConfig, LossPlan
from crosskd.loss.parallel import (
    ParallelConfig,
    ShardedLogProbs,
    build_loss_groups,
    reduce_counts,
    sharded_loss,
)
from crosskd.output_layer import OutputLayer


@dataclass
class RankResult:
    """What one rank reported: ``grad`` of its logits slice, ``metrics``, ``kd_scale``, its
    ``share`` of the loss, ``bytes`` moved by its collectives, ``normalizers`` (the sharded
    log-normaliser at temperature 1 of every row of its data-parallel shard), and its
    coordinates; run fused, ``grad`` is that of its hidden states and ``head_grads`` holds
    those of its weight and bias slices."""

    grad: torch.Tensor
    metrics: dict[str, float]
    normalizers: list[float]
    kd_scale: float
    share: float
    bytes: int
    dp: int
    cp: int
    tp: int
    head_grads: dict[str, torch.Tensor] | None = None


def run_layout(
    layout: ParallelConfig,
    logits: torch.Tensor,
    plans: list[LossPlan],
    config: LossConfig,
    work: Path,
    head: OutputLayer | None = None,
) -> list[RankResult]:
    """Run one micro-batch under ``layout``. ``logits`` ``[B, L, V]`` of all rows; ``plans``:
    one per data-parallel shard, shard ``d`` holding rows ``d * B / dp`` on. ``head``: run
    fused instead, each rank taking its rows and window of the hidden states ``[B, L, H]``
    and its vocabulary slice of the weight and bias (``logits`` gives only the shape)."""
    world = layout.dp * layout.cp * layout.tp
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(
            target=_worker, args=(rank, world, port, layout, logits, plans, config, work, head)
        )
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=300)
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        errors = [(work / f"error-{r}.txt") for r in failed]
        text = "\n".join(e.read_text() for e in errors if e.exists())
        raise RuntimeError(f"ranks {failed} failed:\n{text}")
    results = []
    for rank in range(world):
        info = json.loads((work / f"rank-{rank}.json").read_text())
        grads = load_file(str(work / f"grad-{rank}.safetensors"))
        grad = grads.pop("grad")
        results.append(RankResult(grad=grad, head_grads=grads or None, **info))
    return results


def _worker(rank, world, port, layout, logits, plans, config, work, head) -> None:
    try:
        _run_rank(rank, world, port, layout, logits, plans, config, Path(work), head)
    except BaseException:
        (Path(work) / f"error-{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def _run_rank(rank, world, port, layout, logits, plans, config, work: Path, head) -> None:
    torch.set_num_threads(1)
    moved = [0]
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        moved[0] += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        mesh = build_loss_groups(layout)
        n_b, width, vocab = logits.shape
        rows = n_b // layout.dp
        window, part = width // layout.cp, vocab // layout.tp
        mine = (
            slice(mesh.dp_rank * rows, (mesh.dp_rank + 1) * rows),
            slice(mesh.cp_rank * window, (mesh.cp_rank + 1) * window),
            slice(mesh.tp_rank * part, (mesh.tp_rank + 1) * part),
        )
        local = logits[mine].clone().requires_grad_(True)
        if head is not None:
            local = OutputLayer(
                head.hidden[mine[:2]].clone().requires_grad_(True),
                head.weight[mine[2]].clone().requires_grad_(True),
                None if head.bias is None else head.bias[mine[2]].clone().requires_grad_(True),
            )
        plan = plans[mesh.dp_rank]
        moved[0] = 0  # count from here: one step of the loss
        counts = reduce_counts(plan.counts, mesh)
        out = sharded_loss(local, plan, config, counts, mesh)
        out.loss.backward()
        step_bytes = moved[0]
        everything = np.arange(rows * width)
        if head is None:
            detached, grads = local.detach(), {"grad": local.grad}
        else:
            parts = (local.hidden, local.weight, local.bias)
            detached = OutputLayer(*(None if t is None else t.detach() for t in parts))
            grads = {"grad": local.hidden.grad, "weight": local.weight.grad}
            if local.bias is not None:
                grads["bias"] = local.bias.grad
        normalizers = ShardedLogProbs(detached, mesh, width).log_normalizer(everything)
        save_file(
            {k: v.contiguous() for k, v in grads.items()}, str(work / f"grad-{rank}.safetensors")
        )
        info = {
            "metrics": out.metrics,
            "normalizers": normalizers.tolist(),
            "kd_scale": out.kd_scale,
            "share": out.loss.item(),
            "bytes": step_bytes,
            "dp": mesh.dp_rank,
            "cp": mesh.cp_rank,
            "tp": mesh.tp_rank,
        }
        (work / f"rank-{rank}.json").write_text(json.dumps(info))
    finally:
        dist.destroy_process_group()


def assemble(results: list[RankResult], layout: ParallelConfig, shape) -> torch.Tensor:
    """The full ``[B, L, V]`` gradient from every rank's slice."""
    n_b, width, vocab = shape
    rows, window, part = n_b // layout.dp, width // layout.cp, vocab // layout.tp
    out = torch.zeros(shape, dtype=results[0].grad.dtype)
    for r in results:
        out[
            r.dp * rows : (r.dp + 1) * rows,
            r.cp * window : (r.cp + 1) * window,
            r.tp * part : (r.tp + 1) * part,
        ] = r.grad
    return out
