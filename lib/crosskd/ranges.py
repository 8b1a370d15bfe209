"""Parquet artifacts read by checked byte ranges, each range fetched once per node.

Writing: :func:`write_parquet` writes a Parquet file whose footer records the sha256 of every
row group's bytes (key :data:`DIGESTS`, a JSON list in group order). Row group ``g`` is the
bytes from its first column chunk up to the next group's first, the first group from byte 0,
the last up to the footer (:func:`group_bounds`). :func:`footer_record` gives what the
artifact's manifest entry records of the file: ``{"footer": {"offset", "bytes", "sha256"}}``
(the footer is the last ``bytes`` bytes, from ``offset``; nothing for a file without digests).

Reading: :class:`RangedParquet` fetches the footer (``cat_file(path, start, end)``) and checks
it against the manifest's sha256, then fetches a row group the first time it is read, checked
against the footer's sha256, so a process reads the row groups that hold its rows and no other,
each once while it keeps the file open.
:func:`open_parquet` reads a manifest entry's file that way when the entry records its footer,
else whole (checked against the entry's sha256, as artifacts without footers always were). A
damaged range is refused with the artifact's error in one line naming the file, the range and
what to do.

Sharing: :class:`ArtifactFile` ``node_cache`` (a :class:`NodeCache`, a node-local folder;
:meth:`NodeCache.from_environment` reads it from :data:`NODE_CACHE_ENV` and its size bound
from :data:`NODE_CACHE_BYTES_ENV`) keeps each range fetched from remote storage as a file named
by its sha256. The first process to need a range takes a lock file beside it, fetches and
checks the range, writes it under a temporary name and renames it; the processes that asked
meanwhile wait on the lock, then read the file, so the processes of one node fetch each range
once and its digest is checked once (the node cache is a pod's: the PyTorchJob runs one pod
per node). A file named by its sha256 never goes stale. Past
``max_bytes`` the least recently used ranges are deleted (a hit refreshes a file's time); a
process that finds a range gone fetches it again. Local files (``file://``) are read directly,
without the node cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import itertools
import json
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import fsspec
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from crosskd.errors import CrosskdError

DIGESTS = b"crosskd.row_group_sha256"
"""Footer key of the row groups' sha256 (a JSON list, group order)."""
NODE_CACHE_ENV = "CROSSKD_NODE_CACHE"
"""Environment variable naming the node cache folder (unset or empty: none)."""
NODE_CACHE_BYTES_ENV = "CROSSKD_NODE_CACHE_BYTES"
"""Environment variable bounding the node cache (bytes; unset or empty: no bound)."""
STALE_TEMP_S = 600
"""Seconds after which a node cache's temporary file is taken as left by a killed writer."""
_MAGIC = b"PAR1"
_TAIL = 8
"""A Parquet file ends with the footer's length (4 bytes) and the magic (4 bytes)."""


@dataclass(frozen=True)
class NodeCache:
    """A node-local ``folder`` shared by the processes of one node: each byte range fetched
    from remote storage is kept there once, at most ``max_bytes`` in all (None: no bound; the
    least recently used ranges go first)."""

    folder: str
    max_bytes: int | None = None

    @classmethod
    def from_environment(cls) -> NodeCache | None:
        """The node cache :data:`NODE_CACHE_ENV` and :data:`NODE_CACHE_BYTES_ENV` describe
        (set by the training pod: :mod:`crosskd.k8s.job`), or None."""
        folder = os.environ.get(NODE_CACHE_ENV) or None
        limit = os.environ.get(NODE_CACHE_BYTES_ENV) or None
        if folder is None:
            return None
        if limit is not None and not limit.isdigit():
            raise CrosskdError(
                f"{NODE_CACHE_BYTES_ENV} is {limit!r}; it must be a number of "
                f"bytes (or unset: no bound)."
            )
        return cls(folder, None if limit is None else int(limit))

    def get(self, sha256: str, download) -> bytes:
        """The bytes whose sha256 is ``sha256``, fetched and checked by ``download`` (a
        callable returning them) by the first process of the node that asks."""
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, sha256)
        found = _read_fresh(path)
        if found is not None:
            return found
        with _locked(f"{path}.lock"):
            found = _read_fresh(path)
            if found is not None:
                return found
            payload = download()
            handle, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{sha256}.")
            with os.fdopen(handle, "wb") as f:
                f.write(payload)
            os.replace(tmp, path)
        self._prune(keep=sha256)
        return payload

    def _prune(self, keep: str) -> None:
        """Delete the least recently used ranges (not ``keep``) until the folder holds at most
        ``max_bytes`` of them, and temporary files a killed writer left (older than
        :data:`STALE_TEMP_S`; they count towards the bound until then)."""
        if self.max_bytes is None:
            return
        entries, now = [], time.time()
        with os.scandir(self.folder) as found:
            for entry in found:
                if entry.name.endswith(".lock"):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    stat = entry.stat()
                    if entry.name.startswith(".") and now - stat.st_mtime > STALE_TEMP_S:
                        os.unlink(entry.path)
                        continue
                    entries.append((stat.st_mtime, entry.name, stat.st_size))
        total = sum(size for *_, size in entries)
        for _, name, size in sorted(entries):
            if total <= self.max_bytes:
                break
            if name != keep and not name.startswith("."):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.folder, name))
                total -= size


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """Hold the lock file ``path`` (``flock``), removed on release so that none are left
    behind. A process that waited on a lock file the holder then removed sees that the file at
    ``path`` is no longer the one it locked, and locks again."""
    while True:
        handle = open(path, "a+b")  # noqa: SIM115 (closed below, or by the with block)
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(handle.fileno()).st_ino:
            break
        handle.close()
    with handle:
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _read_fresh(path: str) -> bytes | None:
    """The file at ``path`` (its time refreshed: recently used), or None when it is not there."""
    try:
        with open(path, "rb") as f:
            payload = f.read()
    except FileNotFoundError:
        return None
    with contextlib.suppress(FileNotFoundError):
        os.utime(path)
    return payload


