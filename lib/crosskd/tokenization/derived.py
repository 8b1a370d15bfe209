"""What loading a tokenizer derives from its files, kept on disk by the files' digest.

Loading a tokenizer through ``transformers`` (its import, then ``from_pretrained``, which parses
``tokenizer.json`` in Python before the Rust tokenizer parses it again), parsing its backend JSON
(megabytes: the vocabulary and the merges), hashing the canonical JSON for the fingerprint and
building the byte view of every id take a few seconds a tokenizer, paid again by every process
that loads it (each pipeline step, each data worker). :func:`derive` computes these once per set
of tokenizer files, together with the backend tokenizer's JSON as ``transformers`` configured it
(its post-processor, its added tokens) and the few facts read from the ``transformers`` object,
so a later load builds the Rust tokenizer from that JSON and needs ``transformers`` only for a
chat template or saving. It keeps them under
``<cache>/tokenizers/<key>.npz``, where the key is the sha256 of the files' contents together with
the versions of ``transformers`` and ``tokenizers`` (which build the tokenizer object from the
files) and the source of the code that derives it. A changed file, another library version,
changed code or a tokenizer loaded with ``trust_remote_code`` (whose code can change anything)
is derived afresh; an entry that is cut short or damaged is derived and written again. A cache
that cannot be written (a read-only home in a pod) only costs the time.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import numpy as np
from fsspec.implementations.local import LocalFileSystem
from tokenizers import Tokenizer

from crosskd.artifacts import write_whole

log = logging.getLogger(__name__)

_CODE = ("__init__.py", "byte_level.py", "derived.py")
"""The modules of :mod:`crosskd.tokenization` that compute and store an entry: their source is
part of the key, so changed code never reads what older code derived."""


@dataclass(frozen=True, eq=False)
class Derived:
    """What :func:`~crosskd.tokenization.load_tokenizer` derives from a tokenizer's files.

    ``skeleton``: the backend's JSON with the model's ``vocab`` and ``merges`` left out (the
    components the support check and the loaders read). ``backend``: the Rust tokenizer as
    ``transformers`` configured it (stored as its JSON, from which a read builds it again).
    ``length``: ``len()`` of the ``transformers`` tokenizer; ``special_ids``: its ``bos``,
    ``eos``, ``unk`` and ``pad`` token ids (None where unset); ``strips_content``: whether its
    chat template strips message content. ``data`` (uint8), ``offsets``
    (int64, one more than ``kind``), ``kind`` (uint8): the byte view of ids ``[0, max id]``
    (:class:`~crosskd.tokenization.byte_level.ByteVocab`'s arrays before padding rows are
    added).
    """

    fingerprint: str
    skeleton: dict
    backend: Tokenizer
    length: int
    special_ids: dict[str, int | None]
    strips_content: bool
    data: np.ndarray
    offsets: np.ndarray
    kind: np.ndarray


def source_key(files: Sequence[Path]) -> str:
    """The cache key of a tokenizer built from ``files``: hex sha256 over their names (relative
    to their common folder) and contents, the ``transformers`` and ``tokenizers`` versions and
    the source of the code that derives an entry (:data:`_CODE`)."""
    digest = hashlib.sha256(
        f"transformers-{version('transformers')} tokenizers-{version('tokenizers')}".encode()
    )
    here = Path(__file__).parent
    for name in _CODE:
        digest.update(f"\0code/{name}\0".encode() + (here / name).read_bytes())
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
    """The entry ``key`` of ``cache_dir`` (``<cache_dir>/tokenizers/<key>.npz``), or
    ``compute()``, stored there when the entry is missing or unreadable (``key`` None: no cache,
    computed every time). ``name`` is the tokenizer's reference, for the log."""
    if key is None:
        return compute()
    path = cache_dir / "tokenizers" / f"{key}.npz"
    cached = _read(path)
    if cached is not None:
        return cached
    derived = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(LocalFileSystem(), str(path), _encode(derived))
    except OSError as err:
        log.info("tokenizer %s: cannot keep what loading it derives in %s (%s)", name, path, err)
    return derived


def _encode(derived: Derived) -> bytes:
    """The entry's file: the three arrays, the backend's JSON (UTF-8 bytes) and the JSON of the
    rest, as one ``.npz``."""
    meta = json.dumps(
        {
            "fingerprint": derived.fingerprint,
            "skeleton": derived.skeleton,
            "length": derived.length,
            "special_ids": derived.special_ids,
            "strips_content": derived.strips_content,
        }
    )
    buffer = io.BytesIO()
    np.savez(
        buffer,
        data=derived.data,
        offsets=derived.offsets,
        kind=derived.kind,
        backend=np.frombuffer(derived.backend.to_str().encode("utf-8"), dtype=np.uint8),
        meta=np.frombuffer(meta.encode("utf-8"), dtype=np.uint8),
    )
    return buffer.getvalue()


def _read(path: Path) -> Derived | None:
    """The entry at ``path`` if it is there, whole and consistent; else None (it is then derived
    and written again: a file cut short by a crash, or damaged, is never used)."""
    try:
        with np.load(path, allow_pickle=False) as arrays:
            data, offsets, kind, backend, meta = (
                arrays[k] for k in ("data", "offsets", "kind", "backend", "meta")
            )
        fields = json.loads(meta.tobytes().decode("utf-8"))
        fingerprint, skeleton = fields["fingerprint"], fields["skeleton"]
        length, special_ids = fields["length"], fields["special_ids"]
        strips_content = fields["strips_content"]
        backend_json = backend.tobytes().decode("utf-8")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as err:
        log.info("tokenizer cache entry %s is unreadable (%s); deriving it again", path, err)
        return None
    consistent = (
        data.dtype == np.uint8
        and kind.dtype == np.uint8
        and offsets.dtype == np.int64
        and offsets.shape == (len(kind) + 1,)
        and offsets[0] == 0
        and offsets[-1] == len(data)
        and bool(np.all(np.diff(offsets) >= 0))
        and isinstance(fingerprint, str)
        and isinstance(skeleton, dict)
        and isinstance(length, int)
        and isinstance(special_ids, dict)
        and isinstance(strips_content, bool)
        and all(v is None or isinstance(v, int) for v in special_ids.values())
    )
    if not consistent:
        log.info("tokenizer cache entry %s is inconsistent; deriving it again", path)
        return None
    try:
        tokenizer = Tokenizer.from_str(backend_json)
    except Exception as err:  # tokenizers raises a bare Exception on JSON it cannot build
        log.info("tokenizer cache entry %s holds no tokenizer (%s); deriving it again", path, err)
        return None
    return Derived(
        fingerprint, skeleton, tokenizer, length, special_ids, strips_content, data, offsets, kind
    )
