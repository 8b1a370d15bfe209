"""The launcher (:mod:`crosskd.k8s.launcher`) against FakeKubernetesApi (``tests/k8s_fake.py``).

The fake is an HTTP server speaking the subset of the Kubernetes REST API the launcher uses;
the real ``kubernetes`` client and ``kubeflow-training``'s ``TrainingClient`` run unchanged
against it. The contract checked here: the job is created once under its own name and a
relaunched launcher reattaches to it (409) instead of creating a second; only a ``Succeeded``
condition returns; ``Failed``, the whole-wait timeout and a job deleted under the launcher
raise (non-zero exit); a long ``Created`` phase (queued GPUs) is no error before the deadline;
the master's log reaches the sink line by line, in order, once per line, across a container
restart, a recreated pod and a broken stream, and a worker's log does not; SIGTERM deletes the
job (or keeps it when asked) while SIGKILL leaves it for the next launcher; the submitted
manifest is kept as a file.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from k8s_fake import FakeKubernetesApi
from kubernetes.client import Configuration

from crosskd.errors import ConfigError, CrosskdError
from crosskd.k8s.launcher import submit
from crosskd.k8s.logs import MAX_LINE_BYTES
from crosskd.k8s.result import (
    FINAL_MODEL_URI_ANNOTATION,
    JobCancelled,
    JobDisappeared,
    JobFailed,
    JobResult,
    JobTimeout,
    LauncherError,
)

NS = "team-a"
FAST = {"poll_interval": 0.05, "request_timeout": 5.0, "log_drain_timeout": 5.0}


def manifest(name: str = "crosskd-run-1") -> dict:
    """A small PyTorchJob (Master + 1 Worker) as the job builder renders it (camelCase)."""
    container = {
        "name": "pytorch",
        "image": "crosskd:test",
        "args": ["train", "--config", "/etc/crosskd/train.yaml", "--nproc-per-node", "1"],
        "resources": {"limits": {"cpu": "1"}},
    }
    replica = {
        "replicas": 1,
        "restartPolicy": "ExitCode",
        "template": {
            "metadata": {"annotations": {"sidecar.istio.io/inject": "false"}},
            "spec": {"containers": [container]},
        },
    }
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/name": "crosskd"},
            "annotations": {FINAL_MODEL_URI_ANNOTATION: "s3://bucket/run-1/final"},
        },
        "spec": {
            "nprocPerNode": "1",
            "runPolicy": {"backoffLimit": 0, "ttlSecondsAfterFinished": 3600},
            "pytorchReplicaSpecs": {"Master": replica, "Worker": replica},
        },
    }


@pytest.fixture
def fake():
    with FakeKubernetesApi() as api:
        yield api
        assert api.errors == []


def client_for(api: FakeKubernetesApi):
    from kubeflow.training import TrainingClient

    return TrainingClient(client_configuration=Configuration(host=api.url), namespace=NS)


def run_to_success(api: FakeKubernetesApi, name: str, start: int = 0) -> None:
    """Timeline: Running with a master pod at GET start+1, Succeeded at GET start+3."""
    api.on_get(
        NS,
        name,
        start + 1,
        lambda f: (f.set_condition(NS, name, "Running"), f.start_master(NS, name, ["hello"])),
    )

    def finish(f: FakeKubernetesApi) -> None:
        f.finish_master(NS, f"{name}-master-0")
        f.set_condition(NS, name, "Succeeded")

    api.on_get(NS, name, start + 3, finish)


def test_create_then_succeeded(fake: FakeKubernetesApi, tmp_path: Path) -> None:
    lines: list[str] = []
    run_to_success(fake, "crosskd-run-1")
    result = submit(
        manifest(),
        namespace=NS,
        wait_timeout=20,
        client=client_for(fake),
        manifest_path=tmp_path / "kept" / "job.yaml",
        log_sink=lines.append,
        **FAST,
    )
    assert isinstance(result, JobResult)
    assert result.succeeded and result.condition == "Succeeded"
    assert result.reason == "PyTorchJobSucceeded"
    assert (result.name, result.namespace, result.reattached) == ("crosskd-run-1", NS, False)
    assert not result.timed_out and result.exit_codes == {}  # exit codes: local jobs only
    assert result.final_model_uri == "s3://bucket/run-1/final"
    assert fake.count("POST", fake.job_path(NS)) == 1 and fake.created_total == 1
    assert fake.count("DELETE") == 0  # cleanup is left to ttlSecondsAfterFinished
    assert lines == ["hello"]
    # The manifest kept is what was submitted: camelCase, namespaced, loadable by kubectl.
    kept = yaml.safe_load((tmp_path / "kept" / "job.yaml").read_text())
    assert kept == {**manifest(), "metadata": {**manifest()["metadata"], "namespace": NS}}
    stored = fake.jobs[(NS, "crosskd-run-1")]
    assert stored["spec"] == kept["spec"]


def test_long_queue_is_not_an_error_and_delete_when_done(fake: FakeKubernetesApi) -> None:
    # Created (queued) for a long stretch of polls before Running: no "until Running" deadline.
    name = "crosskd-queued"
    run_to_success(fake, name, start=25)
    result = submit(
        manifest(name),
        namespace=NS,
        wait_timeout=20,
        client=client_for(fake),
        delete_when_done=True,
        final_model_uri="s3://b/x",
        **FAST,
    )
    assert result.succeeded and result.final_model_uri == "s3://b/x"
    assert fake.gets(NS, name) >= 28
    assert (NS, name) not in fake.jobs and fake.count("DELETE") == 1


def test_failed_raises_with_reason_and_message(fake: FakeKubernetesApi) -> None:
    name = "crosskd-fails"
    message = f"PyTorchJob {NS}/{name} has failed because 1 Master replica(s) failed."

    def fail(f: FakeKubernetesApi) -> None:
        f.finish_master(NS, f"{name}-master-0", exit_code=2)
        f.set_condition(NS, name, "Failed", message=message)

    fake.on_get(
        NS,
        name,
        1,
        lambda f: (
            f.set_condition(NS, name, "Running"),
            f.start_master(NS, name, ["crosskd: error: bad"]),
        ),
    )
    fake.on_get(NS, name, 2, fail)
    lines: list[str] = []
    with pytest.raises(JobFailed) as info:
        submit(
            manifest(name),
            namespace=NS,
            wait_timeout=20,
            client=client_for(fake),
            log_sink=lines.append,
            **FAST,
        )
    text = str(info.value)
    assert name in text and "PyTorchJobFailed" in text and message in text
    assert isinstance(info.value, CrosskdError)  # the CLI prints one line, exits non-zero
    assert info.value.result.condition == "Failed" and not info.value.result.succeeded
    assert info.value.result.final_model_uri is None
    assert lines == ["crosskd: error: bad"]  # the logs were drained before raising


def test_timeout_raises_and_leaves_the_job(fake: FakeKubernetesApi) -> None:
    name = "crosskd-slow"
    fake.on_get(
        NS,
        name,
        2,
        lambda f: (f.set_condition(NS, name, "Running"), f.start_master(NS, name, ["step 1"])),
    )
    started = time.monotonic()
    with pytest.raises(JobTimeout) as info:
        submit(
            manifest(name),
            namespace=NS,
            wait_timeout=0.6,
            client=client_for(fake),
            log_sink=lambda line: None,
            **FAST,
        )
    elapsed = time.monotonic() - started
    assert 0.6 <= elapsed < 3.0
    assert "wait_timeout=0.6" in str(info.value) and "Running" in str(info.value)
    assert info.value.result.timed_out and not info.value.result.succeeded
    assert (NS, name) in fake.jobs and fake.count("DELETE") == 0


def test_job_that_disappears_raises(fake: FakeKubernetesApi) -> None:
    name = "crosskd-vanishes"
    fake.on_get(NS, name, 1, lambda f: f.set_condition(NS, name, "Running"))
    fake.on_get(NS, name, 3, lambda f: f.remove_job(NS, name))
    with pytest.raises(JobDisappeared, match=f"{NS}/{name} was deleted"):
        submit(manifest(name), namespace=NS, wait_timeout=20, client=client_for(fake), **FAST)


def test_transient_errors_are_retried_forbidden_is_not(fake: FakeKubernetesApi) -> None:
    name = "crosskd-flaky"
    path = fake.job_path(NS, name)
    fake.on_get(
        NS, name, 1, lambda f: (f.fail_next("GET", path, 503), f.fail_next("GET", path, 500))
    )
    run_to_success(fake, name, start=1)
    assert submit(
        manifest(name),
        namespace=NS,
        wait_timeout=20,
        client=client_for(fake),
        log_sink=lambda line: None,
        **FAST,
    ).succeeded
    fake.fail_next("GET", fake.job_path(NS, "crosskd-denied"), 403)
    with pytest.raises(LauncherError, match="reading PyTorchJob"):
        submit(
            manifest("crosskd-denied"),
            namespace=NS,
            wait_timeout=20,
            client=client_for(fake),
            **FAST,
        )
    fake.fail_next("POST", fake.job_path(NS), 403)
    with pytest.raises(LauncherError, match="submitting PyTorchJob"):
        submit(
            manifest("crosskd-refused"),
            namespace=NS,
            wait_timeout=20,
            client=client_for(fake),
            **FAST,
        )


def test_logs_in_order_across_restarts_and_a_broken_stream(fake: FakeKubernetesApi) -> None:
    name = "crosskd-restarts"
    pod = f"{name}-master-0"
    fake.on_get(
        NS,
        name,
        2,
        lambda f: (f.set_condition(NS, name, "Running"), f.start_master(NS, name, ["a1", "a2"])),
    )
    fake.on_get(
        NS,
        name,
        4,
        lambda f: (f.wait_delivered(NS, pod), f.drop_log_streams(NS, pod), f.log(NS, pod, "a3")),
    )
    # The kubelet restarts the container in the same pod (restartCount 1) ...
    fake.on_get(
        NS,
        name,
        6,
        lambda f: (f.restart_container(NS, pod, ["b1"]), f.set_condition(NS, name, "Restarting")),
    )
    fake.on_get(
        NS, name, 8, lambda f: (f.log(NS, pod, "b2", "b3"), f.set_condition(NS, name, "Running"))
    )
    # ... then the operator recreates the pod (ExitCode policy: same name, a new uid).
    fake.on_get(NS, name, 10, lambda f: f.recreate_pod(NS, pod, ["c1", "c2 é ünïcode"]))
    fake.on_get(
        NS,
        name,
        12,
        lambda f: (
            f.log(NS, pod, "x" * 70_000 + "y", "c3"),
            f.finish_master(NS, pod),
            f.set_condition(NS, name, "Succeeded"),
        ),
    )
    lines: list[str] = []
    result = submit(
        manifest(name),
        namespace=NS,
        wait_timeout=20,
        client=client_for(fake),
        log_sink=lines.append,
        **FAST,
    )
    assert result.succeeded
    long = MAX_LINE_BYTES
    assert lines == [
        "a1",
        "a2",
        "a3",
        "b1",
        "b2",
        "b3",
        "c1",
        "c2 é ünïcode",
        "x" * long,
        "x" * (70_000 - long) + "y",
        "c3",
    ]
    # Only the master was followed, with the streaming call (follow=true), never the worker.
    logs = [p for m, p in fake.requests if "/log" in p]
    assert logs and all(f"/pods/{pod}/log" in p and "follow=true" in p.lower() for p in logs)


@pytest.mark.parametrize("form", ["model", "manifest"])
def test_the_job_builders_job_is_submitted_unchanged(fake: FakeKubernetesApi, form: str) -> None:
    from crosskd.k8s.job import JobConfig, build_job, job_manifest, job_name

    config = JobConfig(run_id="run-42", image="crosskd:test", nodes=2)
    job = build_job(config) if form == "model" else job_manifest(config)
    name = job_name("run-42")
    run_to_success(fake, name)
    result = submit(
        job,
        namespace=NS,
        wait_timeout=20,
        client=client_for(fake),
        log_sink=lambda line: None,
        **FAST,
    )
    assert result.succeeded and result.name == name
    expected = {**job_manifest(config)}
    expected["metadata"] = {**expected["metadata"], "namespace": NS}
    stored = fake.jobs[(NS, name)]
    assert stored["spec"] == expected["spec"]
    assert {k: stored["metadata"][k] for k in expected["metadata"]} == expected["metadata"]
    if form == "model":
        assert job.metadata.namespace is None  # the caller's object is not changed


def test_worker_only_job_follows_worker_0(fake: FakeKubernetesApi) -> None:
    name = "crosskd-elastic"
    job = manifest(name)
    job["spec"]["pytorchReplicaSpecs"] = {
        "Worker": {**job["spec"]["pytorchReplicaSpecs"]["Worker"], "replicas": 2}
    }
    job["spec"]["elasticPolicy"] = {"rdzvBackend": "c10d", "minReplicas": 2, "maxReplicas": 2}
    pod = f"{name}-worker-0"

    def finish(f: FakeKubernetesApi) -> None:
        f.finish_master(NS, pod)
        f.set_condition(NS, name, "Succeeded")

    fake.on_get(NS, name, 1, lambda f: f.start_master(NS, name, ["rank 0"], replica_type="worker"))
    fake.on_get(NS, name, 3, finish)
    lines: list[str] = []
    result = submit(
        job, namespace=NS, wait_timeout=20, client=client_for(fake), log_sink=lines.append, **FAST
    )
    assert result.succeeded and lines == ["rank 0"]


def test_reattach_on_409_without_a_second_job(fake: FakeKubernetesApi) -> None:
    name = "crosskd-existing"
    fake.add_job({**manifest(name), "metadata": {"name": name, "namespace": NS}})
    fake.set_condition(NS, name, "Running")
    run_to_success(fake, name, start=1)
    result = submit(
        manifest(name),
        namespace=NS,
        wait_timeout=20,
        client=client_for(fake),
        log_sink=lambda line: None,
        **FAST,
    )
    assert result.succeeded and result.reattached
    assert fake.count("POST") == 1 and fake.created_total == 1


CHILD = r"""
import json, logging, sys
from kubernetes.client import Configuration
from kubeflow.training import TrainingClient
from crosskd.k8s.launcher import submit
from crosskd.k8s.result import LauncherError
url, ns, job, delete = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4] == "1"
logging.basicConfig(level=logging.INFO)
client = TrainingClient(client_configuration=Configuration(host=url), namespace=ns)
try:
    submit(job, namespace=ns, wait_timeout=60, client=client, poll_interval=0.05,
           delete_on_sigterm=delete)
