"""Ragged arrays in CSR form: a flat ``values`` array cut into rows by ``offsets`` (int64
``[n + 1]``, ``offsets[0] == 0``, non-decreasing; row ``i`` is ``values[offsets[i]:offsets[i+1]]``).

Token chains, the byte view of a vocabulary and chunk byte spans are all of this form; these
helpers keep their loops in numpy.
"""

from __future__ import annotations

import numpy as np


def offsets_from_lengths(lengths: np.ndarray) -> np.ndarray:
    """Row pointers (int64 ``[n + 1]``) of rows with the given lengths (int ``[n]``)."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def positions(lengths: np.ndarray) -> np.ndarray:
    """Each element's place in its row, rows of the given lengths (int ``[n]``) in turn: int64
    ``[sum(lengths)]``; for ``[3, 2]`` it is ``[0, 1, 2, 0, 1]``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(
        offsets_from_lengths(lengths)[:-1], lengths
    )


def select(offsets: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Indices into ``values`` of the elements of ``rows`` (int ``[k]``), row after row, int64."""
    rows = np.asarray(rows, dtype=np.int64)
    lengths = offsets[rows + 1] - offsets[rows]
    shift = offsets[rows] - np.cumsum(lengths) + lengths
    return np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(shift, lengths)


def segments_equal(
    a: np.ndarray, a_offsets: np.ndarray, b: np.ndarray, b_offsets: np.ndarray
) -> np.ndarray:
    """Whether row ``k`` of ``(a, a_offsets)`` equals row ``k`` of ``(b, b_offsets)``, for the
    same number of rows on both sides; bool ``[n]``."""
    a_len, b_len = np.diff(a_offsets), np.diff(b_offsets)
    same = a_len == b_len
    if same.all():  # the common case: compare the two flat arrays as they are
        differ = np.flatnonzero(a != b)
        same[np.unique(np.searchsorted(a_offsets[1:], differ, side="right"))] = False
        return same
    keep = np.flatnonzero(same)
    if keep.size == 0:
        return same
    differ = np.flatnonzero(a[select(a_offsets, keep)] != b[select(b_offsets, keep)])
    if differ.size:
        ends = np.cumsum(a_len[keep])
        same[keep[np.unique(np.searchsorted(ends, differ, side="right"))]] = False
    return same
