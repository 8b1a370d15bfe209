"""The offset-cluster aligner on real tokenizer pairs: hand-checked chunks, a literal
implementation of the spec's walker as the reference, and invariants over generated text."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crosskd.alignment import (
    SHAPE_NAMES,
    SHAPE_SPECIAL,
    Tokenized,
    align,
    align_many,
    tokenize,
)
from crosskd.tokenization import KIND_SPECIAL

PAIRS = [("llama3", "qwen3"), ("smollm2", "qwen3"), ("deepseek-v3", "qwen3"), ("llama3", "smollm2")]


def _chunk_view(text, student, teacher, s_tok, t_tok):
    s, t = tokenize(s_tok, [text])[0], tokenize(t_tok, [text])[0]
    chunks = align(s, t, s_tok, t_tok)
    return [
        (
            SHAPE_NAMES[chunks.shape[k]],
            [s_tok.bytes.token_bytes(i) for i in s.ids[slice(*chunks.student[k])]],
            [t_tok.bytes.token_bytes(i) for i in t.ids[slice(*chunks.teacher[k])]],
            bool(chunks.is_correct[k]),
        )
        for k in range(len(chunks))
    ]


def test_hand_checked_shapes_llama3_vs_qwen3(zoo):
    llama, qwen = zoo("llama3"), zoo("qwen3")
    assert _chunk_view("Hi 12345 👍🏽", None, None, llama, qwen) == [
        ("1:1", [b"Hi"], [b"Hi"], True),
        ("1:1", [b" "], [b" "], True),
        ("1:n", [b"123"], [b"1", b"2", b"3"], True),
        ("1:n", [b"45"], [b"4", b"5"], True),
        ("n:m", [b" \xf0\x9f\x91", b"\x8d"], [b" \xf0\x9f\x91", b"\x8d"], True),
        ("n:1", [b"\xf0\x9f", b"\x8f", b"\xbd"], [b"\xf0\x9f\x8f\xbd"], True),
    ]


def test_trimmed_and_untrimmed_offsets_pair_every_space_token(zoo):
    """Llama-3 trims the leading space out of spans, Qwen does not: ends still meet."""
    llama, qwen = zoo("llama3"), zoo("qwen3")
    view = _chunk_view(" the cat  sat", None, None, llama, qwen)
    assert [v[0] for v in view] == ["1:1"] * len(view)
    assert all(v[3] for v in view)
    assert b"".join(b for v in view for b in v[1]) == b" the cat  sat"


def test_bos_on_one_side_only_is_unpaired_and_first_chunk_has_no_prediction(zoo):
    llama, qwen = zoo("llama3"), zoo("qwen3")
    s = tokenize(llama, ["Hello world"], add_special_tokens=True)[0]
    t = tokenize(qwen, ["Hello world"], add_special_tokens=True)[0]
    assert s.ids.tolist() == [128000, 9906, 1917] and t.ids.tolist() == [9707, 1879]
    chunks = align(s, t, llama, qwen)
    assert chunks.student.tolist() == [[1, 2], [2, 3]]
    assert chunks.teacher.tolist() == [[0, 1], [1, 2]]
    assert chunks.has_prediction.tolist() == [False, True]
    assert SHAPE_SPECIAL not in chunks.shape


def test_specials_pair_by_role_in_their_gap(zoo):
    """Hand-made sequences: eot pairs with eot after the chunk before it; pad never pairs."""
    llama, qwen = zoo("llama3"), zoo("qwen3")
    eot_l, eot_q, bos_l, pad_q = 128009, 151645, 128000, None
    hello_l, world_l = 9906, 1917
    hello_q = qwen.hf.convert_tokens_to_ids("Hello")
    world_q = qwen.hf.convert_tokens_to_ids("Ġworld")
    assert pad_q is None  # Qwen3 has no dedicated pad token
    s = Tokenized(np.array([bos_l, hello_l, eot_l, world_l, eot_l]), np.array([0, 5, 5, 11, 11]))
    t = Tokenized(np.array([hello_q, eot_q, world_q]), np.array([5, 5, 11]))
    chunks = align(s, t, llama, qwen)
    assert chunks.student.tolist() == [[1, 2], [2, 3], [3, 4]]
    assert chunks.teacher.tolist() == [[0, 1], [1, 2], [2, 3]]
    assert [SHAPE_NAMES[x] for x in chunks.shape] == ["1:1", "special", "1:1"]
    assert chunks.has_prediction.tolist() == [False, True, True]


def test_literal_added_token_in_user_text_makes_its_chunk_incorrect(zoo):
    """DeepSeek matches ``<think>`` in user text (added, not special); Llama-3 reads text."""
    llama, deepseek = zoo("llama3"), zoo("deepseek-v3")
    text = "so <think>x y"
    s, t = tokenize(llama, [text])[0], tokenize(deepseek, [text])[0]
    assert deepseek.bytes.kind[t.ids].tolist().count(KIND_SPECIAL) == 1
    assert llama.bytes.kind[s.ids].tolist().count(KIND_SPECIAL) == 0
    chunks = align(s, t, llama, deepseek)
    texts = [
        (_bytes(llama, s, chunks.student[k]), _bytes(deepseek, t, chunks.teacher[k]))
        for k in range(len(chunks))
    ]
    around = [k for k, (a, b) in enumerate(texts) if b"<think>" in a + b]
    assert len(around) == 1 and not chunks.is_correct[around[0]]
    assert texts[0] == (b"so", b"so") and chunks.is_correct[0]
    assert texts[-1] == (b" y", b" y") and chunks.is_correct[-1]


def test_qwen_nfc_and_literal_specials_on_both_sides(zoo):
    """Both Qwen3 and DeepSeek read ``<think>`` in user text as their think_open token: the two
    specials pair by role like any other role pair."""
    deepseek, qwen = zoo("deepseek-v3"), zoo("qwen3")
    s, t = tokenize(deepseek, ["a <think>b"])[0], tokenize(qwen, ["a <think>b"])[0]
    chunks = align(s, t, deepseek, qwen)
    assert [SHAPE_NAMES[x] for x in chunks.shape] == ["1:1", "1:1", "special", "1:1"]


def _bytes(tok, seq, rng) -> bytes:
    return b"".join(tok.bytes.token_bytes(i) for i in seq.ids[slice(*rng)])


def _reference_walk(s_ends, t_ends):
    """The spec's walker, literally: clusters by running max, then take from the smaller end."""

    def clusters(ends):
        out, running = [], -1
        for pos, end in enumerate(ends):
            if out and end <= running:
                out[-1][1] = pos + 1
            else:
                out.append([pos, pos + 1])
            running = max(running, end)
            out[-1].append(running) if len(out[-1]) == 2 else out[-1].__setitem__(2, running)
        return out

    a, b = clusters(list(s_ends)), clusters(list(t_ends))
    i = j = ci = cj = 0
    chunks = []
    while i < len(a) and j < len(b):
        if a[i][2] == b[j][2]:
            chunks.append(((a[ci][0], a[i][1]), (b[cj][0], b[j][1])))
            i, j = i + 1, j + 1
            ci, cj = i, j
        elif a[i][2] < b[j][2]:
            i += 1
        else:
            j += 1
    return chunks


