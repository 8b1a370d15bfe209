"""Reading crosskd's own artifacts back: a folder (any fsspec URI) with a ``manifest.json``
written last and files whose sha256 the manifest records. Shared by prepared data and teacher
caches; errors name the artifact, what is wrong and the command that rebuilds it. And
publishing a folder written under a temporary name (:func:`move_folder`); reading a Parquet
file a row group at a time, from its bytes or by checked byte ranges (:class:`ParquetRows`,
:mod:`crosskd.ranges`)."""

from __future__ import annotations

import io
import json
import posixpath
import uuid
from collections import OrderedDict
from collections.abc import Collection

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from crosskd.errors import CrosskdError
from crosskd.ranges import ArtifactFile, NodeCache, RangedParquet

MANIFEST = "manifest.json"


def read_manifest(
    uri: str,
    *,
    what: str,
    kind: str,
    versions: Collection[int],
    error: type[CrosskdError],
    rebuild: str,
) -> dict:
    """The manifest of the artifact at ``uri`` (``what``: e.g. "prepared data"), refusing a
    missing, damaged or foreign one or an unknown format version with ``error``; ``rebuild``
    names the command that writes it (e.g. "`crosskd prepare`")."""
    fs, root = fsspec.core.url_to_fs(uri)
    path = f"{root}/{MANIFEST}"
    if not fs.exists(path):
        raise error(
            f"{what} {uri}: no {MANIFEST} (missing, or a run that did not finish); run {rebuild}."
        )
    try:
        manifest = json.loads(fs.cat_file(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(
            f"{what} {uri}: {MANIFEST} is not valid JSON ({exc}); it is damaged. Run {rebuild} "
            f"again."
        ) from exc
    if manifest.get("kind") != kind or manifest.get("format_version") not in versions:
        raise error(
            f"{what} {uri}: manifest kind {manifest.get('kind')!r} version "
            f"{manifest.get('format_version')!r}, expected {kind!r} version in "
            f"{sorted(versions)}; run {rebuild} again with this crosskd."
        )
    return manifest


def read_checked(
    uri: str,
    entry: dict,
    *,
    what: str,
    error: type[CrosskdError],
    rebuild: str,
    node_cache: NodeCache | None = None,
) -> bytes:
    """The bytes of the file ``entry["path"]`` under ``uri``, refused with ``error`` unless
    their sha256 is ``entry["sha256"]`` (``node_cache``: :class:`crosskd.ranges.ArtifactFile`)."""
    file = ArtifactFile(uri, entry["path"], what, error, rebuild, node_cache)
    return file.fetch(None, None, entry["sha256"])


def start_run(
    fs: fsspec.AbstractFileSystem, path: str, output: str, run: dict, *, what: str, activity: str
) -> None:
    """Record a resumable run's values at ``path`` (a JSON file in ``output``), or check them
    against the record of an earlier, interrupted run there: other values, other keys or a
    damaged record are refused in one line naming the file and what to do. ``what``: what the
    output holds ("a cache"); ``activity``: what wrote the record ("scoring")."""
    name = posixpath.basename(path)
    if fs.exists(path):
        where = f"{output.rstrip('/')}/{name}"
        earlier = _read_run(fs.cat_file(path), where, list(run), activity)
        differ = [k for k in run if earlier[k] != run[k]]
        if differ:
            raise CrosskdError(
                f"output {output} holds {what} (or an interrupted run) with another "
                f"{' and '.join(differ)}; choose a new output or delete the old one."
            )
        extra = [k for k in earlier if k not in run]
        if extra:
            raise CrosskdError(
                f"output {output} holds {what} (or an interrupted run) whose {name} also records "
                f"{', '.join(extra)} (another crosskd version?); choose a new output or delete "
                f"the old one."
            )
        return
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    write_whole(fs, path, json.dumps(run).encode("utf-8"))


def _read_run(payload: bytes, where: str, keys: list[str], activity: str) -> dict:
    """The earlier run's record: a JSON object with (at least) ``keys``; anything else is
    refused in one line naming the file (``where``) and what to do."""
    what = f"{where} (the record of an earlier {activity} run into this output)"
    advice = "delete that output (or the file) to start afresh, or choose another output."
    try:
        earlier = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8 text"
        raise CrosskdError(f"{what} is damaged: not valid JSON ({reason}); {advice}") from None
    if not isinstance(earlier, dict):
        raise CrosskdError(
            f"{what} is damaged: a JSON {type(earlier).__name__}, not an object; {advice}"
        )
    missing = [k for k in keys if k not in earlier]
    if missing:
        raise CrosskdError(
            f"{what} lacks {', '.join(missing)} (damaged, or written by another crosskd "
            f"version); {advice}"
        )
    return earlier


def write_whole(fs: fsspec.AbstractFileSystem, path: str, payload: bytes) -> None:
    """Write ``payload`` to the file ``path`` on ``fs`` so that a reader finds all of it or no
    file at all, even when the writer is killed part way: written under a hidden temporary name
    beside it (``.<name>.<random>.tmp``, which no ``*.<suffix>`` glob of the folder matches),
    then renamed (one rename on a local filesystem; on an object store the write itself is
    whole). The temporary name is the writer's own, so processes that write the same file at
    once (the scoring pods of one cache, each writing its ``run.json``) never rename each
    other's temporary; the last rename wins. A writer killed before its rename leaves its
    hidden temporary behind."""
    folder, name = posixpath.split(path)
    tmp = f"{folder}/.{name}.{uuid.uuid4().hex}.tmp"
    fs.pipe_file(tmp, payload)
    fs.mv(tmp, path)


def move_folder(
    fs: fsspec.AbstractFileSystem, src: str, dst: str, *, last: str | None = None
) -> None:
    """Rename the folder ``src`` to ``dst`` (which must not exist) on ``fs``: one atomic rename
    on a local filesystem; on an object store (no folders, no rename) every file is copied,
    the file named ``last`` after all others (so its presence at ``dst`` means the copy is
    complete), then ``src`` deleted; the caller publishes what points at ``dst`` afterwards."""
    if isinstance(fs, LocalFileSystem):
        fs.mv(src, dst, recursive=True)
        return
    files = sorted(fs.find(src), key=lambda path: path.rsplit("/", 1)[-1] == last)
    for path in files:
        fs.copy(path, dst + path[len(src) :])
    fs.rm(src, recursive=True)


class ParquetRows:
    """A Parquet file's rows, parsed a row group at a time when asked for (the last
    ``keep_groups`` groups kept). ``source``: the file's bytes (memory: the compressed file plus
    a few groups), or a :class:`crosskd.ranges.RangedParquet` (memory: its footer plus a few
    groups; only the groups read are fetched)."""

    def __init__(self, source: bytes | RangedParquet, keep_groups: int = 2) -> None:
        self._file = pq.ParquetFile(io.BytesIO(source)) if isinstance(source, bytes) else source
        metadata = self._file.metadata
        sizes = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
        self._starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self._groups: OrderedDict[int, object] = OrderedDict()
        self._keep = keep_groups

    def __len__(self) -> int:
        return int(self._starts[-1])

    def statistics(self, name: str) -> list[tuple[object, object]] | None:
        """The least and greatest value of column ``name`` in each row group, from the footer
        (no row group is read); None when a group's footer records none."""
        metadata = self._file.metadata
        out = []
        for g in range(metadata.num_row_groups):
            group = metadata.row_group(g)
            column = next(
                group.column(i)
                for i in range(group.num_columns)
                if group.column(i).path_in_schema == name
            )
            stats = column.statistics
            if stats is None or not stats.has_min_max:
                return None
            out.append((stats.min, stats.max))
        return out

    def find(self, name: str, value: object, statistics: list[tuple[object, object]]) -> range:
        """The rows whose column ``name`` (sorted ascending) holds ``value``, reading only the
        first and last row groups whose ``statistics`` (:meth:`statistics`) may hold it."""
        groups = [g for g, (low, high) in enumerate(statistics) if low <= value <= high]
        if not groups:
            return range(0)
        first = np.flatnonzero(self._group(groups[0]).column(name).to_numpy() == value)
        last = np.flatnonzero(self._group(groups[-1]).column(name).to_numpy() == value)
        if not len(first) or not len(last):
            return range(0)
        return range(
            int(self._starts[groups[0]] + first[0]), int(self._starts[groups[-1]] + last[-1]) + 1
        )

    def rows(self, start: int, stop: int):
        """Rows ``start .. stop - 1`` as a ``pyarrow.Table``."""
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        last = int(np.searchsorted(self._starts, max(stop - 1, start), side="right")) - 1
        tables = [self._group(g) for g in range(first, last + 1)]
        table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
        return table.slice(start - int(self._starts[first]), stop - start)

    def _group(self, index: int):
        if index in self._groups:
            self._groups.move_to_end(index)
        else:
            self._groups[index] = self._file.read_row_group(index)
            while len(self._groups) > self._keep:
                self._groups.popitem(last=False)
        return self._groups[index]
