"""Streaming `crosskd prepare`: one shard per window of input rows, a run that stops part way
resumes to the same bytes, splits over pods merge to what one process writes, and the checks the
merge makes (missing windows, repeated ids, changed input or settings)."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from crosskd.cli import main
from crosskd.data.collate import load_prepared
from crosskd.data.merge import merge_prepared
from crosskd.data.packing import pack_lockstep
from crosskd.data.prepare import PrepareConfig, prepare
from crosskd.errors import CrosskdError, DataError

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
ROWS = [{"id": f"r{i}", "text": " ".join(WORDS[: 2 + (7 * i) % 9]) + f" {i}."} for i in range(10)]
ROWS[4] = {
    "id": "r4",
    "messages": [
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "Hi there."},
    ],
}


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), "utf-8")
    return str(path)


def _config(data: str, output: Path, **kwargs) -> PrepareConfig:
    settings = {"max_length": 48, "shard_rows": 3, **kwargs}
    return PrepareConfig(
        data=data,
        student_tokenizer="zoo:llama3",
        teacher_tokenizers=["zoo:qwen3"],
        output=str(output),
        **settings,
    )


def _files(output: Path) -> dict[str, str]:
    """sha256 of every shard."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(output.glob("part-*.parquet"))
    }


def _comparable(manifest: dict) -> dict:
    return {**manifest, "config": {k: v for k, v in manifest["config"].items() if k != "output"}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, zoo_cache):
    """One uninterrupted run: 10 rows in windows of 3 (4 shards)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CROSSKD_CACHE_DIR", str(zoo_cache))
        root = tmp_path_factory.mktemp("streaming")
        data = _jsonl(root / "data.jsonl", ROWS)
        manifest = prepare(_config(data, root / "whole"), progress=False)
    return data, root / "whole", manifest


@pytest.fixture
def zoo_env(zoo_cache, monkeypatch):
    monkeypatch.setenv("CROSSKD_CACHE_DIR", str(zoo_cache))


def test_one_shard_per_window_packed_on_its_own(reference):
    _, out, manifest = reference
    assert [s["path"] for s in manifest["shards"]] == [f"part-{w:06d}.parquet" for w in range(4)]
    assert [s["rows"] for s in manifest["shards"]] == [3, 3, 3, 1]
    ranges = [s["bins"] for s in manifest["shards"]]
    assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert ranges[-1][1] == manifest["packing"]["bins"]
    data = load_prepared(str(out))
    seen = []
    for w, shard in enumerate(manifest["shards"]):
        samples = data.shard_samples(w)
        seen += [s["sample_id"] for s in samples]
        lengths = [[len(s["student_ids"]), len(s["teacher0_ids"])] for s in samples]
        by_input = sorted(range(len(samples)), key=lambda i: int(samples[i]["sample_id"][1:]))
        bins = pack_lockstep([lengths[i] for i in by_input], [48, 48])
        # The window's bins, numbered from 0 in the shard, as packing the window alone gives.
        assert sorted({s["bin"] for s in samples}) == list(range(len(bins)))
        assert shard["bins"][1] - shard["bins"][0] == len(bins)
        assert [s["sample_id"] for s in samples] == [
            samples[by_input[i]]["sample_id"] for b in bins for i in b.tolist()
        ]
    assert sorted(seen) == sorted(r["id"] for r in ROWS)
    tokens = sum(len(s["student_ids"]) for w in range(4) for s in data.shard_samples(w))
    assert manifest["models"][0]["tokens"] == tokens
    assert manifest["packing"]["efficiency"]["student"] == pytest.approx(
        tokens / (48 * manifest["packing"]["bins"])
    )
    assert manifest["rows"] == 10 and manifest["clipped_rows"] == 0


def _stop_at_row(n: int, seen: list):
    """An ``on_row`` that records each row and stops the run at the ``n``-th, as a kill would."""

    def on_row(reason):
        seen.append(reason)
        if len(seen) == n:
            raise KeyboardInterrupt("killed")

    return on_row


def test_a_stopped_run_resumes_to_the_same_bytes(reference, tmp_path, zoo_env):
    data, whole, manifest = reference
    out = tmp_path / "out"
    seen = []
    with pytest.raises(KeyboardInterrupt):  # in the third window
        prepare(_config(data, out), progress=False, on_row=_stop_at_row(8, seen))
    assert not (out / "manifest.json").exists()
    assert sorted(_files(out)) == ["part-000000.parquet", "part-000001.parquet"]
    # A kill between writing a shard and its record, and a torn temporary file.
    (out / "_prepare/shards/part-000001.parquet.json").unlink()
    (out / ".part-000002.parquet.tmp").write_bytes(b"torn")
    seen.clear()
    resumed = prepare(_config(data, out), progress=False, on_row=seen.append)
    assert len(seen) == 7  # windows 1, 2 and 3 prepared again; window 0 was kept
    assert _files(out) == _files(whole)
    assert _comparable(resumed) == _comparable(manifest)


def test_splits_merge_to_what_one_process_writes(reference, tmp_path, zoo_env, capsys):
    data, whole, manifest = reference
    out = tmp_path / "split"
    assert prepare(_config(data, out, split_index=1, split_count=2), progress=False) is None
    assert sorted(_files(out)) == ["part-000001.parquet", "part-000003.parquet"]
    with pytest.raises(
        DataError,
        match=r"2 input window\(s\) have no shard yet \(0, 2\); run "
        r"the split\(s\) that own them \(with split_count=2: split_index 0\)",
    ):
        merge_prepared(str(out))
    assert main(["prepare-merge", str(out)]) == 2
    assert "have no shard yet" in capsys.readouterr().err
    merged = prepare(_config(data, out, split_index=0, split_count=2), progress=False)
    assert _files(out) == _files(whole)
    assert _comparable(merged) == _comparable(manifest)
    assert main(["prepare-merge", str(out)]) == 0  # merged already: the manifest is read back
    assert "prepared 10 rows" in capsys.readouterr().out


def test_workers_write_what_one_process_writes(reference, tmp_path, zoo_env):
    """A run stopped part way with one process resumes with two worker processes (the worker
    count is not a setting the run records), and the windows the workers prepare are the same
    bytes, the manifest the same, as one uninterrupted process writes."""
    data, whole, manifest = reference
    out, seen = tmp_path / "resumed", []
    with pytest.raises(KeyboardInterrupt):  # in the second window
        prepare(_config(data, out), progress=False, on_row=_stop_at_row(4, seen))
    assert sorted(_files(out)) == ["part-000000.parquet"]
    seen.clear()
    resumed = prepare(_config(data, out, workers=2), progress=False, on_row=seen.append)
    assert len(seen) == 7  # windows 1, 2 and 3, by the workers
    assert _files(out) == _files(whole)
    assert _comparable(resumed) == _comparable(manifest)


def test_changed_input_or_settings_are_refused_on_resume(tmp_path, zoo_env):
    data = _jsonl(tmp_path / "data.jsonl", ROWS)
    out = tmp_path / "out"
    prepare(_config(data, out, split_index=0, split_count=2), progress=False)
    with pytest.raises(
        CrosskdError,
        match=r"holds prepared data \(or an interrupted run\) with "
        r"another config",
    ):
        prepare(_config(data, out, max_length=64), progress=False)
    edited = [dict(ROWS[0], text="edited."), *ROWS[1:]]
    _jsonl(tmp_path / "data.jsonl", edited)
    with pytest.raises(
        DataError,
        match=r"part-000000.parquet was prepared from other input "
        r"rows than window 0",
    ):
        prepare(_config(data, out), progress=False)


def test_a_repeated_id_across_windows_names_both_lines(tmp_path, zoo_env):
    rows = [*ROWS[:5], {"id": "r1", "text": "again"}]
    data = _jsonl(tmp_path / "data.jsonl", rows)
    with pytest.raises(
        DataError,
        match=r"data.jsonl line 6: sample id 'r1' was already used by "
        r".*data.jsonl line 2; .*make the 'id' column unique",
    ):
        prepare(_config(data, tmp_path / "out"), progress=False)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_bad_split_settings_are_refused():
    with pytest.raises(
        CrosskdError,
        match=r"split_index is 2; it must be an integer from 0 to "
        r"split_count - 1 \(1\)",
    ):
        PrepareConfig(
            data="d",
            student_tokenizer="s",
            teacher_tokenizers=["t"],
            output="o",
            split_index=2,
            split_count=2,
        )
    with pytest.raises(CrosskdError, match=r"split_count is 0"):
        PrepareConfig(
            data="d", student_tokenizer="s", teacher_tokenizers=["t"], output="o", split_count=0
        )


def test_shards_are_parquet_with_the_window_rows(reference):
    _, out, _ = reference
    table = pq.read_table(out / "part-000001.parquet", columns=["sample_id", "bin"])
    assert sorted(table.column("sample_id").to_pylist()) == ["r3", "r4", "r5"]


def test_a_killed_process_resumes_to_the_same_bytes(tmp_path, zoo_cache):
    """`crosskd prepare` killed with SIGKILL part way (a real process), then run again: the
    same shards and manifest as a run that was never killed."""
    rows = [
        {"id": f"k{i}", "text": f"{r.get('text', 'Hi there.')} {i}"}
        for i, r in enumerate(ROWS * 20)
    ]
    data = _jsonl(tmp_path / "data.jsonl", rows)
    out, whole = tmp_path / "killed", tmp_path / "whole"
    command = [
        sys.executable,
        "-m",
        "crosskd.cli",
        "prepare",
        "--data",
        data,
        "--output",
        str(out),
        "--student-tokenizer",
        "zoo:llama3",
        "--teacher-tokenizers",
        "zoo:qwen3",
        "--max-length",
        "48",
        "shard_rows=2",
    ]
    env = {**os.environ, "CROSSKD_CACHE_DIR": str(zoo_cache), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    records = out / "_prepare" / "shards"
    deadline = time.monotonic() + 120
    while process.poll() is None and len(list(records.glob("*.json"))) < 5:
        assert time.monotonic() < deadline, "no shard record within 120 s"
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (out / "manifest.json").exists()
    kept = len(list(records.glob("*.json")))
    assert 5 <= kept < 100  # killed part way
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CROSSKD_CACHE_DIR", str(zoo_cache))
        assert main(command[3:]) == 0
        reference = prepare(_config(data, whole, shard_rows=2), progress=False)
    assert len(_files(out)) == 100 and _files(out) == _files(whole)
    assert _comparable(json.loads((out / "manifest.json").read_text())) == _comparable(reference)


def test_a_record_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """``write_whole`` (shard records, split markers, run records, shards): a writer killed part
    way leaves no file at the path (a resume then redoes that shard) instead of a torn record
    that the resume cannot read; a finished write leaves the whole payload and no temporary."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    from crosskd.artifacts import write_whole

    fs = fsspec.filesystem("file")
    path = f"{tmp_path}/part-000000.parquet.json"
    write_whole(fs, path, b'{"rows": 3}')
    assert json.loads(Path(path).read_text()) == {"rows": 3}
    assert [p.name for p in tmp_path.iterdir()] == ["part-000000.parquet.json"]
    real = LocalFileSystem.pipe_file

    def killed(self, target, value, **kwargs):
        real(self, target, value[:3], **kwargs)  # part of the bytes reach the disk, then a kill
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(LocalFileSystem, "pipe_file", killed)
    second = f"{tmp_path}/part-000001.parquet.json"
    with pytest.raises(KeyboardInterrupt):
        write_whole(fs, second, b'{"rows": 4}')
    assert not Path(second).exists()
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["part-000000.parquet.json"]


