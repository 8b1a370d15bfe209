"""Packed rows of prepared data by number, read shard by shard.

:class:`PackedRows` numbers the packed rows of every shard in shard order (the manifest records
each shard's range) and reads a shard (its sha256 checked, its Parquet parsed) the first time
one of its rows is asked for, keeping the ``keep_shards`` most recently used as their bytes. A
row's samples are parsed (their row group) and converted to Python values only when that row is
asked for, so a process that trains on a slice of each step converts only its slice. ``reads``
counts the reads per shard.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import numpy as np

from crosskd.artifacts import ParquetRows, read_checked
from crosskd.data.collate import PreparedData
from crosskd.errors import DataError


@dataclass
class _Shard:
    rows: ParquetRows
    starts: np.ndarray
    """Row of the first sample of each packed row, and the number of samples at the end."""


@dataclass
class PackedRows:
    """The packed rows of ``data``, numbered across shards."""

    data: PreparedData
    keep_shards: int = 16
    """Read shards kept in memory (least recently used dropped first)."""
    reads: Counter = field(default_factory=Counter, repr=False)
    """How many times each shard was read."""
    _open: OrderedDict[int, _Shard] = field(default_factory=OrderedDict, repr=False)

    def shard_sizes(self) -> list[int]:
        """Packed rows of each shard, in shard order."""
        return [stop - start for start, stop in (s["bins"] for s in self.data.manifest["shards"])]

    def row(self, shard: int, index: int) -> tuple[list[dict], int]:
        """Packed row ``index`` of shard ``shard``: its samples (column name -> value) and the
        row of its first sample in the shard (its samples follow one another there)."""
        opened = self._shard(shard)
        start, stop = int(opened.starts[index]), int(opened.starts[index + 1])
        return opened.rows.rows(start, stop).to_pylist(), start

    def _shard(self, index: int) -> _Shard:
        if index in self._open:
            self._open.move_to_end(index)
            return self._open[index]
        entry = self.data.manifest["shards"][index]
        payload = read_checked(self.data.uri, entry, what="prepared data", error=DataError,
                               rebuild="Run `crosskd prepare` again.")  # fmt: skip
        rows = ParquetRows(payload)
        bins = np.asarray(rows.column("bin"), dtype=np.int64)
        starts = np.concatenate([[0], np.flatnonzero(bins[1:] != bins[:-1]) + 1, [len(bins)]])
        expected = entry["bins"][1] - entry["bins"][0]
        if len(starts) - 1 != expected:
            raise DataError(
                f"prepared data {self.data.uri}: {entry['path']} holds {len(starts) - 1} packed "
                f"rows, the manifest says {expected}; run `crosskd prepare` again."
            )
        self.reads[index] += 1
        self._open[index] = _Shard(rows, starts)
        while len(self._open) > self.keep_shards:
            self._open.popitem(last=False)
        return self._open[index]
