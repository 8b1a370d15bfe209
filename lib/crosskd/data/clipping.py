"""Clipping an over-long text to the longest prefix that every model can hold.

Every model in a lockstep batch must see the same characters, so a text is clipped once for
all of them: :func:`clip_text` keeps the longest prefix whose token count, as each tokenizer
encodes it (``split_special_tokens=True``, so user text never becomes a control token; special
tokens the tokenizer adds count), is at most that model's maximum length. Lengths are token
counts; cuts are character (code point) offsets.

Cuts fall on character boundaries and never split what belongs together: not before a
combining character (``unicodedata.combining``), which stays with its base, and not between
``"\\r"`` and ``"\\n"``. The first cut comes from the offsets of the full encoding; because a
prefix can tokenize differently near its end, every candidate is then verified by encoding
it, and a bisection between a prefix that fits and one that does not ends on a prefix that
fits while the next allowed cut does not (token counts are not strictly monotonic in the
prefix length, so "longest" is meant in this local sense). A text that fits is never clipped.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

from crosskd.errors import DataError
from crosskd.tokenization import LoadedTokenizer

__all__ = ["ClipResult", "clip_text"]

_FIRST_STEP = 8  # characters; the first gallop step away from the estimated cut


@dataclass(frozen=True)
class ClipResult:
    """The text as it is kept, and token counts per model (in the order the models were given).

    ``original_lengths`` are the counts of the full text and ``lengths`` those of ``text``;
    they are equal when ``clipped`` is false.
    """

    text: str
    clipped: bool
    original_lengths: tuple[int, ...]
    lengths: tuple[int, ...]


def clip_text(
    text: str,
    tokenizers: Sequence[LoadedTokenizer],
    max_lengths: Sequence[int],
    *,
    add_special_tokens: bool = True,
) -> ClipResult:
    """Clip ``text`` to the longest prefix whose token count is at most ``max_lengths[m]`` for
    every tokenizer ``m`` (see the module docstring for the boundary rules).

    Raises :class:`~crosskd.errors.DataError` when a maximum length cannot even hold the
    special tokens a tokenizer adds to an empty text.
    """
    if len(tokenizers) != len(max_lengths):
        raise ValueError(
            f"clip_text got {len(tokenizers)} tokenizers but {len(max_lengths)} max lengths; "
            "give one maximum length per tokenizer"
        )
    encodings = _encode_all(text, tokenizers, add_special_tokens, offsets=True)
    original = tuple(len(encoding["input_ids"]) for encoding in encodings)
    if all(n <= cap for n, cap in zip(original, max_lengths, strict=True)):
        return ClipResult(text, False, original, original)

    probe = _Probe(text, tokenizers, max_lengths, add_special_tokens)
    for tok, cap, n in zip(tokenizers, max_lengths, probe.counts(0), strict=True):
        if n > cap:
            raise DataError(
                f"max length {cap} of {tok.name} cannot hold the {n} special tokens it adds to "
                "every text; raise that maximum length"
            )
    lo = 0  # known to fit
    hi = len(text)  # known not to fit
    guess = _snap_down(text, _estimate_cut(len(text), encodings, max_lengths))
    if lo < guess < hi:
        lo, hi = _gallop(probe, guess, lo, hi)
    while True:
        mid = _snap_down(text, (lo + hi) // 2)
        if mid <= lo:
            mid = _snap_up(text, lo + 1)
        if mid >= hi:
            break
        if probe.fits(mid):
            lo = mid
        else:
            hi = mid
    return ClipResult(text[:lo], True, original, probe.counts(lo))


class _Probe:
    """Token counts of prefixes of one text, computed once per cut."""

    def __init__(
        self,
        text: str,
        tokenizers: Sequence[LoadedTokenizer],
        max_lengths: Sequence[int],
        add_special_tokens: bool,
    ) -> None:
        self.text = text
        self.tokenizers = tokenizers
        self.max_lengths = max_lengths
        self.add_special_tokens = add_special_tokens
        self._counts: dict[int, tuple[int, ...]] = {}

    def counts(self, cut: int) -> tuple[int, ...]:
        """Token counts of ``text[:cut]`` for every model."""
        if cut not in self._counts:
            prefix = self.text[:cut]
            encodings = _encode_all(prefix, self.tokenizers, self.add_special_tokens)
            self._counts[cut] = tuple(len(encoding["input_ids"]) for encoding in encodings)
        return self._counts[cut]

    def fits(self, cut: int) -> bool:
        """Whether ``text[:cut]`` is within every model's maximum length."""
        return all(n <= cap for n, cap in zip(self.counts(cut), self.max_lengths, strict=True))


def _gallop(probe: _Probe, guess: int, lo: int, hi: int) -> tuple[int, int]:
    """Narrow ``(lo, hi)`` (``lo`` fits, ``hi`` does not) around ``guess`` with steps that
    double away from it."""
    text = probe.text
    step = _FIRST_STEP
    if probe.fits(guess):
        lo = guess
        while (nxt := _snap_down(text, lo + step)) < hi and nxt > lo:
            if not probe.fits(nxt):
                return lo, nxt
            lo, step = nxt, step * 2
    else:
        hi = guess
        while (nxt := _snap_down(text, hi - step)) > lo:
            if probe.fits(nxt):
                return nxt, hi
            hi, step = nxt, step * 2
    return lo, hi


def _estimate_cut(n_chars: int, encodings: list, max_lengths: Sequence[int]) -> int:
    """The smallest, over the models that overflow, of the start of the first text token that
    does not fit by the full text's offsets (special tokens have empty spans)."""
    cut = n_chars
    for encoding, cap in zip(encodings, max_lengths, strict=True):
        offsets = encoding["offset_mapping"]
        if len(offsets) <= cap:
            continue
        starts = [start for start, end in offsets if end > start]
        budget = cap - (len(offsets) - len(starts))
        cut = min(cut, starts[max(budget, 0)])
    return cut


def _encode_all(
    text: str,
    tokenizers: Sequence[LoadedTokenizer],
    add_special_tokens: bool,
    *,
    offsets: bool = False,
) -> list:
    """Each tokenizer's encoding of ``text`` (``input_ids``, and ``offset_mapping`` in
    characters when ``offsets``)."""
    return [
        tok.hf(
            text,
            add_special_tokens=add_special_tokens,
            split_special_tokens=True,
            return_offsets_mapping=offsets,
            verbose=False,
        )
        for tok in tokenizers
    ]


def _is_cut(text: str, i: int) -> bool:
    """Whether a cut before ``text[i]`` keeps combining marks and CRLF pairs whole."""
    if i <= 0 or i >= len(text):
        return True
    return not unicodedata.combining(text[i]) and not (text[i] == "\n" and text[i - 1] == "\r")


def _snap_down(text: str, i: int) -> int:
    while not _is_cut(text, i):
        i -= 1
    return i


def _snap_up(text: str, i: int) -> int:
    while not _is_cut(text, i):
        i += 1
    return i
