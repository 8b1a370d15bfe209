"""Loading a teacher's safetensors weights straight into its FSDP2 shards: each process reads
only the rows of every weight that it holds, all processes at once.

:func:`empty_model` builds the model of a Hugging Face folder's ``config.json`` without its
weights: every parameter on the meta device (no memory), while buffers (the rotary embedding's
``inv_freq``, ...) are computed by the modules' own constructors, exactly as in an ordinary
construction (transformers' ``from_pretrained`` recomputes these non-persistent buffers the same
way, with the same functions; none of them is in a checkpoint). After
:func:`crosskd.parallel.parallelize.parallelize` has sharded it (every parameter a DTensor whose
rank-local part is a run of rows of dimension 0), :func:`load_shards` allocates the local
parts on the device and fills each from the checkpoint
(``safe_open(file).get_slice(name)[first:last]``: the memory-mapped file copies out those rows
only), converting to the teacher's dtype. The checkpoint is ``model.safetensors`` or the files
``model.safetensors.index.json`` names; a parameter shared by several modules (an output head
tied to the input embedding) is read once, under whichever of its names the checkpoint holds.
Persistent buffers found in the checkpoint are read whole (every process holds them).

The checkpoint must name each parameter as the model does (:func:`missing_names`):
transformers renames or fuses some models' weights while it loads them (mixture-of-experts
layers, for one); :func:`crosskd.teacher.sharded.load_sharded_teacher` loads those with
``from_pretrained`` instead.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from crosskd.parallel.parallelize import ParallelStudent, local_part
from crosskd.teacher.model import TeacherError

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Within it, every parameter a module registers is moved to the meta device as it is
    registered (the CPU tensor its constructor made, a never-written ``torch.empty`` for a
    weight matrix, is dropped at once); buffers stay where their module computes them. Not
    thread-safe: it patches :meth:`torch.nn.Module.register_parameter` for the duration."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":  # a tied one is already there
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def empty_model(folder: Path, dtype: torch.dtype, *, trust_remote_code: bool) -> nn.Module:
    """The causal LM of ``folder``'s ``config.json`` in eval mode: parameters (in ``dtype``) on
    the meta device, tied as the config says; buffers real, on the CPU, as its constructors
    compute them."""
    # lazy: transformers costs ~1 s over torch; every pipeline step imports crosskd.steps, which
    # imports this module (crosskd.steps.score through crosskd.teacher.sharded), and only a sharded
    # teacher needs it
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(
        str(folder), local_files_only=True, trust_remote_code=trust_remote_code
    )
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=trust_remote_code
        )
    return model.eval()


def weight_files(folder: Path) -> dict[str, Path]:
    """Which file of ``folder`` holds each checkpoint tensor: ``model.safetensors.index.json``'s
    ``weight_map``, else every tensor of ``model.safetensors`` (its header only is read)."""
    if (folder / INDEX).is_file():
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        return {key: folder / name for key, name in weight_map.items()}
    if not (folder / SINGLE).is_file():
        found = sorted(p.name for p in folder.glob("*.safetensors"))
        raise TeacherError(
            f"teacher folder {folder} has neither {INDEX} nor {SINGLE} (safetensors files: "
            f"{found}); save the model with save_pretrained(safe_serialization=True)."
        )
    with safe_open(str(folder / SINGLE), framework="pt") as handle:
        return dict.fromkeys(handle.keys(), folder / SINGLE)


def _persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` of every buffer that is part of the model's state dict."""
    for prefix, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                yield f"{prefix}.{name}" if prefix else name, buffer


@dataclass(frozen=True)
class _Part:
    """One tensor to fill: this rank's ``local`` part of a tensor of ``shape``, starting at row
    ``first``, read from ``key`` of ``file``."""

    file: Path
    key: str
    local: torch.Tensor
    first: int
    shape: tuple[int, ...]


