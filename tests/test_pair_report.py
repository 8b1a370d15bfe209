"""The tokenizer-pair compatibility report: hand-checked numbers on tiny texts, parity with a
chunk-by-chunk recomputation from ``align`` over generated and real documents, batching and
table-building parity, the JSON round trip, and the text rendering."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from crosskd.alignment import SHAPE_NAMES, align, tokenize
from crosskd.alignment.corpus import _po_messages, benchmark_corpus
from crosskd.alignment.report import PairReport, ShapeStats, pair_report
from crosskd.alignment.report_text import format_report
from crosskd.tables import TablePair

PAIRS = [("llama3", "qwen3"), ("smollm2", "qwen3"), ("deepseek-v3", "qwen3"), ("llama3", "smollm2")]


@pytest.fixture(scope="module")
def table_pair(built_table):
    """``table_pair(student, teacher)`` -> the TablePair of both directions."""
    made: dict = {}

    def get(student: str, teacher: str) -> TablePair:
        if (student, teacher) not in made:
            made[student, teacher] = TablePair(
                built_table(student, teacher), built_table(teacher, student)
            )
        return made[student, teacher]

    return get


def _report(zoo, table_pair, student, teacher, texts, **kwargs) -> PairReport:
    return pair_report(
        zoo(student),
        zoo(teacher),
        texts,
        tables=table_pair(student, teacher),
        progress=False,
        **kwargs,
    )


def test_hand_checked_llama3_vs_qwen3(zoo, table_pair):
    """Chunks: 1:1 "Hi", 1:1 " ", 1:n "123" (Qwen splits digits), 1:n "45", n:m " 👍" (2:2
    byte pieces), n:1 "🏽" (3 Llama byte pieces, one Qwen token): 9 student, 10 teacher tokens."""
    r = _report(zoo, table_pair, "llama3", "qwen3", ["Hi 12345 👍🏽"])
    assert (r.documents, r.characters, r.student_tokens, r.teacher_tokens) == (1, 11, 9, 10)
    assert {n: s.chunks for n, s in r.shapes.items()} == {
        "1:1": 2,
        "1:n": 2,
        "n:1": 1,
        "n:m": 1,
        "special": 0,
    }
    assert [r.shapes[n].student_tokens for n in SHAPE_NAMES] == [2, 2, 3, 2, 0]
    assert [r.shapes[n].teacher_tokens for n in SHAPE_NAMES] == [2, 5, 1, 2, 0]
    assert r.one_to_one_student_share == pytest.approx(2 / 9)
    assert r.one_to_one_teacher_share == pytest.approx(2 / 10)
    assert r.student_tokens_per_char == pytest.approx(9 / 11)
    assert r.shapes["1:n"].max_teacher_tokens == 3
    assert r.shapes["n:1"].max_student_tokens == 3
    assert (r.shapes["n:m"].max_student_tokens, r.shapes["n:m"].max_teacher_tokens) == (2, 2)
    assert r.correct_rate == 1.0 and r.incorrect_student_share == 0.0
    assert (r.unpaired_student_tokens, r.unpaired_teacher_tokens) == (0, 0)
    assert r.chunks_without_prediction == 1
    assert r.signal_shares == pytest.approx(
        {"token": 2 / 9, "chunk": 5 / 9, "realized": 2 / 9, "none": 0.0}
    )
    # Not common: Llama's "123" and "45" (Qwen has no multi-digit token) and Qwen's "🏽"
    # (Llama has it only as byte pieces); every other token of the text is.
    assert (r.student_tokens_common, r.teacher_tokens_common) == (7, 9)
    assert r.common_vocabulary == len(table_pair("llama3", "qwen3").common)
    assert r.verdict.startswith("WEAK: 22.2% of student tokens")


def test_decomposed_accent_is_incorrect_and_leaves_the_mark_unpaired(zoo, table_pair):
    """Qwen's NFC turns "e" + U+0301 into one token "é" ending at 1; Llama keeps "e" (end 1)
    and the mark (end 2): one incorrect 1:1 chunk, and the mark has no counterpart."""
    r = _report(zoo, table_pair, "llama3", "qwen3", ["e\u0301"])
    assert (r.student_tokens, r.teacher_tokens, r.chunks) == (2, 1, 1)
    assert (r.shapes["1:1"].chunks, r.shapes["1:1"].correct_chunks) == (1, 0)
    assert r.incorrect_student_share == pytest.approx(0.5)
    assert (r.unpaired_student_tokens, r.unpaired_teacher_tokens) == (1, 0)
    assert r.documents_with_unpaired == 1
    assert r.signal_shares["none"] == pytest.approx(1.0)
    assert "Check text normalisation" in r.verdict


def test_dropped_control_character_and_special_pair(zoo, table_pair):
    """SmolLM2 drops U+0004: Llama's token for it stays unpaired. DeepSeek and Qwen both match
    a literal ``<think>``: a special pair of its own, counted as realized-only signal."""
    r = _report(zoo, table_pair, "llama3", "smollm2", ["a\x04"])
    assert (r.student_tokens, r.teacher_tokens, r.unpaired_student_tokens) == (2, 1, 1)
    assert r.shapes["1:1"].correct_chunks == 1 and r.documents_with_unpaired == 1
    r = _report(zoo, table_pair, "deepseek-v3", "qwen3", ["x <think> y"])
    assert [r.shapes[n].chunks for n in SHAPE_NAMES] == [3, 0, 0, 0, 1]
    assert r.signal_shares["realized"] == pytest.approx(1 / 4)


def _generated_documents(count: int, seed: int = 7) -> list[str]:
    pieces = [
        "hello",
        " world",
        "  \t ",
        "\r\n",
        "\n\n\n",
        "12345678",
        "3.14159",
        "def f(x):\n    ",
        "return x ** 2",
        "東京都",
        "中文文本",
        "한국어",
        "Ελληνικά",
        "русский",
        "👍🏽",
        "👨‍👩‍👧",
        "e\u0301",
        "\u0301",
        "\x04",
        "\x01",
        "\x7f",
        "<|im_end|>",
        "<think>",
        "<|eot_id|>",
        "</think>",
        "ﬁ",
        "      ",
        "Ａ",
        "\u200b",
        "😀😀",
        "x",
    ]
    rng = random.Random(seed)
    return ["".join(rng.choices(pieces, k=rng.randint(0, 40))) for _ in range(count)]


def _recompute(student, teacher, texts: list[str]) -> dict:
    """The report's counts from ``align``, one text and one chunk at a time."""
    shapes = {n: dict.fromkeys(ShapeStats.__dataclass_fields__, 0) for n in SHAPE_NAMES}
    out = dict.fromkeys(
        [
            "documents",
            "characters",
            "student_tokens",
            "teacher_tokens",
            "unpaired_student_tokens",
            "unpaired_teacher_tokens",
            "documents_with_unpaired",
            "chunks_without_prediction",
        ],
        0,
    )
    for text in texts:
        s, t = tokenize(student, [text])[0], tokenize(teacher, [text])[0]
        special_s = {i for i, x in enumerate(s.ids.tolist()) if student.is_special(x)}
        special_t = {i for i, x in enumerate(t.ids.tolist()) if teacher.is_special(x)}
        chunks = align(s, t, student, teacher)
        paired_s, paired_t = set(), set()
        for k in range(len(chunks)):
            # A content chunk's tokens are its content tokens; a special pair is its specials.
            pair = SHAPE_NAMES[chunks.shape[k]] == "special"
            in_s = [i for i in range(*chunks.student[k]) if (i in special_s) == pair]
            in_t = [i for i in range(*chunks.teacher[k]) if (i in special_t) == pair]
            st = shapes[SHAPE_NAMES[chunks.shape[k]]]
            st["chunks"] += 1
            st["student_tokens"] += len(in_s)
            st["teacher_tokens"] += len(in_t)
            st["max_student_tokens"] = max(st["max_student_tokens"], len(in_s))
            st["max_teacher_tokens"] = max(st["max_teacher_tokens"], len(in_t))
            if chunks.is_correct[k]:
                st["correct_chunks"] += 1
                st["correct_student_tokens"] += len(in_s)
            out["chunks_without_prediction"] += not chunks.has_prediction[k]
            assert paired_s.isdisjoint(in_s) and paired_t.isdisjoint(in_t)
            paired_s.update(in_s)
            paired_t.update(in_t)
        out["documents"] += 1
        out["characters"] += len(text)
        out["student_tokens"] += len(s)
        out["teacher_tokens"] += len(t)
        out["unpaired_student_tokens"] += len(s) - len(paired_s)
        out["unpaired_teacher_tokens"] += len(t) - len(paired_t)
        out["documents_with_unpaired"] += len(paired_s) < len(s) or len(paired_t) < len(t)
    out["shapes"] = shapes
    return out


