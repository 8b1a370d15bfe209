"""A teacher larger than one GPU: its weights sharded over the pod's GPUs, each GPU scoring its
own shards (``ScoreConfig.processes`` > 1; ``crosskd score processes=8``, the pipeline's
``score_gpus``).

How: the parent resolves the teacher's folder and hashes its weights once
(:func:`~crosskd.teacher.model.fingerprint`, recorded in the cache's ``run.json``), then starts
``processes`` workers (torch's elastic agent on one machine, one per GPU; gloo on CPU) that get
the folder and the fingerprint and hash nothing. Their process group waits
``ScoreConfig.collective_timeout_s`` in a collective before it gives up (torch's NCCL default,
10 minutes, is short for a large teacher). Each worker builds the teacher without its weights
(parameters on the meta device) and shards it with FSDP2
(:func:`crosskd.parallel.parallelize.parallelize` with ``dp_shard`` = ``processes``), then all
workers at once fill their own parts from the safetensors files, each reading only its rows of
every weight (:mod:`crosskd.teacher.shard_load`, which logs each rank's progress). So a 70B
bfloat16 teacher (140 GB) costs each GPU of an 8-GPU pod ~18 GB plus one gathered layer and the
activations, and no process ever holds the whole teacher. A checkpoint that names some
parameters otherwise (transformers renames or fuses them while loading: Mixtral's and other
mixture-of-experts layers) cannot be read row by row; the workers then load it whole with
``from_pretrained`` on the host one at a time and keep their shards (a warning says so).
During scoring each holds ~1/N of the
weights and gathers one decoder layer at a time during its forward pass (ZeRO-3 inference).
Each worker scores a contiguous part of the pod's shard range with :func:`score_shards` (its
own range record), so every GPU computes at once on its own rows, and each row's logits stay on
the GPU that computed them: nothing ``[tokens, V]`` is gathered. Because every forward pass is
a collective, the workers run them in lockstep
(:class:`~crosskd.parallel.parallelize.Lockstep`): a worker whose shards are
done joins the others' passes with a one-token batch until all are done.

Why this and not a layer-wise ``device_map`` (accelerate): that keeps one GPU busy at a time
and copies activations between them; FSDP2 is the library the student already uses, works for
any Hugging Face causal LM, and keeps all GPUs computing. A shard is scored with the same
batches as in one process, so the cache is the same bytes (tested on CPU).
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from crosskd.data.collate import load_prepared
from crosskd.errors import CrosskdError
from crosskd.parallel.layout import ParallelLayout
from crosskd.parallel.mesh import build_parallel_mesh
from crosskd.parallel.parallelize import Lockstep, parallelize
from crosskd.parallel.rendezvous import rendezvous
from crosskd.teacher.model import (
    LoadedTeacher,
    TeacherError,
    default_device,
    fingerprint,
    model_folder,
    teacher_dtype,
)
from crosskd.teacher.scoring import begin_cache, merge_cache, score_shards
from crosskd.teacher.shard_load import empty_model, load_shards, missing_names

log = logging.getLogger(__name__)


def load_sharded_teacher(
    config: Any,
    device: torch.device,
    folder: Path,
    teacher_fingerprint: str,
    *,
    progress: bool = False,
) -> LoadedTeacher:
    """The teacher of ``config`` (a :class:`~crosskd.teacher.scoring.ScoreConfig`), from its
    local ``folder``, sharded with FSDP2 over every process of the initialised process group
    and loaded by all of them at once, each reading only its rows
    (:func:`crosskd.teacher.shard_load.load_shards`; ``progress``: a bar of it). Its
    fingerprint is ``teacher_fingerprint`` (the parent's hash of ``folder``)."""
    mesh = build_parallel_mesh(ParallelLayout(dp_shard=dist.get_world_size()), device)
    dtype = teacher_dtype(config.dtype, device)
    model = empty_model(folder, dtype, trust_remote_code=config.trust_remote_code)
    missing = missing_names(model, folder)
    if missing:
        log.warning(
            "teacher %s: its checkpoint names %d of the model's parameters otherwise "
            "(%s, ...), as transformers converts them while loading; the processes "
            "load it whole with from_pretrained, one at a time",
            folder,
            len(missing),
            missing[0],
        )
        model = _whole_in_turns(config, folder, dtype, mesh)
    else:
        load_shards(parallelize(model, mesh), folder, progress=progress)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    return LoadedTeacher(
        config.teacher,
        folder,
        model,
        teacher_fingerprint,
        vocab,
        device,
        dtype,
        Lockstep(model, device),
    )


def _whole_in_turns(config: Any, folder: Path, dtype: torch.dtype, mesh) -> torch.nn.Module:
    """The teacher of ``folder`` loaded whole by ``from_pretrained`` (which converts renamed or
    fused checkpoint tensors) on the host and sharded by FSDP2 over ``mesh``, one process at a
    time (one whole copy in host memory at a time). A checkpoint that still lacks tensors of
    the model is refused on every process after the last turn (none left in a barrier); any
    other failure of a turn ends that process, and the elastic agent then stops the others."""
    # lazy: transformers costs ~1 s over torch; every pipeline step imports crosskd.steps, which
    # imports this module (crosskd.steps.score), and only a checkpoint that cannot be read row by
    # row needs it
    from transformers import AutoModelForCausalLM

    rank, model, failure = dist.get_rank(), None, None
    for turn in range(dist.get_world_size()):
        if turn == rank:
            started = time.perf_counter()
            model, info = AutoModelForCausalLM.from_pretrained(
                str(folder),
                dtype=dtype,
                use_safetensors=True,
                local_files_only=True,
                trust_remote_code=config.trust_remote_code,
                output_loading_info=True,
            )
            if info["missing_keys"]:
                failure = TeacherError(
                    f"teacher {folder}: its checkpoint holds no tensor for "
                    f"{sorted(info['missing_keys'])[:5]} ({len(info['missing_keys'])} of the "
                    f"model's), under the model's names or names transformers converts; save "
                    f"the teacher with save_pretrained."
                )
            else:
                parallelize(model, mesh)
                model.eval()
                log.info(
                    "rank %d: loaded the whole teacher and kept its shard in %.1f s",
                    rank,
                    time.perf_counter() - started,
                )
        dist.barrier()
    if failure is not None:
        raise failure
    return model


def _worker(
    config: Any, start: int, stop: int, progress: bool, folder: Path, teacher_fingerprint: str
) -> dict | None:
    """One process of :func:`score_on_processes`: its contiguous part of ``start .. stop``,
    with the teacher of ``folder`` that the parent hashed to ``teacher_fingerprint``."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        timeout=timedelta(seconds=config.collective_timeout_s),
    )
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        teacher = load_sharded_teacher(
            config, device, folder, teacher_fingerprint, progress=progress and rank == 0
        )
        bounds = [start + round(i * (stop - start) / world) for i in range(world + 1)]
        part = None
        if bounds[rank] < bounds[rank + 1]:
            part = score_shards(
                config,
                bounds[rank],
                bounds[rank + 1],
                progress=progress and rank == 0,
                teacher=teacher,
            )
        joined = teacher.lockstep.finish()
        log.info(
            "rank %d scored shards %d..%d and joined %d forward passes of the others",
            rank,
            bounds[rank],
            bounds[rank + 1] - 1,
            joined,
        )
        return part
    finally:
        dist.destroy_process_group()


def score(config: Any, *, progress: bool = True) -> dict:
    """Score every sample of the prepared data of ``config`` (a
    :class:`~crosskd.teacher.scoring.ScoreConfig`) and write the cache; returns its manifest:
    :func:`~crosskd.teacher.scoring.score_shards` over every shard in this process, or
    :func:`score_on_processes` when ``config.processes`` > 1, then
    :func:`~crosskd.teacher.scoring.merge_cache`."""
    if config.processes > 1:
        score_on_processes(config, 0, None, progress=progress)
    else:
        score_shards(config, progress=progress)
    return merge_cache(config.output)


def score_on_processes(
    config: Any, start: int = 0, stop: int | None = None, *, progress: bool = True
) -> dict:
    """Score shards ``start .. stop - 1`` (``stop`` None: to the last) of ``config`` (a
    :class:`~crosskd.teacher.scoring.ScoreConfig`) in ``config.processes`` processes sharing
    the teacher; each writes the range record of its part, and the return value sums them:
    ``{"start", "stop", "samples", "parts"}``."""
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
    # The weights hashed once, here, and run.json written first: the workers only read it.
    folder = model_folder(config.teacher, role="teacher")
    teacher_fingerprint = fingerprint(folder)
    begin_cache(
        config,
        prepared.manifest["data_fingerprint"],
        teacher_fingerprint,
        device,
        teacher_dtype(config.dtype, device),
    )
    launch = LaunchConfig(
        nproc_per_node=config.processes,
        max_restarts=0,
        start_method="spawn",
        monitor_interval=0.5,
        **rendezvous({}),
    )
    results = elastic_launch(launch, _worker)(
        config, start, stop, progress, folder, teacher_fingerprint
    )
    parts = [results[rank] for rank in sorted(results) if results[rank] is not None]
    return {
        "start": start,
        "stop": stop,
        "samples": sum(p["samples"] for p in parts),
        "parts": parts,
    }