def test_a_json_record_that_fails_part_way_leaves_the_one_before(tmp_path, monkeypatch):
    """``write_json`` (an evaluation, a step's record): a write that fails part way (a full
    disk) leaves the earlier file whole, not a torn one that every later reader fails on."""
    import errno

    from fsspec.implementations.local import LocalFileSystem

    from crosskd.steps.locations import read_json, write_json

    path = f"{tmp_path}/runs/evaluation.json"
    write_json(path, {"models": {"teacher": 1.5}})
    real = LocalFileSystem.pipe_file

    def full(self, target, value, **kwargs):
        real(self, target, value[:10], **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(LocalFileSystem, "pipe_file", full)
    with pytest.raises(OSError, match="No space left"):
        write_json(path, {"models": {"teacher": 1.5, "student": 2.5}})
    assert read_json(path) == {"models": {"teacher": 1.5}}


def test_writers_of_the_same_record_at_once_never_take_each_others_temporary(tmp_path):
    """Processes that write the same file at once (a cache's scoring pods each write its
    ``run.json``) each rename their own temporary: none fails, and the file is one writer's
    whole payload."""
    import threading

    import fsspec

    from crosskd.artifacts import write_whole

    fs, path = fsspec.filesystem("file"), f"{tmp_path}/run.json"
    payloads = [json.dumps({"writer": i, "pad": "x" * 4096}).encode() for i in range(8)]
    failures, start = [], threading.Barrier(len(payloads))

    def writer(payload: bytes) -> None:
        start.wait()
        for _ in range(50):
            try:
                write_whole(fs, path, payload)
            except OSError as exc:
                failures.append(exc)

    threads = [threading.Thread(target=writer, args=(p,)) for p in payloads]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert Path(path).read_bytes() in payloads
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]
