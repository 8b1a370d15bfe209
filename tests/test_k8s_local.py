"""The local Training-Operator executor on the job spec ``crosskd job render`` makes: the
manifest's own command line, the operator's environment, its result and restart rules, with
real processes (2 replicas x 1 worker, gloo) and real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from crosskd.errors import ConfigError
from crosskd.k8s.job import JobConfig, job_manifest, job_name
from crosskd.k8s.local import (
    _replicas,
    _trainjob_replicas,
    pod_processes,
    run_local,
    run_local_job,
)
from crosskd.k8s.result import FINAL_MODEL_URI_ANNOTATION, JobTimeout
from crosskd.k8s.trainjob import runtime_manifest, trainjob_manifest

STEPS = 30
LOCAL_JOB = JobConfig(
    run_id="local-test",
    image="crosskd:test",
    nodes=2,
    env={"OMP_NUM_THREADS": "1"},
    grace_seconds=60,
)
"""The job of every run here: 2 nodes of 1 CPU worker each."""


def _documents(train_inputs: dict, output: Path, **train) -> list[dict]:
    values = {
        "student": train_inputs["student"],
        "data": train_inputs["data"],
        "output": str(output),
        "teachers": [train_inputs["cache"]],
        "loss": {
            "dynamic_kd_scale": True,
            "teachers": [
                {
                    "k": 16,
                    "student_to_teacher": train_inputs["s2t"],
                    "teacher_to_student": train_inputs["t2s"],
                }
            ],
        },
        "steps": STEPS,
        "micro_batch_rows": 1,
        "global_batch_rows": 2,
        "lr": 3e-3,
        "warmup_steps": 2,
        "checkpoint_every": 5,
    } | train
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "crosskd-train"},
        "data": {"train.yaml": yaml.safe_dump(values)},
    }
    return [config_map, job_manifest(LOCAL_JOB)]


@pytest.fixture(scope="module")
def reference(train_inputs, tmp_path_factory) -> list[dict]:
    """The uninterrupted one-process curve (one micro-batch of 2 rows per step), from
    ``crosskd train`` in a process of its own (no later test forks after a Trainer ran here)."""
    root = tmp_path_factory.mktemp("one")
    values = yaml.safe_load(_documents(train_inputs, root / "run")[0]["data"]["train.yaml"])
    # One process takes the global batch's 2 rows in one micro-batch (the dynamic kd_scale is
    # per micro-batch, as it is per step of the 2-rank job).
    (root / "train.yaml").write_text(yaml.safe_dump(values | {"micro_batch_rows": 2}))
    crosskd = str(Path(sys.executable).parent / "crosskd")
    done = subprocess.run(
        [crosskd, "train", "--config", str(root / "train.yaml")],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return _curve(root / "run")


def _curve(output: Path) -> list[dict]:
    """The run's logged steps, the last record of each step winning (a resumed run logs the
    steps after its checkpoint again)."""
    by_step = {}
    for line in (output / "metrics-rank0.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def _assert_curve(output: Path, want: list[dict]) -> None:
    got = _curve(output)
    assert [g["step"] for g in got] == list(range(1, STEPS + 1))
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "ce", "kd", "kd_scale"):
            assert g[key] == pytest.approx(w[key], rel=1e-5), (g["step"], key)


def test_the_operators_environment_and_nothing_more(train_inputs, tmp_path, monkeypatch):
    monkeypatch.setenv("SOME_HOST_VARIABLE", "not in a container")
    documents = _documents(train_inputs, tmp_path / "run")
    job = documents[1]
    replicas = _replicas(job, {"crosskd-train": documents[0]}, tmp_path / "work")
    assert [(r.kind, r.index, r.rank) for r in replicas] == [("Master", 0, 0), ("Worker", 0, 1)]
    master, worker = (r.env for r in replicas)
    for env, rank in ((master, "0"), (worker, "1")):
        assert (env["RANK"], env["PET_NODE_RANK"], env["WORLD_SIZE"]) == (rank, rank, "2")
        assert (env["PET_NNODES"], env["PET_NPROC_PER_NODE"]) == ("2", "1")
        assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == "127.0.0.1"
        assert env["MASTER_PORT"] == env["PET_MASTER_PORT"] == master["MASTER_PORT"]
        assert "SOME_HOST_VARIABLE" not in env and "LOCAL_RANK" not in env
        assert env["OMP_NUM_THREADS"] == "1" and env["CROSSKD_GRACE_SECONDS"] == "60"
    # The manifest's own command, with the mounted config file mapped to the run's copy and
    # the metrics port moved for the second replica on this host.
    command = replicas[1].command
    assert Path(command[0]).name == "crosskd" and command[1:3] == ["train", "--config"]
    assert Path(command[3]).read_text() == documents[0]["data"]["train.yaml"]
    assert command[4:] == ["--nproc-per-node", "1", "metrics_port=9401"]
    assert replicas[0].command[-1] == "metrics_port=9400"


def test_a_two_replica_job_trains_like_one_process(train_inputs, reference, tmp_path):
    started = time.perf_counter()
    result = run_local(_documents(train_inputs, tmp_path / "run"), tmp_path / "work", timeout=600)
    seconds = time.perf_counter() - started
    assert result.succeeded, (result, (tmp_path / "work/master-0/log.txt").read_text()[-3000:])
    assert result.exit_codes == {"master-0": [0], "worker-0": [0]}
    assert (result.name, result.namespace) == (job_name("local-test"), "local")
    assert not result.timed_out and 0 < result.elapsed_s <= seconds
    _assert_curve(tmp_path / "run", reference)
    print(f"2-replica local job: {seconds:.1f} s")  # shown with -s; recorded in the docs


def _act_at(work: Path, output: Path, steps: int, action) -> threading.Thread:
    """Call ``action(pids)`` (the replicas' entry-point pids, which are also their process
    groups) once the run has logged ``steps`` steps. The pids are found before training starts,
    and an action that must land mid-run first stops the Master's processes (SIGSTOP), so
    a run of ~30 ms a step cannot finish under it."""

    def watch() -> None:
        deadline = time.monotonic() + 300
        pids: dict[str, int] = {}
        while time.monotonic() < deadline and len(pids) < 2:
            pids = {r: p for r in ("master-0", "worker-0") if (p := _pid_of(work, r))}
            time.sleep(0.02)
        log = output / "metrics-rank0.jsonl"
        while time.monotonic() < deadline:
            if log.exists() and len(log.read_text().splitlines()) >= steps:
                action(pids)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _signal_pod(work: Path, replica: str, sig: int) -> None:
    """``sig`` to every process of a local replica (its agent and the workers, which torch
    starts in sessions of their own)."""
    for pid in pod_processes(work / replica / "log.txt"):
        os.kill(pid, sig)


def _pid_of(work: Path, replica: str) -> int | None:
    """The process (the pod's entry point) of a running replica, from /proc: the one whose
    command line holds the replica's copy of the mounted train config."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--nproc-per-node" in cmdline and any(
            arg.startswith(bytes(work / replica) + b"/") for arg in cmdline
        ):
            return int(entry.name)
    return None


