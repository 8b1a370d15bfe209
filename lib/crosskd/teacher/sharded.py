"""A teacher larger than one GPU: its weights sharded over the pod's GPUs, each GPU scoring its
own shards (``ScoreConfig.processes`` > 1; ``crosskd score processes=8``, the pipeline's
``score_gpus``).

How: ``processes`` workers (torch's elastic agent on one machine, one per GPU; gloo on CPU)
shard the teacher with FSDP2 (:func:`crosskd.train.parallelize.parallelize` with ``dp_shard``
= ``processes``): each holds ~1/N of the weights and gathers one decoder layer at a time during
its forward pass (ZeRO-3 inference), so a 70B bfloat16 teacher (140 GB) needs ~18 GB per GPU of
an 8-GPU pod plus one layer and the activations. The workers load the teacher in turns (one full
copy in host memory at a time, sharded and moved to the GPU layer by layer as FSDP2 wraps it).
Each worker scores a contiguous part of the pod's shard range with :func:`score_shards` (its
own range record), so every GPU computes at once on its own rows, and each row's logits stay on
the GPU that computed them: nothing ``[tokens, V]`` is gathered. Because every forward pass is
a collective, the workers run them in lockstep
(:class:`~crosskd.train.parallelize.Lockstep`): a worker whose shards are
done joins the others' passes with a one-token batch until all are done.

Why this and not a layer-wise ``device_map`` (accelerate): that keeps one GPU busy at a time
and copies activations between them; FSDP2 is the library the student already uses, works for
any Hugging Face causal LM, and keeps all GPUs computing. A shard is scored with the same
batches as in one process, so the cache is the same bytes (tested on CPU).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from crosskd.teacher.model import (
    LoadedTeacher,
    default_device,
    fingerprint,
    load_teacher,
    model_folder,
    teacher_dtype,
)

log = logging.getLogger(__name__)


def load_sharded_teacher(config: Any, device: torch.device) -> LoadedTeacher:
    """The teacher of ``config`` (a :class:`~crosskd.teacher.scoring.ScoreConfig`) sharded with
    FSDP2 over every process of the initialised process group, loaded in turns."""
    from crosskd.layout import ParallelLayout
    from crosskd.train.mesh import build_train_mesh
    from crosskd.train.parallelize import Lockstep, parallelize

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = build_train_mesh(ParallelLayout(dp_shard=world), device)
    dtype = teacher_dtype(config.dtype, device)
    loaded = None
    for turn in range(world):
        if turn == rank:
            whole = load_teacher(config.teacher, device="cpu", dtype=dtype,
                                 trust_remote_code=config.trust_remote_code)  # fmt: skip
            parallelize(whole.model, mesh)
            whole.model.eval()
            loaded = whole
        dist.barrier()
    return LoadedTeacher(loaded.name, loaded.folder, loaded.model, loaded.fingerprint,
                         loaded.vocab_size, device, loaded.dtype,
                         Lockstep(loaded.model, device))  # fmt: skip


def _worker(config: Any, start: int, stop: int, progress: bool) -> dict | None:
    """One process of :func:`score_on_processes`: its contiguous part of ``start .. stop``."""
    from crosskd.teacher.scoring import score_shards

    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        teacher = load_sharded_teacher(config, device)
        bounds = [start + round(i * (stop - start) / world) for i in range(world + 1)]
        part = None
        if bounds[rank] < bounds[rank + 1]:
            part = score_shards(config, bounds[rank], bounds[rank + 1],
                                progress=progress and rank == 0, teacher=teacher)  # fmt: skip
        joined = teacher.lockstep.finish()
        log.info("rank %d scored shards %d..%d and joined %d forward passes of the others",
                 rank, bounds[rank], bounds[rank + 1] - 1, joined)  # fmt: skip
        return part
    finally:
        dist.destroy_process_group()


def score_on_processes(
    config: Any, start: int = 0, stop: int | None = None, *, progress: bool = True
) -> dict:
    """Score shards ``start .. stop - 1`` (``stop`` None: to the last) of ``config`` (a
    :class:`~crosskd.teacher.scoring.ScoreConfig`) in ``config.processes`` processes sharing
    the teacher; each writes the range record of its part, and the return value sums them:
    ``{"start", "stop", "samples", "parts"}``."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from crosskd.data.collate import load_prepared
    from crosskd.errors import CrosskdError
    from crosskd.teacher.scoring import begin_cache
    from crosskd.train.launch import rendezvous

    config.check()
    prepared = load_prepared(config.data)
    total = len(prepared.manifest["shards"])
    stop = total if stop is None else stop
    device = default_device()
    if config.device is not None and torch.device(config.device).type != device.type:
        raise CrosskdError(
            f"device is {config.device!r}, but processes = {config.processes} puts one process "
            f"on each {device.type} device here; leave device unset."
        )
    # run.json first, here: the workers then only read it.
    begin_cache(config, prepared.manifest["data_fingerprint"],
                fingerprint(model_folder(config.teacher, role="teacher")), device,
                teacher_dtype(config.dtype, device))  # fmt: skip
    launch = LaunchConfig(nproc_per_node=config.processes, max_restarts=0, start_method="spawn",
                          monitor_interval=0.5, **rendezvous({}))  # fmt: skip
    results = elastic_launch(launch, _worker)(config, start, stop, progress)
    parts = [results[rank] for rank in sorted(results) if results[rank] is not None]
    return {"start": start, "stop": stop, "samples": sum(p["samples"] for p in parts),
            "parts": parts}  # fmt: skip
