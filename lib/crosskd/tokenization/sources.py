"""Where tokenizers come from: a folder, a ``tokenizer.json``, ``zoo:NAME``, an fsspec URI
(copied to a local cache) or a Hugging Face id already in the local cache. Nothing is
downloaded from a hub.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import fsspec
from huggingface_hub import try_to_load_from_cache

from crosskd.config import default_cache_dir
from crosskd.errors import TokenizerError
from crosskd.zoo import zoo_tokenizer_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Source:
    """A tokenizer's files on this machine: ``path`` is a folder with a ``tokenizer.json`` or a
    ``tokenizer.json`` itself, ``folder`` the folder they are in (a ``config.json`` there gives
    the model's vocabulary size), ``files`` the files the tokenizer is built from (None with
    ``trust_remote_code``: its code may read anything)."""

    path: Path
    folder: Path
    files: list[Path] | None


def locate(ref: str, *, trust_remote_code: bool, cache_dir: str | os.PathLike | None) -> Source:
    """Where the tokenizer ``ref`` (a folder, a ``tokenizer.json``, ``zoo:NAME``, an fsspec URI
    or a Hugging Face id in the local cache) is on this machine, copying a URI into the cache
    first; refused with a :class:`~crosskd.errors.TokenizerError` when it holds no
    ``tokenizer.json``."""
    if ref.startswith("zoo:"):
        ref = str(zoo_tokenizer_dir(ref[len("zoo:") :], cache_dir=cache_dir))
    elif "://" in ref and not ref.startswith("file://"):
        ref = str(_fetch_uri(ref, Path(cache_dir) if cache_dir else default_cache_dir()))
    elif ref.startswith("file://"):
        ref = ref[len("file://") :]
    path = Path(ref)
    if path.is_file():
        if path.suffix != ".json":
            raise TokenizerError(
                f"tokenizer {ref!r} is a file but not a tokenizer.json; pass the folder that "
                f"holds tokenizer.json, or the tokenizer.json itself."
            )
        return Source(path, path.parent, [path])
    if not path.is_dir():
        path = _hub_folder(ref)
    if not (path / "tokenizer.json").is_file():
        raise TokenizerError(
            f"tokenizer folder {str(path)!r} has no tokenizer.json; crosskd reads fast tokenizers "
            f"only. Load it with transformers and `save_pretrained` it to get one, or pass a "
            f"folder that has it."
        )
    if trust_remote_code:
        return Source(path, path, None)
    names = sorted(TOKENIZER_FILES | SLOW_TOKENIZER_FILES)
    files = [path / name for name in names if (path / name).is_file()]
    templates = path / "additional_chat_templates"
    if templates.is_dir():
        files += sorted(p for p in templates.iterdir() if p.is_file())
    return Source(path, path, files)


def load_hf(source: Source, *, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    """The ``transformers`` tokenizer of ``source`` (never downloads)."""
    # lazy: transformers costs seconds and imports torch; a tokenizer whose derived entry is in
    # the cache encodes without it (crosskd.tokenization), so only a first load, a chat template
    # or saving a tokenizer pays for it
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if source.path.is_file():
        return PreTrainedTokenizerFast(tokenizer_file=str(source.path))
    return AutoTokenizer.from_pretrained(
        str(source.path), local_files_only=True, trust_remote_code=trust_remote_code
    )


def _hub_folder(repo_id: str) -> Path:
    """The snapshot folder of a Hugging Face id in the local cache (never downloads)."""
    try:
        found = try_to_load_from_cache(repo_id, "tokenizer.json")
    except ValueError as exc:  # not a valid repo id either
        found, cause = None, f" ({exc})"
    else:
        cause = ""
    if not isinstance(found, str):
        raise TokenizerError(
            f"tokenizer {repo_id!r} is not a local path, a zoo:NAME, an fsspec URI, or a Hugging "
            f"Face id with a tokenizer.json in the local cache{cause}; crosskd never downloads "
            f"from a hub at run time. Download it first (`huggingface-cli download {repo_id}`) "
            f"or pass its folder."
        )
    return Path(found).parent


TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "chat_template.jinja",
        "chat_template.json",
        "config.json",
    }
)
"""The files of a folder that ``transformers`` builds a fast tokenizer from (``config.json`` can
name its class): what is copied from a remote folder (model weights next to them are not), and,
with every file of ``additional_chat_templates/``, what a loaded tokenizer's cache key covers."""

SLOW_TOKENIZER_FILES = frozenset({"tokenizer.model", "vocab.json", "merges.txt"})
"""A slow tokenizer's files, which ``transformers`` reads beside ``tokenizer.json`` when it
converts one (``from_slow``, a Llama tokenizer's ``add_prefix_space``): part of the cache key of
a folder that holds them."""

_VERSION_KEYS = ("size", "ETag", "etag", "mtime", "LastModified", "created", "md5Hash")


def _fetch_uri(uri: str, cache_dir: Path) -> Path:
    """Copy a tokenizer.json, or the :data:`TOKENIZER_FILES` of a folder, at an fsspec URI into
    the cache (atomically).

    The copy is keyed by the URI and each file's name, size and version stamp (ETag, mtime...),
    so a changed remote tokenizer is copied again instead of read stale from the cache.
    """
    fs, path = fsspec.core.url_to_fs(uri)
    if not fs.exists(path):
        raise TokenizerError(f"tokenizer {uri!r} does not exist; check the URI and credentials.")
    is_dir = fs.isdir(path)
    entries = (
        [
            e
            for e in fs.ls(path, detail=True)
            if e.get("type") == "file" and Path(e["name"]).name in TOKENIZER_FILES
        ]
        if is_dir
        else [fs.info(path)]
    )
    if is_dir and "tokenizer.json" not in {Path(e["name"]).name for e in entries}:
        raise TokenizerError(
            f"tokenizer folder {uri!r} has no tokenizer.json; crosskd reads fast tokenizers "
            f"only. Upload the tokenizer.json that `save_pretrained` writes, or pass another URI."
        )
    names = [Path(e["name"]).name if is_dir else "tokenizer.json" for e in entries]
    target = copy_to_cache(fs, uri, entries, names, cache_dir / "uris")
    return target if is_dir else target / "tokenizer.json"


def copy_to_cache(fs: Any, uri: str, entries: list[dict], names: list[str], parent: Path) -> Path:
    """Copy the files ``entries`` (``fs.ls(detail=True)`` / ``fs.info`` records) of ``uri`` into
    a folder under ``parent``, under ``names``, once: the folder is keyed by the URI and each
    file's name, size and version stamp (ETag, mtime...), so a changed remote file is copied
    again instead of read stale, and it is published with one atomic rename."""
    stamp = [[Path(e["name"]).name, {k: e[k] for k in _VERSION_KEYS if k in e}] for e in entries]
    key = json.dumps([uri, sorted(stamp)], sort_keys=True, default=str)
    target = parent / hashlib.sha256(key.encode("utf-8")).hexdigest()[:20]
    if not target.is_dir():
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
        try:
            for entry, name in zip(entries, names, strict=True):
                fs.get(entry["name"], str(tmp / name))
            os.replace(tmp, target)
            log.info("copied %s to %s", uri, target)
        except OSError:
            if not target.is_dir():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