def _run_and_act(train_inputs, tmp_path: Path, paused: str, act) -> tuple:
    """Run the 2-replica job; after 12 logged steps pause replica ``paused`` (SIGSTOP to all
    its processes), call ``act(pids)``, resume it; checks that it acted mid-run and that the
    job succeeded. Returns the result and the run's output folder."""
    work, output = tmp_path / "work", tmp_path / "run"
    acted = []

    def action(pids: dict[str, int]) -> None:
        _signal_pod(work, paused, signal.SIGSTOP)
        try:
            act(pids)
            acted.append(len((output / "metrics-rank0.jsonl").read_text().splitlines()))
        finally:
            _signal_pod(work, paused, signal.SIGCONT)

    watcher = _act_at(work, output, 12, action)
    result = run_local(_documents(train_inputs, output), work, timeout=600)
    watcher.join()
    assert acted and acted[0] < STEPS, acted  # it landed mid-run
    assert result.succeeded, (result, (work / "master-0/log.txt").read_text()[-3000:])
    return result, output


def test_a_sigkilled_replica_is_recreated_and_the_job_ends_on_the_curve(
    train_inputs, reference, tmp_path
):
    def kill(pids: dict[str, int]) -> None:  # the Master's pod: its agent and workers
        _signal_pod(tmp_path / "work", "master-0", signal.SIGKILL)

    result, output = _run_and_act(train_inputs, tmp_path, "worker-0", kill)
    assert result.exit_codes["master-0"][0] < 0 and result.exit_codes["master-0"][-1] == 0
    assert result.exit_codes["worker-0"][0] == 200  # it lost its peer: retryable, recreated
    _assert_curve(output, reference)


