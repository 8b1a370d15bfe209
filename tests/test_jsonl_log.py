"""The per-step JSONL log: appended locally; on an object store (moto's S3 server) written in
parts, a write never costing more than one part, read back whole in order."""

from __future__ import annotations

import json

from crosskd.metrics import JsonlLog, read_jsonl_log


def test_local_log_is_appended_line_by_line(tmp_path):
    uri = str(tmp_path / "run" / "metrics-rank0.jsonl")
    log = JsonlLog(uri)
    for step in (1, 2):
        log.write({"step": step, "loss": 1.0 / step})
        # Each record is on disk at once.
        assert len((tmp_path / "run" / "metrics-rank0.jsonl").read_text().splitlines()) == step
    log.close()
    assert read_jsonl_log(uri) == [{"loss": 1.0, "step": 1}, {"loss": 0.5, "step": 2}]
    assert read_jsonl_log(str(tmp_path / "none.jsonl")) == []


def test_object_store_log_is_written_in_parts(s3, monkeypatch):
    uri = "s3://crosskd-test/log-parts/metrics-rank0.jsonl"
    written: list[int] = []
    log = JsonlLog(uri, flush_s=3600.0, part_records=3)
    real = log.fs.pipe_file

    def counted(path, value, **kwargs):
        written.append(len(value))
        return real(path, value, **kwargs)

    monkeypatch.setattr(log.fs, "pipe_file", counted)
    for step in range(1, 8):
        log.write({"step": step})
    # Parts 0 and 1 filled (3 records each) and written; step 7 waits in the open part.
    assert [r["step"] for r in read_jsonl_log(uri)] == list(range(1, 7))
    log.flush()  # what a checkpoint does
    assert [r["step"] for r in read_jsonl_log(uri)] == list(range(1, 8))
    log.close()
    line = len(json.dumps({"step": 1}).encode()) + 1
    assert written == [3 * line, 3 * line, line, line]  # never more than one part a write
    assert not s3.exists(uri[len("s3://") :])
    # A resumed run numbers its parts on and rewrites nothing of the earlier ones.
    again = JsonlLog(uri, flush_s=0.0, part_records=3)
    again.write({"step": 8})
    parts = sorted(
        p.rsplit("/", 1)[-1] for p in s3.ls("crosskd-test/log-parts/metrics-rank0.jsonl.parts")
    )
    assert parts == [
        "part-000000.jsonl",
        "part-000001.jsonl",
        "part-000002.jsonl",
        "part-000003.jsonl",
    ]
    assert [r["step"] for r in read_jsonl_log(uri)] == list(range(1, 9))
