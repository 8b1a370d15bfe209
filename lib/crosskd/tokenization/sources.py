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
from pathlib import Path
from typing import TYPE_CHECKING

from crosskd.errors import TokenizerError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """``$CROSSKD_CACHE_DIR`` or ``~/.cache/crosskd``."""
    return Path(os.environ.get("CROSSKD_CACHE_DIR") or Path.home() / ".cache" / "crosskd")


def load_hf(
    ref: str, *, trust_remote_code: bool, cache_dir: str | os.PathLike | None
) -> tuple[PreTrainedTokenizerBase, Path | None]:
    """Returns the transformers tokenizer and the local folder it came from (if any)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if ref.startswith("zoo:"):
        from crosskd.zoo import zoo_tokenizer_dir

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
        return PreTrainedTokenizerFast(tokenizer_file=str(path)), path.parent
    if path.is_dir():
        if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            raise TokenizerError(
                f"tokenizer folder {ref!r} has no tokenizer.json or tokenizer_config.json."
            )
        tok = AutoTokenizer.from_pretrained(
            str(path), local_files_only=True, trust_remote_code=trust_remote_code
        )
        return tok, path
    try:
        tok = AutoTokenizer.from_pretrained(
            ref, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as exc:
        raise TokenizerError(
            f"tokenizer {ref!r} is not a local path, a zoo:NAME, an fsspec URI, or a Hugging Face "
            f"id in the local cache (crosskd never downloads from a hub at run time); download "
            f"it first (`huggingface-cli download {ref}`) or pass its folder. Cause: {exc}"
        ) from exc
    return tok, _hub_folder(ref)


def _hub_folder(repo_id: str) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json")
    return Path(found).parent if isinstance(found, str) else None


_VERSION_KEYS = ("size", "ETag", "etag", "mtime", "LastModified", "created", "md5Hash")


def _fetch_uri(uri: str, cache_dir: Path) -> Path:
    """Copy a tokenizer folder or tokenizer.json at an fsspec URI into the cache (atomically).

    The copy is keyed by the URI and each file's name, size and version stamp (ETag, mtime...),
    so a changed remote tokenizer is copied again instead of read stale from the cache.
    """
    import fsspec

    fs, path = fsspec.core.url_to_fs(uri)
    if not fs.exists(path):
        raise TokenizerError(f"tokenizer {uri!r} does not exist; check the URI and credentials.")
    is_dir = fs.isdir(path)
    entries = (
        [e for e in fs.ls(path, detail=True) if e.get("type") == "file"]
        if is_dir
        else [fs.info(path)]
    )
    names = {Path(e["name"]).name for e in entries}
    if is_dir and not names & {"tokenizer.json", "tokenizer_config.json"}:
        raise TokenizerError(
            f"tokenizer folder {uri!r} has no tokenizer.json or tokenizer_config.json."
        )
    stamp = [[Path(e["name"]).name, {k: e[k] for k in _VERSION_KEYS if k in e}] for e in entries]
    key = json.dumps([uri, sorted(stamp)], sort_keys=True, default=str)
    target = cache_dir / "uris" / hashlib.sha256(key.encode("utf-8")).hexdigest()[:20]
    if not target.is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            for entry in entries:
                name = Path(entry["name"]).name if is_dir else "tokenizer.json"
                fs.get(entry["name"], str(tmp / name))
            os.replace(tmp, target)
            log.info("copied tokenizer %s to %s", uri, target)
        except OSError:
            if not target.is_dir():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target if is_dir else target / "tokenizer.json"