def test_sigterm_to_the_master_checkpoints_and_retries_never_a_succeeded_job(
    train_inputs, reference, tmp_path
):
    def sigterm(pids: dict[str, int]) -> None:  # the kubelet signals PID 1, the agent
        os.kill(pids["master-0"], signal.SIGTERM)

    result, output = _run_and_act(train_inputs, tmp_path, "master-0", sigterm)
    assert result.exit_codes["master-0"] == [143, 0]  # stopped, retried, then finished
    assert result.exit_codes["worker-0"][0] == 143  # the stop was all-reduced
    _assert_curve(output, reference)


def test_a_config_error_fails_the_job_once_without_restarts(train_inputs, tmp_path):
    documents = _documents(train_inputs, tmp_path / "run", steps=0)
    result = run_local(documents, tmp_path / "work", timeout=300)
    assert result.condition == "Failed"
    # every replica refuses the config; whichever exits first fails the job, the others are
    # stopped with it: no replica is ever recreated
    failed = {name: codes for name, codes in result.exit_codes.items() if codes}
    assert failed and all(codes == [2] for codes in failed.values()), result
    first = next(iter(failed))
    assert f"{first} exited 2 (permanent under ExitCode)" in result.message
    log = (tmp_path / "work" / first / "log.txt").read_text()
    assert "steps is 0; it must be an integer >= 1" in log


def _shell_job(command: list[str]) -> list[dict]:
    """A rendered one-node job whose container runs ``command`` instead of ``crosskd train``
    (its train config on object storage: no ConfigMap to mount), naming its final model."""
    job = job_manifest(
        JobConfig(run_id="local-shell", image="crosskd:test", train_config_uri="s3://b/t.yaml")
    )
    job["metadata"]["annotations"] = {FINAL_MODEL_URI_ANNOTATION: "s3://b/final"}
    job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"] = (
        command
    )
    return [job]


def test_the_local_mode_answers_as_the_launcher_does(tmp_path):
    result = run_local_job(_shell_job(["true"]), tmp_path / "done")
    assert result.succeeded and (result.condition, result.reason) == ("Succeeded", None)
    assert (result.name, result.namespace) == (job_name("local-shell"), "local")
    assert result.final_model_uri == "s3://b/final"
    assert result.exit_codes == {"master-0": [0]}
    assert result.message == "the Master exited 0; exit codes {'master-0': [0]}"
    with pytest.raises(JobTimeout, match=r"not finished after 0\.5 s") as info:
        run_local_job(_shell_job(["sleep", "60"]), tmp_path / "slow", wait_timeout=0.5)
    assert info.value.result.timed_out and info.value.result.condition == "Failed"
    assert not info.value.result.succeeded and info.value.result.final_model_uri is None


def _trainjob_documents(train_inputs: dict, output: Path, **train) -> list[dict]:
    """The same run as a 2-node TrainJob on the crosskd-torch runtime (with the ConfigMap)."""
    config_map = _documents(train_inputs, output, **train)[0]
    return [config_map, runtime_manifest(), trainjob_manifest(LOCAL_JOB)]