@pytest.fixture(scope="module")
def real_documents() -> list[str]:
    """About 100 KB of the benchmark corpus (stdlib sources, docstrings, translations)."""
    return benchmark_corpus(100_000)


@pytest.fixture(scope="module")
def mixed_documents(real_documents) -> list[str]:
    """Generated edge-case documents plus the real ones."""
    return _generated_documents(300) + real_documents


@pytest.mark.parametrize(("student", "teacher"), PAIRS)
def test_parity_with_chunk_by_chunk_recomputation(
    zoo, table_pair, mixed_documents, student, teacher
):
    r = _report(zoo, table_pair, student, teacher, mixed_documents, batch_size=32)
    expected = _recompute(zoo(student), zoo(teacher), mixed_documents)
    got = r.to_dict()
    assert {key: got[key] for key in expected} == expected
    assert r.shapes["1:1"].chunks > 0
    common = table_pair(student, teacher).common
    common_s, common_t = set(common[:, 0].tolist()), set(common[:, 1].tolist())
    s_ids = np.concatenate([x.ids for x in tokenize(zoo(student), mixed_documents)]).tolist()
    t_ids = np.concatenate([x.ids for x in tokenize(zoo(teacher), mixed_documents)]).tolist()
    assert r.student_tokens_common == sum(i in common_s for i in s_ids)
    assert r.teacher_tokens_common == sum(i in common_t for i in t_ids)
    shares = r.signal_shares
    assert sum(shares.values()) == pytest.approx(1.0)
    assert all(0.0 <= v <= 1.0 for v in shares.values())


