"""Clipping with real zoo tokenizers: every model fits, the cut is maximal and on an allowed
boundary, and nothing that fits is clipped."""

from __future__ import annotations

import string
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crosskd.alignment import tokenize
from crosskd.data import ClipResult, clip_text, clip_texts
from crosskd.errors import DataError

COMBINING = st.characters(min_codepoint=0x300, max_codepoint=0x36F)
PIECES = st.one_of(
    st.text(alphabet=string.ascii_letters + string.digits + " .,;:!?()[]{}=+-*/'\"_", max_size=20),
    st.text(alphabet=st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF), max_size=8),
    st.sampled_from(["👍", "👍🏽", "👨\u200d👩\u200d👧", "🇯🇵", "❤️", "😀😀"]),
    st.builds(str.__add__, st.sampled_from("aeoxY 世"), st.text(COMBINING, min_size=1, max_size=3)),
    st.sampled_from(["\r\n", "\r\n\r\n", "\n", "\r"]),
    st.builds(str.__mul__, st.sampled_from([" ", "\t", "\n", "\u3000"]), st.integers(2, 40)),
    st.sampled_from(["def f(x):\n    return x", "if (a && b) { y++; }", "<|endoftext|>"]),
)
TEXTS = st.lists(PIECES, min_size=1, max_size=25).map("".join)


def _counts(tokenizers, text: str) -> tuple[int, ...]:
    encodings = [
        tok.hf(text, add_special_tokens=True, split_special_tokens=True, verbose=False)
        for tok in tokenizers
    ]
    return tuple(len(encoding.input_ids) for encoding in encodings)


def _allowed_cut(text: str, i: int) -> bool:
    """The documented rule: never before a combining mark, never between CR and LF."""
    if i in (0, len(text)):
        return True
    return not unicodedata.combining(text[i]) and text[i - 1 : i + 1] != "\r\n"


def _check(text: str, tokenizers, caps: list[int], result: ClipResult) -> None:
    assert result.original_lengths == _counts(tokenizers, text)
    assert result.lengths == _counts(tokenizers, result.text)
    assert text.startswith(result.text)
    assert all(n <= cap for n, cap in zip(result.lengths, caps, strict=True))
    whole_fits = all(n <= cap for n, cap in zip(result.original_lengths, caps, strict=True))
    assert result.clipped is not whole_fits
    if whole_fits:
        assert result.text == text
        assert result.lengths == result.original_lengths
        return
    cut = len(result.text)
    assert cut < len(text)
    assert _allowed_cut(text, cut)
    longer = next(i for i in range(cut + 1, len(text) + 1) if _allowed_cut(text, i))
    longer_counts = _counts(tokenizers, text[:longer])
    assert any(n > cap for n, cap in zip(longer_counts, caps, strict=True))


MODEL_SETS = [("llama3", "qwen3"), ("smollm2",), ("smollm2", "llama3", "qwen3")]


@pytest.mark.parametrize("names", MODEL_SETS)
def test_clipped_prefix_fits_every_model_and_is_maximal(zoo, names):
    tokenizers = [zoo(name) for name in names]

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        text=TEXTS,
        caps=st.lists(
            st.integers(1, 60) | st.integers(60, 300), min_size=len(names), max_size=len(names)
        ),
    )
    def run(text: str, caps: list[int]) -> None:
        _check(text, tokenizers, caps, clip_text(text, tokenizers, caps))

    run()


def test_hand_checked_clip(zoo):
    llama, qwen = zoo("llama3"), zoo("qwen3")
    text = "Hello world, hello world"
    ids = llama.hf(text, split_special_tokens=True).input_ids
    assert llama.hf.convert_ids_to_tokens(ids) == [
        "<|begin_of_text|>",
        "Hello",
        "Ġworld",
        ",",
        "Ġhello",
        "Ġworld",
    ]
    # Llama-3 adds a BOS, Qwen3 does not: 3 Llama tokens and 2 Qwen tokens both keep
    # "Hello world"; one character more ("Hello world,") needs 4 and 3.
    assert clip_text(text, [llama, qwen], [3, 2]) == ClipResult("Hello world", True, (6, 5), (3, 2))
    assert clip_text(text, [llama, qwen], [3, 100]) == ClipResult(
        "Hello world", True, (6, 5), (3, 2)
    )
    assert clip_text(text, [llama, qwen], [4, 2]) == ClipResult("Hello world", True, (6, 5), (3, 2))
    assert clip_text(text, [llama, qwen], [1, 5]) == ClipResult("", True, (6, 5), (1, 0))
    assert clip_text(text, [llama], [6]) == ClipResult(text, False, (6,), (6,))
    assert clip_text(text, [qwen], [5], add_special_tokens=False) == ClipResult(
        text, False, (5,), (5,)
    )