def test_a_two_node_trainjob_trains_like_one_process(train_inputs, reference, tmp_path):
    """The TrainJob's own command line with exactly the torch plugin's environment (PET_*,
    no MASTER_ADDR): the nodes find each other through PET_MASTER_ADDR / PET_MASTER_PORT and
    train as one process does; the job succeeds once both nodes exited 0."""
    documents = _trainjob_documents(train_inputs, tmp_path / "run")
    replicas, _ = _trainjob_replicas(
        documents[2], documents, {"crosskd-train": documents[0]}, tmp_path / "env"
    )
    for rank, replica in enumerate(replicas):
        assert replica.name == f"node-{rank}"
        env = replica.env
        assert (env["PET_NNODES"], env["PET_NPROC_PER_NODE"], env["PET_NODE_RANK"]) == (
            "2",
            "1",
            str(rank),
        )
        assert env["PET_MASTER_ADDR"] == "127.0.0.1" and "MASTER_ADDR" not in env
    result = run_local(documents, tmp_path / "work", timeout=600)
    assert result.succeeded, (result, (tmp_path / "work/node-0/log.txt").read_text()[-3000:])
    assert result.exit_codes == {"node-0": [0], "node-1": [0]}
    _assert_curve(tmp_path / "run", reference)


def test_a_trainjob_fails_on_the_runtimes_permanent_code_and_needs_its_runtime(
    train_inputs, tmp_path
):
    documents = _trainjob_documents(train_inputs, tmp_path / "run", steps=0)
    result = run_local(documents, tmp_path / "work", timeout=300)
    assert result.condition == "Failed"
    failed = {name: codes for name, codes in result.exit_codes.items() if codes}
    assert failed and all(codes == [2] for codes in failed.values()), result
    assert "exited 2 (a FailJob exit code of TrainingRuntime crosskd-torch)" in result.message
    with pytest.raises(ConfigError, match=r"runs on TrainingRuntime 'crosskd-torch', which the"):
        run_local([documents[0], documents[2]], tmp_path / "work2")


def test_a_retryable_exit_restarts_every_node_of_a_trainjob(tmp_path):
    """JobSet's rule: a node that exits retryably (here 200 once) recreates every node, the
    others included; the job succeeds once every node exited 0."""
    job = trainjob_manifest(
        JobConfig(run_id="local-shell", image="crosskd:test", nodes=2, train_config_uri="s3://b")
    )
    script = (
        'test "$PET_NODE_RANK" = 1 && test ! -e "$MARK" && touch "$MARK" && exit 200; '
        "sleep 0.5; exit 0"
    )
    job["spec"]["trainer"]["command"] = ["sh", "-c", script]
    job["spec"]["trainer"]["env"].append({"name": "MARK", "value": str(tmp_path / "failed-once")})
    result = run_local([runtime_manifest(), job], tmp_path / "work", timeout=60)
    assert result.succeeded, result
    assert result.exit_codes["node-1"] == [200, 0]
    assert result.exit_codes["node-0"][-1] == 0 and len(result.exit_codes["node-0"]) <= 2


def test_the_cli_runs_a_rendered_trainjob_with_its_train_config(tmp_path, capsys):
    """``crosskd job run-local FILE --train-config PATH`` on a rendered TrainJob and its runtime:
    the train config becomes the ConfigMap the patched pod mounts (its name from the patch's
    volume), the node's command sees the file at its mount path, and success is one line; a
    file with a TrainJob and a PyTorchJob is refused in one line."""
    from crosskd.k8s.cli import main

    job = trainjob_manifest(JobConfig(run_id="local-cli", image="crosskd:test"))
    job["spec"]["trainer"]["command"] = ["test", "-s", "/etc/crosskd/train.yaml"]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump_all([runtime_manifest(), job]))
    config = tmp_path / "train.yaml"
    config.write_text("steps: 1\n")
    work = tmp_path / "work"
    args = ["run-local", str(path), "--train-config", str(config), "--workdir", str(work)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"TrainJob {job['metadata']['name']} succeeded locally in ")
    assert (work / "node-0/volumes/train-config/train.yaml").read_text() == "steps: 1\n"
    both = tmp_path / "both.yaml"
    both.write_text(yaml.safe_dump_all([runtime_manifest(), job, job_manifest(LOCAL_JOB)]))
    assert main(["run-local", str(both), "--workdir", str(work)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("crosskd: error: ") and err.count("\n") == 1
    assert "hold 2 PyTorchJob and TrainJob objects; give exactly one." in err