TEXT_PARTS = st.sampled_from(
    [
        "hello",
        " world",
        "  ",
        "\n",
        "\r\n",
        "\t",
        "    ",
        "x = f(a, b)\n",
        "def g():\n\treturn 1",
        "日本語",
        "中文字符",
        "👍🏽",
        "👨‍👩‍👧",
        "🇫🇷",
        "e\u0301",
        "A\u030a",
        "n\u0303",
        "\x00",
        "\x04",
        "\x7f",
        "<|im_end|>",
        "<|eot_id|>",
        "<think>",
        "</think>",
        "<｜User｜>",
        "123456",
        "3.14",
        "½²",
        "Ünïcödé",
        "I'm",
        "WE'VE",
        "ß",
        "\u200b",
        "—",
        "«»",
        "…",
    ]
)
TEXTS = st.lists(st.one_of(TEXT_PARTS, st.text(max_size=6)), min_size=1, max_size=25).map("".join)


@pytest.mark.parametrize(("student", "teacher"), PAIRS)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=TEXTS, bos=st.booleans())
def test_invariants_over_generated_text(zoo, student, teacher, text, bos):
    s_tok, t_tok = zoo(student), zoo(teacher)
    s = tokenize(s_tok, [text], add_special_tokens=bos)[0]
    t = tokenize(t_tok, [text], add_special_tokens=bos)[0]
    chunks = align(s, t, s_tok, t_tok)
    s_special = s_tok.bytes.kind[s.ids] == KIND_SPECIAL
    t_special = t_tok.bytes.kind[t.ids] == KIND_SPECIAL
    content = chunks.shape != SHAPE_SPECIAL

    # Content chunks equal the literal walker's, partition both sides in order, ends coincide.
    s_pos, t_pos = np.flatnonzero(~s_special), np.flatnonzero(~t_special)
    expected = _reference_walk(s.ends[s_pos], t.ends[t_pos])
    got = list(zip(chunks.student[content].tolist(), chunks.teacher[content].tolist(), strict=True))
    assert got == [
        ([s_pos[a0], s_pos[a1 - 1] + 1], [t_pos[b0], t_pos[b1 - 1] + 1])
        for (a0, a1), (b0, b1) in expected
    ]
    previous = (0, 0)
    for (s0, s1), (t0, t1) in got:
        assert s0 >= previous[0] and t0 >= previous[1] and s1 > s0 and t1 > t0
        assert s.ends[s0:s1][~s_special[s0:s1]].max() == t.ends[t0:t1][~t_special[t0:t1]].max()
        previous = (s1, t1)
    covered = sum(int((~s_special[a:b]).sum()) for (a, b), _ in got)
    assert covered == (expected[-1][0][1] if expected else 0)

    # Correct chunks have equal bytes; specials are pairs of one token with equal roles.
    for k in np.flatnonzero(chunks.is_correct & content):
        assert _bytes(s_tok, s, chunks.student[k]) == _bytes(t_tok, t, chunks.teacher[k])
    for k in np.flatnonzero(~content):
        (s0, s1), (t0, t1) = chunks.student[k], chunks.teacher[k]
        assert s1 - s0 == 1 and t1 - t0 == 1
        role = s_tok.roles[int(s.ids[s0])]
        assert role == t_tok.roles[int(t.ids[t0])] and role != "pad"
    # Chunks come in text order and has_prediction is exactly "not at token 0".
    assert (np.diff(chunks.student[:, 0]) > 0).all()
    first = (chunks.student[:, 0] == 0) | (chunks.teacher[:, 0] == 0)
    assert (chunks.has_prediction == ~first).all()


