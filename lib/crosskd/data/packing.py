"""Lockstep packing: several samples share one packed row, the same samples in the same order
for every model, each model's row within that model's capacity.

Units: ``lengths`` is an integer array ``[n_samples, n_models]`` of token counts (each model
tokenizes the same text into its own count), ``capacities`` holds one token count per model.
A bin is an array of sample indices in the order the samples sit in the packed row; every
model's row is the concatenation of those samples' tokens, so the sample order is the same for
all models by construction.

:func:`pack_lockstep` is first-fit-decreasing over the vector of per-model lengths: samples
sorted by their largest length relative to capacity (descending; ties by sample index), each
placed into the first open bin (in creation order) where it fits for every model, else into a
new bin. The result is a deterministic function of the inputs. Within a packed row,
:func:`packed_positions` restarts position ids at 0 per sample and :func:`segment_ids` numbers
the samples, so attention can be kept within a sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from crosskd import ragged
from crosskd.errors import DataError

__all__ = ["pack_lockstep", "packed_positions", "packing_efficiency", "segment_ids"]


def pack_lockstep(lengths: np.ndarray, capacities: Sequence[int]) -> list[np.ndarray]:
    """Pack samples into bins that fit every model's capacity (first-fit-decreasing).

    ``lengths``: int ``[n_samples, n_models]`` token counts; ``capacities``: ``n_models`` token
    counts. Returns the bins in creation order, each an int64 array of sample indices in row
    order; every sample is in exactly one bin and, for every model ``m``,
    ``lengths[bin, m].sum() <= capacities[m]``. Raises :class:`~crosskd.errors.DataError` when
    a sample alone exceeds a capacity (clip it first).
    """
    lengths, caps = _check(lengths, capacities)
    n_samples, n_models = lengths.shape
    order = np.argsort(-(lengths / caps).max(axis=1), kind="stable")
    ordered = lengths[order]
    # rest_min[j, m]: the shortest length for model m among the samples placed from step j on;
    # a bin with less room than that for any model can take nothing more and is skipped.
    rest_min = np.minimum.accumulate(ordered[::-1], axis=0)[::-1]
    room = np.empty((n_models, n_samples), dtype=np.int64)  # room[m, b]: tokens left in bin b
    members: list[list[int]] = []
    first_open = 0
    for step, (sample, need) in enumerate(zip(order.tolist(), ordered, strict=True)):
        n_bins = len(members)
        fits = room[0, first_open:n_bins] >= need[0]
        for m in range(1, n_models):
            fits &= room[m, first_open:n_bins] >= need[m]
        found = int(fits.argmax()) if fits.size else 0
        if fits.size and fits[found]:
            target = first_open + found
        else:
            target = n_bins
            room[:, target] = caps
            members.append([])
        room[:, target] -= need
        members[target].append(sample)
        if step + 1 < n_samples:
            while first_open < len(members) and (room[:, first_open] < rest_min[step + 1]).any():
                first_open += 1
    return [np.asarray(bin_, dtype=np.int64) for bin_ in members]


def packing_efficiency(
    lengths: np.ndarray, bins: Sequence[np.ndarray], capacities: Sequence[int]
) -> list[float]:
    """Per model, the share of packed-row slots holding tokens: the tokens of all samples in
    ``bins`` over ``len(bins) * capacity`` (1.0 is perfect, padding is the rest)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if not bins:
        return [0.0 for _ in capacities]
    used = lengths[np.concatenate(bins)].sum(axis=0)
    return [float(tokens) / (len(bins) * cap) for tokens, cap in zip(used, capacities, strict=True)]


def packed_positions(lengths_of_bin: Sequence[int]) -> np.ndarray:
    """Position ids of one model's packed row: ``0 .. length-1`` for each sample in turn.

    ``lengths_of_bin``: that model's token counts of the bin's samples, in row order. Returns
    int64 ``[sum(lengths_of_bin)]``; for ``[3, 2]`` it is ``[0, 1, 2, 0, 1]``.
    """
    return ragged.positions(np.asarray(lengths_of_bin, dtype=np.int64))


def segment_ids(lengths_of_bin: Sequence[int]) -> np.ndarray:
    """Which sample of the row (0, 1, ...) each token of one model's packed row belongs to.

    ``lengths_of_bin`` as for :func:`packed_positions`. Returns int64 ``[sum(lengths_of_bin)]``;
    for ``[3, 2]`` it is ``[0, 0, 0, 1, 1]``. Two tokens may attend to each other only when
    their segment ids are equal.
    """
    lengths = np.asarray(lengths_of_bin, dtype=np.int64)
    return np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)


def _check(lengths: np.ndarray, capacities: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Validate the inputs of :func:`pack_lockstep`; return them as int64 arrays."""
    lengths = np.asarray(lengths)
    caps = np.asarray(capacities, dtype=np.int64)
    if lengths.size == 0:
        lengths = lengths.reshape(0, caps.size)
    if lengths.ndim != 2 or lengths.shape[1] != caps.size or caps.size == 0:
        raise ValueError(
            f"lengths has shape {lengths.shape} but there are {caps.size} capacities; pass "
            "lengths as [n_samples, n_models] with one capacity per model"
        )
    if not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"lengths must be integer token counts, not {lengths.dtype}")
    if (caps <= 0).any() or (lengths < 0).any():
        raise ValueError("capacities must be positive and lengths non-negative token counts")
    lengths = lengths.astype(np.int64, copy=False)
    over = np.flatnonzero((lengths > caps).any(axis=1))
    if over.size:
        first = int(over[0])
        raise DataError(
            f"sample {first} has lengths {lengths[first].tolist()} tokens per model, more than "
            f"the capacities {caps.tolist()} ({over.size} samples in all); clip the samples to "
            "the capacities first (crosskd.data.clip_text)"
        )
    return lengths, caps
