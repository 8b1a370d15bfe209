"""Packed rows of prepared data by number, read shard by shard.

:class:`PackedRows` numbers the packed rows of every shard in shard order (the manifest records
each shard's range) and opens a shard the first time one of its rows is asked for, keeping the
``keep_shards`` most recently used. A shard whose manifest entry records its footer
(:mod:`crosskd.ranges`) is read by byte ranges: its footer (checked against the manifest's
sha256; its ``bin`` statistics say which row groups hold a packed row), then only the row
groups that hold the rows asked for (each checked against the footer's sha256), so a process
fetches the rows it trains on, not the whole shard; with a node cache the processes of a node
fetch each range once. A shard without one (written before) is read whole and its sha256
checked. A row's samples are converted to Python values only when that row is asked for.
``reads`` counts the opens per shard.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from crosskd.artifacts import ParquetRows
from crosskd.data.collate import PreparedData
from crosskd.errors import DataError
from crosskd.ranges import ArtifactFile, NodeCache, open_parquet

REBUILD = "Run `crosskd prepare` again."


@dataclass
class _Shard:
    rows: ParquetRows
    bins: list[tuple[int, int]]
    """Least and greatest packed row (``bin``) of each row group, from the footer."""


@dataclass
class PackedRows:
    """The packed rows of ``data``, numbered across shards."""

    data: PreparedData
    keep_shards: int = 16
    """Shards kept open (least recently used dropped first)."""
    node_cache: NodeCache | None = field(default_factory=NodeCache.from_environment)
    """Node-local folder remote byte ranges are shared through (:mod:`crosskd.ranges`;
    default: ``CROSSKD_NODE_CACHE``, None: not shared)."""
    reads: Counter = field(default_factory=Counter, repr=False)
    """How many times each shard was opened."""
    _open: OrderedDict[int, _Shard] = field(default_factory=OrderedDict, repr=False)

    def shard_sizes(self) -> list[int]:
        """Packed rows of each shard, in shard order."""
        return [stop - start for start, stop in (s["bins"] for s in self.data.manifest["shards"])]

    def row(self, shard: int, index: int) -> tuple[list[dict], int]:
        """Packed row ``index`` of shard ``shard``: its samples (column name -> value) and the
        row of its first sample in the shard (its samples follow one another there)."""
        opened = self._shard(shard)
        rows = opened.rows.find("bin", index, opened.bins)
        if not rows:
            path = self.data.manifest["shards"][shard]["path"]
            raise DataError(
                f"prepared data {self.data.uri}: {path} holds no packed row {index} (the "
                f"manifest gives it {self.shard_sizes()[shard]}); {REBUILD}"
            )
        return opened.rows.rows(rows.start, rows.stop).to_pylist(), rows.start

    def _shard(self, index: int) -> _Shard:
        if index in self._open:
            self._open.move_to_end(index)
            return self._open[index]
        entry = self.data.manifest["shards"][index]
        file = ArtifactFile(
            self.data.uri, entry["path"], "prepared data", DataError, REBUILD, self.node_cache
        )
        rows = ParquetRows(open_parquet(file, entry))
        bins = rows.statistics("bin")
        expected = entry["bins"][1] - entry["bins"][0]
        held = 0 if bins is None else max(high for _, high in bins) + 1
        if bins is None or held != expected or min(low for low, _ in bins) != 0:
            found = "no statistics of its bin column" if bins is None else f"{held} packed rows"
            raise DataError(
                f"prepared data {self.data.uri}: {entry['path']} holds {found}, the manifest "
                f"says {expected}; {REBUILD}"
            )
        self.reads[index] += 1
        self._open[index] = _Shard(rows, bins)
        while len(self._open) > self.keep_shards:
            self._open.popitem(last=False)
        return self._open[index]
