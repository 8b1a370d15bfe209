"""A process of one "node" reading rows of a Parquet artifact on S3 by byte ranges through the
node cache (:mod:`crosskd.ranges`), counting the bytes it fetched from S3; spawned by
``tests/test_ranged_reads.py`` (kept apart so the child imports neither torch nor the tests)."""

from __future__ import annotations


def read_rows(
    uri: str, path: str, footer: dict, rows: tuple[int, int], node_cache: str, barrier, results
) -> None:
    """Wait at ``barrier`` with the other processes, read ``rows`` of ``path`` under ``uri``
    and put ``(rows as Python values, bytes fetched from S3)`` on ``results``."""
    import fsspec

    from crosskd.artifacts import ParquetRows
    from crosskd.errors import DataError
    from crosskd.ranges import ArtifactFile, NodeCache, RangedParquet

    fs = fsspec.core.url_to_fs(uri)[0]
    fetch, fetched = fs.cat_file, []

    def counting(*args, **kwargs) -> bytes:
        data = fetch(*args, **kwargs)
        fetched.append(len(data))
        return data

    fs.cat_file = counting
    barrier.wait()
    file = ArtifactFile(uri, path, "test data", DataError, "Write it again.", NodeCache(node_cache))
    table = ParquetRows(RangedParquet(file, footer)).rows(*rows)
    results.put((table.to_pylist(), sum(fetched)))
