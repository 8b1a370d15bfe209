"""Checkpoints of a training run, to any fsspec URI, without pickle.

A checkpoint is a folder ``step-NNNNNNN/`` holding ``model.safetensors`` (the student's state,
shared tensors handled), ``optimizer.safetensors`` (every per-parameter optimizer tensor, keyed
``state.<index>.<name>``, plus the torch RNG state) and ``state.json`` (step, optimizer
hyperparameters, anything else the trainer records). It is written under a temporary name and
renamed, then ``latest.json`` (which checkpoint to resume from) is replaced, so a run killed at
any moment resumes from its last complete checkpoint. ``torch.distributed.checkpoint`` is not
used: its metadata file is a pickle, and crosskd never unpickles its own artifacts.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import fsspec
import torch
from safetensors.torch import load, load_model, save, save_model

from crosskd.errors import CrosskdError

LATEST = "latest.json"


def save_checkpoint(
    uri: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict
) -> str:
    """Write the checkpoint of ``step`` under ``uri``; returns its folder URI."""
    fs, root = fsspec.core.url_to_fs(uri)
    name = f"step-{step:07d}"
    tmp = f"{root}/.tmp-{name}"
    fs.makedirs(tmp, exist_ok=True)
    with fs.open(f"{tmp}/model.safetensors", "wb") as fh:
        fh.write(_model_bytes(model))
    state = optimizer.state_dict()
    tensors = {"rng.torch": torch.get_rng_state()}
    for index, values in state["state"].items():
        for key, value in values.items():
            tensors[f"state.{index}.{key}"] = torch.as_tensor(value).contiguous()
    fs.pipe_file(f"{tmp}/optimizer.safetensors", save(tensors))
    groups = [dict(g) for g in state["param_groups"]]
    fs.pipe_file(f"{tmp}/state.json", json.dumps(
        {"step": step, "param_groups": groups, **extra}, indent=1
    ).encode())  # fmt: skip
    final = f"{root}/{name}"
    if fs.exists(final):  # the same step saved again (a rerun): replace it, never nest into it
        fs.rm(final, recursive=True)
    fs.mv(tmp, final, recursive=True)
    fs.pipe_file(f"{root}/{LATEST}.tmp", json.dumps({"step": step, "path": name}).encode())
    fs.mv(f"{root}/{LATEST}.tmp", f"{root}/{LATEST}")
    return f"{uri.rstrip('/')}/{name}"


def load_checkpoint(
    uri: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any] | None:
    """Restore the latest checkpoint under ``uri`` into ``model`` and ``optimizer`` (and the
    torch RNG); returns its ``state.json``, or None when there is none."""
    fs, root = fsspec.core.url_to_fs(uri)
    if not fs.exists(f"{root}/{LATEST}"):
        return None
    latest = json.loads(fs.cat_file(f"{root}/{LATEST}"))
    folder = f"{root}/{latest['path']}"
    try:
        model_bytes = fs.cat_file(f"{folder}/model.safetensors")
        tensors = load(fs.cat_file(f"{folder}/optimizer.safetensors"))
        state = json.loads(fs.cat_file(f"{folder}/state.json"))
        _load_model_bytes(model, model_bytes)
    except CrosskdError:
        raise
    except Exception as exc:  # safetensors raises its own error type for damaged files
        raise CrosskdError(
            f"checkpoint {uri}/{latest['path']} is incomplete or damaged ({exc}); delete it and "
            f"point {LATEST} at an earlier one, or start a new run."
        ) from exc
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("state."):
            _, index, name = key.split(".", 2)
            per_param.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": per_param, "param_groups": state["param_groups"]})
    torch.set_rng_state(tensors["rng.torch"])
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