def test_batching_and_table_building_do_not_change_the_report(zoo, table_pair):
    texts = _generated_documents(60, seed=11)
    llama, qwen = zoo("llama3"), zoo("qwen3")
    by_one = _report(zoo, table_pair, "llama3", "qwen3", iter(texts), batch_size=1)
    by_many = _report(zoo, table_pair, "llama3", "qwen3", texts, batch_size=64)
    built_here = pair_report(llama, qwen, texts, progress=False)
    assert by_one == by_many == built_here


def test_llama3_vs_qwen3_on_real_text_is_mostly_one_to_one(zoo, table_pair, real_documents):
    r = _report(zoo, table_pair, "llama3", "qwen3", real_documents)
    assert 0.75 < r.one_to_one_student_share < 0.99
    assert r.correct_rate > 0.999 and r.unpaired_student_tokens == 0
    assert r.verdict.startswith("GOOD")


def test_json_round_trip_and_empty_input(zoo, table_pair):
    r = _report(zoo, table_pair, "llama3", "qwen3", ["Hi 12345 👍🏽", "", "e\u0301"])
    data = json.loads(json.dumps(r.to_dict()))
    assert PairReport.from_dict(data) == r
    assert data["derived"]["one_to_one_student_share"] == pytest.approx(3 / 11)  # 2 + "e"
    assert data["derived"]["correct_rate_by_shape"]["1:1"] == pytest.approx(2 / 3)
    assert data["derived"]["verdict"] == r.verdict
    empty = _report(zoo, table_pair, "llama3", "qwen3", [])
    assert (empty.documents, empty.student_tokens, empty.chunks) == (0, 0, 0)
    assert empty.verdict.startswith("NO DATA")
    assert "Verdict: NO DATA" in format_report(empty)
    with pytest.raises(ValueError, match="batch_size"):
        _report(zoo, table_pair, "llama3", "qwen3", ["x"], batch_size=0)


def test_format_shows_the_headline_numbers(zoo, table_pair):
    r = _report(zoo, table_pair, "llama3", "qwen3", ["Hi 12345 👍🏽"])
    text = format_report(r)
    for needle in (
        "student zoo:llama3",
        "teacher zoo:qwen3",
        "Verdict: WEAK",
        "Chunk shapes",
        "What this means",
        "22.22%",
        f"{r.common_vocabulary:,}",
        f"{r.common_student_share:.2%}",
    ):
        assert needle in text, needle
    lines = text.splitlines()
    table = lines[lines.index("Chunk shapes") + 2 : lines.index("Chunk shapes") + 8]
    rows = {line.split()[0]: line.split() for line in table}
    assert rows["1:n"][:2] == ["1:n", "2"] and rows["n:1"][3] == "3"
    assert rows["all"][1] == "6"