def _checkpoint_names(model: nn.Module, files: dict[str, Path]) -> dict[str, str | None]:
    """For each parameter of ``model`` (each shared one once): the name the checkpoint holds it
    under (any of the names it has in the model), or None."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {
        name: next((n for n in names[id(param)] if n in files), None)
        for name, param in model.named_parameters()
    }


def missing_names(model: nn.Module, folder: Path) -> list[str]:
    """The parameters of ``model`` that ``folder``'s checkpoint holds under none of their
    names (a checkpoint transformers renames or fuses while loading it: mixture-of-experts
    layers, for one); empty when :func:`load_shards` can read every one directly."""
    return [n for n, key in _checkpoint_names(model, weight_files(folder)).items() if key is None]


def _plan(student: ParallelStudent, files: dict[str, Path], folder: Path) -> list[_Part]:
    """The parts of every parameter (each shared one once) and of every persistent buffer the
    checkpoint holds, in file order."""
    model = student.model
    keys = _checkpoint_names(model, files)
    missing = [name for name, key in keys.items() if key is None]
    if missing:
        raise TeacherError(
            f"teacher {folder}: its checkpoint has no tensor named {missing[:5]} "
            f"({len(missing)} of the model's parameters), so their rows cannot be read "
            f"directly; load it with crosskd.teacher.sharded.load_sharded_teacher."
        )
    parts = []
    for name, param in model.named_parameters():
        offset = student.placement(name, param).offset
        parts.append(
            _Part(
                files[keys[name]],
                keys[name],
                local_part(param),
                offset[0] if offset else 0,
                tuple(param.shape),
            )
        )
    parts += [
        _Part(files[name], name, buffer, 0, tuple(buffer.shape))
        for name, buffer in _persistent_buffers(model)
        if name in files
    ]
    return sorted(parts, key=lambda part: (str(part.file), part.key))


@torch.no_grad()
def load_shards(student: ParallelStudent, folder: Path, *, progress: bool = False) -> None:
    """Give the parameters of ``student`` (sharded by :func:`parallelize` from
    :func:`empty_model`, still on the meta device) their values from ``folder``'s safetensors
    checkpoint: this rank's local parts are allocated on the mesh's device and filled with their
    rows (first row = the part's offset in dimension 0), converted to the parameters' dtype; the
    buffers keep their values, moved there too. Logs each file and the total (rank, tensors,
    MiB read, seconds); ``progress``: a tqdm bar of the tensors."""
    model, rank = student.model, student.mesh.rank
    started = time.perf_counter()
    files = weight_files(folder)
    buffers = dict(model.named_buffers())  # to_empty replaces them with uninitialised ones
    model.to_empty(device=student.mesh.device)
    for name, buffer in model.named_buffers():
        buffer.copy_(buffers[name])
    plan = _plan(student, files, folder)
    by_file = [(path, list(parts)) for path, parts in groupby(plan, key=lambda p: p.file)]
    log.info(
        "rank %d: loading its rows of %d tensors from %d file(s) of %s",
        rank,
        len(plan),
        len(by_file),
        folder,
    )
    done = read = 0
    bar = tqdm(total=len(plan), desc="load teacher shards", unit="tensor", disable=not progress)
    for number, (path, parts) in enumerate(by_file, start=1):
        with safe_open(str(path), framework="pt") as handle:
            for part in parts:
                view = handle.get_slice(part.key)
                if tuple(view.get_shape()) != part.shape:
                    raise TeacherError(
                        f"teacher {folder}: {part.key} has shape {view.get_shape()} in "
                        f"{path.name}, but the model's config.json makes it {list(part.shape)}."
                    )
                local = part.local
                rows = view[part.first : part.first + len(local)] if local.dim() else view[...]
                local.copy_(rows)
                read += rows.numel() * rows.element_size()
                done += 1
                bar.update()
        log.info(
            "rank %d: file %d/%d (%s) read, %d/%d tensors, %.1f MiB, %.1f s",
            rank,
            number,
            len(by_file),
            path.name,
            done,
            len(plan),
            read / 2**20,
            time.perf_counter() - started,
        )
    bar.close()
    log.info(
        "rank %d: loaded its rows of %d tensors (%.1f MiB read) in %.1f s",
        rank,
        done,
        read / 2**20,
        time.perf_counter() - started,
    )
