"""Where tokenizers come from: a folder, a ``tokenizer.json``, ``zoo:NAME``, an fsspec URI
(copied to a local cache) or a Hugging Face id already in the local cache. Nothing is
downloaded from a hub.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

from crosskd.errors import TokenizerError

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """``$CROSSKD_CACHE_DIR`` or ``~/.cache/crosskd``."""
    return Path(os.environ.get("CROSSKD_CACHE_DIR") or Path.home() / ".cache" / "crosskd")


def load_hf(
    ref: str, *, trust_remote_code: bool, cache_dir: str | os.PathLike | None
) -> tuple[object, Path | None]:
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


def _fetch_uri(uri: str, cache_dir: Path) -> Path:
    """Copy a tokenizer folder or tokenizer.json at an fsspec URI into the cache (atomically)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(uri)
    digest = hashlib.sha256(uri.encode("utf-8")).hexdigest()[:16]
    target = cache_dir / "uris" / digest
    if target.is_dir():
        return target / "tokenizer.json" if uri.endswith(".json") else target
    if not fs.exists(path):
        raise TokenizerError(f"tokenizer {uri!r} does not exist; check the URI and credentials.")
    tmp = target.with_name(f"{digest}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    if fs.isdir(path):
        for child in fs.ls(path, detail=False):
            if fs.isfile(child):
                fs.get(child, str(tmp / Path(child).name))
    else:
        fs.get(path, str(tmp / "tokenizer.json"))
    log.info("copied tokenizer %s to %s", uri, target)
    try:
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.is_dir():
            raise
    return target / "tokenizer.json" if not fs.isdir(path) else target
