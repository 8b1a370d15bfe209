"""X-Token's projection ``W``: rows worked out by hand on a small table pair, the rules on real
tokenizer pairs (exact rows, chains, specials by role, the digits Llama-3 packs), the file
(round trip, refusals), the validator and the ``crosskd projection`` commands."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from loss_cases import hand_table

from crosskd.cli import main
from crosskd.errors import ConfigError, TableError
from crosskd.loss.gold import partition
from crosskd.projection import (
    build_projection,
    chain_weights,
    load_projection,
    save_projection,
    validate_projection,
)
from crosskd.projection.format import Projection
from crosskd.tables import Flag, TablePair, save_table


def _small_pair() -> TablePair:
    """Student ``a b ab abc c d`` (ids 0-5), teacher ``a b c bc abd d`` (ids 0-5)."""
    s2t = hand_table([[0], [1], [0, 1], [0, 3], [2], [5]], "S", "T", 6)
    t2s = hand_table([[0], [1], [4], [1, 4], [2, 5], [5]], "T", "S", 6)
    return TablePair(s2t, t2s)


def test_chain_weights_decay_by_a_tenth():
    np.testing.assert_allclose(chain_weights(1), [1.0])
    np.testing.assert_allclose(chain_weights(2), [10 / 11, 1 / 11])
    np.testing.assert_allclose(chain_weights(3), [100 / 111, 10 / 111, 1 / 111])


def test_rows_worked_out_by_hand():
    """``ab``: forward chain a, b (10/11, 1/11) plus the reverse piece of teacher ``abd``
    (spelt ab + d: 10/11 on ab): a 10/21, abd 10/21, b 1/21; ``abc``: a 10/11, bc 1/11; the
    tokens the teacher has alone are exact (and take nothing from the reverse pass)."""
    w = build_projection(_small_pair()).to_dense()
    want = np.zeros((6, 6))
    want[0, 0] = want[1, 1] = want[4, 2] = want[5, 5] = 1.0
    want[2, [0, 1, 4]] = [10 / 21, 1 / 21, 10 / 21]
    want[3, [0, 3]] = [10 / 11, 1 / 11]
    np.testing.assert_allclose(w, want, rtol=1e-6)
    top2 = build_projection(_small_pair(), top_k=2)
    columns, weights = top2.row(2)
    assert columns.tolist() == [0, 4]  # equal weights: the lower teacher id first
    np.testing.assert_allclose(weights, [0.5, 0.5])
    cut1 = build_projection(_small_pair(), chain_cut=1).to_dense()
    np.testing.assert_allclose(cut1[2, [0, 4]], [0.5, 0.5])  # only first pieces weigh
    np.testing.assert_allclose(cut1[3, 0], 1.0)


def test_a_pair_of_exact_rows_only():
    """Every token on both sides the other's twin: no spread row (the pair of tiny tokenizers of
    the pipeline tests, in small)."""
    pair = TablePair(hand_table([[1], [0]], "S", "T", 2), hand_table([[1], [0]], "T", "S", 2))
    w = build_projection(pair)
    np.testing.assert_array_equal(w.to_dense(), [[0.0, 1.0], [1.0, 0.0]])
    assert w.weights.dtype == np.float32 and w.columns.dtype == np.int32


@pytest.mark.parametrize("key", ["top_k", "chain_cut"])
def test_bad_build_settings_are_refused(key):
    with pytest.raises(ConfigError, match=f"{key} is 0; it must be an integer >= 1"):
        build_projection(_small_pair(), **{key: 0})


@pytest.fixture(scope="module")
def llama_smol(zoo, built_table):
    pair = TablePair(built_table("llama3", "smollm2"), built_table("smollm2", "llama3"))
    return zoo("llama3"), zoo("smollm2"), pair, build_projection(pair)


def _spell(tok, text: str) -> list[int]:
    return tok.hf.encode(text, add_special_tokens=False)


def test_real_pair_rules(llama_smol):
    """Llama-3 packs up to three digits, SmolLM2 spells them one by one: ``123`` spreads over
    1, 2, 3 by the chain weights; ``00`` is all on 0 (its two pieces add up); a token both
    have is exact; a special maps by role; every non-empty row sums to 1."""
    llama, smol, pair, w = llama_smol
    (i123,) = _spell(llama, "123")
    columns, weights = w.row(i123)
    assert [smol.bytes.token_bytes(int(t)) for t in columns] == [b"1", b"2", b"3"]
    np.testing.assert_allclose(weights, chain_weights(3), rtol=1e-6)
    (i00,) = _spell(llama, "00")
    columns, weights = w.row(i00)
    assert [smol.bytes.token_bytes(int(t)) for t in columns] == [b"0"] and weights[0] == 1.0
    (the,) = _spell(llama, " the")
    columns, weights = w.row(the)
    assert smol.bytes.token_bytes(int(columns[0])) == b" the" and weights.tolist() == [1.0]
    mapped = np.flatnonzero(pair.student_to_teacher.flags == Flag.SPECIAL_MAPPED)
    assert len(mapped) > 0
    for s in mapped.tolist():
        assert w.row(s)[0].tolist() == pair.student_to_teacher.chain(s).tolist()
    rows = np.repeat(np.arange(len(w.lengths)), w.lengths)
    sums = np.bincount(rows, w.weights, len(w.lengths))
    np.testing.assert_allclose(sums[w.lengths > 0], 1.0, atol=1e-6)
    same_row = rows[1:] == rows[:-1]
    assert (w.weights[1:][same_row] <= w.weights[:-1][same_row]).all()  # largest first
    assert validate_projection(w, llama, smol).ok


def test_by_teacher_is_the_transpose(llama_smol):
    _, _, _, w = llama_smol
    offsets, students, weights = w.by_teacher
    t = int(w.row(100)[0][0])
    span = slice(offsets[t], offsets[t + 1])
    assert 100 in students[span].tolist()
    assert (np.diff(students[span]) > 0).all()
    rows = np.repeat(np.arange(len(w.lengths)), w.lengths)
    teacher_of = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    back = dict(
        zip(zip(students.tolist(), teacher_of.tolist(), strict=True), weights.tolist(), strict=True)
    )
    forth = zip(rows.tolist(), w.columns.tolist(), strict=True)
    assert back == pytest.approx(dict(zip(forth, w.weights.astype(float).tolist(), strict=True)))


def test_gold_and_hkl_partitions_on_a_real_pair(llama_smol):
    """Llama-3 -> SmolLM2: gold pairs the exact rows, one teacher id each; H-KL adds the rows
    led by a weight >= 0.6 whose teacher token no stronger row claims; ``123`` (0.90 on ``1``)
    stays uncommon in both, since ``1`` is claimed by its exact twin."""
    llama, smol, _, w = llama_smol
    gold, hkl = partition(w, relaxed=False), partition(w, relaxed=True)
    for pairs in (gold, hkl):
        assert len(np.unique(pairs[:, 1])) == len(pairs) and (np.diff(pairs[:, 0]) > 0).all()
    assert set(map(tuple, gold.tolist())) <= set(map(tuple, hkl.tolist()))
    assert len(hkl) > len(gold) > 30_000
    for s, t in gold.tolist():
        assert w.lengths[s] == 1 and w.row(s)[0][0] == t
    first = w.weights[w.offsets[hkl[:, 0]]]
    assert (first >= 0.6).all()
    (i123,) = llama.hf.encode("123", add_special_tokens=False)
    (one,) = smol.hf.encode("1", add_special_tokens=False)
    assert i123 not in hkl[:, 0] and [one] == hkl[hkl[:, 1] == one, 1].tolist()


def test_file_round_trip_and_refusals(llama_smol, tmp_path):
    _, _, _, w = llama_smol
    path = str(tmp_path / "w.safetensors")
    again = load_projection(save_projection(w, path).source)
    assert again.meta == w.meta
    for name in ("offsets", "columns", "weights"):
        np.testing.assert_array_equal(getattr(again, name), getattr(w, name))
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]  # no temporary left
    with pytest.raises(TableError, match=r"no such file; build it with `crosskd projection"):
        load_projection(str(tmp_path / "missing.safetensors"))
    torch.save({"indices": torch.zeros(2, 4)}, tmp_path / "xtoken.pt")
    with pytest.raises(TableError, match=r"pickle or torch.save file .* never unpickles"):
        load_projection(str(tmp_path / "xtoken.pt"))
    (tmp_path / "cut.safetensors").write_bytes((tmp_path / "w.safetensors").read_bytes()[:100])
    with pytest.raises(TableError, match=r"not a readable safetensors file"):
        load_projection(str(tmp_path / "cut.safetensors"))


def test_damaged_rows_are_refused_naming_them():
    w = build_projection(_small_pair())
    weights = w.weights.copy()
    weights[w.offsets[2]] = 0.9  # row 2 (ab) no longer sums to 1
    with pytest.raises(TableError, match=r"1 student rows have weights that do not sum to 1 "):
        _check(Projection(w.offsets, w.columns, weights, w.meta, "bad"))
    columns = w.columns.copy()
    columns[w.offsets[3]] = 6  # outside [0, 6)
    with pytest.raises(TableError, match=r"teacher ids outside \[0, 6\) \(first rows: \[3\]\)"):
        _check(Projection(w.offsets, columns, w.weights, w.meta, "bad"))
    columns = w.columns.copy()
    columns[w.offsets[3] + 1] = columns[w.offsets[3]]
    with pytest.raises(TableError, match=r"a teacher id twice \(first rows: \[3\]\)"):
        _check(Projection(w.offsets, columns, w.weights, w.meta, "bad"))


def _check(projection: Projection) -> None:
    from crosskd.projection.format import check_structure

    check_structure(projection)


def test_validator_names_the_wrong_pair_and_wrong_rows(llama_smol, zoo):
    llama, smol, _, w = llama_smol
    swapped = validate_projection(w, smol, llama)
    assert not swapped.ok and "other way round" in swapped.violations[0]
    other = validate_projection(w, llama, zoo("qwen3"))
    assert "built for a teacher tokenizer" in other.violations[0]
    (the,) = _spell(llama, " the")
    (cat,) = _spell(smol, " cat")
    columns = w.columns.copy()
    columns[w.offsets[the]] = cat
    report = validate_projection(Projection(w.offsets, columns, w.weights, w.meta), llama, smol)
    assert report.violations == [
        f"1 student rows have entries that share no bytes with the student token (first ids: "
        f"[{the}])"
    ]


def test_cli_build_inspect_validate(built_table, tmp_path, capsys):
    s2t, t2s = tmp_path / "s2t.safetensors", tmp_path / "t2s.safetensors"
    save_table(built_table("llama3", "smollm2"), str(s2t))
    save_table(built_table("smollm2", "llama3"), str(t2s))
    out = tmp_path / "w.safetensors"
    assert main(["projection", "build", "--student-to-teacher", str(s2t),
                 "--teacher-to-student", str(t2s), "--output", str(out)]) == 0  # fmt: skip
    sides = ["--student-tokenizer", "zoo:llama3", "--teacher-tokenizer", "zoo:smollm2"]
    assert main(["projection", "inspect", str(out), *sides]) == 0
    text = capsys.readouterr().out
    assert "rows: exact " in text and "'.' (" in text
    assert main(["projection", "validate", str(out), *sides]) == 0
    assert ": ok" in capsys.readouterr().out
    wrong = ["--student-tokenizer", "zoo:smollm2", "--teacher-tokenizer", "zoo:llama3"]
    assert main(["projection", "validate", str(out), *wrong]) == 1
    assert "other way round" in capsys.readouterr().out
    assert main(["projection", "inspect", str(tmp_path / "none.safetensors")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such file" in err[0]
