"""Sub-token tables on real tokenizer pairs: build, store, validate, derive lookups."""

from __future__ import annotations

import numpy as np
import pytest

from crosskd.tables import (
    Flag,
    TablePair,
    load_table,
    save_table,
    validate_pair,
    validate_table,
)

PAIRS = [("llama3", "qwen3"), ("smollm2", "qwen3"), ("deepseek-v3", "qwen3")]


@pytest.mark.parametrize(("student", "teacher"), PAIRS)
def test_fresh_tables_validate_in_both_directions(zoo, built_table, student, teacher):
    reports = validate_pair(
        zoo(student), zoo(teacher), built_table(student, teacher), built_table(teacher, student)
    )
    assert [r.violations for r in reports] == [[], []]
    for report, (src, dst) in zip(reports, [(student, teacher), (teacher, student)], strict=True):
        counts = report.counts
        assert sum(counts.values()) == zoo(src).vocab_size
        assert counts["normal"] > 40_000
        table = built_table(src, dst)
        assert len(table.flags) == zoo(src).vocab_size
        assert table.meta.dst_vocab_size == zoo(dst).vocab_size


@pytest.mark.parametrize(("src", "dst"), [("llama3", "qwen3"), ("qwen3", "llama3")])
def test_chains_equal_tiktoken_bpe_of_the_raw_bytes(zoo, built_table, tiktoken_encoding, src, dst):
    """Parity with an independent BPE (tiktoken over the same rank file, no regex split)."""
    table, tok, reference = built_table(src, dst), zoo(src), tiktoken_encoding(dst)
    normal = np.flatnonzero(table.flags == Flag.NORMAL)
    assert len(normal) == tok.length - len(tok.special_ids)
    mismatched = [
        i
        for i in normal.tolist()
        if table.chain(i).tolist() != reference._encode_single_piece(tok.bytes.token_bytes(i))
    ]
    assert mismatched == []


def test_chains_are_complete_and_never_truncated(zoo, built_table):
    table = built_table("qwen3", "llama3")
    longest = int(np.argmax(table.lengths))
    chain = table.chain(longest)
    assert len(chain) >= 8
    assert zoo("llama3").bytes.concat(chain).tobytes() == zoo("qwen3").bytes.token_bytes(longest)


def test_bytes_that_are_not_utf8_alone_are_mapped(zoo, built_table):
    llama, qwen = zoo("llama3"), zoo("qwen3")
    table = built_table("llama3", "qwen3")
    partial = [
        i
        for i in range(0, 128000, 7)
        if not _is_utf8(llama.bytes.token_bytes(i)) and table.flags[i] == Flag.NORMAL
    ]
    assert len(partial) > 50
    for i in partial[:200]:
        assert qwen.bytes.concat(table.chain(i)).tobytes() == llama.bytes.token_bytes(i)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_specials_map_by_role(zoo, built_table):
    llama, qwen = zoo("llama3"), zoo("qwen3")
    s2t, t2s = built_table("llama3", "qwen3"), built_table("qwen3", "llama3")
    bot = llama.hf.convert_tokens_to_ids("<|begin_of_text|>")
    eot = llama.hf.convert_tokens_to_ids("<|eot_id|>")
    im_end = qwen.hf.convert_tokens_to_ids("<|im_end|>")
    assert (bot, eot, im_end) == (128000, 128009, 151645)
    assert s2t.flags[bot] == Flag.SPECIAL_UNMAPPED and s2t.chain(bot).size == 0
    assert s2t.flags[eot] == Flag.SPECIAL_MAPPED and s2t.chain(eot).tolist() == [im_end]
    assert t2s.chain(im_end).tolist() == [eot]
    think = qwen.hf.convert_tokens_to_ids("<think>")
    assert t2s.flags[think] == Flag.SPECIAL_UNMAPPED


def test_padding_rows_are_flagged(zoo, built_table):
    qwen = zoo("qwen3")
    table = built_table("qwen3", "llama3")
    assert qwen.length == 151669 and qwen.vocab_size == 151936
    assert np.all(table.flags[qwen.length :] == Flag.PADDING)
    assert table.flag_counts()["padding"] == 151936 - 151669
    assert np.all(table.lengths[qwen.length :] == 0)


