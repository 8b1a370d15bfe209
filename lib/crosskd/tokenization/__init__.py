"""Tokenizers as CSD sees them: loading, the byte view of every id, special-token roles and
the fingerprint (spec section 1).

Supported: Hugging Face *fast* tokenizers whose model is BPE with a ByteLevel pre-tokenizer
and decoder, and whose normalizer is none, an empty sequence or NFC. Anything else is refused
with a :class:`~crosskd.errors.TokenizerError` naming the tokenizer, what was found and what is
supported.

Ids and sizes:

* ``length`` is ``len(tokenizer)``; ``vocab_size`` (``V``) is the number of rows of the model's
  output layer, which can be larger (Qwen2.5: 151665 tokens, 151936 rows). Ids in ``[0, V)``
  that map to no token are **padding rows**.
* ``bytes(i)`` of a normal token inverts the ByteLevel byte-to-unicode map over the token's
  string (valid for ids whose bytes are not UTF-8 on their own); ``bytes(i)`` of an added token
  (special or not) is its content in UTF-8. Every added token is **special** for CSD.
* **Roles** of specials: :mod:`crosskd.tokenization.roles`.
* The **fingerprint** (sha256 of the canonical JSON of everything that decides ids and
  rendering) is what every artifact records and every consumer checks.

The fingerprint, the byte view, the backend's JSON and the few facts read from the
``transformers`` tokenizer are derived once per set of tokenizer files and read from the cache
after that (:mod:`crosskd.tokenization.derived`): a later load builds the Rust tokenizer alone,
and ``transformers`` is imported only when something asks for :attr:`LoadedTokenizer.hf` (a
chat template, saving the tokenizer).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache, cached_property, partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from crosskd import ragged
from crosskd.config import default_cache_dir
from crosskd.errors import TokenizerError
from crosskd.tokenization.byte_level import (
    KIND_NONE,
    KIND_NORMAL,
    KIND_SPECIAL,
    ByteVocab,
    byte_level_to_bytes,
    bytes_to_byte_level,
)
from crosskd.tokenization.derived import Derived, derive, source_key
from crosskd.tokenization.roles import ROLES, assign_roles
from crosskd.tokenization.sources import Source, load_hf, locate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

__all__ = [
    "KIND_NONE",
    "KIND_NORMAL",
    "KIND_SPECIAL",
    "ROLES",
    "SUPPORTED",
    "ByteVocab",
    "LoadedTokenizer",
    "check_supported",
    "default_cache_dir",
    "fingerprint",
    "fingerprint_fields",
    "fingerprint_payload",
    "load_tokenizer",
]

SUPPORTED = (
    "Hugging Face fast tokenizers with a BPE model, a ByteLevel pre-tokenizer and decoder, and "
    "no normalizer or NFC (GPT-2, Llama-3, Qwen2/3, DeepSeek, SmolLM, Mistral-Nemo style)"
)


@dataclass(frozen=True, eq=False)
class LoadedTokenizer:
    """A supported tokenizer with everything CSD derives from it.

    ``backend`` is the Rust tokenizer (what encodes); :attr:`hf`, the ``transformers`` fast
    tokenizer (chat templates, saving), is built by ``open_hf`` on first use.
    ``strips_content``: whether its chat template strips whitespace around message content
    (Llama-3's ``| trim``). ``skeleton``: the backend's JSON without the model's ``vocab`` and
    ``merges`` (:class:`~crosskd.tokenization.derived.Derived`). ``renderings``: chat-template
    renderings kept by conversation shape (:func:`crosskd.alignment.render`).
    """

    name: str
    backend: Tokenizer = field(repr=False)
    open_hf: Callable[[], PreTrainedTokenizerBase] = field(repr=False)
    fingerprint: str
    length: int
    vocab_size: int
    bytes: ByteVocab
    roles: dict[int, str]
    strips_content: bool
    skeleton: dict = field(repr=False)
    renderings: dict = field(default_factory=dict, repr=False)

    @cached_property
    def hf(self) -> PreTrainedTokenizerBase:
        """The ``transformers`` fast tokenizer (loaded on first use: seconds)."""
        return self.open_hf()

    @cached_property
    def vocab(self) -> dict[str, int]:
        """The BPE model's vocabulary: ByteLevel string -> id (added tokens not included)."""
        return self.backend.get_vocab(with_added_tokens=False)

    @cached_property
    def backend_json(self) -> dict:
        """The backend tokenizer's whole JSON form (parsed on first use: megabytes)."""
        return json.loads(self.backend.to_str())

    @cached_property
    def role_ids(self) -> dict[str, int]:
        """Role -> the lowest id that carries it."""
        out: dict[str, int] = {}
        for token_id in sorted(self.roles):
            out.setdefault(self.roles[token_id], token_id)
        return out

    @cached_property
    def special_ids(self) -> np.ndarray:
        """Sorted ids of all specials (every added token), int64."""
        return np.flatnonzero(self.bytes.kind == KIND_SPECIAL)

    @property
    def normalizes_nfc(self) -> bool:
        """Whether the tokenizer NFC-normalises text (Qwen): data preparation then NFC-normalises
        once, before any tokenizer sees the text, so no tokenizer changes bytes under offsets."""
        return "NFC" in _components(self.skeleton.get("normalizer"), "normalizers")

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is an added/special token."""
        return bool(self.bytes.kind[token_id] == KIND_SPECIAL)

    @cached_property
    def word_model(self) -> Tokenizer:
        """A ``tokenizers.Tokenizer`` around this tokenizer's own BPE model (its merges and
        ``ignore_merges``; dropout off), with no normalizer, pre-tokenizer, added tokens or
        post-processor, so a ByteLevel string is encoded as one word."""
        if self.skeleton["model"].get("dropout") is None:
            return Tokenizer(self.backend.model)
        spec = {"version": "1.0", "model": dict(self.backend_json["model"], dropout=None)}
        return Tokenizer.from_str(json.dumps(spec))

    @cached_property
    def token_strings(self) -> list[str | None]:
        """The ByteLevel string of every id in ``[0, V)`` (None for specials and padding)."""
        out: list[str | None] = [None] * self.vocab_size
        kind = self.bytes.kind
        for token, token_id in self.vocab.items():
            if kind[token_id] == KIND_NORMAL:
                out[token_id] = token
        return out

    def encode_words(self, words: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """The BPE model applied to each byte string as one word (bytes need not be UTF-8).

        Returns CSR ``(offsets int64 [n + 1], ids int32)``. Bytes the vocabulary cannot
        represent are dropped by the BPE model (it has no byte fallback), so callers compare
        the result's bytes with the input.
        """
        return self.encode_byte_level([bytes_to_byte_level(w) for w in words])

    def encode_byte_level(
        self, words: list[str], *, block: int = 32768, parts: int = 4, desc: str | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Like :meth:`encode_words` for words already in the ByteLevel alphabet.

        Words go to the BPE as pre-tokenized sequences (``parts`` per ``encode_batch`` call, so
        they run in parallel), ``block`` words per progress-bar step; ``desc`` shows a bar.
        """
        ids: list[np.ndarray] = []
        owners: list[np.ndarray] = []
        bar = tqdm(total=len(words), desc=desc, unit="tok", disable=desc is None, leave=False)
        with bar:
            for start in range(0, len(words), block):
                stop = min(start + block, len(words))
                cuts = np.linspace(start, stop, parts + 1).astype(np.int64)
                batch = [words[a:b] for a, b in itertools.pairwise(cuts)]
                encodings = self.word_model.encode_batch(
                    batch, is_pretokenized=True, add_special_tokens=False
                )
                for first, encoding in zip(cuts[:-1], encodings, strict=True):
                    ids.append(np.asarray(encoding.ids, dtype=np.int32))
                    owners.append(np.asarray(encoding.word_ids, dtype=np.int64) + first)
                bar.update(stop - start)
        flat = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int32)
        owner = np.concatenate(owners) if owners else np.zeros(0, dtype=np.int64)
        counts = np.bincount(owner, minlength=len(words)).astype(np.int64)
        return ragged.offsets_from_lengths(counts), flat


