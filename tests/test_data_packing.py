"""Lockstep packing: first-fit-decreasing by hand and against a plain reference, invariants
over generated inputs, positions and segments per sample."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from crosskd.data import pack_lockstep, packed_positions, packing_efficiency, segment_ids
from crosskd.errors import DataError


def _reference_ffd(lengths: np.ndarray, capacities: list[int]) -> list[list[int]]:
    """First-fit-decreasing written out plainly, with exact fractions for the sort key."""
    from fractions import Fraction

    rows = lengths.tolist()

    def key(i: int) -> tuple[Fraction, int]:
        return (-max(Fraction(n, c) for n, c in zip(rows[i], capacities, strict=True)), i)

    bins: list[list[int]] = []
    rooms: list[list[int]] = []
    for i in sorted(range(len(rows)), key=key):
        fitting = [
            b
            for b, room in enumerate(rooms)
            if all(n <= r for n, r in zip(rows[i], room, strict=True))
        ]
        if not fitting:
            bins.append([])
            rooms.append(list(capacities))
        b = fitting[0] if fitting else len(bins) - 1
        bins[b].append(i)
        rooms[b] = [r - n for r, n in zip(rooms[b], rows[i], strict=True)]
    return bins


@st.composite
def packing_inputs(draw) -> tuple[np.ndarray, list[int]]:
    n_models = draw(st.integers(1, 3))
    capacities = draw(st.lists(st.integers(1, 64), min_size=n_models, max_size=n_models))
    n_samples = draw(st.integers(0, 60))
    columns = [
        draw(hnp.arrays(np.int64, n_samples, elements=st.integers(0, cap))) for cap in capacities
    ]
    return np.stack(columns, axis=1).reshape(n_samples, n_models), capacities


def test_hand_checked_first_fit_decreasing():
    # Keys (largest share of capacity): s0 6/10, s1 6/8, s2 5/8, s3 4/10, s4 2/8, so the order
    # is s1 s2 s0 s3 s4. s1 opens bin 0 (room 7, 2); s2 does not fit there (2 < 5) and opens
    # bin 1 (room 5, 3); s0 fits bin 0 (room 1, 0); s3 fits bin 1 (room 1, 2); s4 fits neither
    # and opens bin 2.
    lengths = np.array([[6, 2], [3, 6], [5, 5], [4, 1], [2, 2]])
    bins = pack_lockstep(lengths, [10, 8])
    assert [b.tolist() for b in bins] == [[1, 0], [2, 3], [4]]
    assert all(b.dtype == np.int64 for b in bins)
    # 20 of 30 tokens for model 0, 16 of 24 for model 1.
    assert packing_efficiency(lengths, bins, [10, 8]) == pytest.approx([2 / 3, 2 / 3])


def test_ties_are_broken_by_sample_index():
    lengths = np.array([[2, 1], [1, 2], [2, 2], [1, 1]])
    # Keys 2/4, 2/4, 2/4, 1/4: samples 0, 1, 2 tie and keep their order.
    assert [b.tolist() for b in pack_lockstep(lengths, [4, 4])] == [[0, 1, 3], [2]]


def test_nothing_to_pack():
    assert pack_lockstep(np.zeros((0, 2), dtype=np.int64), [8, 8]) == []
    assert packing_efficiency(np.zeros((0, 2), dtype=np.int64), [], [8, 8]) == [0.0, 0.0]


@settings(max_examples=300, deadline=None)
@given(packing_inputs())
def test_packing_invariants(case):
    lengths, capacities = case
    bins = pack_lockstep(lengths, capacities)
    placed = np.concatenate(bins) if bins else np.zeros(0, dtype=np.int64)
    assert sorted(placed.tolist()) == list(range(len(lengths)))
    for members in bins:
        assert len(members) > 0
        assert (lengths[members].sum(axis=0) <= np.asarray(capacities)).all()
        for m in range(len(capacities)):
            # Every model's row holds the bin's samples in the bin's order.
            segments = segment_ids(lengths[members, m])
            row_samples = members[segments]
            expected = np.repeat(members, lengths[members, m])
            assert np.array_equal(row_samples, expected)
    assert [b.tolist() for b in bins] == _reference_ffd(lengths, capacities)
    assert [b.tolist() for b in pack_lockstep(lengths.copy(), capacities)] == [
        b.tolist() for b in bins
    ]
    if bins:
        used = lengths.sum(axis=0)
        expected_eff = [float(u) / (len(bins) * c) for u, c in zip(used, capacities, strict=True)]
        assert packing_efficiency(lengths, bins, capacities) == pytest.approx(expected_eff)


def test_positions_and_segments_by_hand():
    assert packed_positions([3, 2]).tolist() == [0, 1, 2, 0, 1]
    assert segment_ids([3, 2]).tolist() == [0, 0, 0, 1, 1]
    assert packed_positions([1, 0, 4]).tolist() == [0, 0, 1, 2, 3]
    assert segment_ids([1, 0, 4]).tolist() == [0, 2, 2, 2, 2]
    assert packed_positions([]).tolist() == [] and segment_ids([]).tolist() == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 20), max_size=12))
def test_positions_restart_per_sample(lengths):
    positions, segments = packed_positions(lengths), segment_ids(lengths)
    assert len(positions) == len(segments) == sum(lengths)
    expected_positions = [p for n in lengths for p in range(n)]
    expected_segments = [s for s, n in enumerate(lengths) for _ in range(n)]
    assert positions.tolist() == expected_positions
    assert segments.tolist() == expected_segments


def test_oversized_sample_is_named():
    lengths = np.array([[3, 3], [4, 9], [9, 9]])
    with pytest.raises(
        DataError,
        match=r"sample 1 has lengths \[4, 9\] .* capacities \[8, 8\] "
        r"\(2 samples in all\); clip",
    ):
        pack_lockstep(lengths, [8, 8])


def test_malformed_arguments_are_refused():
    with pytest.raises(ValueError, match=r"shape \(3,\) but there are 2 capacities"):
        pack_lockstep(np.array([1, 2, 3]), [4, 4])
    with pytest.raises(ValueError, match="integer token counts"):
        pack_lockstep(np.array([[1.5, 2.0]]), [4, 4])
    with pytest.raises(ValueError, match="non-negative"):
        pack_lockstep(np.array([[-1, 2]]), [4, 4])


def test_hundred_thousand_samples_pack_densely():
    rng = np.random.default_rng(0)
    student = np.clip(rng.lognormal(5.5, 1.0, 100_000).astype(np.int64) + 1, 1, 4096)
    teacher = np.clip((student * rng.uniform(0.8, 1.3, student.size)).astype(np.int64), 1, 4096)
    lengths = np.stack([student, teacher], axis=1)
    bins = pack_lockstep(lengths, [4096, 4096])
    assert np.array_equal(np.sort(np.concatenate(bins)), np.arange(len(lengths)))
    assert max(lengths[b].sum(axis=0).max() for b in bins) <= 4096
    assert min(packing_efficiency(lengths, bins, [4096, 4096])) > 0.9
