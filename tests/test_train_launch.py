"""The training pod's entry point (``crosskd train --nproc-per-node N``, torch's elastic agent)
and its exit-code contract: real agent and worker processes on gloo, signals sent for real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from train_inputs import train_config

from crosskd.parallel.rendezvous import rendezvous, shutdown_timeout
from crosskd.train.launch import (
    EXIT_INPUT,
    EXIT_NONFINITE,
    EXIT_RESTART_BUDGET,
    EXIT_RETRYABLE,
    EXIT_SIGTERM,
    pod_exit_code,
    record_failure,
)


def test_exit_codes_of_failed_workers():
    """A permanent crosskd code wins over the peers that only lost it; SIGTERM on every
    worker is a stop; anything else (exit 1, a signal) is retryable."""
    assert pod_exit_code([1, EXIT_INPUT, -9]) == EXIT_INPUT
    assert pod_exit_code([EXIT_NONFINITE, EXIT_INPUT]) == EXIT_INPUT
    assert pod_exit_code([EXIT_NONFINITE, 1]) == EXIT_NONFINITE
    assert pod_exit_code([143, -15]) == EXIT_SIGTERM
    assert pod_exit_code([143, 1]) == EXIT_RETRYABLE
    assert pod_exit_code([1]) == pod_exit_code([-9]) == EXIT_RETRYABLE >= 128
    assert all(1 <= c <= 127 for c in (EXIT_INPUT, EXIT_NONFINITE, EXIT_RESTART_BUDGET))


def test_rendezvous_from_the_operators_environment():
    master = {
        "MASTER_ADDR": "job-master-0",
        "MASTER_PORT": "23456",
        "PET_NNODES": "4",
        "PET_NODE_RANK": "2",
        "WORLD_SIZE": "32",
        "RANK": "2",
    }
    assert rendezvous(master) == {
        "rdzv_backend": "static",
        "rdzv_endpoint": "job-master-0:23456",
        "rdzv_configs": {"rank": 2},
        "min_nodes": 4,
        "max_nodes": 4,
        "run_id": "crosskd",
    }
    elastic = {
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": "job-worker-0:23456",
        "PET_RDZV_ID": "job",
        "PET_NNODES": "2:4",
    }
    got = rendezvous(elastic)
    assert (got["rdzv_backend"], got["min_nodes"], got["max_nodes"], got["run_id"]) == (
        "c10d",
        2,
        4,
        "job",
    )
    alone = rendezvous({})
    assert alone["rdzv_endpoint"].startswith("127.0.0.1:") and alone["max_nodes"] == 1
    with pytest.raises(Exception, match=r"PET_NNODES is 4 but PET_NODE_RANK is not set"):
        rendezvous({k: v for k, v in master.items() if k != "PET_NODE_RANK"})
    # Kubeflow Trainer v2's torch plugin (a TrainJob's node pods): PET_* only
    trainjob = {
        "PET_MASTER_ADDR": "run-node-0-0.run",
        "PET_MASTER_PORT": "29500",
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "8",
        "PET_NODE_RANK": "1",
    }
    got = rendezvous(trainjob)
    assert (got["rdzv_endpoint"], got["rdzv_configs"], got["max_nodes"]) == (
        "run-node-0-0.run:29500",
        {"rank": 1},
        2,
    )
    assert shutdown_timeout({"CROSSKD_GRACE_SECONDS": "120"}) == 115
    assert shutdown_timeout({}) == 25


def test_the_restart_budget_counts_failures_without_progress(train_inputs, tmp_path):
    config = train_config(train_inputs, tmp_path / "run", max_restarts=1)
    assert [record_failure(config, 0) for _ in range(3)] == [1, 2, 3]
    assert record_failure(config, 1) == 1  # per node
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "latest.json").write_text(json.dumps({"step": 4, "path": "step-0000004"}))
    assert record_failure(config, 0) == 1  # a newer checkpoint: the count starts again
    assert record_failure(config, 0) == 2


def _write_config(tmp_path: Path, train_inputs: dict, **kw) -> Path:
    values = {
        "student": train_inputs["student"],
        "data": train_inputs["data"],
        "output": str(tmp_path / "run"),
        "teachers": [train_inputs["cache"]],
        "loss": {
            "dynamic_kd_scale": True,
            "mismatch_weight": 5.0,  # as train_inputs.train_config
            "teachers": [
                {
                    "k": 16,
                    "student_to_teacher": train_inputs["s2t"],
                    "teacher_to_student": train_inputs["t2s"],
                }
            ],
        },
        "steps": 6,
        "micro_batch_rows": 1,
        "global_batch_rows": 2,
        "lr": 3e-3,
        "warmup_steps": 2,
    } | kw
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def _agent(config: Path, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "crosskd.cli",
            "train",
            "--config",
            str(config),
            "--nproc-per-node",
            "2",
            *overrides,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _logged(tmp_path: Path) -> list[dict]:
    path = tmp_path / "run" / "metrics-rank0.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _wait_logged(tmp_path: Path, n: int, proc: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while len(_logged(tmp_path)) < n:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "no training progress"
        time.sleep(0.1)


def test_two_workers_under_the_agent_train_like_one_process(train_inputs, tmp_path):
    """The pod's process with 2 local workers (1 row each) gives the one-process curve (2 rows
    per micro-batch) and exits 0 only when the run is complete."""
    from crosskd.train import Trainer

    single = Trainer(train_config(train_inputs, tmp_path / "one"), progress=False)
    single.setup()
    want = single.train()
    single.close()
    proc = _agent(_write_config(tmp_path, train_inputs))
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    got = _logged(tmp_path)
    assert [g["step"] for g in got] == list(range(1, 7))
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "ce", "kd", "kd_scale"):
            assert g[key] == pytest.approx(w[key], rel=1e-5), key
    assert json.loads((tmp_path / "run" / "final" / "crosskd-model.json").read_text())["step"] == 6


def test_sigterm_stops_every_worker_after_a_step_checkpoints_and_exits_143(train_inputs, tmp_path):
    """SIGTERM to the pod's process (eviction): the workers finish their step together, it is
    checkpointed, the pod exits 143 (retried by the operator), never 0, and no final model is
    written; started again, the run resumes from that checkpoint and completes."""
    config = _write_config(tmp_path, train_inputs, steps=5000, checkpoint_every=0)
    proc = _agent(config)
    _wait_logged(tmp_path, 3, proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_SIGTERM, output[-3000:]
    logged = _logged(tmp_path)[-1]["step"]
    latest = json.loads((tmp_path / "run" / "checkpoints" / "latest.json").read_text())
    assert latest["step"] == logged
    assert not (tmp_path / "run" / "final").exists()
    assert not (tmp_path / "run" / "restarts").exists()  # a stop is not a failure
    again = _agent(config, f"steps={logged + 1}")
    output, _ = again.communicate(timeout=300)
    assert again.returncode == 0, output[-3000:]
    assert _logged(tmp_path)[-1]["step"] == logged + 1


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(x) for x in text.split()]


def test_a_killed_worker_is_retryable_and_a_data_error_is_not(train_inputs, tmp_path):
    """SIGKILL one worker: the pod exits 200 (retryable) and counts the failure; tables that
    do not belong to the data fail in the workers with exit 2, permanent, not counted."""
    config = _write_config(tmp_path, train_inputs, steps=5000, checkpoint_every=0, max_restarts=1)
    proc = _agent(config)
    _wait_logged(tmp_path, 2, proc)
    workers = _children(proc.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_RETRYABLE, output[-3000:]
    record = json.loads((tmp_path / "run" / "restarts" / "node-0.json").read_text())
    assert record["count"] == 1
    wrong = _write_config(
        tmp_path,
        train_inputs,
        output=str(tmp_path / "wrong"),
        loss={
            "teachers": [
                {
                    "k": 16,
                    "student_to_teacher": train_inputs["s2t_b"],
                    "teacher_to_student": train_inputs["t2s_b"],
                }
            ]
        },
    )
    proc = _agent(wrong)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_INPUT, output[-3000:]
    assert "was built for a teacher tokenizer" in output
    assert not (tmp_path / "wrong" / "restarts").exists()