def load_tokenizer(
    ref: str | os.PathLike,
    *,
    vocab_size: int | None = None,
    role_overrides: dict[str, str | None] | None = None,
    trust_remote_code: bool = False,
    cache_dir: str | os.PathLike | None = None,
) -> LoadedTokenizer:
    """Load and check a tokenizer.

    Args:
        ref: a folder, a ``tokenizer.json`` file, ``zoo:NAME`` (see :mod:`crosskd.zoo`), an
            fsspec URI of either (copied to ``cache_dir``), or a Hugging Face id already in the
            local cache (nothing is downloaded).
        vocab_size: output rows ``V`` of the model; default ``vocab_size`` from a
            ``config.json`` next to the tokenizer, else the largest token id + 1.
        role_overrides: token content -> role (or None to clear its role), applied last.
        trust_remote_code: passed to ``transformers``; off unless the user asks.
        cache_dir: where URIs are copied; default ``$CROSSKD_CACHE_DIR`` or ``~/.cache/crosskd``.
    """
    name = str(ref)
    source = locate(name, trust_remote_code=trust_remote_code, cache_dir=cache_dir)
    open_hf = cache(partial(_load_fast, name, source, trust_remote_code))
    key = source_key(source.files) if source.files else None
    folder = Path(cache_dir) if cache_dir else default_cache_dir()
    derived = derive(key, folder, lambda: _derive(name, open_hf()), name=name)
    check_supported(name, derived.skeleton)
    max_id = len(derived.kind) - 1
    if vocab_size is None:
        vocab_size = _config_vocab_size(source.folder)
    if vocab_size is None:
        vocab_size = max_id + 1
        log.warning(
            "tokenizer %s: no config.json with the model's vocab_size next to it; assuming the "
            "output layer has %d rows (largest id + 1). Pass the real size (--*-vocab-size) if "
            "the model pads its vocabulary, or padding rows will be missing.",
            name,
            vocab_size,
        )
    if vocab_size <= max_id:
        raise TokenizerError(
            f"tokenizer {name!r} has token id {max_id} but the model's output size was given as "
            f"{vocab_size}; pass the model's real vocab_size (config.json) or a larger value."
        )
    padding = vocab_size - len(derived.kind)
    byte_vocab = ByteVocab(
        data=derived.data,
        offsets=np.concatenate([derived.offsets, np.full(padding, derived.offsets[-1])]),
        kind=np.concatenate([derived.kind, np.full(padding, KIND_NONE, dtype=np.uint8)]),
    )
    added = {tok["id"]: tok["content"] for tok in derived.skeleton.get("added_tokens", [])}
    roles = assign_roles(name, derived.special_ids, added, role_overrides or {})
    return LoadedTokenizer(
        name=name,
        backend=derived.backend,
        open_hf=open_hf,
        fingerprint=derived.fingerprint,
        length=derived.length,
        vocab_size=vocab_size,
        bytes=byte_vocab,
        roles=roles,
        strips_content=derived.strips_content,
        skeleton=derived.skeleton,
    )


