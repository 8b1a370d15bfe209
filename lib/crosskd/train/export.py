"""The trained student as a plain Hugging Face model folder, gathered from any parallel layout
one tensor at a time.

Every rank takes part in gathering each parameter (the FSDP2 shards over ``dp_shard``, then the
vocabulary slices over ``tp``); only the writing rank keeps it, and it writes the kept tensors
out as soon as they reach ``max_file_bytes``, so no rank ever holds more than one file's worth of
the model beyond its own shards. One file is ``model.safetensors``; more are
``model-0000i-of-0000n.safetensors`` with transformers' ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor

from crosskd.parallel.parallelize import ParallelStudent

MAX_FILE_BYTES = 2 * 1024**3
"""The largest safetensors file of a written model folder (bytes)."""


def gather_parameter(student: ParallelStudent, name: str, param: Tensor) -> Tensor:
    """The whole parameter ``name`` on every rank (a collective: every rank calls it for the
    same parameters in the same order)."""
    whole = param.full_tensor() if hasattr(param, "full_tensor") else param
    whole = whole.detach()
    if name in student.sliced and student.mesh.layout.tp > 1:
        parts = [torch.empty_like(whole) for _ in range(student.mesh.layout.tp)]
        dist.all_gather(parts, whole.contiguous(), group=student.mesh.group("tp"))
        whole = torch.cat(parts)
    return whole


def save_gathered(
    student: ParallelStudent, folder: Path | None, max_file_bytes: int = MAX_FILE_BYTES
) -> None:
    """Every rank: gather the student's parameters and persistent buffers one at a time; the
    rank given a ``folder`` (an existing local directory) writes them there as safetensors with
    the model's ``config.json`` (and generation config). A write that fails is raised after
    the last gather, so that the other ranks are not left waiting in one."""
    model = student.model
    persistent = set(model.state_dict().keys())
    files: list[dict[str, int]] = []
    current: dict[str, Tensor] = {}
    size = 0
    names = [(n, p) for n, p in student.named_parameters()] + [
        (n, b) for n, b in model.named_buffers() if n in persistent
    ]
    failure: Exception | None = None
    for name, tensor in names:
        whole = gather_parameter(student, name, tensor)
        if folder is None or failure is not None:
            continue
        try:
            if current and size + whole.numel() * whole.element_size() > max_file_bytes:
                files.append(_write(folder, len(files), current))
                current, size = {}, 0
            current[name] = whole.to("cpu", copy=True).contiguous()
            size += whole.numel() * whole.element_size()
        except Exception as exc:  # raised after the gathers, which every rank must finish
            failure, current = exc, {}
    if folder is None:
        return
    if failure is not None:
        raise failure
    files.append(_write(folder, len(files), current))
    _name_files(folder, files)
    model.config.save_pretrained(str(folder))
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(str(folder))


def _write(folder: Path, number: int, tensors: dict[str, Tensor]) -> dict[str, int]:
    """Write one file of tensors (under a numbered name until all are known); returns their
    names with their sizes."""
    save_file(tensors, str(folder / f"part-{number:05d}.safetensors"), metadata={"format": "pt"})
    return {name: tensor.numel() * tensor.element_size() for name, tensor in tensors.items()}


def _name_files(folder: Path, files: list[dict[str, int]]) -> None:
    """Give the written files transformers' names (and its index where there are several)."""
    if len(files) == 1:
        (folder / "part-00000.safetensors").rename(folder / "model.safetensors")
        return
    weight_map = {}
    for number, sizes in enumerate(files):
        name = f"model-{number + 1:05d}-of-{len(files):05d}.safetensors"
        (folder / f"part-{number:05d}.safetensors").rename(folder / name)
        weight_map |= dict.fromkeys(sizes, name)
    total = sum(sum(sizes.values()) for sizes in files)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
