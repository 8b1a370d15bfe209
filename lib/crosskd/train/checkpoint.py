"""Checkpoints of a training run, to any fsspec URI, without pickle.

A checkpoint is a folder ``step-NNNNNNN/`` holding ``model.safetensors`` (the student's state,
shared tensors handled), ``optimizer.safetensors`` (every per-parameter optimizer tensor, keyed
``state.<index>.<name>``, plus the torch RNG states: ``rng.torch`` and, on GPU, ``rng.cuda``)
and ``state.json`` (step, optimizer hyperparameters, the data order and anything else the
trainer records). It is written under a temporary name and renamed, then ``latest.json`` (which
checkpoint to resume from) is replaced, and only then are older checkpoints beyond the
retention deleted, so a run killed at any moment (a checkpoint write included) resumes from its
last complete checkpoint. ``torch.distributed.checkpoint`` is not used: its metadata file is a
pickle, and crosskd never unpickles its own artifacts.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

import fsspec
import torch
from safetensors.torch import load, load_model, save, save_model

from crosskd.artifacts import move_folder
from crosskd.errors import CrosskdError

LATEST = "latest.json"
STATE = "state.json"
_NAME = re.compile(r"step-(\d{7,})$")


def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint of ``step``."""
    return f"step-{step:07d}"


def save_checkpoint(
    uri: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict,
    *, keep: int = 0,
) -> str:  # fmt: skip
    """Write the checkpoint of ``step`` under ``uri``, point ``latest.json`` at it, then keep
    the newest ``keep`` checkpoints (0: all); returns its folder URI."""
    fs, root = fsspec.core.url_to_fs(uri)
    name = checkpoint_name(step)
    tmp = f"{root}/.tmp-{name}"
    if fs.exists(tmp):  # left by a write that was killed
        fs.rm(tmp, recursive=True)
    fs.makedirs(tmp, exist_ok=True)
    with fs.open(f"{tmp}/model.safetensors", "wb") as fh:
        fh.write(_model_bytes(model))
    state = optimizer.state_dict()
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    for index, values in state["state"].items():
        for key, value in values.items():
            tensors[f"state.{index}.{key}"] = torch.as_tensor(value).contiguous()
    fs.pipe_file(f"{tmp}/optimizer.safetensors", save(tensors))
    groups = [dict(g) for g in state["param_groups"]]
    fs.pipe_file(f"{tmp}/{STATE}", json.dumps(
        {"step": step, "param_groups": groups, **extra}, indent=1
    ).encode())  # fmt: skip
    final = f"{root}/{name}"
    if fs.exists(final):  # the same step saved again (a rerun): replace it, never nest into it
        fs.rm(final, recursive=True)
    move_folder(fs, tmp, final, last=STATE)
    fs.pipe_file(f"{root}/{LATEST}.tmp", json.dumps({"step": step, "path": name}).encode())
    fs.mv(f"{root}/{LATEST}.tmp", f"{root}/{LATEST}")
    if keep:
        prune_checkpoints(uri, keep)
    return f"{uri.rstrip('/')}/{name}"


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
            f"{uri}/{LATEST} is damaged ({exc}); write {{\"step\": N, \"path\": "
            f"\"step-000000N\"}} naming a complete checkpoint folder, or delete it to start over."
        ) from exc
    return step


def load_checkpoint(
    uri: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Restore the checkpoint of ``step`` under ``uri`` into ``model`` and ``optimizer`` (and
    the torch RNG states); returns its ``state.json``."""
    fs, root = fsspec.core.url_to_fs(uri)
    name = checkpoint_name(step)
    folder = f"{root}/{name}"
    if not fs.exists(f"{folder}/{STATE}"):
        raise CrosskdError(
            f"checkpoint {uri}/{name} cannot be read here ({LATEST} names it); every process "
            f"of a run must see the same output: put output on storage all of them share (S3, "
            f"a shared volume), not on one machine's local disk."
        )
    try:
        model_bytes = fs.cat_file(f"{folder}/model.safetensors")
        tensors = load(fs.cat_file(f"{folder}/optimizer.safetensors"))
        state = json.loads(fs.cat_file(f"{folder}/{STATE}"))
        if not isinstance(state, dict) or not isinstance(state.get("param_groups"), list):
            raise ValueError(f"{STATE} has no param_groups list")
        _load_model_bytes(model, model_bytes)
    except CrosskdError:
        raise
    except Exception as exc:  # safetensors raises its own error type for damaged files
        raise CrosskdError(
            f"checkpoint {uri}/{name} is incomplete or damaged ({exc}); delete it and point "
            f"{LATEST} at an earlier one, or start a new run."
        ) from exc
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("state."):
            _, index, field = key.split(".", 2)
            per_param.setdefault(int(index), {})[field] = value
    try:
        optimizer.load_state_dict({"state": per_param, "param_groups": state["param_groups"]})
    except (ValueError, KeyError, TypeError) as exc:
        raise CrosskdError(
            f"checkpoint {uri}/{name}: its optimizer state does not fit this model's "
            f"optimizer ({exc}); it was written for another model or optimizer. Start a new "
            f"output, or delete the checkpoints to train from scratch."
        ) from exc
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    return state


def _model_bytes(model: torch.nn.Module) -> bytes:
    """``safetensors.torch.save_model`` into memory (it handles tied weights)."""
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as fh:
        save_model(model, fh.name)
        return Path(fh.name).read_bytes()


def _load_model_bytes(model: torch.nn.Module, payload: bytes) -> None:
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as fh:
        fh.write(payload)
        fh.flush()
        missing, unexpected = load_model(model, fh.name, strict=False)
    if missing or unexpected:
        raise CrosskdError(
            f"checkpoint does not fit the student: missing {sorted(missing)[:5]}, unexpected "
            f"{sorted(unexpected)[:5]}; resume with the student the run started from."
        )
