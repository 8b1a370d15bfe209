"""What loading a tokenizer derives from its files, kept on disk by the files' digest.

Loading a tokenizer parses its backend JSON (megabytes: the vocabulary and the merges), hashes
the canonical JSON for the fingerprint and builds the byte view of every id: about a second a
tokenizer, paid again by every process that loads it (each pipeline step, each data worker).
:func:`derive` computes these once per set of tokenizer files and keeps them under
``<cache>/tokenizers/<key>``, where the key is the sha256 of the files' contents together with
the versions of ``transformers`` and ``tokenizers`` (which build the tokenizer object from the
files) and :data:`FORMAT`. A changed file, another library version or a tokenizer loaded with
``trust_remote_code`` (whose code can change anything) is derived afresh. A cache that cannot be
written (a read-only home in a pod) only costs the time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

FORMAT = 1
"""The layout of a cached entry; part of the key, so a new layout never reads an old entry."""
_ARRAYS = ("data", "offsets", "kind")


@dataclass(frozen=True)
class Derived:
    """What :func:`~crosskd.tokenization.load_tokenizer` derives from a tokenizer's files.

    ``skeleton``: the backend's JSON with the model's ``vocab`` and ``merges`` left out (the
    components the support check and the loaders read). ``data``, ``offsets``, ``kind``: the
    byte view of ids ``[0, max id]`` (:class:`~crosskd.tokenization.byte_level.ByteVocab`'s
    arrays before padding rows are added).
    """

    fingerprint: str
    skeleton: dict
    data: np.ndarray
    offsets: np.ndarray
    kind: np.ndarray


def source_key(files: Sequence[Path]) -> str:
    """The cache key of a tokenizer built from ``files`` (hex sha256 over their names and
    contents, the library versions and :data:`FORMAT`)."""
    digest = hashlib.sha256(
        f"crosskd-tokenizer-{FORMAT} transformers-{version('transformers')} "
        f"tokenizers-{version('tokenizers')}".encode()
    )
    root = Path(os.path.commonpath([path.parent for path in files])) if files else Path()
    for name, path in sorted((path.relative_to(root).as_posix(), path) for path in files):
        digest.update(f"\0{name}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def derive(
    key: str | None, cache_dir: Path, compute: Callable[[], Derived], *, name: str
) -> Derived:
    """The entry ``key`` of ``cache_dir``, or ``compute()`` stored under it (``key`` None: no
    cache, computed every time). ``name`` is the tokenizer's reference, for the log."""
    if key is None:
        return compute()
    folder = cache_dir / "tokenizers" / key
    cached = _read(folder)
    if cached is not None:
        return cached
    shutil.rmtree(folder, ignore_errors=True)  # an entry someone cut short is written again
    derived = compute()
    try:
        _write(folder, derived)
    except OSError as err:
        log.info("tokenizer %s: cannot keep what loading it derives in %s (%s)", name, folder, err)
    return derived


def _read(folder: Path) -> Derived | None:
    """A complete entry, or None (absent, or unreadable: it is then written again)."""
    try:
        meta = json.loads((folder / "derived.json").read_text(encoding="utf-8"))
        with np.load(folder / "bytes.npz", allow_pickle=False) as arrays:
            data, offsets, kind = (arrays[name] for name in _ARRAYS)
    except (OSError, ValueError, KeyError):
        return None
    return Derived(meta["fingerprint"], meta["skeleton"], data, offsets, kind)


def _write(folder: Path, derived: Derived) -> None:
    """Write the entry whole or not at all: into a temporary folder beside it, then renamed (a
    concurrent writer of the same key wrote the same content, so losing the rename is fine)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        meta = {"fingerprint": derived.fingerprint, "skeleton": derived.skeleton}
        (staging / "derived.json").write_text(json.dumps(meta), encoding="utf-8")
        np.savez(staging / "bytes.npz", **{name: getattr(derived, name) for name in _ARRAYS})
        os.rename(staging, folder)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / "derived.json").is_file():
            raise
