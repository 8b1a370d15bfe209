"""A teacher sharded over processes (FSDP2, real gloo workers under torch's elastic agent)
scores the same cache, byte for byte, as the whole teacher in one process: also when a worker
has no shard of its own and only joins the others' forward passes, and when a run resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from crosskd.errors import CrosskdError
from crosskd.teacher.scoring import MANIFEST, ScoreConfig, score
from crosskd.teacher.sharded import score_on_processes


def _shards(cache: str) -> dict[str, bytes]:
    manifest = json.loads((Path(cache) / MANIFEST).read_text())
    return {s["path"]: (Path(cache) / s["path"]).read_bytes() for s in manifest["shards"]}


def test_a_teacher_sharded_over_two_processes_scores_the_same_bytes(train_inputs, tmp_path):
    config = ScoreConfig(data=train_inputs["data_sharded"], teacher=train_inputs["teacher"],
                         output=str(tmp_path / "cache"), k=16, processes=2)  # fmt: skip
    # One shard over two processes: the second has none and joins the first's passes.
    first = score_on_processes(config, 0, 1, progress=False)
    assert (first["start"], first["stop"], len(first["parts"])) == (0, 1, 1)
    assert first["samples"] == first["parts"][0]["samples"] > 0
    # All of it: the halves 0..2 and 3..5, shard 0 kept from the first run (recorded twice).
    manifest = score(config, progress=False)
    assert sorted(p.name for p in (tmp_path / "cache" / "parts").iterdir()) == [
        "00000-00001.json", "00000-00003.json", "00003-00006.json"]
    whole = json.loads((Path(train_inputs["cache_sharded"]) / MANIFEST).read_text())
    assert manifest["samples"] == whole["samples"] and len(manifest["shards"]) == 6
    assert _shards(config.output) == _shards(train_inputs["cache_sharded"])
    assert manifest["bits_per_byte"] == pytest.approx(whole["bits_per_byte"], rel=1e-12)


def test_processes_must_be_a_positive_integer_and_use_the_default_device(train_inputs,
                                                                         tmp_path):  # fmt: skip
    with pytest.raises(CrosskdError, match=r"processes is 0; it must be an integer >= 1"):
        ScoreConfig(data="d", teacher="t", output="o", processes=0).check()
    config = ScoreConfig(data=train_inputs["data_sharded"], teacher=train_inputs["teacher"],
                         output=str(tmp_path / "c"), processes=2, device="cuda:0")  # fmt: skip
    with pytest.raises(CrosskdError, match=r"device is 'cuda:0', but processes = 2 puts one "
                                           r"process on each cpu device here"):  # fmt: skip
        score_on_processes(config)
