"""Every way a table can be wrong gets a clear error or a named violation."""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from crosskd.cli import main
from crosskd.errors import TableError
from crosskd.tables import Flag, TablePair, load_table, save_table, validate_pair, validate_table
from crosskd.tokenization import load_tokenizer
from crosskd.zoo import zoo_tokenizer_dir


def _with_row(table, row: int, chain: list[int], flag: Flag):
    """A copy of ``table`` whose ``row`` has ``chain`` and ``flag`` (CSR rebuilt)."""
    start, end = int(table.offsets[row]), int(table.offsets[row + 1])
    chains = np.concatenate([table.chains[:start], np.asarray(chain, np.int32), table.chains[end:]])
    offsets = table.offsets.copy()
    offsets[row + 1 :] += len(chain) - (end - start)
    flags = table.flags.copy()
    flags[row] = flag
    return dataclasses.replace(table, offsets=offsets, chains=chains, flags=flags)


def test_swapped_tables_are_named(zoo, built_table):
    reports = validate_pair(
        zoo("llama3"), zoo("qwen3"), built_table("qwen3", "llama3"), built_table("llama3", "qwen3")
    )
    for report in reports:
        assert not report.ok
        assert "tables swapped" in report.violations[0]


def test_changed_tokenizer_fingerprint_is_named(tmp_path, zoo, zoo_cache, built_table):
    folder = tmp_path / "llama3-edited"
    shutil.copytree(zoo_tokenizer_dir("llama3", zoo_cache), folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{{ messages[0]['content'] }}"
    config_path.write_text(json.dumps(config))
    edited = load_tokenizer(folder)
    original = zoo("llama3")
    assert edited.fingerprint != original.fingerprint
    table = save_table(built_table("llama3", "qwen3"), str(tmp_path / "s2t.safetensors"))
    report = validate_table(table, edited, zoo("qwen3"), src_side="student")
    assert not report.ok
    message = report.violations[0]
    assert "student tokenizer fingerprint mismatch" in message
    assert original.fingerprint in message and edited.fingerprint in message
    assert str(tmp_path / "s2t.safetensors") in message


def test_chain_id_out_of_range_is_named(zoo, built_table):
    table = built_table("llama3", "qwen3")
    for bad_id in (151936 + 5, -7):
        broken = _with_row(table, 1234, [bad_id], Flag.NORMAL)
        report = validate_table(broken, zoo("llama3"), zoo("qwen3"))
        assert (
            "1 rows have chain ids outside [0, 151936) (first rows: [1234])"
            in (report.violations[0])
        )


@pytest.mark.parametrize("bad_id", [151936 + 5, -7])
def test_chain_id_out_of_range_is_refused_on_load(tmp_path, built_table, bad_id, capsys):
    """Before anything indexes with it: the loader, TablePair and `tables inspect`."""
    table = _with_row(built_table("llama3", "qwen3"), 1234, [bad_id], Flag.NORMAL)
    path = str(tmp_path / "bad.safetensors")
    save_table(table, path)
    expected = r"chain ids outside \[0, 151936\) \(first rows: \[1234\]\)"
    with pytest.raises(TableError, match=expected):
        load_table(path)
    assert main(["tables", "inspect", path]) == 2
    assert "chain ids outside" in capsys.readouterr().err


def test_bad_metadata_is_a_table_error(tmp_path, built_table):
    table = built_table("llama3", "qwen3")
    for field, value in (("src_vocab_size", "abc"), ("format_version", "1.0")):
        meta = dataclasses.replace(table.meta)
        path = tmp_path / f"{field}.safetensors"
        save_table(table, str(path))
        _rewrite_metadata(path, {**meta.to_metadata(), field: value})
        with pytest.raises(TableError, match=f"metadata field {field!r} is {value!r}"):
            load_table(str(path))


def _rewrite_metadata(path: Path, metadata: dict[str, str]) -> None:
    from safetensors.numpy import load_file, save_file

    save_file(load_file(str(path)), str(path), metadata=metadata)


def test_valid_table_whose_header_starts_like_a_pickle_loads(tmp_path, built_table):
    """A safetensors header length of 0x80 mod 256 must not be mistaken for a pickle."""
    table = built_table("llama3", "qwen3")
    for pad in range(256):
        meta = dataclasses.replace(table.meta, src_name="s" * pad)
        path = tmp_path / "t.safetensors"
        save_table(dataclasses.replace(table, meta=meta), str(path))
        if path.read_bytes()[0] == 0x80:
            break
    else:
        pytest.fail("no padding gave a header length of 0x80 mod 256")
    assert load_table(str(path)).meta.src_name == "s" * pad


def test_chain_with_other_bytes_is_named(zoo, built_table):
    table = built_table("llama3", "qwen3")
    hello = zoo("llama3").hf.convert_tokens_to_ids("ĠHello")
    world = zoo("qwen3").hf.convert_tokens_to_ids("Ġworld")
    broken = _with_row(table, hello, [world], Flag.NORMAL)
    report = validate_table(broken, zoo("llama3"), zoo("qwen3"))
    assert report.violations == [
        f"1 rows have chains whose bytes differ from the token's bytes (first ids: [{hello}]); "
        "rebuild the table with `crosskd tables build`"
    ]


def test_byte_equal_chain_that_is_not_the_bpe_split_is_named(zoo, built_table):
    """Right bytes, wrong split: the common tokens and prefix index would silently change."""
    llama, qwen = zoo("llama3"), zoo("qwen3")
    table = built_table("llama3", "qwen3")
    hello = llama.hf.convert_tokens_to_ids("ĠHello")
    letters = [qwen.hf.convert_tokens_to_ids(t) for t in ("Ġ", "H", "e", "l", "l", "o")]
    assert qwen.bytes.concat(np.array(letters)).tobytes() == b" Hello"
    broken = _with_row(table, hello, letters, Flag.NORMAL)
    assert validate_table(broken, llama, qwen).violations == [
        f"1 rows have chains with the right bytes that are not the destination BPE's split "
        f"(first ids: [{hello}]); rebuild the table with `crosskd tables build`"
    ]


def test_special_role_mistakes_are_named(zoo, built_table):
    llama, qwen = zoo("llama3"), zoo("qwen3")
    table = built_table("llama3", "qwen3")
    eot = llama.role_ids["eot"]
    wrong_role = _with_row(table, eot, [qwen.role_ids["turn_start"]], Flag.SPECIAL_MAPPED)
    assert "without their role" in validate_table(wrong_role, llama, qwen).violations[0]
    missed = _with_row(table, eot, [], Flag.SPECIAL_UNMAPPED)
    assert (
        "flagged unmapped but the destination has their role"
        in (validate_table(missed, llama, qwen).violations[0])
    )


def test_false_unrepresentable_flag_is_named(zoo, built_table):
    table = built_table("llama3", "qwen3")
    broken = _with_row(table, 500, [], Flag.UNREPRESENTABLE)
    violations = validate_table(broken, zoo("llama3"), zoo("qwen3")).violations
    assert violations == [
        "1 rows are flagged unrepresentable but the destination encodes them exactly "
        "(first ids: [500]); rebuild the table with `crosskd tables build`"
    ]


def test_false_normal_flag_is_named(zoo, built_table):
    """A Qwen token holding byte 0x04, which SmolLM2 cannot spell, flagged normal anyway."""
    qwen, smol = zoo("qwen3"), zoo("smollm2")
    table = built_table("qwen3", "smollm2")
    row = int(np.flatnonzero(table.flags == Flag.UNREPRESENTABLE)[0])
    broken = _with_row(table, row, [0], Flag.NORMAL)
    violations = validate_table(broken, qwen, smol).violations
    assert violations[0].startswith(
        f"1 rows are flagged normal but the destination cannot spell their bytes exactly "
        f"(first ids: [{row}])"
    )


def test_truncated_file_is_refused(tmp_path, built_table):
    path = tmp_path / "t.safetensors"
    save_table(built_table("llama3", "qwen3"), str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TableError, match="not a readable safetensors file"):
        load_table(str(path))
    path.write_bytes(data[:5])
    with pytest.raises(TableError, match="shorter than the 8-byte header length"):
        load_table(str(path))


def test_other_formats_are_refused(tmp_path):
    path = tmp_path / "t.safetensors"
    path.write_text('{"offsets": [0]}')
    with pytest.raises(TableError, match="not a readable safetensors file"):
        load_table(str(path))
    with pytest.raises(TableError, match="no such file"):
        load_table(str(tmp_path / "absent.safetensors"))


class _Payload:
    """Unpickling this writes a marker file: proof that a loader ran pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "unpickled"))


def test_pickle_files_are_refused_and_never_loaded(tmp_path):
    marker = tmp_path / "marker"
    for name, payload in [
        ("table.pkl", pickle.dumps(_Payload(marker))),
        ("table.pt", b"PK\x03\x04" + pickle.dumps(_Payload(marker))),
    ]:
        path = tmp_path / name
        path.write_bytes(payload)
        with pytest.raises(TableError, match="never unpickles"):
            load_table(str(path))
    assert not marker.exists()


def test_wrong_tensor_shapes_are_refused(tmp_path, built_table):
    table = built_table("llama3", "qwen3")
    short = dataclasses.replace(table, flags=table.flags[:-1])
    save_table(short, str(tmp_path / "t.safetensors"))
    with pytest.raises(TableError, match=r"flags and .* offsets for a source vocabulary"):
        load_table(str(tmp_path / "t.safetensors"))
    backwards = dataclasses.replace(table, offsets=table.offsets[::-1].copy())
    save_table(backwards, str(tmp_path / "b.safetensors"))
    with pytest.raises(TableError, match="offsets run from 155047 to 0"):
        load_table(str(tmp_path / "b.safetensors"))
    dip = table.offsets.copy()
    dip[10] = dip[12]
    save_table(dataclasses.replace(table, offsets=dip), str(tmp_path / "d.safetensors"))
    with pytest.raises(TableError, match=r"offsets decrease at rows \[10\]"):
        load_table(str(tmp_path / "d.safetensors"))


def test_pair_of_unrelated_tables_is_refused(built_table):
    with pytest.raises(TableError, match="not the two directions of one pair"):
        TablePair(built_table("llama3", "qwen3"), built_table("qwen3", "smollm2"))


def test_cli_build_validate_inspect(tmp_path, zoo_cache, capsys, monkeypatch):
    monkeypatch.setenv("CROSSKD_CACHE_DIR", str(zoo_cache))
    s2t, t2s = str(tmp_path / "s2t.safetensors"), str(tmp_path / "t2s.safetensors")
    assert (
        main(
            [
                "tables",
                "build",
                "--source-tokenizer",
                "zoo:llama3",
                "--destination-tokenizer",
                "zoo:qwen3",
                "--output",
                s2t,
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "tables",
                "build",
                "--source-tokenizer",
                "zoo:qwen3",
                "--destination-tokenizer",
                "zoo:llama3",
                "--output",
                t2s,
            ]
        )
        == 0
    )
    validate = [
        "tables",
        "validate",
        "--student-tokenizer",
        "zoo:llama3",
        "--teacher-tokenizer",
        "zoo:qwen3",
    ]
    capsys.readouterr()
    assert main([*validate, "--student-to-teacher", s2t, "--teacher-to-student", t2s]) == 0
    assert capsys.readouterr().out.count(": ok") == 2
    assert main([*validate, "--student-to-teacher", t2s, "--teacher-to-student", s2t]) == 1
    assert "tables swapped" in capsys.readouterr().out
    assert main(["tables", "inspect", s2t, t2s, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary[s2t]["flags"]["special_mapped"] == 3
    assert summary["common_tokens"] > 100_000


def test_cli_bad_input_exits_2_with_one_clear_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "crosskd.cli", "tables", "inspect", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip().startswith("crosskd: error: table ")
    assert "no such file" in result.stderr


def test_pair_consumer_refuses_other_tokenizers(zoo, built_table):
    pair = TablePair(built_table("llama3", "qwen3"), built_table("qwen3", "llama3"))
    pair.check_tokenizers(zoo("llama3"), zoo("qwen3"))
    with pytest.raises(TableError) as info:
        pair.check_tokenizers(zoo("smollm2"), zoo("qwen3"))
    message = str(info.value)
    assert "student tokenizer" in message
    assert zoo("llama3").fingerprint in message and zoo("smollm2").fingerprint in message
