"""`crosskd prepare` end to end: shards + manifest, the collator's indices into packed rows,
clipping, unpacked mode, fsspec output, and bad input that leaves nothing behind."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from crosskd.cli import main
from crosskd.data.collate import collate, load_prepared
from crosskd.data.prepare import PrepareConfig, prepare
from crosskd.data.shards import FLAG_CORRECT, FLAG_KD, FLAG_PREDICTION
from crosskd.errors import DataError

ROWS = [
    {"id": "t1", "text": "Hello world. crosskd aligns 12345 tokens 👍🏽 across café e\u0301."},
    {
        "id": "c1",
        "messages": [
            {"role": "user", "content": "Name a colour. <|im_end|>"},
            {"role": "assistant", "content": "<think>Pick one.</think>Blue."},
        ],
    },
    {"id": "t2", "text": "Short."},
    {"id": "t3", "text": "def f(x):\n    return x  # 日本語\r\n"},
]


def _write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
    return str(path)


def _config(tmp_path: Path, rows=ROWS, **kwargs) -> PrepareConfig:
    data = _write_jsonl(tmp_path / "data.jsonl", rows)
    settings = {"output": str(tmp_path / "out"), "max_length": 96, **kwargs}
    return PrepareConfig(
        data=data,
        student_tokenizer="zoo:llama3",
        teacher_tokenizers=["zoo:qwen3", "zoo:smollm2"],
        **settings,
    )


@pytest.fixture
def zoo_env(zoo_cache, monkeypatch):
    monkeypatch.setenv("CROSSKD_CACHE_DIR", str(zoo_cache))


def test_prepare_and_collate_round_trip(tmp_path, zoo_env, zoo):
    manifest = prepare(_config(tmp_path), progress=False)
    assert manifest["rows"] == 4 and manifest["clipped_rows"] == 0
    assert manifest["nfc_normalized"] is True
    assert [m["name"] for m in manifest["models"]] == ["student", "teacher0", "teacher1"]
    assert manifest["models"][1]["fingerprint"] == zoo("qwen3").fingerprint
    assert manifest["format_version"] == 2
    assert [m.get("same_tokenizer") for m in manifest["models"]] == [None, False, False]
    assert list(manifest["chunk_shapes"]) == ["teacher0", "teacher1"]
    prepared = load_prepared(
        str(tmp_path / "out"),
        fingerprints={"student": zoo("llama3").fingerprint, "teacher0": zoo("qwen3").fingerprint},
    )
    rows = list(prepared.packed_rows())
    assert sorted(s["sample_id"] for row in rows for s in row) == ["c1", "t1", "t2", "t3"]
    assert len(rows) == manifest["packing"]["bins"]
    text = {s["sample_id"]: s["text"] for row in rows for s in row}
    assert text["t1"].endswith("café é.")  # NFC once, before any tokenizer

    batch = collate(rows, n_teachers=2)
    student = batch.models["student"]
    for r, row in enumerate(rows):
        ids = np.concatenate([s["student_ids"] for s in row])
        assert student.input_ids[r, : len(ids)].tolist() == ids.tolist()
        assert (student.segment_ids[r, len(ids) :] == -1).all()
        starts = np.flatnonzero(student.position_ids[r, : len(ids)].numpy() == 0)
        lengths = [len(s["student_ids"]) for s in row]
        assert starts.tolist() == np.cumsum([0, *lengths])[:-1].tolist()
    for k, name in enumerate(("llama3", "qwen3", "smollm2")[1:]):
        chunks, teacher = batch.chunks[k], batch.models[f"teacher{k}"]
        s_tok, t_tok = zoo("llama3"), zoo(name)
        assert chunks.valid.any()
        for c in np.flatnonzero(chunks.valid.numpy()):
            r = int(chunks.row[c])
            (s0, s1), (t0, t1) = chunks.student[c].tolist(), chunks.teacher[c].tolist()
            s_bytes = s_tok.bytes.concat(student.input_ids[r, s0:s1].numpy()).tobytes()
            t_bytes = t_tok.bytes.concat(teacher.input_ids[r, t0:t1].numpy()).tobytes()
            assert s_bytes == t_bytes or chunks.shape[c] == 4
            assert batch.loss_mask[r, s0:s1].all()
            assert student.segment_ids[r, s0] == student.segment_ids[r, s1 - 1]
        # The chunk's sample: its segment in the row, counted over the batch in row order.
        first_sample = np.cumsum([0, *(len(row) for row in rows)])
        segment = student.segment_ids[chunks.row, chunks.student[:, 0]]
        assert (chunks.sample == torch.from_numpy(first_sample[chunks.row.numpy()]) + segment).all()
        need = FLAG_CORRECT | FLAG_PREDICTION | FLAG_KD
        assert ((chunks.flags & need) == need).tolist() == chunks.valid.tolist()


def test_clipping_unpacked_mode_and_memory_output(tmp_path, zoo_env):
    long = {"id": "long", "text": "word " * 400}
    config = _config(tmp_path, rows=[*ROWS, long], pack=False, output="memory://prep-test/out")
    manifest = prepare(config, progress=False)
    assert manifest["clipped_rows"] == 1 and manifest["packing"]["bins"] == 5
    rows = list(load_prepared("memory://prep-test/out").packed_rows())
    assert all(len(row) == 1 for row in rows)
    clipped = next(row[0] for row in rows if row[0]["sample_id"] == "long")
    assert clipped["clipped"] and clipped["original_lengths"][0] > 96
    assert len(clipped["student_ids"]) <= 96 and len(clipped["teacher0_ids"]) <= 96


def test_cli_prepare_with_config_file_and_overrides(tmp_path, zoo_env, capsys):
    config = _config(tmp_path)
    (tmp_path / "prepare.yaml").write_text(
        f"data: {config.data}\nstudent_tokenizer: zoo:llama3\nteacher_tokenizers: [zoo:qwen3]\n"
    )
    status = main(
        [
            "prepare",
            "--config",
            str(tmp_path / "prepare.yaml"),
            "--output",
            str(tmp_path / "cli"),
            "max_length=64",
            "pack=false",
        ]
    )
    assert status == 0
    out = capsys.readouterr().out
    assert out.startswith("prepared 4 rows (0 clipped) into 4 packed rows")
    manifest = json.loads((tmp_path / "cli" / "manifest.json").read_text())
    assert manifest["config"]["max_length"] == 64 and manifest["config"]["pack"] is False


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"id": "x", "body": "no text column"}], r"data\.jsonl line 2"),
        ([{"id": "x", "text": ""}], r"data\.jsonl line 2"),
        ([{"id": "x", "messages": [{"role": "user", "content": "hi"}]}], "assistant"),
    ],
)
def test_bad_input_writes_nothing(tmp_path, zoo_env, rows, message):
    config = _config(tmp_path, rows=[ROWS[0], *rows])
    with pytest.raises(DataError, match=message):
        prepare(config, progress=False)
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_invalid_utf8_line_is_named(tmp_path, zoo_env):
    config = _config(tmp_path)
    with open(config.data, "ab") as fh:
        fh.write(b'{"id": "bad", "text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"line 5"):
        prepare(config, progress=False)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_consumers_refuse_foreign_or_damaged_data(tmp_path, zoo_env, zoo):
    prepare(_config(tmp_path), progress=False)
    out = str(tmp_path / "out")
    with pytest.raises(DataError, match="teacher0 tokenizer fingerprint is"):
        load_prepared(out, fingerprints={"teacher0": zoo("deepseek-v3").fingerprint})
    shard = next((tmp_path / "out").glob("part-*.parquet"))
    shard.write_bytes(shard.read_bytes()[:-10] + b"0123456789")
    with pytest.raises(DataError, match="has sha256"):
        list(load_prepared(out).packed_rows())
    with pytest.raises(DataError, match="already holds prepared data"):
        prepare(_config(tmp_path), progress=False)
    with pytest.raises(DataError, match=r"no manifest\.json"):
        load_prepared(str(tmp_path / "nothing"))


def test_long_conversations_keep_whole_turns_then_clip_the_answer(tmp_path, zoo_env):
    turn = [{"role": "user", "content": "Tell me."}, {"role": "assistant", "content": "Sure. " * 6}]
    long_tail = {
        "id": "turns",
        "messages": [
            *turn,
            {"role": "user", "content": "More?"},
            {"role": "assistant", "content": "word " * 200},
        ],
    }
    huge = {
        "id": "huge",
        "messages": [
            {"role": "user", "content": "Go."},
            {"role": "assistant", "content": "go " * 300},
        ],
    }
    config = _config(tmp_path, rows=[long_tail, huge], max_length=80, pack=False)
    config.teacher_tokenizers = ["zoo:qwen3"]
    manifest = prepare(config, progress=False)
    assert manifest["clipped_rows"] == 2
    assert manifest["content_stripped"] is True  # Llama-3's template trims message content
    rows = {r[0]["sample_id"]: r[0] for r in load_prepared(config.output).packed_rows()}
    assert json.loads(rows["turns"]["messages"]) == [
        turn[0],
        {**turn[1], "content": turn[1]["content"].strip()},
    ]
    answer = json.loads(rows["huge"]["messages"])[-1]["content"]
    assert 0 < len(answer) < len("go " * 300) and ("go " * 300).startswith(answer)
    for row in rows.values():
        assert len(row["student_ids"]) <= 80 and len(row["teacher0_ids"]) <= 80
        assert row["clipped"] and row["original_lengths"][0] > 80
    grown = json.loads(rows["huge"]["messages"])
    grown[-1]["content"] = ("go " * 300)[: len(answer) + 1]
    from crosskd.alignment import render
    from crosskd.tokenization import load_tokenizer

    lengths = [
        len(render(load_tokenizer(t), grown, sample_id="huge").tokens)
        for t in ("zoo:llama3", "zoo:qwen3")
    ]
    assert max(lengths) > 80  # one more character would not fit: the clip is maximal


def test_shards_read_together_as_one_dataset(tmp_path, zoo_env):
    """A fixed schema: a chat-only shard and a text-only shard still read as one dataset."""
    import pyarrow.dataset as ds

    config = _config(tmp_path, pack=False, shard_rows=1)
    config.teacher_tokenizers = ["zoo:qwen3"]
    manifest = prepare(config, progress=False)
    assert len(manifest["shards"]) == 4
    shards = sorted(str(p) for p in (tmp_path / "out").glob("part-*.parquet"))
    table = ds.dataset(shards, format="parquet").to_table()
    assert sorted(table.column("sample_id").to_pylist()) == ["c1", "t1", "t2", "t3"]


def test_long_reasoning_is_clipped_after_the_answer(tmp_path, zoo_env):
    row = {
        "id": "r",
        "messages": [
            {"role": "user", "content": "Think."},
            {"role": "assistant", "content": "Done.", "reasoning_content": "step " * 300},
        ],
    }
    config = _config(tmp_path, rows=[row], max_length=96)
    config.teacher_tokenizers = ["zoo:qwen3"]
    prepare(config, progress=False)
    (sample,) = next(load_prepared(config.output).packed_rows())
    kept = json.loads(sample["messages"])[-1]
    assert kept["content"] == ""
    assert 0 < len(kept["reasoning_content"]) < len(("step " * 300).strip())
    assert len(sample["student_ids"]) <= 96 and len(sample["teacher0_ids"]) <= 96
    eot = 128009
    assert eot not in [
        i for i, m in zip(sample["student_ids"], sample["student_loss_mask"], strict=True) if m
    ]


def test_flags_win_over_the_config_file(tmp_path, zoo_env):
    config = _config(tmp_path)
    (tmp_path / "c.yaml").write_text(
        f"data: {config.data}\nstudent_tokenizer: zoo:llama3\nteacher_tokenizers: [zoo:qwen3]\n"
        f"output: {tmp_path / 'from-file'}\nmax_length: 4096\n"
    )
    assert (
        main(
            [
                "prepare",
                "--config",
                str(tmp_path / "c.yaml"),
                "--output",
                str(tmp_path / "from-flag"),
                "--max-length",
                "100",
            ]
        )
        == 0
    )
    manifest = json.loads((tmp_path / "from-flag" / "manifest.json").read_text())
    assert manifest["config"]["max_length"] == 100
    assert not (tmp_path / "from-file").exists()
    assert (
        main(["prepare", "--config", str(tmp_path / "c.yaml"), "teacher_tokenizers=zoo:qwen3"]) == 2
    )
