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
it: a gallop away from the first cut with steps that double (8, 16, ... characters), then a
bisection between a prefix that fits and one that does not, ends on a prefix that fits while
the next allowed cut does not (token counts are not strictly monotonic in the prefix length,
so "longest" is meant in this local sense: a few more characters can merge into fewer
tokens, which the gallop's first step of 8 characters finds). A text that fits is never
clipped.

:func:`clip_texts` clips many texts in lockstep: each text's search asks for the same cuts, in
the same order, as :func:`clip_text` alone would, and every round of the search encodes the
prefixes all unfinished texts ask for in one batch per tokenizer (the tokenizers' threads work
across the texts), model by model, the one a text overflows most first: a prefix already too
long for one model is not encoded by the others. It can start from encodings the caller
already has (:func:`~crosskd.alignment.tokenize` of the texts with their special tokens and
start offsets), so the full texts are encoded once for clipping and rendering together.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field

from crosskd.alignment import Tokenized, tokenize
from crosskd.errors import DataError
from crosskd.tokenization import LoadedTokenizer

__all__ = ["ClipResult", "clip_text", "clip_texts"]

_FIRST_STEP = 8  # characters; the first gallop step away from the estimated cut

Search = Generator[int, bool, int]
"""One text's search for its cut: yields the next cut it needs to know about (in characters),
is sent whether that prefix fits every model, and returns the cut it keeps."""


@dataclass(frozen=True)
class ClipResult:
    """The text as it is kept, and token counts per model (in the order the models were given).

    ``original_lengths`` are the counts of the full text and ``lengths`` those of ``text``;
    they are equal when ``clipped`` is false. ``encoded``: each model's encoding of ``text``
    (:func:`~crosskd.alignment.tokenize` with the special tokens and start offsets), when
    :func:`clip_texts` made one (a text it cut), else None; not compared.
    """

    text: str
    clipped: bool
    original_lengths: tuple[int, ...]
    lengths: tuple[int, ...]
    encoded: tuple[Tokenized, ...] | None = field(default=None, compare=False, repr=False)


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
    return clip_texts([text], tokenizers, max_lengths, add_special_tokens=add_special_tokens)[0]


def clip_texts(
    texts: Sequence[str],
    tokenizers: Sequence[LoadedTokenizer],
    max_lengths: Sequence[int],
    *,
    add_special_tokens: bool = True,
    encoded: Sequence[Sequence[Tokenized]] | None = None,
) -> list[ClipResult]:
    """:func:`clip_text` of every text of ``texts``, with the same results, searched in lockstep
    (module docstring). ``encoded[m][i]``: tokenizer ``m``'s encoding of ``texts[i]`` with
    ``add_special_tokens`` and start offsets, when the caller has it (None: encoded here)."""
    if len(tokenizers) != len(max_lengths):
        raise ValueError(
            f"clip_text got {len(tokenizers)} tokenizers but {len(max_lengths)} max lengths; "
            "give one maximum length per tokenizer"
        )
    if not texts:
        return []
    if encoded is None:
        encoded = [
            tokenize(tok, list(texts), add_special_tokens=add_special_tokens, with_starts=True)
            for tok in tokenizers
        ]
    original = [tuple(len(per_model[i]) for per_model in encoded) for i in range(len(texts))]
    results: list[ClipResult | None] = [
        ClipResult(text, False, n, n) if _fits(n, max_lengths) else None
        for text, n in zip(texts, original, strict=True)
    ]
    over = [i for i, result in enumerate(results) if result is None]
    if not over:
        return results
    empty = [
        tokenize(tok, [""], add_special_tokens=add_special_tokens, with_starts=True)[0]
        for tok in tokenizers
    ]
    for tok, cap, n in zip(tokenizers, max_lengths, _lengths(empty), strict=True):
        if n > cap:
            raise DataError(
                f"max length {cap} of {tok.name} cannot hold the {n} special tokens it adds to "
                "every text; raise that maximum length"
            )
    kept = {i: (0, tuple(empty)) for i in over}  # the last cut that fit, with its encodings
    order = {
        i: sorted(range(len(tokenizers)), key=lambda m: -original[i][m] / max_lengths[m])
        for i in over
    }
    searches: dict[int, Search] = {}
    wanted: dict[int, int] = {}
    for i in over:
        guess = _estimate_cut(len(texts[i]), [per_model[i] for per_model in encoded], max_lengths)
        searches[i] = _search(texts[i], _snap_down(texts[i], guess))
        _advance(i, searches, wanted, kept, results, texts, original, None)
    while wanted:
        probes = {i: [None] * len(tokenizers) for i in wanted}
        for stage in range(len(tokenizers)):
            asked: dict[int, list[int]] = {}
            for i, got in probes.items():
                if not _overflows(got, max_lengths):
                    asked.setdefault(order[i][stage], []).append(i)
            for m, texts_asked in sorted(asked.items()):
                prefixes = [texts[i][: wanted[i]] for i in texts_asked]
                tokens = tokenize(
                    tokenizers[m], prefixes, add_special_tokens=add_special_tokens, with_starts=True
                )
                for i, t in zip(texts_asked, tokens, strict=True):
                    probes[i][m] = t
        for i, got in probes.items():
            fits = not _overflows(got, max_lengths)
            if fits:
                kept[i] = (wanted[i], tuple(got))
            _advance(i, searches, wanted, kept, results, texts, original, fits)
    return results


def _advance(
    i: int,
    searches: dict[int, Search],
    wanted: dict[int, int],
    kept: dict[int, tuple[int, tuple[Tokenized, ...]]],
    results: list[ClipResult | None],
    texts: Sequence[str],
    original: list[tuple[int, ...]],
    fits: bool | None,
) -> None:
    """Tell text ``i``'s search whether the cut it asked for fits (None: start it); note the
    next cut it wants, or its result once it has one (the last cut that fit: the search only
    ever moves its fitting bound up)."""
    try:
        wanted[i] = next(searches[i]) if fits is None else searches[i].send(fits)
    except StopIteration as stop:
        cut, encoded = kept.pop(i)
        if cut != stop.value:
            raise RuntimeError(
                f"clip search of text {i} ended at {stop.value}, not at {cut}"
            ) from None
        results[i] = ClipResult(texts[i][:cut], True, original[i], _lengths(encoded), encoded)
        wanted.pop(i, None)
        del searches[i]


def _lengths(encoded: tuple[Tokenized, ...]) -> tuple[int, ...]:
    return tuple(len(tokens) for tokens in encoded)


def _fits(counts: tuple[int, ...], max_lengths: Sequence[int]) -> bool:
    return all(n <= cap for n, cap in zip(counts, max_lengths, strict=True))


def _overflows(encoded: list[Tokenized | None], max_lengths: Sequence[int]) -> bool:
    """Whether a model encoded so far holds more tokens than its maximum length (a probe
    whose every model is encoded and none overflows fits)."""
    return any(t is not None and len(t) > cap for t, cap in zip(encoded, max_lengths, strict=True))


def _search(text: str, guess: int) -> Search:
    """The cut of a text that does not fit: a gallop away from ``guess`` with steps that double,
    then a bisection between a cut that fits (``lo``) and one that does not (``hi``)."""
    lo, hi = 0, len(text)
    if lo < guess < hi:
        step = _FIRST_STEP
        if (yield guess):
            lo = guess
            while (nxt := _snap_down(text, lo + step)) < hi and nxt > lo:
                if not (yield nxt):
                    hi = nxt
                    break
                lo, step = nxt, step * 2
        else:
            hi = guess
            while (nxt := _snap_down(text, hi - step)) > lo:
                if (yield nxt):
                    lo = nxt
                    break
                hi, step = nxt, step * 2
    while True:
        mid = _snap_down(text, (lo + hi) // 2)
        if mid <= lo:
            mid = _snap_up(text, lo + 1)
        if mid >= hi:
            return lo
        if (yield mid):
            lo = mid
        else:
            hi = mid


def _estimate_cut(n_chars: int, encoded: list[Tokenized], max_lengths: Sequence[int]) -> int:
    """The smallest, over the models that overflow, of the start of the first text token that
    does not fit by the full text's offsets (special tokens have empty spans)."""
    cut = n_chars
    for tokens, cap in zip(encoded, max_lengths, strict=True):
        if len(tokens) <= cap:
            continue
        starts = tokens.starts[tokens.ends > tokens.starts]
        budget = cap - (len(tokens) - len(starts))
        cut = min(cut, int(starts[max(budget, 0)]))
    return cut


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