def test_benchmark_corpus_is_deterministic_and_mixed(real_documents):
    again = benchmark_corpus(100_000)
    assert again == real_documents
    size = sum(len(d.encode("utf-8")) for d in again)
    assert 100_000 <= size < 100_000 + 3 * 4096
    assert any("def " in d for d in again)  # code
    if any(ord(c) > 0x3000 for d in again for c in d):  # CJK from the catalogues, if present
        assert sum(len(d) for d in again) < size


def test_po_messages_hand_checked():
    po = (
        'msgid ""\nmsgstr ""\n"Content-Type: text/plain; charset=UTF-8\\n"\n\n'
        '#: a.c:1\nmsgid "Hello"\nmsgstr "Hallo"\n\n'
        'msgid "two\\nlines"\nmsgstr ""\n"zwei\\n"\n"Zeilen \\"gut\\""\n\n'
        'msgid "file"\nmsgid_plural "files"\nmsgstr[0] "Datei"\nmsgstr[1] "Dateien"\n\n'
        'msgid "untranslated"\nmsgstr ""\n\n'
        'msgctxt "menu"\nmsgid ""\n"a long id"\nmsgstr ""\n"ein langer Text, 中文"\n'
    )
    assert _po_messages(po) == [
        "Hallo",
        'zwei\nZeilen "gut"',
        "Datei",
        "Dateien",
        "ein langer Text, 中文",
    ]


def test_cli_inspect_pair_matches_the_aligners_own_chunks(
    tmp_path, zoo, zoo_cache, monkeypatch, capsys
):
    """`crosskd inspect pair --json` over rows: the 1:1 share is the aligner's own count."""
    from crosskd.alignment import SHAPE_1_1, align_many
    from crosskd.cli import main

    monkeypatch.setenv("CROSSKD_CACHE_DIR", str(zoo_cache))
    texts = ["Hello world, 12345!", "def f(x):\n    return x * 2  # 日本語", "Ünïcödé 👍🏽 text."]
    rows = [{"text": t} for t in texts[:2]] + [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": texts[2]}]}
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), "utf-8")
    status = main(
        [
            "inspect",
            "pair",
            "--student-tokenizer",
            "zoo:llama3",
            "--teacher-tokenizer",
            "zoo:qwen3",
            "--data",
            str(tmp_path / "rows.jsonl"),
            "--json",
        ]
    )
    assert status == 0
    derived = json.loads(capsys.readouterr().out)["derived"]
    llama, qwen = zoo("llama3"), zoo("qwen3")
    plain = ["Hello world, 12345!", texts[1], "q\n" + texts[2]]
    students, teachers = tokenize(llama, plain), tokenize(qwen, plain)
    chunks = align_many(students, teachers, llama, qwen)
    one_to_one = sum(int((c.shape == SHAPE_1_1).sum()) for c in chunks)
    assert derived["one_to_one_student_share"] == pytest.approx(
        one_to_one / sum(len(s) for s in students)
    )


def test_licence_documents_hand_checked(tmp_path):
    from crosskd.alignment.corpus import licence_documents
    from crosskd.errors import DataError

    (tmp_path / "a").write_text("one\ntwo\n")
    (tmp_path / "b").write_text("three\nfour\n")
    (tmp_path / "0").symlink_to(tmp_path / "b")  # first by name, but a link: skipped
    # Lines of 4, 4, 6 and 5 bytes in windows of at most 10: "one\ntwo\n" (8 bytes, below the
    # target of 10), then "three\n" reaches it.
    assert licence_documents(10, document_bytes=10, folder=tmp_path) == ["one\ntwo\n", "three\n"]
    assert licence_documents(100, document_bytes=10, folder=tmp_path) == [
        "one\ntwo\n",
        "three\n",
        "four\n",
    ]  # all there is
    with pytest.raises(DataError, match=r"nowhere: no licence texts there .* give ood_data"):
        licence_documents(10, folder=tmp_path / "nowhere")