def _load_fast(name: str, source: Source, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    """The ``transformers`` tokenizer of ``source``, refused unless it is a fast one."""
    hf = load_hf(source, trust_remote_code=trust_remote_code)
    if not getattr(hf, "is_fast", False):
        raise TokenizerError(
            f"tokenizer {name!r} is a slow (Python) tokenizer ({type(hf).__name__}); "
            f"supported: {SUPPORTED}. Pass a folder with a tokenizer.json."
        )
    return hf


def _derive(name: str, hf: PreTrainedTokenizerBase) -> Derived:
    """Everything :class:`~crosskd.tokenization.derived.Derived` holds, from ``hf``, refused
    (:func:`check_supported`) before the byte view is built."""
    backend = json.loads(hf.backend_tokenizer.to_str())
    model = backend["model"]
    skeleton = dict(backend, model={k: v for k, v in model.items() if k not in _MODEL_TABLES})
    check_supported(name, skeleton)
    added = {tok["id"]: tok["content"] for tok in backend.get("added_tokens", [])}
    max_id = max(max(model["vocab"].values(), default=-1), max(added, default=-1))
    byte_vocab = _byte_vocab(name, model["vocab"], added, max_id + 1)
    return Derived(
        fingerprint=fingerprint(hf, backend),
        skeleton=skeleton,
        backend=hf.backend_tokenizer,
        length=len(hf),
        special_ids={role: getattr(hf, f"{role}_token_id", None) for role in _SPECIAL_ROLES},
        strips_content=_template_strips(hf),
        data=byte_vocab.data,
        offsets=byte_vocab.offsets,
        kind=byte_vocab.kind,
    )


def _template_strips(hf: PreTrainedTokenizerBase) -> bool:
    """Whether ``hf``'s chat template strips whitespace around message content (Llama-3's
    ``| trim``); False without a template."""
    if not hf.chat_template:
        return False
    probe = [{"role": "user", "content": " \ue002 "}, {"role": "assistant", "content": " \ue003 "}]
    rendered = hf.apply_chat_template(probe, tokenize=False)
    return " \ue003 " not in rendered


_SPECIAL_ROLES = ("bos", "eos", "unk", "pad")
"""The ``transformers`` tokenizer's special-token attributes the roles read, in their order of
precedence (:mod:`crosskd.tokenization.roles`)."""


_MODEL_TABLES = ("vocab", "merges")
"""The backend model's keys the skeleton leaves out (the bulk of a tokenizer's JSON)."""


def check_supported(name: str, backend: dict) -> None:
    """Refuse a backend tokenizer (its JSON form) that CSD cannot take the byte view of."""
    model = backend["model"]
    if model.get("type") != "BPE":
        raise TokenizerError(
            f"tokenizer {name!r} has a {model.get('type')} model; supported: {SUPPORTED}."
        )
    for option in ("continuing_subword_prefix", "end_of_word_suffix", "byte_fallback"):
        if model.get(option):
            raise TokenizerError(
                f"tokenizer {name!r} has a BPE model with {option}={model[option]!r}, which "
                f"changes what a token's bytes are; supported: {SUPPORTED}, with none of "
                f"continuing_subword_prefix, end_of_word_suffix or byte_fallback."
            )
    pre = _components(backend.get("pre_tokenizer"), "pretokenizers")
    if "ByteLevel" not in pre:
        found = ", ".join(pre) or "no"
        raise TokenizerError(
            f"tokenizer {name!r} has {found} pre-tokenizer(s) and no ByteLevel one; "
            f"supported: {SUPPORTED}."
        )
    decoder = _components(backend.get("decoder"), "decoders")
    if decoder != ["ByteLevel"]:
        found = ", ".join(decoder) or "no"
        raise TokenizerError(
            f"tokenizer {name!r} has a {found} decoder, not ByteLevel; supported: {SUPPORTED}."
        )
    normalizers = _components(backend.get("normalizer"), "normalizers")
    if normalizers not in ([], ["NFC"]):
        raise TokenizerError(
            f"tokenizer {name!r} has a {', '.join(normalizers)} normalizer, which changes text "
            f"under the character offsets; supported: no normalizer or NFC."
        )


def _components(node: dict | None, list_key: str) -> list[str]:
    """Types of a (possibly Sequence) tokenizer component, flattened."""
    if node is None:
        return []
    if node.get("type") == "Sequence":
        return [t for child in node.get(list_key, []) for t in _components(child, list_key)]
    return [node["type"]]


def fingerprint(hf: PreTrainedTokenizerBase, backend: dict | None = None) -> str:
    """sha256 (hex) of the canonical JSON of what decides ids and rendering.

    Covers the backend's model, normalizer, pre-tokenizer, post-processor, decoder and added
    tokens, the special-token map and the list of all specials, ``split_special_tokens``,
    ``clean_up_tokenization_spaces`` and the chat template (:func:`fingerprint_payload`).
    """
    return _sha256(fingerprint_payload(hf, backend))


def fingerprint_fields(hf: PreTrainedTokenizerBase, backend: dict | None = None) -> dict[str, str]:
    """sha256 (hex) of each field of the fingerprint, to say *which* fields two tokenizers
    differ in."""
    return {key: _sha256(value) for key, value in fingerprint_payload(hf, backend).items()}


def fingerprint_payload(hf: PreTrainedTokenizerBase, backend: dict | None = None) -> dict:
    """The fields the fingerprint covers, field name -> JSON value."""
    if backend is None:
        backend = json.loads(hf.backend_tokenizer.to_str())
    keys = ("model", "normalizer", "pre_tokenizer", "post_processor", "decoder", "added_tokens")
    payload = {key: backend.get(key) for key in keys}
    special_attrs = ("bos_token", "eos_token", "unk_token", "pad_token")
    payload["special_tokens"] = {attr: getattr(hf, attr, None) for attr in special_attrs}
    payload["all_special_tokens"] = sorted(getattr(hf, "all_special_tokens", []))
    payload["split_special_tokens"] = bool(getattr(hf, "split_special_tokens", False))
    payload["clean_up_tokenization_spaces"] = bool(
        getattr(hf, "clean_up_tokenization_spaces", False)
    )
    payload["chat_template"] = getattr(hf, "chat_template", None)
    return payload


def _sha256(value: object) -> str:
    canonical = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _byte_vocab(name: str, vocab: dict[str, int], added: dict[int, str], size: int) -> ByteVocab:
    pieces: list[bytes] = [b""] * size
    kind = np.zeros(size, dtype=np.uint8)
    bad: list[int] = []
    for token, token_id in vocab.items():
        data = byte_level_to_bytes(token)
        if data is None:
            bad.append(token_id)
            continue
        pieces[token_id] = data
        kind[token_id] = KIND_NORMAL
    for token_id, content in added.items():
        pieces[token_id] = content.encode("utf-8")
        kind[token_id] = KIND_SPECIAL
    bad = [i for i in bad if kind[i] != KIND_SPECIAL]
    if bad:
        raise TokenizerError(
            f"tokenizer {name!r}: {len(bad)} vocabulary entries are not ByteLevel strings "
            f"(first ids: {sorted(bad)[:5]}); supported: {SUPPORTED}."
        )
    lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=size)
    offsets = ragged.offsets_from_lengths(lengths)
    data = np.frombuffer(b"".join(pieces), dtype=np.uint8)
    return ByteVocab(data=data, offsets=offsets, kind=kind)


def _config_vocab_size(folder: Path | None) -> int | None:
    if folder is None or not (folder / "config.json").is_file():
        return None
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    size = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
    return int(size) if size is not None else None