def write_parquet(table, **options) -> bytes:
    """``table`` (a ``pyarrow.Table``) as Parquet bytes, written by ``pyarrow.parquet.write_table``
    with ``options``, its footer recording each row group's sha256 (:data:`DIGESTS`). The
    table is written twice: once to find the groups' bytes, once with their digests (the groups'
    bytes are the same; only the footer differs)."""

    def write(table) -> bytes:
        buffer = io.BytesIO()
        pq.write_table(table, buffer, **options)
        return buffer.getvalue()

    first = write(table)
    offset = len(first) - _footer_size(first)
    bounds = group_bounds(pq.read_metadata(io.BytesIO(first)), offset)
    digests = [hashlib.sha256(first[a:b]).hexdigest() for a, b in itertools.pairwise(bounds)]
    metadata = {**(table.schema.metadata or {}), DIGESTS: json.dumps(digests).encode()}
    payload = write(table.replace_schema_metadata(metadata))
    if payload[:offset] != first[:offset]:
        raise CrosskdError(
            "pyarrow wrote the same table's row groups to different bytes twice; crosskd cannot "
            "record their digests with this pyarrow: install the version the project pins."
        )
    return payload


def footer_record(payload: bytes) -> dict:
    """What a manifest entry records of the Parquet file ``payload`` for ranged reads:
    ``{"footer": {"offset", "bytes", "sha256"}}`` (bytes), or ``{}`` for a file whose footer
    holds no row group digests (one written before :func:`write_parquet`: read whole)."""
    metadata = pq.read_metadata(io.BytesIO(payload)).metadata or {}
    if DIGESTS not in metadata:
        return {}
    size = _footer_size(payload)
    tail = payload[len(payload) - size :]
    return {
        "footer": {
            "offset": len(payload) - size,
            "bytes": size,
            "sha256": hashlib.sha256(tail).hexdigest(),
        }
    }


def _footer_size(payload: bytes) -> int:
    """Bytes of the footer of Parquet ``payload``, its length and magic included."""
    return int.from_bytes(payload[-_TAIL:-4], "little") + _TAIL


def group_bounds(metadata, footer_offset: int) -> list[int]:
    """Byte offsets where each row group of a Parquet file (``metadata``: its
    ``pyarrow.parquet.FileMetaData``) starts, then ``footer_offset``: group ``g`` is bytes
    ``[bounds[g], bounds[g + 1])`` (the first from byte 0, the last up to the footer)."""
    starts = []
    for g in range(metadata.num_row_groups):
        group = metadata.row_group(g)
        starts.append(
            min(
                c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset
                for c in (group.column(i) for i in range(group.num_columns))
            )
        )
    return [0, *starts[1:], footer_offset] if starts else []


