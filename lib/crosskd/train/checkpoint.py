"""Checkpoints of a training run, to any fsspec URI, without pickle, written by every rank in
parallel and read back on any parallel layout.

A checkpoint is a folder ``step-NNNNNNN/`` holding, per rank ``r``:

* ``rank-0000r.safetensors``: the parts of the student's parameters (``model.<name>``) and of
  their AdamW state (``optim.<name>.<key>``) that this rank writes (of the ranks that hold the
  same part, the first: :class:`crosskd.parallel.parallelize.Placement`), and its torch RNG
  states (``rng.torch``, on GPU ``rng.cuda``);
* ``rank-0000r.json``: where each of those parts lies in the whole tensor (offset, size);

then ``index.json`` (every tensor's whole shape and dtype and its parts: file, offset, size;
the layout and the number of ranks that wrote it) and ``state.json`` (step, optimizer
hyperparameters, the data order and anything else the trainer records), both written by rank
0 once every rank's parts are in. Loading gives each rank the region of every tensor its own
layout places there, read from the overlapping parts only (:func:`load_checkpoint`), so a
checkpoint written by 4 ranks under ``dp_shard=2, tp=2`` loads in one process, under
``dp_shard=4`` or any other layout.

The folder is written under a temporary name and renamed (``state.json`` last), then
``latest.json`` (which checkpoint to resume from) is replaced, and only then are older
checkpoints beyond the retention deleted, so a run killed at any moment (a checkpoint write
included) resumes from its last complete checkpoint. ``torch.distributed.checkpoint`` is not
used: its metadata file is a pickle, and crosskd never unpickles its own artifacts.
"""

from __future__ import annotations

import json
import re
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors import safe_open
from safetensors.torch import save

from crosskd.artifacts import move_folder
from crosskd.errors import CrosskdError
from crosskd.parallel.parallelize import ParallelStudent, local_part

FORMAT = 2
LATEST = "latest.json"
STATE = "state.json"
INDEX = "index.json"
_NAME = re.compile(r"step-(\d{7,})$")


