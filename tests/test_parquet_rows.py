"""Reading a Parquet file a row group at a time (:class:`crosskd.artifacts.ParquetRows`): any
range of rows equals the same slice of the whole table, across group boundaries."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import given, settings
from hypothesis import strategies as st

from crosskd.artifacts import ParquetRows

TABLE = pa.table({"n": list(range(100)), "s": [f"row {i}" for i in range(100)],
                  "v": [[i] * (i % 5) for i in range(100)]})  # fmt: skip


def _payload(group: int) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(TABLE, buffer, row_group_size=group)
    return buffer.getvalue()


PAYLOADS = {group: _payload(group) for group in (1, 7, 100)}


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(PAYLOADS)), st.integers(0, 99), st.integers(1, 40))
def test_any_range_equals_the_whole_tables_slice(group, start, count):
    rows = ParquetRows(PAYLOADS[group])
    stop = min(start + count, 100)
    assert len(rows) == 100 and rows.column("n") == list(range(100))
    assert rows.rows(start, stop).to_pylist() == TABLE.slice(start, stop - start).to_pylist()
    assert rows.rows(start, stop).to_pylist() == TABLE.slice(start, stop - start).to_pylist()