def test_combining_marks_and_crlf_stay_whole(zoo):
    tokenizers = [zoo("qwen3"), zoo("smollm2")]
    for text in ["e\u0301\u0302" * 30, "ab\r\n" * 40, "\u0301x\u0301" * 25]:
        for cap in range(1, 25):
            result = clip_text(text, tokenizers, [cap, cap])
            _check(text, tokenizers, [cap, cap], result)


def test_long_text_clips_fast_and_right(zoo):
    tokenizers = [zoo("llama3"), zoo("qwen3"), zoo("smollm2")]
    text = "Prose and code: x = [i ** 2 for i in range(10)]  # 世界 e\u0301 👍🏽\r\n" * 1500
    for caps in ([1000, 900, 1500], [4096, 4096, 4096]):
        _check(text, tokenizers, caps, clip_text(text, tokenizers, caps))


def test_bad_arguments_are_named(zoo):
    with pytest.raises(DataError, match=r"max length 0 of .*llama3.* cannot hold the 1 special"):
        clip_text("hello", [zoo("llama3")], [0])
    with pytest.raises(ValueError, match=r"2 tokenizers but 1 max lengths"):
        clip_text("hello", [zoo("llama3"), zoo("qwen3")], [5])


def _sequential_cut(text: str, tokenizers, caps: list[int]) -> int:
    """The documented search written plainly, one encoding at a time: start at the first
    overflowing token's start (snapped down to an allowed cut), gallop with steps 8, 16, ...
    towards the side that holds the answer, then bisect."""

    def fits(cut: int) -> bool:
        return all(n <= c for n, c in zip(_counts(tokenizers, text[:cut]), caps, strict=True))

    def down(i: int) -> int:
        while i < len(text) and not _allowed_cut(text, i):
            i -= 1
        return i

    def up(i: int) -> int:
        while not _allowed_cut(text, i):
            i += 1
        return i

    guess = len(text)
    for tok, cap in zip(tokenizers, caps, strict=True):
        spans = tok.hf(
            text, add_special_tokens=True, split_special_tokens=True, return_offsets_mapping=True
        ).offset_mapping
        starts = [a for a, b in spans if b > a]
        if len(spans) > cap:
            guess = min(guess, starts[max(cap - (len(spans) - len(starts)), 0)])
    lo, hi, guess, step = 0, len(text), down(guess), 8
    if lo < guess < hi:
        if fits(guess):
            lo = guess
            while (nxt := down(lo + step)) < hi and nxt > lo:
                if not fits(nxt):
                    hi = nxt
                    break
                lo, step = nxt, step * 2
        else:
            hi = guess
            while (nxt := down(hi - step)) > lo:
                if fits(nxt):
                    lo = nxt
                    break
                hi, step = nxt, step * 2
    while True:
        mid = down((lo + hi) // 2)
        if mid <= lo:
            mid = up(lo + 1)
        if mid >= hi:
            return lo
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)


def test_many_texts_clip_in_lockstep_to_the_sequential_search(zoo):
    """Each text of a batch ends where the search run alone, one encoding at a time, ends, and
    a text that was cut carries every model's encoding of what it keeps."""
    tokenizers = [zoo("llama3"), zoo("qwen3")]

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        texts=st.lists(TEXTS, min_size=1, max_size=6),
        caps=st.lists(st.integers(1, 40) | st.integers(40, 200), min_size=2, max_size=2),
    )
    def run(texts: list[str], caps: list[int]) -> None:
        results = clip_texts(texts, tokenizers, caps)
        for text, result in zip(texts, results, strict=True):
            _check(text, tokenizers, caps, result)
            if not result.clipped:
                assert result.encoded is None
                continue
            assert len(result.text) == _sequential_cut(text, tokenizers, caps)
            for tok, tokens in zip(tokenizers, result.encoded, strict=True):
                expected = tokenize(tok, [result.text], add_special_tokens=True, with_starts=True)
                assert tokens.ids.tolist() == expected[0].ids.tolist()
                assert tokens.ends.tolist() == expected[0].ends.tolist()
                assert tokens.starts.tolist() == expected[0].starts.tolist()

    run()
    assert clip_texts([], tokenizers, [5, 5]) == []


def test_a_few_more_characters_can_take_fewer_tokens(zoo):
    """Hand-checked: Llama-3 reads 'Iceland' as 'I' + 'celand', so at 5 tokens the first cut is
    after 'I' (BOS, 'Hung', 'ary', newline, 'I'), which fits while 'Ic' (6 tokens) does not;
    but 'Ice' is one token, and the gallop's 8-character step finds the longer cut."""
    llama = zoo("llama3")
    text = "Hungary\nIceland\nIndia"
    assert llama.hf.convert_ids_to_tokens(llama.hf(text).input_ids)[3:6] == ["Ċ", "I", "celand"]
    assert [_counts([llama], text[:n])[0] for n in (9, 10, 11)] == [5, 6, 5]
    assert clip_text(text, [llama], [5]) == ClipResult("Hungary\nIce", True, (8,), (5,))
