"""Where the steps write: content-addressed prefixes for pure steps, a run folder for the rest,
and fingerprints of input files."""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from crosskd import __version__
from crosskd.artifacts import write_whole
from crosskd.errors import ConfigError

log = logging.getLogger(__name__)

COMPLETE = ".complete"
"""Written last into a folder :func:`materialize` publishes: its presence means complete."""


def content_uri(root: str, kind: str, key: Mapping[str, Any]) -> str:
    """``<root>/<kind>/<20 hex of sha256(key as sorted JSON)>``: the same key (input
    fingerprints and the options that change the output) gives the same URI on every run."""
    blob = json.dumps(
        {"key": key, "format": __version__.split(".")[0]}, sort_keys=True, default=str
    )
    return f"{root.rstrip('/')}/{kind}/{hashlib.sha256(blob.encode()).hexdigest()[:20]}"


def run_folder(root: str, run_id: str) -> str:
    """The folder of one pipeline run's own outputs: ``<root>/runs/<run_id>``."""
    if not run_id or "/" in run_id:
        raise ConfigError(f"run id {run_id!r}: it must be a non-empty name without '/'.")
    return f"{root.rstrip('/')}/runs/{run_id}"


def is_local(uri: str) -> bool:
    """Whether ``uri`` is a path on this machine's filesystem."""
    return isinstance(fsspec.core.url_to_fs(uri)[0], LocalFileSystem)


def exists(uri: str) -> bool:
    """Whether a file or folder exists at ``uri``."""
    fs, path = fsspec.core.url_to_fs(uri)
    return fs.exists(path)


def materialize(uri: str, build: Callable[[Path], None]) -> str:
    """Publish the folder that ``build(folder)`` writes at ``uri`` once: returns at once when
    ``uri`` holds a complete one (its :data:`COMPLETE` marker); otherwise builds into a
    temporary local folder, copies it to ``uri`` and writes the marker last."""
    fs, root = fsspec.core.url_to_fs(uri)
    if fs.exists(f"{root}/{COMPLETE}"):
        return uri
    with tempfile.TemporaryDirectory(prefix="crosskd-build-") as tmp:
        folder = Path(tmp) / "out"
        folder.mkdir()
        build(folder)
        fs.makedirs(root, exist_ok=True)
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            target = f"{root}/{path.relative_to(folder).as_posix()}"
            if isinstance(fs, LocalFileSystem):
                fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
            fs.put_file(str(path), target)
    fs.pipe_file(f"{root}/{COMPLETE}", b"")
    log.info("published %s", uri)
    return uri


def data_fingerprint(uri: str) -> str:
    """sha256 over the name and content sha256 of every file of the data at ``uri`` (a file, a
    folder or a glob; hidden files skipped)."""
    fs, path = fsspec.core.url_to_fs(uri)
    if fs.isdir(path):
        files = sorted(p for p in fs.find(path) if not Path(p).name.startswith("."))
    elif fs.exists(path):
        files = [path]
    else:
        files = sorted(fs.glob(path))
    if not files:
        raise ConfigError(
            f"data {uri}: no such file, folder or glob; check the URI (and the "
            f"S3 credentials in the environment)."
        )
    digest = hashlib.sha256()
    for name in files:
        file_hash = hashlib.sha256()
        with fs.open(name, "rb") as fh:
            for block in iter(lambda fh=fh: fh.read(1 << 22), b""):
                file_hash.update(block)
        digest.update(Path(name).name.encode() + b"\0" + file_hash.digest())
    return digest.hexdigest()


def write_json(uri: str, value: Any) -> None:
    """Write ``value`` as JSON at ``uri`` (parents created), whole or not at all
    (:func:`crosskd.artifacts.write_whole`): a write that fails part way (a full disk, a kill)
    leaves the file that was there."""
    fs, path = fsspec.core.url_to_fs(uri)
    if "/" in path:
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    write_whole(fs, path, json.dumps(value, indent=1, default=str).encode("utf-8"))


def read_json(uri: str) -> Any:
    """The JSON value at ``uri``."""
    fs, path = fsspec.core.url_to_fs(uri)
    return json.loads(fs.cat_file(path))