except LauncherError as exc:
    sys.stderr.write(f"crosskd: error: {exc}\n")
    sys.exit(getattr(exc, "exit_code", 2))
"""


def start_child(api: FakeKubernetesApi, name: str, *, delete: bool = True) -> subprocess.Popen:
    """A launcher in its own process, once it polls the job it created (or found)."""
    before = api.gets(NS, name)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, api.url, NS, json.dumps(manifest(name)), "01"[delete]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + 30
    while api.gets(NS, name) < before + 2:
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "the child launcher never polled its job"
        time.sleep(0.02)
    return child


def test_sigkill_leaves_the_job_and_the_next_launcher_reattaches(fake: FakeKubernetesApi) -> None:
    name = "crosskd-killed"
    fake.on_get(
        NS,
        name,
        1,
        lambda f: (
            f.set_condition(NS, name, "Running"),
            f.start_master(NS, name, ["before the kill"]),
        ),
    )
    child = start_child(fake, name)
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=10)
    assert child.returncode == -signal.SIGKILL
    assert (NS, name) in fake.jobs and fake.count("DELETE") == 0
    fake.log(NS, f"{name}-master-0", "after the relaunch")

    def finish(f: FakeKubernetesApi) -> None:
        f.finish_master(NS, f"{name}-master-0")
        f.set_condition(NS, name, "Succeeded")

    fake.on_get(NS, name, fake.gets(NS, name) + 3, finish)
    lines: list[str] = []
    result = submit(
        manifest(name),
        namespace=NS,
        wait_timeout=20,
        client=client_for(fake),
        log_sink=lines.append,
        **FAST,
    )
    assert result.succeeded and result.reattached
    assert fake.count("POST") == 2 and fake.created_total == 1  # one job, two launchers
    assert lines == ["before the kill", "after the relaunch"]  # a reattach shows the log


@pytest.mark.parametrize("delete", [True, False], ids=["deletes", "keeps"])
def test_sigterm_deletes_the_job(fake: FakeKubernetesApi, delete: bool) -> None:
    name = f"crosskd-cancelled-{int(delete)}"
    fake.on_get(
        NS,
        name,
        1,
        lambda f: (f.set_condition(NS, name, "Running"), f.start_master(NS, name, ["training"])),
    )
    child = start_child(fake, name, delete=delete)
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=10)
    assert child.returncode == JobCancelled.exit_code == 143, err
    assert err.strip().splitlines()[-1].startswith("crosskd: error: SIGTERM")
    if delete:
        assert fake.count("DELETE", fake.job_path(NS, name)) == 1
        assert (NS, name) not in fake.jobs and not fake.pods  # no pod keeps its GPUs
    else:
        assert fake.count("DELETE") == 0 and (NS, name) in fake.jobs
        assert "left running" in err


def test_bad_jobs_are_refused_before_submission() -> None:
    bad = manifest()
    bad["spec"]["runPolicy"]["backofLimit"] = 3  # misspelt: the model would drop it
    with pytest.raises(ConfigError, match=r"spec\.runPolicy\.backofLimit"):
        submit(bad, namespace=NS, wait_timeout=1, client=object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="DNS-1035"):
        submit(manifest("Crosskd_Run"), namespace=NS, wait_timeout=1, client=object())
    other = manifest()
    other["metadata"]["namespace"] = "elsewhere"
    with pytest.raises(ConfigError, match="elsewhere"):
        submit(other, namespace=NS, wait_timeout=1, client=object())
    with pytest.raises(ConfigError, match="wait_timeout"):
        submit(manifest(), namespace=NS, wait_timeout=0, client=object())
    with pytest.raises(ConfigError, match=r"kubeflow\.org/v1 PyTorchJob"):
        submit({**manifest(), "kind": "TFJob"}, namespace=NS, wait_timeout=math.inf)
