"""The CSR helpers against plain Python lists (hypothesis)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from crosskd import ragged

rows = st.lists(st.lists(st.integers(0, 3), max_size=5), max_size=12)


def _csr(values: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    offsets = ragged.offsets_from_lengths(np.array([len(r) for r in values], dtype=np.int64))
    flat = np.array([x for r in values for x in r], dtype=np.int64)
    return flat, offsets


@settings(max_examples=200, deadline=None)
@given(rows, st.data())
def test_select_gathers_rows_in_order(values, data):
    flat, offsets = _csr(values)
    picked = data.draw(st.lists(st.integers(0, max(len(values) - 1, 0)), max_size=8))
    picked = picked if values else []
    expected = [x for i in picked for x in values[i]]
    assert flat[ragged.select(offsets, np.array(picked, dtype=np.int64))].tolist() == expected


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 2), max_size=4), st.lists(st.integers(0, 2), max_size=4)),
        max_size=10,
    )
)
def test_segments_equal_matches_list_equality(pairs):
    a, a_offsets = _csr([p[0] for p in pairs])
    b, b_offsets = _csr([p[1] for p in pairs])
    expected = [p[0] == p[1] for p in pairs]
    assert ragged.segments_equal(a, a_offsets, b, b_offsets).tolist() == expected


@settings(max_examples=200, deadline=None)
@given(rows)
def test_positions_count_within_each_row(values):
    lengths = np.array([len(r) for r in values], dtype=np.int64)
    assert ragged.positions(lengths).tolist() == [i for r in values for i in range(len(r))]
    assert ragged.positions(lengths).dtype == np.int64
