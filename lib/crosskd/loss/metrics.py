"""Loss metrics per teacher and chunk shape (spec section 5, "Metrics").

Metrics are kept as **sums** (counts and sums of per-chunk values) so that micro-batches and
ranks combine by addition; :func:`summarize` turns the sums into the reported means. Keys are
``"{teacher}/{shape}/{name}"`` with ``shape`` one of ``1:1 1:n n:1 n:m special token`` (``token``
for same-tokenizer positions). Sums:

* ``chunks``: all chunks of that shape; ``valid``: the counted ones;
* ``skipped_{reason}``: a skipped chunk counts once, under its first reason in the order
  ``incorrect``, ``masked`` (outside the KD mask), ``no_prediction``, ``not_selected`` (its sample
  chose another teacher, ``select`` mode), ``unsupported`` (too few events),
  ``dropped_unrealized``;
* over counted chunks: ``sum_divergence`` (D), ``sum_weighted`` (``w * D``, for each shape's KD
  share), ``sum_events`` (``|E|``), ``sum_rest_student`` / ``sum_rest_teacher`` (REST mass),
  ``top1`` (the teacher's most likely token at the chunk's first row is the realized one),
  ``realized_in_topk``.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
from torch import Tensor

from crosskd.data.shards import FLAG_CORRECT, FLAG_KD, FLAG_PREDICTION
from crosskd.loss.csd import KdTerm
from crosskd.loss.events import (
    SHAPE_NAMES,
    STATUS_DROPPED,
    STATUS_INVALID,
    STATUS_UNSUPPORTED,
    Events,
)
from crosskd.loss.gold import GOLD_STATS
from crosskd.loss.tokens import SHAPE_TOKEN
from crosskd.loss.uld import ULD_STATS
from crosskd.transfer import to_device

SHAPES = (*SHAPE_NAMES, "token")
"""Metric names of the shape codes (``SHAPE_TOKEN``: a same-tokenizer position)."""
SKIP_REASONS = (
    "incorrect",
    "masked",
    "no_prediction",
    "not_selected",
    "unsupported",
    "dropped_unrealized",
)


def _shapes(chunk_shape: np.ndarray, same_tokenizer: bool) -> np.ndarray:
    """The shape code of every chunk (``SHAPE_TOKEN`` for a same-tokenizer teacher), int64."""
    shape = np.asarray(chunk_shape, dtype=np.int64)
    return np.full(len(shape), SHAPE_TOKEN) if same_tokenizer else shape


def chunk_sums(
    teacher: str,
    events: Events,
    chunk_shape: np.ndarray,
    chunk_flags: np.ndarray,
    *,
    same_tokenizer: bool = False,
) -> dict[str, float]:
    """The metric sums of one teacher over one batch that the plan knows on the host (see the
    module docstring; those of the KD term's values: :func:`term_sums`); keys whose sum is 0
    are left out.

    ``chunk_shape`` / ``chunk_flags``: uint8 ``[C]`` of every chunk of the batch (numpy).
    """
    out: dict[str, float] = defaultdict(float)
    shape = _shapes(chunk_shape, same_tokenizer)
    flags = np.asarray(chunk_flags)
    status = events.status
    incorrect = (flags & FLAG_CORRECT) == 0
    masked = (flags & FLAG_KD) == 0
    no_prediction = (flags & FLAG_PREDICTION) == 0
    # A chunk whose flags make it a candidate but that the builder was not given: its sample
    # selected another teacher.
    not_selected = ~incorrect & ~masked & ~no_prediction & (status == STATUS_INVALID)
    reasons = [
        incorrect,
        masked,
        no_prediction,
        not_selected,
        status == STATUS_UNSUPPORTED,
        status == STATUS_DROPPED,
    ]
    taken = np.zeros(len(flags), dtype=bool)
    for code, name in enumerate(SHAPES):
        count = float((shape == code).sum())
        if count:
            out[f"{teacher}/{name}/chunks"] += count
    for reason, hit in zip(SKIP_REASONS, reasons, strict=True):
        first = hit & ~taken
        taken |= hit
        for code, name in enumerate(SHAPES):
            count = float((first & (shape == code)).sum())
            if count:
                out[f"{teacher}/{name}/skipped_{reason}"] += count
    counted_shape = shape[events.chunk_index]
    values = {
        "valid": np.ones(len(counted_shape)),
        "top1": events.top1.astype(np.float64),
        "realized_in_topk": events.in_topk.astype(np.float64),
    }
    for code, name in enumerate(SHAPES):
        here = counted_shape == code
        if not here.any():
            continue
        for key, value in values.items():
            out[f"{teacher}/{name}/{key}"] += float(value[here].sum())
    return dict(out)


TERM_STATS = (
    "sum_divergence",
    "sum_weighted",
    "sum_events",
    "sum_rest_student",
    "sum_rest_teacher",
)
"""The sums of values the KD term computed on the device (:func:`term_sums`)."""


def term_sums(
    teacher: str,
    events: Events,
    term: KdTerm,
    chunk_shape: np.ndarray,
    *,
    same_tokenizer: bool = False,
) -> tuple[list[str], Tensor | None]:
    """The :data:`TERM_STATS` sums of one teacher's KD term over its counted chunks, per shape
    present: their keys and a float64 vector on the term's device, summed there (nothing is
    read back to the host); ``([], None)`` without counted chunks."""
    shape = _shapes(chunk_shape, same_tokenizer)[events.chunk_index]
    if len(shape) == 0:
        return [], None
    present = np.unique(shape)
    device = term.divergence.device
    codes = to_device(np.searchsorted(present, shape), device)
    weight = to_device(np.asarray(events.weight, dtype=np.float64), device)
    divergence = term.divergence.double()
    columns = torch.stack(
        [
            divergence,
            divergence * weight,
            term.n_events.double(),
            term.log_rest_student.double().exp(),
            term.log_rest_teacher.double().exp(),
        ],
        dim=1,
    )
    grid = columns.new_zeros(len(present), len(TERM_STATS)).index_add_(0, codes, columns)
    keys = [f"{teacher}/{SHAPES[code]}/{stat}" for code in present for stat in TERM_STATS]
    return keys, grid.reshape(-1)


CHUNK_STATS = (
    "chunks",
    "valid",
    *(f"skipped_{r}" for r in SKIP_REASONS),
    "sum_divergence",
    "sum_weighted",
    "sum_events",
    "sum_rest_student",
    "sum_rest_teacher",
    "top1",
    "realized_in_topk",
)
TEACHER_STATS = ("bits", "bytes", "selected_samples")


def sum_keys(term_names: list[str], n_teachers: int) -> list[str]:
    """Every key the sums of a loss with these KD terms and teachers can hold, in a fixed order
    (so that sums can be packed into one vector and all-reduced across ranks)."""
    keys = [f"{t}/{shape}/{stat}" for t in term_names for shape in SHAPES for stat in CHUNK_STATS]
    keys += [f"{t}/{stat}" for t in term_names for stat in (*ULD_STATS, *GOLD_STATS)]
    return keys + [f"teacher{i}/{stat}" for i in range(n_teachers) for stat in TEACHER_STATS]


def add_sums(total: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    """``total + more`` key by key (a new dict)."""
    out = dict(total)
    for key, value in more.items():
        out[key] = out.get(key, 0.0) + value
    return out


def summarize(sums: dict[str, float]) -> dict[str, float]:
    """Reported metrics from sums: counts as they are, and per teacher and shape
    ``mean_divergence``, ``mean_events``, ``mean_rest_student``, ``mean_rest_teacher``,
    ``top1_agreement``, ``realized_in_topk_rate`` (over valid chunks) and ``kd_share`` (the
    shape's part of the teacher's ``sum w D``). Keys without a ``teacher/shape/`` prefix pass
    through."""
    out: dict[str, float] = {}
    groups: dict[str, dict[str, float]] = defaultdict(dict)
    for key, value in sums.items():
        parts = key.split("/")
        if len(parts) != 3:
            out[key] = value
            continue
        groups[f"{parts[0]}/{parts[1]}"][parts[2]] = value
    weighted: dict[str, float] = defaultdict(float)
    for group, values in groups.items():
        weighted[group.split("/")[0]] += values.get("sum_weighted", 0.0)
    means = {
        "sum_divergence": "mean_divergence",
        "sum_events": "mean_events",
        "sum_rest_student": "mean_rest_student",
        "sum_rest_teacher": "mean_rest_teacher",
        "top1": "top1_agreement",
        "realized_in_topk": "realized_in_topk_rate",
    }
    for group, values in groups.items():
        valid = values.get("valid", 0.0)
        for key, value in values.items():
            if key not in means and key != "sum_weighted":
                out[f"{group}/{key}"] = value
        if valid:
            for key, name in means.items():
                out[f"{group}/{name}"] = values.get(key, 0.0) / valid
        total = weighted[group.split("/")[0]]
        if total > 0:
            out[f"{group}/kd_share"] = values.get("sum_weighted", 0.0) / total
    return out