@pytest.mark.parametrize(("student", "teacher"), PAIRS[:3])
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(texts=st.lists(TEXTS, min_size=0, max_size=6), bos=st.booleans())
def test_align_many_equals_align_per_document(zoo, student, teacher, texts, bos):
    s_tok, t_tok = zoo(student), zoo(teacher)
    students = tokenize(s_tok, texts, add_special_tokens=bos) if texts else []
    teachers = tokenize(t_tok, texts, add_special_tokens=bos) if texts else []
    batched = align_many(students, teachers, s_tok, t_tok)
    assert len(batched) == len(texts)
    for s, t, got in zip(students, teachers, batched, strict=True):
        one = align(s, t, s_tok, t_tok)
        for field in ("student", "teacher", "shape", "is_correct", "has_prediction"):
            assert getattr(got, field).tolist() == getattr(one, field).tolist()


@pytest.mark.parametrize("name", ["llama3", "qwen3", "smollm2", "deepseek-v3"])
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(texts=st.lists(TEXTS, min_size=1, max_size=5), bos=st.booleans())
def test_tokenize_reads_what_transformers_returns(zoo, name, texts, bos):
    """The Rust encodings read directly equal transformers' call with the same options."""
    tok = zoo(name)
    expected = tok.hf(
        texts, add_special_tokens=bos, split_special_tokens=True, return_offsets_mapping=True
    )
    got = tokenize(tok, texts, add_special_tokens=bos, with_starts=True)
    for i, tokens in enumerate(got):
        spans = expected["offset_mapping"][i]
        assert tokens.ids.tolist() == expected["input_ids"][i]
        assert tokens.starts.tolist() == [a for a, _ in spans]
        assert tokens.ends.tolist() == [b for _, b in spans]


def test_tokenize_ignores_the_tokenizers_own_truncation_and_padding(zoo_cache):
    """A tokenizer.json may carry truncation or padding; tokenize applies neither (as
    transformers' call does not) and leaves the special-token switch as it was."""
    from crosskd.tokenization import load_tokenizer

    tok = load_tokenizer("zoo:llama3", cache_dir=zoo_cache)
    backend = tok.hf.backend_tokenizer
    backend.enable_truncation(3)
    backend.enable_padding(length=40)
    text = "one two three four five <|eot_id|>"
    (tokens,) = tokenize(tok, [text], add_special_tokens=True)
    assert backend.encode_special_tokens is False
    # BOS, five words, and the special's text in six pieces: neither cut at 3 nor padded to 40.
    assert len(tokens) == 12
    assert tokens.ids.tolist() == tok.hf(text, split_special_tokens=True).input_ids


def test_pad_specials_never_pair(zoo):
    deepseek = zoo("deepseek-v3")
    pad, eot = deepseek.role_ids["pad"], deepseek.role_ids["eot"]
    hello = deepseek.hf.convert_tokens_to_ids("Hello")
    seq = Tokenized(np.array([hello, pad, eot, pad]), np.array([5, 5, 5, 5]))
    chunks = align(seq, seq, deepseek, deepseek)
    special = chunks.shape == SHAPE_SPECIAL
    assert chunks.student[special].tolist() == [[2, 3]]  # the eot pair only


def test_special_inside_a_content_chunk_does_not_pair(zoo):
    """Found by hypothesis: DeepSeek's `<think>` matched right after `é` sits inside the
    (incorrect) content chunk on one side; pairing it too would put a token in two chunks."""
    deepseek, qwen = zoo("deepseek-v3"), zoo("qwen3")
    s, t = tokenize(deepseek, ["é<think>hello"])[0], tokenize(qwen, ["é<think>hello"])[0]
    chunks = align(s, t, deepseek, qwen)
    assert (np.diff(chunks.student[:, 0]) > 0).all() and (np.diff(chunks.teacher[:, 0]) > 0).all()
    covered = np.zeros(len(s), dtype=int)
    for s0, s1 in chunks.student:
        covered[s0:s1] += 1
    assert covered.max() == 1
