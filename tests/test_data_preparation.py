"""A window of rows prepared together (`prepare_rows`: one encoding batch per model, clipping in
lockstep, one vectorised alignment per teacher) equals the rows prepared one by one
(`prepare_row`), field by field, on real tokenizers: plain text clipped and whole, text with
specials, emoji and combining marks, conversations between them, a cross-tokenizer and a
same-tokenizer teacher."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crosskd.alignment import ChatOptions, harmonize_reasoning, render
from crosskd.data.preparation import Preparation, _longest_prefixes, prepare_row, prepare_rows
from crosskd.data.records import Record
from crosskd.errors import DataError

TEXTS = [
    "Hello world, hello world.",
    "def f(x):\n    return x ** 2  # squares\n" * 6,
    "Hungary\nIceland\nIndia\nIndonesia\nIran\nIraq\nIreland\n" * 3,
    "<|endoftext|> is text here, and so is <|im_start|>.",
    "e\u0301\u0302 👍🏽 世界 \r\n\r\n" * 5,
    " ",
]
CHAT = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "It is 4, because two and two make four."},
]


def _same(a: object, b: object, where: str = "row") -> None:
    """Equal values, arrays element by element, dataclasses field by field."""
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype, where
        assert np.array_equal(a, b), where
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _records(texts: list[str], chat_at: set[int]) -> list[Record]:
    """The texts as text rows, with a conversation before each index of ``chat_at``: its
    answer is the text there (cut when long), then :data:`CHAT` (whole)."""
    records = []
    for i, text in enumerate(texts):
        if i in chat_at:
            long = [CHAT[0], {"role": "assistant", "content": text * 4}]
            records.append(Record(f"l{i}", None, long, "data.jsonl", i + 1))
            records.append(Record(f"c{i}", None, CHAT, "data.jsonl", i + 1))
        records.append(Record(f"t{i}", text, None, "data.jsonl", i + 1))
    return records


def _check(records: list[Record], preparation: Preparation) -> list[dict]:
    together = prepare_rows(records, preparation)
    assert len(together) == len(records)
    for i, (row, record) in enumerate(zip(together, records, strict=True)):
        _same(row, prepare_row(record, preparation), f"row {i}")
    return together


def test_a_window_prepares_as_its_rows_one_by_one(zoo):
    llama, qwen = zoo("llama3"), zoo("qwen3")
    preparation = Preparation.of(llama, [qwen, llama], [80, 76, 80], ChatOptions())
    rows = _check(_records(TEXTS, chat_at={1, 2, 5}), preparation)
    reasons = [row["clip_reason"] for row in rows]
    assert "text" in reasons and None in reasons  # text rows clipped and whole
    chats = [reason for row, reason in zip(rows, reasons, strict=True) if row["messages"]]
    assert chats.count("message") >= 2 and None in chats  # answers cut in lockstep, and whole


def test_generated_windows_prepare_as_their_rows(zoo):
    llama, qwen = zoo("llama3"), zoo("qwen3")
    pieces = st.sampled_from(
        [
            "Ice",
            "land",
            " ",
            "\n",
            "👍🏽",
            "e\u0301",
            "\r\n",
            "世界",
            "x = 1;",
            "<|endoftext|>",
            "42",
        ]
    )
    texts = st.lists(pieces, min_size=1, max_size=30).map("".join)

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(texts, min_size=1, max_size=5), st.integers(4, 30))
    def run(window: list[str], cap: int) -> None:
        preparation = Preparation.of(llama, [qwen], [cap, cap + 3], ChatOptions())
        _check(_records(window, chat_at=set()), preparation)

    run()


def _reference_longest_prefix(messages, key, models, capacities):
    """The cut of the last message's ``key`` by rendering every probe whole: the plain
    bisection :func:`_longest_prefix` must match."""
    text = messages[-1][key]

    def fits(cut: int) -> bool:
        probe = [*messages[:-1], {**messages[-1], key: text[:cut]}]
        views = [render(tok, probe, sample_id="s") for tok in models]
        return all(len(v.tokens) <= c for v, c in zip(views, capacities, strict=True))

    lo, hi = 0, len(text)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return None if lo == 0 else [*messages[:-1], {**messages[-1], key: text[:lo]}]


def test_messages_are_cut_where_rendering_every_probe_cuts_them(zoo):
    """The answers' (or reasoning's) cuts, searched in lockstep by encoding each cut text alone
    against the rest of its rendering measured once, are the cuts that rendering each probe
    whole finds, one conversation at a time, on real templates; a content that is not one
    piece of the rendering (a second think block, split off again by rendering) falls back to
    whole renderings and still agrees; the same with the conversations' renderings given."""
    models = [zoo("llama3"), zoo("qwen3"), zoo("deepseek-v3")]
    pieces = st.sampled_from(
        ["Ice", "land", " ", "\n", "👍🏽", "e\u0301", "\r\n", "世界", "x = 1;", "<|eot_id|>", "42"]
    )
    texts = st.lists(pieces, min_size=2, max_size=40).map("".join)
    user = {"role": "user", "content": "Hi?"}
    bare = [user, {"role": "assistant", "content": ""}]
    base = [len(render(tok, bare, sample_id="s").tokens) for tok in models]
    conversation = st.tuples(texts, texts, st.booleans(), st.booleans(), st.booleans())

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(conversation, min_size=1, max_size=4), st.integers(0, 40))
    def run(conversations: list[tuple], slack: int) -> None:
        capacities = [n + slack // (m + 1) for m, n in enumerate(base)]
        jobs, expected = [], []
        for answer, reasoning, think, twice, given_views in conversations:
            message = {"role": "assistant", "content": answer}
            if think:
                message["reasoning_content"] = reasoning
            elif twice:
                message["content"] = f"<think></think><think>{reasoning}</think>{answer}"
            messages = harmonize_reasoning(models, [user, message])
            views = [render(tok, messages, sample_id="s") for tok in models]
            for key in ("content", "reasoning_content"):
                if messages[-1].get(key):
                    jobs.append((messages, key, views if given_views else None))
                    expected.append(_reference_longest_prefix(messages, key, models, capacities))
        assert _longest_prefixes(jobs, models, capacities, ["s"] * len(jobs)) == expected

    run()


def test_the_first_bad_conversation_of_a_window_is_the_one_named(zoo):
    """Conversations are prepared in phases across the window (renderings, then the answers'
    cuts), yet the error raised is the first bad record's, in order, as one by one: a prompt
    too long for any answer (found while cutting) comes before a conversation with no
    answer at all (found first)."""
    llama, qwen = zoo("llama3"), zoo("qwen3")
    preparation = Preparation.of(llama, [qwen], [60, 60], ChatOptions())
    long_prompt = [{"role": "user", "content": "word " * 200}, CHAT[1]]
    no_answer = [CHAT[0]]
    records = [
        Record("fine", None, CHAT, "data.jsonl", 1),
        Record("too-long", None, long_prompt, "data.jsonl", 2),
        Record("no-answer", None, no_answer, "data.jsonl", 3),
    ]
    with pytest.raises(DataError, match=r"sample too-long \(data\.jsonl, row 2\): even with an"):
        prepare_rows(records, preparation)
    with pytest.raises(DataError, match="sample no-answer: the conversation has no assistant"):
        prepare_rows([records[0], records[2], records[1]], preparation)
