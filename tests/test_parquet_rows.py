"""Reading a Parquet file a row group at a time (:class:`crosskd.artifacts.ParquetRows`): any
range of rows equals the same slice of the whole table, across group boundaries, whether the
file is held as its bytes or read by checked byte ranges (:mod:`crosskd.ranges`)."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crosskd.artifacts import ParquetRows
from crosskd.errors import DataError
from crosskd.ranges import ArtifactFile, RangedParquet, footer_record, write_parquet

TABLE = pa.table(
    {
        "n": list(range(100)),
        "s": [f"row {i}" for i in range(100)],
        "v": [[i] * (i % 5) for i in range(100)],
    }
)


def _payload(group: int) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(TABLE, buffer, row_group_size=group)
    return buffer.getvalue()


PAYLOADS = {group: _payload(group) for group in (1, 7, 100)}
RANGED = {group: write_parquet(TABLE, row_group_size=group) for group in (1, 7, 100)}


@pytest.fixture(scope="module")
def ranged_files(tmp_path_factory):
    """The RANGED payloads as files of one local artifact folder."""
    root = tmp_path_factory.mktemp("ranged")
    for group, payload in RANGED.items():
        (root / f"g{group}.parquet").write_bytes(payload)
    return root


def _ranged(root, group: int) -> RangedParquet:
    file = ArtifactFile(str(root), f"g{group}.parquet", "test data", DataError, "Write it again.")
    return RangedParquet(file, footer_record(RANGED[group])["footer"])


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(PAYLOADS)), st.integers(0, 99), st.integers(1, 40))
def test_any_range_equals_the_whole_tables_slice(group, start, count):
    rows = ParquetRows(PAYLOADS[group])
    stop = min(start + count, 100)
    assert len(rows) == 100
    assert rows.rows(start, stop).to_pylist() == TABLE.slice(start, stop - start).to_pylist()
    assert rows.rows(start, stop).to_pylist() == TABLE.slice(start, stop - start).to_pylist()


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(RANGED)), st.integers(0, 99), st.integers(1, 40))
def test_ranged_reads_equal_the_whole_tables_slice(ranged_files, group, start, count):
    rows = ParquetRows(_ranged(ranged_files, group))
    stop = min(start + count, 100)
    assert len(rows) == 100
    assert rows.rows(start, stop).to_pylist() == TABLE.slice(start, stop - start).to_pylist()


def test_digests_change_only_the_footer_and_statistics_find_sorted_values(ranged_files):
    for group, payload in RANGED.items():
        footer = footer_record(payload)["footer"]
        assert payload[: footer["offset"]] == PAYLOADS[group][: footer["offset"]]
        assert footer["offset"] + footer["bytes"] == len(payload)
    assert footer_record(PAYLOADS[7]) == {}
    rows = ParquetRows(_ranged(ranged_files, 7))
    statistics = rows.statistics("n")
    assert statistics == [(g * 7, min(g * 7 + 6, 99)) for g in range(15)]
    assert rows.find("n", 20, statistics) == range(20, 21)
    assert rows.find("n", 100, statistics) == range(0)