def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint of ``step``."""
    return f"step-{step:07d}"


def _rank_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def _tmp(uri: str, step: int) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, root = fsspec.core.url_to_fs(uri)
    return fs, f"{root}/.tmp-{checkpoint_name(step)}"


def begin_checkpoint(uri: str, step: int) -> None:
    """Rank 0, before any rank writes its parts: clear the temporary folder of ``step`` a
    killed write may have left."""
    fs, tmp = _tmp(uri, step)
    if fs.exists(tmp):
        fs.rm(tmp, recursive=True)
    fs.makedirs(tmp, exist_ok=True)


def _tensors(
    student: ParallelStudent, optimizer: torch.optim.Optimizer
) -> list[tuple[str, torch.Tensor, torch.Tensor | None, str]]:
    """``(key, tensor, like, parameter name)`` of every parameter and optimizer state tensor:
    ``like`` is the parameter the tensor is laid out like (None for a tensor every rank holds
    whole, such as AdamW's step count)."""
    out = []
    states = optimizer.state
    for name, param in student.named_parameters():
        out.append((f"model.{name}", param.data, param, name))
        for key, value in sorted(states.get(param, {}).items()):
            value = torch.as_tensor(value)
            like = param if value.shape == param.shape else None
            out.append((f"optim.{name}.{key}", value, like, name))
    return out


def write_parts(
    uri: str, step: int, student: ParallelStudent, optimizer: torch.optim.Optimizer
) -> None:
    """Every rank, after :func:`begin_checkpoint`: write this rank's parts of the checkpoint of
    ``step`` into its temporary folder (the where-file first, then the tensors)."""
    fs, tmp = _tmp(uri, step)
    rank = student.mesh.rank
    tensors: dict[str, torch.Tensor] = {}
    where: dict[str, dict] = {}
    for key, value, like, name in _tensors(student, optimizer):
        if like is None:
            if rank != 0:
                continue
            shape, offset, part = list(value.shape), [0] * value.dim(), value
        else:
            placement = student.placement(name, value)
            if not placement.writer:
                continue
            shape, offset, part = list(placement.shape), list(placement.offset), local_part(value)
        tensors[key] = part.detach().to("cpu", copy=True).contiguous()
        where[key] = {
            "shape": shape,
            "dtype": str(part.dtype).removeprefix("torch."),
            "offset": offset,
            "size": list(part.shape),
        }
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    fs.pipe_file(f"{tmp}/{_rank_name(rank)}.json", json.dumps(where).encode())
    fs.pipe_file(f"{tmp}/{_rank_name(rank)}.safetensors", save(tensors))


def publish_checkpoint(
    uri: str,
    step: int,
    student: ParallelStudent,
    optimizer: torch.optim.Optimizer,
    extra: dict,
    *,
    keep: int = 0,
) -> str:
    """Rank 0, once every rank's :func:`write_parts` is done: merge the where-files into
    ``index.json``, write ``state.json``, rename the folder, point ``latest.json`` at it, then
    keep the newest ``keep`` checkpoints (0: all); returns the folder's URI."""
    fs, tmp = _tmp(uri, step)
    root = tmp.rsplit("/", 1)[0]
    world = 1 if student.mesh.mesh is None else student.mesh.mesh.size()
    tensors: dict[str, dict] = {}
    for rank in range(world):
        file = f"{_rank_name(rank)}.safetensors"
        for key, part in json.loads(fs.cat_file(f"{tmp}/{_rank_name(rank)}.json")).items():
            entry = tensors.setdefault(
                key, {"shape": part["shape"], "dtype": part["dtype"], "parts": []}
            )
            entry["parts"].append({"file": file, "offset": part["offset"], "size": part["size"]})
    index = {
        "format": FORMAT,
        "ranks": world,
        "layout": student.mesh.layout.to_json(),
        "tensors": tensors,
    }
    fs.pipe_file(f"{tmp}/{INDEX}", json.dumps(index, indent=1).encode())
    groups = [
        {k: v for k, v in g.items() if k != "params"}
        for g in optimizer.state_dict()["param_groups"]
    ]
    fs.pipe_file(
        f"{tmp}/{STATE}",
        json.dumps({"step": step, "param_groups": groups, **extra}, indent=1).encode(),
    )
    name = checkpoint_name(step)
    final = f"{root}/{name}"
    if fs.exists(final):  # the same step saved again (a rerun): replace it, never nest into it
        fs.rm(final, recursive=True)
    move_folder(fs, tmp, final, last=STATE)
    fs.pipe_file(f"{root}/{LATEST}.tmp", json.dumps({"step": step, "path": name}).encode())
    fs.mv(f"{root}/{LATEST}.tmp", f"{root}/{LATEST}")
    if keep:
        prune_checkpoints(uri, keep)
    return f"{uri.rstrip('/')}/{name}"


def save_checkpoint(
    uri: str,
    step: int,
    student: ParallelStudent,
    optimizer: torch.optim.Optimizer,
    extra: dict,
    *,
    keep: int = 0,
) -> str:
    """The three steps of a checkpoint in one process (a one-rank layout)."""
    begin_checkpoint(uri, step)
    write_parts(uri, step, student, optimizer)
    return publish_checkpoint(uri, step, student, optimizer, extra, keep=keep)


def prune_checkpoints(uri: str, keep: int) -> list[int]:
    """Delete every complete checkpoint (one with its ``state.json``) under ``uri`` but the
    newest ``keep`` (never the one ``latest.json`` names) and any temporary folder a killed
    write left; returns the deleted steps."""
    fs, root = fsspec.core.url_to_fs(uri)
    latest = latest_step(uri)
    steps = []
    for entry in fs.ls(root, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith(".tmp-step-"):
            fs.rm(entry, recursive=True)
        elif (match := _NAME.match(name)) is not None and fs.exists(f"{entry}/{STATE}"):
            steps.append(int(match.group(1)))  # complete: state.json is moved last
    doomed = [s for s in sorted(steps)[: max(len(steps) - keep, 0)] if s != latest]
    for step in doomed:
        fs.rm(f"{root}/{checkpoint_name(step)}", recursive=True)
    return doomed


def latest_step(uri: str) -> int | None:
    """The step ``latest.json`` under ``uri`` names, or None when there is no checkpoint."""
    fs, root = fsspec.core.url_to_fs(uri)
    path = f"{root}/{LATEST}"
    if not fs.exists(path):
        return None
    try:
        latest = json.loads(fs.cat_file(path))
        step = latest["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step is {step!r}")
        if latest.get("path") != checkpoint_name(step):
            raise ValueError(f"path is {latest.get('path')!r}, expected {checkpoint_name(step)}")
    except (ValueError, KeyError, TypeError) as exc:  # JSONDecodeError is a ValueError
        raise CrosskdError(
            f'{uri}/{LATEST} is damaged ({exc}); write {{"step": N, "path": '
            f'"step-000000N"}} naming a complete checkpoint folder, or delete it to start over.'
        ) from exc
    return step


def load_checkpoint(
    uri: str, step: int, student: ParallelStudent, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Restore the checkpoint of ``step`` under ``uri`` into ``student`` and ``optimizer``
    (whatever layout either was written with; this rank's RNG state where the writing run had
    a rank of its number); returns its ``state.json``."""
    fs, root = fsspec.core.url_to_fs(uri)
    name = checkpoint_name(step)
    folder = f"{root}/{name}"
    where = f"{uri.rstrip('/')}/{name}"
    if not fs.exists(f"{folder}/{STATE}"):
        raise CrosskdError(
            f"checkpoint {where} cannot be read here ({LATEST} names it); every process "
            f"of a run must see the same output: put output on storage all of them share (S3, "
            f"a shared volume), not on one machine's local disk."
        )
    try:
        state = json.loads(fs.cat_file(f"{folder}/{STATE}"))
        if not isinstance(state, dict) or not isinstance(state.get("param_groups"), list):
            raise ValueError(f"{STATE} has no param_groups list")
        if not fs.exists(f"{folder}/{INDEX}"):
            raise CrosskdError(
                f"checkpoint {where} has no {INDEX}: it was written by an earlier crosskd "
                f"(one file per model); resume it with that version, or start a new output."
            )
        index = json.loads(fs.cat_file(f"{folder}/{INDEX}"))
        with _Parts(fs, folder) as parts:
            _restore(student, optimizer, index["tensors"], parts, where)
            rng = (
                parts.tensor(f"{_rank_name(student.mesh.rank)}.safetensors", "rng.torch")
                if student.mesh.rank < index["ranks"]
                else None
            )
            cuda = (
                parts.tensor(f"{_rank_name(student.mesh.rank)}.safetensors", "rng.cuda")
                if rng is not None and torch.cuda.is_available()
                else None
            )
    except CrosskdError:
        raise
    except Exception as exc:  # safetensors raises its own error type for damaged files
        raise CrosskdError(
            f"checkpoint {where} is incomplete or damaged ({exc}); delete it and point "
            f"{LATEST} at an earlier one, or start a new run."
        ) from exc
    try:
        optimizer.load_state_dict(
            {
                "state": optimizer.state_dict()["state"],
                "param_groups": _groups(optimizer, state["param_groups"]),
            }
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise CrosskdError(
            f"checkpoint {where}: its optimizer state does not fit this model's "
            f"optimizer ({exc}); it was written for another model or optimizer. Start a new "
            f"output, or delete the checkpoints to train from scratch."
        ) from exc
    if rng is not None:
        torch.set_rng_state(rng)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    return state


def _groups(optimizer: torch.optim.Optimizer, saved: list[dict]) -> list[dict]:
    """The saved hyperparameters with this optimizer's parameter indices."""
    current = optimizer.state_dict()["param_groups"]
    if len(saved) != len(current):
        raise ValueError(
            f"{len(saved)} parameter group(s) saved, {len(current)} here; first_trainable makes "
            f"two: resume with it set as the run started, or unset"
        )
    return [{**g, "params": c["params"]} for g, c in zip(saved, current, strict=True)]


DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors' dtype names."""


class _RangedFile:
    """A safetensors file on remote storage read by byte ranges: its header once, then only
    the rows of dimension 0 a region needs (the parts of a checkpoint are split on dimension
    0, so those rows are one contiguous range)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str) -> None:
        self.fs, self.path = fs, path
        size = int.from_bytes(fs.cat_file(path, start=0, end=8), "little")
        header = json.loads(fs.cat_file(path, start=8, end=8 + size))
        header.pop("__metadata__", None)
        self.entries, self.data = header, 8 + size

    def keys(self) -> list[str]:
        return list(self.entries)

    def region(self, key: str, box: tuple[slice, ...]) -> torch.Tensor:
        """``key``'s values in ``box`` (a slice per dimension; empty: the whole tensor)."""
        entry = self.entries[key]
        dtype, shape = DTYPES[entry["dtype"]], list(entry["shape"])
        begin, end = entry["data_offsets"]
        rows = range(shape[0])[box[0]] if box and shape else None
        if rows is not None and rows.step == 1:
            row_bytes = (end - begin) // shape[0] if shape[0] else 0
            begin, end = begin + rows.start * row_bytes, begin + rows.stop * row_bytes
            shape[0], box = len(rows), (slice(None), *box[1:])
        if end == begin:
            tensor = torch.empty(shape, dtype=dtype)
        else:
            raw = self.fs.cat_file(self.path, start=self.data + begin, end=self.data + end)
            tensor = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
        return tensor[box] if box else tensor


class _MappedFile:
    """A safetensors file on a local disk, memory-mapped (the interface of :class:`_RangedFile`)."""

    def __init__(self, path: str) -> None:
        self.handle = safe_open(path, framework="pt")

    def keys(self) -> list[str]:
        return list(self.handle.keys())

    def region(self, key: str, box: tuple[slice, ...]) -> torch.Tensor:
        """``key``'s values in ``box`` (a slice per dimension; empty: the whole tensor)."""
        return self.handle.get_slice(key)[box] if box else self.handle.get_tensor(key)


class _Parts:
    """The checkpoint's rank files, opened lazily: memory-mapped on a local disk, read by byte
    ranges elsewhere (each rank fetches only the rows of the parts it needs)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, folder: str) -> None:
        self.fs, self.folder = fs, folder
        self.local = isinstance(fs, LocalFileSystem)
        self.open: dict[str, _MappedFile | _RangedFile] = {}

    def __enter__(self) -> _Parts:
        return self

    def __exit__(self, *exc) -> None:
        self.open.clear()

    def file(self, name: str) -> _MappedFile | _RangedFile:
        if name not in self.open:
            path = f"{self.folder}/{name}"
            self.open[name] = _MappedFile(path) if self.local else _RangedFile(self.fs, path)
        return self.open[name]

    def tensor(self, name: str, key: str) -> torch.Tensor | None:
        handle = self.file(name)
        return handle.region(key, ()) if key in set(handle.keys()) else None

    def region(self, name: str, key: str, box: tuple[slice, ...]) -> torch.Tensor:
        return self.file(name).region(key, box)


def _fill(
    target: torch.Tensor, offset: tuple[int, ...], entry: dict, parts: _Parts, key: str, where: str
) -> None:
    """Copy into ``target`` (this rank's part, at ``offset`` of the whole tensor) every
    overlapping region of the saved parts of ``key``."""
    covered = 0
    for part in entry["parts"]:
        box_src, box_dst = [], []
        for lo_t, n_t, lo_p, n_p in zip(
            offset, target.shape, part["offset"], part["size"], strict=True
        ):
            lo, hi = max(lo_t, lo_p), min(lo_t + n_t, lo_p + n_p)
            if lo >= hi:
                break
            box_src.append(slice(lo - lo_p, hi - lo_p))
            box_dst.append(slice(lo - lo_t, hi - lo_t))
        else:
            region = parts.region(part["file"], key, tuple(box_src))
            target[tuple(box_dst)] = region.to(target.dtype)
            covered += region.numel()
    if covered != target.numel():
        raise CrosskdError(
            f"checkpoint {where}: the parts of {key} cover {covered} of the {target.numel()} "
            f"values this rank needs; a rank's file is missing from the index. Point "
            f"{LATEST} at an earlier checkpoint."
        )


def _restore(
    student: ParallelStudent,
    optimizer: torch.optim.Optimizer,
    index: dict,
    parts: _Parts,
    where: str,
) -> None:
    """Every parameter and AdamW state tensor of this rank from the checkpoint's parts."""
    names = sorted(k for k in index if k.startswith("model."))
    here = {f"model.{name}" for name, _ in student.named_parameters()}
    if set(names) != here:
        missing, unexpected = sorted(here - set(names)), sorted(set(names) - here)
        raise CrosskdError(
            f"checkpoint {where} does not fit the student: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}; resume with the student the run started from."
        )
    with torch.no_grad():
        for name, param in student.named_parameters():
            placement = student.placement(name, param)
            if list(placement.shape) != index[f"model.{name}"]["shape"]:
                raise CrosskdError(
                    f"checkpoint {where}: model.{name} has shape "
                    f"{index[f'model.{name}']['shape']} there but {list(placement.shape)} "
                    f"here; resume with the student the run started from."
                )
            _fill(
                local_part(param.data),
                placement.offset,
                index[f"model.{name}"],
                parts,
                f"model.{name}",
                where,
            )
            prefix = f"optim.{name}."
            saved = sorted(k[len(prefix) :] for k in index if k.startswith(prefix))
            if not saved:
                continue
            state = optimizer.state[param]
            for key in saved:
                entry = index[prefix + key]
                if list(entry["shape"]) == list(placement.shape):
                    value = torch.zeros_like(param.data)
                    _fill(local_part(value), placement.offset, entry, parts, prefix + key, where)
                else:
                    value = torch.zeros(entry["shape"], dtype=getattr(torch, entry["dtype"]))
                    _fill(value, (0,) * value.dim(), entry, parts, prefix + key, where)
                state[key] = value