@dataclass(frozen=True)
class ArtifactFile:
    """File ``path`` of the artifact at ``uri`` (any fsspec URI), whose damage is reported as
    ``error``: "``what`` ``uri``: ``path`` ... ``rebuild``" (``rebuild``: the sentence saying
    what to do). ``node_cache``: where the processes of a node share the ranges fetched from
    remote storage (None: nowhere)."""

    uri: str
    path: str
    what: str
    error: type[CrosskdError]
    rebuild: str
    node_cache: NodeCache | None = None

    def fetch(
        self,
        start: int | None,
        stop: int | None,
        sha256: str,
        *,
        part: str = "",
        recorder: str = "the manifest",
    ) -> bytes:
        """Bytes ``[start, stop)`` of the file (None, None: all of it), refused unless their
        sha256 is ``sha256``; ``part`` names the range in the message (e.g. "row group 3"),
        ``recorder`` what recorded the digest."""
        fs, root = fsspec.core.url_to_fs(self.uri)

        def download() -> bytes:
            payload = fs.cat_file(f"{root}/{self.path}", start=start, end=stop)
            digest = hashlib.sha256(payload).hexdigest()
            if digest != sha256:
                where = f" {part} (bytes {start}..{stop})" if part else ""
                raise self.error(
                    f"{self.what} {self.uri}: {self.path}{where} has sha256 {digest}, "
                    f"{recorder} says {sha256}; the file changed or is damaged. {self.rebuild}"
                )
            return payload

        if self.node_cache is None or isinstance(fs, LocalFileSystem):
            return download()
        return self.node_cache.get(sha256, download)


def open_parquet(file: ArtifactFile, entry: dict) -> bytes | RangedParquet:
    """The Parquet file of manifest ``entry`` (``path``, ``sha256``, and ``footer`` when it was
    written by :func:`write_parquet`): a :class:`RangedParquet` when the entry records its
    footer, else the whole file's bytes, checked against ``sha256``."""
    if "footer" in entry:
        return RangedParquet(file, entry["footer"])
    return file.fetch(None, None, entry["sha256"])


class RangedParquet:
    """A Parquet file written by :func:`write_parquet`, read by checked byte ranges: its
    footer when opened (``footer``: its manifest record), a row group when it is read. Reads
    like a ``pyarrow.parquet.ParquetFile``: ``metadata``, :meth:`read_row_group`."""

    def __init__(self, file: ArtifactFile, footer: dict) -> None:
        self.file = file
        offset, size = int(footer["offset"]), int(footer["bytes"])
        tail = file.fetch(offset, offset + size, footer["sha256"], part="footer")
        self.metadata = pq.read_metadata(io.BytesIO(_MAGIC + tail))
        self.bounds = group_bounds(self.metadata, offset)
        self.digests = json.loads((self.metadata.metadata or {}).get(DIGESTS, b"null"))
        if not isinstance(self.digests, list) or len(self.digests) != len(self.bounds) - 1:
            raise file.error(
                f"{file.what} {file.uri}: {file.path}'s footer records no sha256 for each of "
                f"its {self.metadata.num_row_groups} row groups (another writer?). "
                f"{file.rebuild}"
            )
        self._held = _Held(offset + size, f"{file.uri}/{file.path}")
        self._parquet = pq.ParquetFile(self._held, metadata=self.metadata)
        self._fetched: dict[int, bytes] = {}

    def read_row_group(self, index: int):
        """Row group ``index`` as a ``pyarrow.Table``, its bytes fetched and checked the first
        time it is read and kept while this object lives (memory: at most the compressed file,
        as a whole read; rows read in any order fetch each group once)."""
        start, stop = self.bounds[index], self.bounds[index + 1]
        if index not in self._fetched:
            self._fetched[index] = self.file.fetch(
                start, stop, self.digests[index], part=f"row group {index}", recorder="its footer"
            )
        self._held.start, self._held.data = start, self._fetched[index]
        try:
            return self._parquet.read_row_group(index)
        finally:
            self._held.data = b""


class _Held(io.RawIOBase):
    """A file of ``size`` bytes of which one range (``data`` from ``start``) is held: pyarrow
    reads a row group through it; a read elsewhere is a bug in the ranges, reported as such."""

    def __init__(self, size: int, name: str) -> None:
        super().__init__()
        self.size, self.name = size, name
        self.start, self.data, self.position = 0, b"", 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = base + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def read(self, size: int = -1) -> bytes:
        stop = self.size if size < 0 else min(self.position + size, self.size)
        if not self.start <= self.position <= stop <= self.start + len(self.data):
            raise OSError(
                f"{self.name}: pyarrow read bytes {self.position}..{stop}, outside the row group "
                f"fetched ({self.start}..{self.start + len(self.data)}): a crosskd bug."
            )
        out = self.data[self.position - self.start : stop - self.start]
        self.position = stop
        return out
