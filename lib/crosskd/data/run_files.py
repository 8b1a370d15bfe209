"""The bookkeeping files of a streaming prepare under its output's ``_prepare/`` folder, which
the splits that write shards (:mod:`crosskd.data.prepare`) and the merge that writes the
manifest (:mod:`crosskd.data.merge`) both read: the run's settings, one record per written
shard, one marker per finished split, and the 64-bit id hashes the merge checks for repeats."""

from __future__ import annotations

import hashlib
import json

import fsspec

RUN = "_prepare/run.json"
"""The run's settings (what every split and every resume must share)."""
SHARDS = "_prepare/shards"
"""One record per written shard (``part-NNNNNN.parquet.json``), written after the shard."""
SPLITS = "_prepare/splits"
"""One record per split that has read the whole input (``I-of-N.json``)."""


def shard_name(window: int) -> str:
    """The shard of input window ``window``: ``part-NNNNNN.parquet`` (names sort in input
    order whichever split wrote them)."""
    return f"part-{window:06d}.parquet"


def read_shard_record(fs: fsspec.AbstractFileSystem, root: str, window: int) -> dict | None:
    """The record of window ``window``'s shard (written after the shard), or None."""
    path = f"{root}/{SHARDS}/{shard_name(window)}.json"
    return json.loads(fs.cat_file(path)) if fs.exists(path) else None


def id_hash(sample_id: str) -> int:
    """A sample id as a 64-bit number (the first 8 bytes of its sha256, little-endian): the
    merge finds repeated ids among these and confirms them on the ids themselves."""
    return int.from_bytes(hashlib.sha256(sample_id.encode("utf-8")).digest()[:8], "little")
