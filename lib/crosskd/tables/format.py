"""The sub-token table file: one direction ``src -> dst`` in safetensors (spec section 3).

Tensors: ``offsets`` int64 ``[V_src + 1]`` (CSR row pointers), ``chains`` int32
``[sum of chain lengths]`` (dst ids), ``flags`` uint8 ``[V_src]`` (:class:`Flag`). The chain of
src id ``i`` is ``chains[offsets[i]:offsets[i + 1]]``: the dst ids whose concatenated bytes are
bytes(i). Metadata (:class:`TableMeta`): format and builder versions, both names, fingerprints,
``len(tokenizer)``, ``V`` and the special-token roles of both sides.

Files are never pickled and never unpickled: a file that is not safetensors is refused before
anything is parsed. Writes go to a temporary name and are published by rename, so a killed
writer never leaves a file that looks complete.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import struct
import uuid
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from typing import TYPE_CHECKING, TypeVar

import fsspec
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load, save

from crosskd.errors import TableError

if TYPE_CHECKING:
    from crosskd.tokenization import LoadedTokenizer

FORMAT_VERSION = 1
BUILDER_VERSION = "crosskd-tables-1"
M = TypeVar("M")
TENSOR_NAMES = ("offsets", "chains", "flags")
PICKLE_MAGIC = (b"\x80", b"PK\x03\x04")  # pickle protocol 2+, torch.save's zip container


class Flag(enum.IntEnum):
    """What a table row is."""

    NORMAL = 0
    SPECIAL_MAPPED = 1
    SPECIAL_UNMAPPED = 2
    PADDING = 3
    UNREPRESENTABLE = 4


@dataclass(frozen=True)
class TableMeta:
    """The metadata every table file carries."""

    src_name: str
    dst_name: str
    src_fingerprint: str
    dst_fingerprint: str
    src_len: int
    dst_len: int
    src_vocab_size: int
    dst_vocab_size: int
    src_roles: str
    dst_roles: str
    format_version: int = FORMAT_VERSION
    builder_version: str = BUILDER_VERSION

    def to_metadata(self) -> dict[str, str]:
        """The safetensors ``__metadata__`` (all values strings)."""
        return {key: str(value) for key, value in asdict(self).items()}

    @classmethod
    def from_metadata(cls, metadata: dict[str, str] | None, where: str) -> TableMeta:
        """Parse and check the metadata of the file at ``where``."""
        return parse_metadata(
            cls, metadata, f"table {where}", "Rebuild it with `crosskd tables build`."
        )


def parse_metadata(cls: type[M], metadata: dict[str, str] | None, what: str, fix: str) -> M:
    """The metadata dataclass ``cls`` of a file's ``__metadata__`` (string values; its ``int``
    fields parsed), refused with a :class:`TableError` that names the file (``what``, e.g.
    ``table s3://...``) and ends with ``fix`` when a field is missing or damaged, or when its
    ``format_version`` is not ``cls``'s default."""
    metadata = metadata or {}
    missing = [f.name for f in fields(cls) if f.name not in metadata]
    if missing:
        raise TableError(
            f"{what}: metadata lacks {', '.join(missing)}; it was not written by crosskd. {fix}"
        )
    values: dict[str, object] = {}
    for f in fields(cls):
        raw = metadata[f.name]
        if f.type in ("int", int):
            try:
                values[f.name] = int(raw)
            except ValueError:
                raise TableError(
                    f"{what}: metadata field {f.name!r} is {raw!r}, not an integer; the file is "
                    f"damaged. {fix}"
                ) from None
        else:
            values[f.name] = raw
    meta = cls(**values)
    version = next(f.default for f in fields(cls) if f.name == "format_version")
    if meta.format_version != version:
        raise TableError(
            f"{what}: format version {meta.format_version}, this crosskd reads version "
            f"{version}. {fix}"
        )
    return meta


def roles_json(tok: LoadedTokenizer) -> str:
    """The role of every special of ``tok`` as canonical JSON (``{"id": "role"}``), recorded
    in tables so that a validator with other role choices (overrides) notices."""
    return json.dumps({str(i): r for i, r in sorted(tok.roles.items())}, separators=(",", ":"))


@dataclass(frozen=True, eq=False)
class SubTokenTable:
    """One direction ``src -> dst`` of a table pair (shapes in the module docstring)."""

    offsets: np.ndarray
    chains: np.ndarray
    flags: np.ndarray
    meta: TableMeta
    source: str = "<memory>"

    def chain(self, src_id: int) -> np.ndarray:
        """The dst ids for ``src_id`` (int32; empty unless the row is mapped)."""
        return self.chains[self.offsets[src_id] : self.offsets[src_id + 1]]

    @cached_property
    def lengths(self) -> np.ndarray:
        """Chain length of every src id, int64 ``[V_src]``."""
        return np.diff(self.offsets)

    def flag_counts(self) -> dict[str, int]:
        """Number of rows per flag, by flag name (lower case)."""
        counts = np.bincount(self.flags, minlength=len(Flag))
        return {flag.name.lower(): int(counts[flag]) for flag in Flag}

    def length_histogram(self) -> dict[int, int]:
        """Chain length -> number of rows, over rows with a non-empty chain."""
        lengths = self.lengths[self.lengths > 0]
        values, counts = np.unique(lengths, return_counts=True)
        return {int(v): int(c) for v, c in zip(values, counts, strict=True)}


def save_table(table: SubTokenTable, uri: str) -> SubTokenTable:
    """Write ``table`` to a local path or fsspec URI (temporary name, then rename); returns the
    table with ``source`` set to ``uri``."""
    payload = save(
        {"offsets": table.offsets, "chains": table.chains, "flags": table.flags},
        metadata=table.meta.to_metadata(),
    )
    fs, path = fsspec.core.url_to_fs(uri)
    parent = os.path.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open(tmp, "wb") as fh:
        fh.write(payload)
    try:
        fs.mv(tmp, path)
    except Exception:
        fs.rm(tmp)
        raise
    return dataclasses.replace(table, source=uri)


def load_table(uri: str) -> SubTokenTable:
    """Read a table from a local path or fsspec URI, checking structure but not semantics.

    Refuses (with :class:`TableError`) a missing file, a pickle/``torch.save`` file (never
    loaded), a truncated or non-safetensors file, missing tensors, wrong dtypes or shapes, and
    non-monotone offsets. Semantic checks against tokenizers are :mod:`crosskd.tables.validate`.
    """
    fs, path = fsspec.core.url_to_fs(uri)
    if not fs.exists(path):
        raise TableError(f"table {uri}: no such file; build it with `crosskd tables build`.")
    with fs.open(path, "rb") as fh:
        payload = fh.read()
    try:
        metadata = read_metadata(payload)
        tensors = load(payload)
    except (SafetensorError, ValueError) as exc:
        if payload.startswith(PICKLE_MAGIC):
            raise TableError(
                f"table {uri}: this is a pickle or torch.save file; crosskd never unpickles (it "
                f"can run arbitrary code). Tables are safetensors: rebuild with `crosskd tables "
                f"build`."
            ) from None
        raise TableError(
            f"table {uri}: not a readable safetensors file ({exc}); it may be truncated or "
            f"another format. Rebuild it with `crosskd tables build`."
        ) from exc
    meta = TableMeta.from_metadata(metadata, uri)
    table = SubTokenTable(
        offsets=tensors.get("offsets"),
        chains=tensors.get("chains"),
        flags=tensors.get("flags"),
        meta=meta,
        source=uri,
    )
    check_structure(table)
    return table


def read_metadata(payload: bytes) -> dict[str, str] | None:
    """The ``__metadata__`` of a safetensors payload (the JSON header after its u64 length)."""
    if len(payload) < 8:
        raise ValueError("file shorter than the 8-byte header length")
    (header_len,) = struct.unpack("<Q", payload[:8])
    if header_len > len(payload) - 8:
        raise ValueError(f"header of {header_len} bytes in a file of {len(payload)} bytes")
    header = json.loads(payload[8 : 8 + header_len])
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header.get("__metadata__")


def check_structure(table: SubTokenTable) -> None:
    """Tensors present with the right dtypes and shapes; offsets a valid CSR pointer array."""
    where = f"table {table.source}"
    expected = {"offsets": np.int64, "chains": np.int32, "flags": np.uint8}
    for name, dtype in expected.items():
        value = getattr(table, name)
        if value is None:
            raise TableError(f"{where}: tensor {name!r} is missing. Rebuild the table.")
        if value.dtype != dtype or value.ndim != 1:
            raise TableError(
                f"{where}: tensor {name!r} is {value.dtype}{list(value.shape)}, expected 1-D "
                f"{np.dtype(dtype)}. Rebuild the table."
            )
    v_src = table.meta.src_vocab_size
    if len(table.flags) != v_src or len(table.offsets) != v_src + 1:
        raise TableError(
            f"{where}: {len(table.flags)} flags and {len(table.offsets)} offsets for a source "
            f"vocabulary of {v_src} rows (expected {v_src} and {v_src + 1}). Rebuild the table."
        )
    offsets = table.offsets
    if offsets[0] != 0 or offsets[-1] != len(table.chains):
        raise TableError(
            f"{where}: offsets run from {offsets[0]} to {offsets[-1]}, expected 0 to the "
            f"{len(table.chains)} chain entries. Rebuild the table."
        )
    if np.any(np.diff(offsets) < 0):
        bad = np.flatnonzero(np.diff(offsets) < 0)[:5].tolist()
        raise TableError(
            f"{where}: offsets decrease at rows {bad} (they must not). Rebuild the table."
        )
    v_dst = table.meta.dst_vocab_size
    outside = (table.chains < 0) | (table.chains >= v_dst)
    if outside.any():
        rows = np.unique(np.searchsorted(offsets, np.flatnonzero(outside), side="right") - 1)
        raise TableError(
            f"{where}: {rows.size} rows have chain ids outside [0, {v_dst}) (first rows: "
            f"{rows[:5].tolist()}). Rebuild the table."
        )
    if table.flags.size and int(table.flags.max()) >= len(Flag):
        bad = np.flatnonzero(table.flags >= len(Flag))[:5].tolist()
        raise TableError(f"{where}: unknown flag values at rows {bad}. Rebuild the table.")