def test_smollm2_missing_bytes_are_flagged_unrepresentable(zoo, built_table):
    smol, qwen = zoo("smollm2"), zoo("qwen3")
    table = built_table("qwen3", "smollm2")
    single_bytes = {qwen.bytes.token_bytes(i): i for i in range(256)}
    present = {
        smol.bytes.token_bytes(i)
        for i in np.flatnonzero(
            (smol.bytes.lengths == 1) & ~np.isin(np.arange(smol.vocab_size), smol.special_ids)
        ).tolist()
    }
    missing = [b for b in range(256) if bytes([b]) not in present]
    assert len(missing) == 21 and 0x04 in missing
    for b in missing:
        token_id = single_bytes[bytes([b])]
        assert table.flags[token_id] == Flag.UNREPRESENTABLE
        assert table.chain(token_id).size == 0
    unrep = np.flatnonzero(table.flags == Flag.UNREPRESENTABLE)
    for i in unrep.tolist():
        assert any(bytes([b]) in qwen.bytes.token_bytes(i) for b in missing)
    assert validate_table(table, qwen, smol).ok


def test_common_tokens_and_prefix_index(zoo, built_table):
    llama, qwen = zoo("llama3"), zoo("qwen3")
    pair = TablePair(built_table("llama3", "qwen3"), built_table("qwen3", "llama3"))
    hello_l = llama.hf.convert_tokens_to_ids("ĠHello")
    hello_q = qwen.hf.convert_tokens_to_ids("ĠHello")
    common = {tuple(row) for row in pair.common.tolist()}
    assert (hello_l, hello_q) in common
    students, teachers = pair.common[:, 0], pair.common[:, 1]
    assert len(np.unique(students)) == len(students) and len(np.unique(teachers)) == len(teachers)
    assert not np.isin(students, llama.special_ids).any()
    assert not np.isin(teachers, qwen.special_ids).any()
    for s, t in pair.common[:: max(1, len(pair.common) // 500)].tolist():
        assert llama.bytes.token_bytes(s) == qwen.bytes.token_bytes(t)
    for prefix, rows in list(pair.prefix_t2s.items())[:300]:
        for src_id, last in rows.tolist():
            chain = pair.teacher_to_student.chain(src_id).tolist()
            assert chain == [*prefix, last]
    # One row per whole chain (its lowest src id); llama3 has no two normal tokens with the same
    # bytes, so that is every normal token (tests/test_loss_chains.py has duplicates).
    total = sum(len(rows) for rows in pair.prefix_s2t.values())
    assert total == len(pair.chain_s2t) == int((pair.student_to_teacher.flags == Flag.NORMAL).sum())
    hello_chain = tuple(pair.student_to_teacher.chain(hello_l).tolist())
    assert hello_chain == (hello_q,) and pair.chain_s2t[hello_chain] == hello_l
    for chain, src_id in list(pair.chain_t2s.items())[:500]:
        assert pair.teacher_to_student.chain(src_id).tolist() == list(chain)
    assert len(pair.chain_t2s) == int((pair.teacher_to_student.flags == Flag.NORMAL).sum())


def test_save_and_load_round_trip(tmp_path, built_table):
    table = built_table("llama3", "qwen3")
    path = tmp_path / "deep" / "s2t.safetensors"
    saved = save_table(table, str(path))
    assert saved.source == str(path)
    loaded = load_table(str(path))
    assert loaded.meta == table.meta
    np.testing.assert_array_equal(loaded.offsets, table.offsets)
    np.testing.assert_array_equal(loaded.chains, table.chains)
    np.testing.assert_array_equal(loaded.flags, table.flags)
    assert [p.name for p in path.parent.iterdir()] == ["s2t.safetensors"]


def test_save_and_load_through_fsspec_memory(built_table):
    table = built_table("llama3", "qwen3")
    save_table(table, "memory://crosskd-test/tables/s2t.safetensors")
    loaded = load_table("memory://crosskd-test/tables/s2t.safetensors")
    np.testing.assert_array_equal(loaded.chains, table.chains)
