"""What every step needs when it runs as its own process (a KFP component): logging to stderr
and the small pointer file that stands for a produced URI."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

ERRORS_ENV = "CROSSKD_STEP_ERRORS"
"""A folder: a step that fails writes its one-line error there (``crosskd pipeline run-local``
reads it back to fail with the step's own message)."""


def start_step(name: str) -> logging.Logger:
    """Log at INFO to stderr (timestamped, as ``crosskd`` does), quiet per-load progress bars,
    and make an uncaught error end with one line naming the step and the error (also written to
    the folder ``$CROSSKD_STEP_ERRORS`` when set); returns the logger ``crosskd.step.<name>``."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    default_hook = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, trace: Any) -> None:
        default_hook(kind, error, trace)
        line = f"step {name} failed: {kind.__name__}: {' '.join(str(error).split())}"
        sys.stderr.write(f"crosskd: {line}\n")
        folder = os.environ.get(ERRORS_ENV)
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / f"{name}-{os.getpid()}.txt").write_text(line, encoding="utf-8")

    sys.excepthook = hook
    return logging.getLogger(f"crosskd.step.{name}")


def write_pointer(path: str, uri: str | None, metadata: dict[str, Any] | None = None) -> dict:
    """Write ``{**metadata, "uri": uri}`` (None values left out) as JSON to the local file
    ``path`` (an output artifact's file: the data stay at ``uri``, only this small file is
    stored by KFP); returns the mapping, for the artifact's metadata."""
    record = drop_none({**(metadata or {}), "uri": uri})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=1, default=str), encoding="utf-8")
    return record


def drop_none(value: Any) -> Any:
    """``value`` with every mapping entry whose value is None left out, recursively: what a
    step returns to KFP (a parameter value may not hold a null; readers take the default)."""
    if isinstance(value, dict):
        return {k: drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [drop_none(v) for v in value]
    return value


def from_kfp(value: Any) -> Any:
    """A parameter value as KFP delivers it, with its integers back: KFP carries every number of
    a dict or list parameter as a double (protobuf ``Value``), so ``4`` arrives as ``4.0``;
    every integral float becomes an int, recursively (a float key such as ``lr: 1.0`` then
    reads as ``1``, which every float setting accepts)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: from_kfp(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [from_kfp(v) for v in value]
    return value
