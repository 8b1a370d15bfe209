"""The launcher (:mod:`crosskd.k8s.launcher`) against FakeKubernetesApi (``tests/k8s_fake.py``).

The fake is an HTTP server speaking the subset of the Kubernetes REST API the launcher uses;
the real ``kubernetes`` client, ``kubeflow-training``'s ``TrainingClient`` and crosskd's
``TrainJobClient`` run unchanged against it. The contract is checked for both job kinds (the
``each`` fixture: a PyTorchJob, then a Trainer v2 TrainJob): the job is created once under its
own name and a relaunched launcher reattaches to it (409) instead of creating a second, unless
it is being deleted; only the kind's success condition (``Succeeded``, ``Complete``) with status
"True" returns; ``Failed``, the whole-wait timeout and a job deleted under the launcher raise
(non-zero exit); a long queued phase is no error before the deadline; rank 0's log reaches the
sink line by line, in order, once per line, across a container restart, a recreated pod (a
restarted JobSet's new pod) and a broken stream, and another rank's log does not; SIGTERM
deletes the job (or keeps it when asked) while SIGKILL leaves it for the next launcher; the
submitted manifest is kept as a file; a malformed job, or a client of the other API, is refused
before anything is submitted.
"""

from __future__ import annotations

import functools
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
from k8s_fake import PYTORCHJOB, TRAINJOB, FakeKubernetesApi
from kubernetes.client import ApiClient, Configuration

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
from crosskd.k8s.trainjob_api import TrainJobClient

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


@functools.cache
def _rendered_trainjob() -> str:
    """The job builder's TrainJob of a 2-node run, as JSON (copied per test)."""
    from crosskd.k8s.job import JobConfig
    from crosskd.k8s.trainjob import trainjob_manifest

    return json.dumps(trainjob_manifest(JobConfig(run_id="run-1", image="crosskd:test", nodes=2)))


def trainjob(name: str = "crosskd-run-1") -> dict:
    """The job builder's TrainJob of a 2-node run, named ``name``, with the final model's
    annotation."""
    job = json.loads(_rendered_trainjob())
    job["metadata"]["name"] = name
    job["metadata"]["annotations"] = {FINAL_MODEL_URI_ANNOTATION: "s3://bucket/run-1/final"}
    return job


@pytest.fixture
def fake():
    with FakeKubernetesApi() as api:
        yield api
        assert api.errors == []


@pytest.fixture(params=[PYTORCHJOB, TRAINJOB], ids=["pytorchjob", "trainjob"])
def each(request):
    """The fake serving one job kind, then the other: the launcher's contract holds for both."""
    with FakeKubernetesApi(job=request.param) as api:
        yield api
        assert api.errors == []


def job_for(api: FakeKubernetesApi, name: str = "crosskd-run-1") -> dict:
    """A job of the kind ``api`` serves."""
    return trainjob(name) if api.job is TRAINJOB else manifest(name)


def client_for(api: FakeKubernetesApi):
    """The client of the kind ``api`` serves, talking to it."""
    configuration = Configuration(host=api.url)
    if api.job is TRAINJOB:
        return TrainJobClient(NS, api=ApiClient(configuration))
    from kubeflow.training import TrainingClient

    return TrainingClient(client_configuration=configuration, namespace=NS)


def running(api: FakeKubernetesApi, name: str, lines: list[str]) -> str:
    """The job runs: a PyTorchJob gets ``Running``, a TrainJob (which has no such condition)
    one active child Job; rank 0's pod logs ``lines``. Returns that pod's name."""
    if api.job is TRAINJOB:
        api.set_status(NS, name, jobsStatus=[JOBS_ACTIVE])
    else:
        api.set_condition(NS, name, "Running")
    return api.start_master(NS, name, lines)


def finish(api: FakeKubernetesApi, name: str, pod: str, exit_code: int = 0, **condition) -> None:
    """Rank 0 exits with ``exit_code`` (its log streamed); the job gets its kind's success
    condition (0) or ``Failed``."""
    api.finish_master(NS, pod, exit_code=exit_code)
    api.set_condition(NS, name, "Failed" if exit_code else api.job.final[0], **condition)


JOBS_ACTIVE = {"name": "node", "active": 1, "ready": 1, "succeeded": 0, "failed": 0, "suspended": 0}
"""A TrainJob's ``jobsStatus`` entry while its node Job runs."""


def run_to_success(api: FakeKubernetesApi, name: str, start: int = 0) -> None:
    """Timeline: running with rank 0's pod logging "hello" at GET start+1, successful at GET
    start+3."""
    pods: list[str] = []
    api.on_get(NS, name, start + 1, lambda f: pods.append(running(f, name, ["hello"])))
    api.on_get(NS, name, start + 3, lambda f: finish(f, name, pods[0]))


def test_create_then_succeeded(each: FakeKubernetesApi, tmp_path: Path) -> None:
    lines: list[str] = []
    run_to_success(each, "crosskd-run-1")
    result = submit(
        job_for(each),
        namespace=NS,
        wait_timeout=20,
        client=client_for(each),
        manifest_path=tmp_path / "kept" / "job.yaml",
        log_sink=lines.append,
        **FAST,
    )
    success = each.job.final[0]
    assert isinstance(result, JobResult)
    assert result.succeeded and result.condition == success
    assert result.reason == each.job.reasons[success][0]
    assert (result.name, result.namespace, result.reattached) == ("crosskd-run-1", NS, False)
    assert not result.timed_out and result.exit_codes == {}  # exit codes: local jobs only
    assert result.final_model_uri == "s3://bucket/run-1/final"
    assert each.count("POST", each.job_path(NS)) == 1 and each.created_total == 1
    assert each.count("DELETE") == 0  # cleanup is left to ttlSecondsAfterFinished
    assert lines == ["hello"]
    # The manifest kept is what was submitted: camelCase, namespaced, loadable by kubectl.
    kept = yaml.safe_load((tmp_path / "kept" / "job.yaml").read_text())
    given = job_for(each)
    assert kept == {**given, "metadata": {**given["metadata"], "namespace": NS}}
    stored = each.jobs[(NS, "crosskd-run-1")]
    assert stored["spec"] == kept["spec"]


def test_long_queue_is_not_an_error_and_delete_when_done(each: FakeKubernetesApi) -> None:
    # Queued (Created; a TrainJob without a condition) for a long stretch of polls before it
    # runs: there is no "until Running" deadline.
    name = "crosskd-queued"
    run_to_success(each, name, start=25)
    result = submit(
        job_for(each, name),
        namespace=NS,
        wait_timeout=20,
        client=client_for(each),
        delete_when_done=True,
        final_model_uri="s3://b/x",
        **FAST,
    )
    assert result.succeeded and result.final_model_uri == "s3://b/x"
    assert each.gets(NS, name) >= 28
    assert (NS, name) not in each.jobs and each.count("DELETE") == 1


def test_failed_raises_with_reason_and_message(each: FakeKubernetesApi) -> None:
    name = "crosskd-fails"
    message = f"{each.job.kind} {NS}/{name} has failed because 1 node failed."
    pods: list[str] = []
    each.on_get(NS, name, 1, lambda f: pods.append(running(f, name, ["crosskd: error: bad"])))
    each.on_get(NS, name, 2, lambda f: finish(f, name, pods[0], exit_code=2, message=message))
    lines: list[str] = []
    with pytest.raises(JobFailed) as info:
        submit(
            job_for(each, name),
            namespace=NS,
            wait_timeout=20,
            client=client_for(each),
            log_sink=lines.append,
            **FAST,
        )
    text = str(info.value)
    assert f"{each.job.kind} {NS}/{name} failed" in text
    assert each.job.reasons["Failed"][0] in text and message in text
    assert isinstance(info.value, CrosskdError)  # the CLI prints one line, exits non-zero
    assert info.value.result.condition == "Failed" and not info.value.result.succeeded
    assert info.value.result.final_model_uri is None
    assert lines == ["crosskd: error: bad"]  # the logs were drained before raising


def test_a_success_condition_that_is_not_true_is_no_success(each: FakeKubernetesApi) -> None:
    # The success condition present but "False" (or another kind's success type) never returns.
    name = "crosskd-not-yet"
    other = "Complete" if each.job is PYTORCHJOB else "Succeeded"

    def false_success(f: FakeKubernetesApi) -> None:
        f.set_status(
            NS,
            name,
            conditions=[
                {
                    "type": f.job.final[0],
                    "status": "False",
                    "reason": "NotYet",
                    "message": "not yet",
                    "lastTransitionTime": "2026-12-04T00:00:00Z",
                },
                {
                    "type": other,
                    "status": "True",
                    "reason": "OtherKinds",
                    "message": "another API's success type",
                    "lastTransitionTime": "2026-12-04T00:00:00Z",
                },
            ],
        )

    each.on_get(NS, name, 1, false_success)
    with pytest.raises(JobTimeout) as info:
        submit(
            job_for(each, name),
            namespace=NS,
            wait_timeout=0.5,
            client=client_for(each),
            stream_logs=False,
            **FAST,
        )
    assert info.value.result.condition == other  # the status was read, and not taken as success


def test_timeout_raises_and_leaves_the_job(each: FakeKubernetesApi) -> None:
    name = "crosskd-slow"
    each.on_get(NS, name, 2, lambda f: running(f, name, ["step 1"]))
    started = time.monotonic()
    with pytest.raises(JobTimeout) as info:
        submit(
            job_for(each, name),
            namespace=NS,
            wait_timeout=0.6,
            client=client_for(each),
            log_sink=lambda line: None,
            **FAST,
        )
    elapsed = time.monotonic() - started
    assert 0.6 <= elapsed < 3.0
    assert "wait_timeout=0.6" in str(info.value) and "left running" in str(info.value)
    assert f"kubectl -n {NS} delete {each.job.kind.lower()} {name}" in str(info.value)
    if each.job is PYTORCHJOB:
        assert "last condition: Running (PyTorchJobRunning)" in str(info.value)
    else:  # a running TrainJob has no condition: its Jobs' counts say how it stands
        assert "last condition: no condition yet [jobs node: 1 active, 1 ready]" in str(info.value)
    assert info.value.result.timed_out and not info.value.result.succeeded
    assert (NS, name) in each.jobs and each.count("DELETE") == 0


def test_job_that_disappears_raises(each: FakeKubernetesApi) -> None:
    name = "crosskd-vanishes"
    each.on_get(NS, name, 1, lambda f: running(f, name, []))
    each.on_get(NS, name, 3, lambda f: f.remove_job(NS, name))
    with pytest.raises(JobDisappeared, match=f"{each.job.kind} {NS}/{name} was deleted"):
        submit(job_for(each, name), namespace=NS, wait_timeout=20, client=client_for(each), **FAST)


def test_transient_errors_are_retried_forbidden_is_not(each: FakeKubernetesApi) -> None:
    name = "crosskd-flaky"
    path = each.job_path(NS, name)
    each.on_get(
        NS, name, 1, lambda f: (f.fail_next("GET", path, 503), f.fail_next("GET", path, 500))
    )
    run_to_success(each, name, start=1)
    assert submit(
        job_for(each, name),
        namespace=NS,
        wait_timeout=20,
        client=client_for(each),
        log_sink=lambda line: None,
        **FAST,
    ).succeeded
    kind = each.job.kind
    each.fail_next("GET", each.job_path(NS, "crosskd-denied"), 403)
    with pytest.raises(LauncherError, match=f"reading {kind} {NS}/crosskd-denied"):
        submit(
            job_for(each, "crosskd-denied"),
            namespace=NS,
            wait_timeout=20,
            client=client_for(each),
            **FAST,
        )
    each.fail_next("POST", each.job_path(NS), 403)
    with pytest.raises(LauncherError, match=f"submitting {kind} {NS}/crosskd-refused"):
        submit(
            job_for(each, "crosskd-refused"),
            namespace=NS,
            wait_timeout=20,
            client=client_for(each),
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
def test_the_job_builders_job_is_submitted_unchanged(each: FakeKubernetesApi, form: str) -> None:
    from kubeflow_trainer_api import models as tr

    from crosskd.k8s.job import JobConfig, build_job, job_manifest, job_name
    from crosskd.k8s.trainjob import build_trainjob, trainjob_manifest

    config = JobConfig(run_id="run-42", image="crosskd:test", nodes=2)
    trainjobs = each.job is TRAINJOB
    build, render = (build_trainjob, trainjob_manifest) if trainjobs else (build_job, job_manifest)
    job = build(config) if form == "model" else render(config)
    name = job_name("run-42")
    run_to_success(each, name)
    result = submit(
        job,
        namespace=NS,
        wait_timeout=20,
        client=client_for(each),
        log_sink=lambda line: None,
        **FAST,
    )
    assert result.succeeded and result.name == name
    expected = render(config)
    expected["metadata"] = {**expected["metadata"], "namespace": NS}
    stored = each.jobs[(NS, name)]
    assert stored["spec"] == expected["spec"]
    assert {k: stored["metadata"][k] for k in expected["metadata"]} == expected["metadata"]
    if form == "model":
        assert job.metadata.namespace is None  # the caller's object is not changed
        assert isinstance(job, tr.TrainerV1alpha1TrainJob) == trainjobs


def test_trainjob_log_follows_node_0_across_restarts_and_progress_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Node 0's container restarts in its pod, then the JobSet is restarted (every node's pod
    # made anew under a new name): the log goes on from the new node 0; node 1 is never shown.
    # What jobsStatus and trainerStatus say is logged as it changes.
    name = "crosskd-trainjob-restarts"
    pods: list[str] = []
    with FakeKubernetesApi(job=TRAINJOB) as api:
        api.on_get(NS, name, 2, lambda f: pods.append(running(f, name, ["a1", "a2"])))
        api.on_get(NS, name, 4, lambda f: f.restart_container(NS, pods[0], ["b1"]))
        api.on_get(
            NS,
            name,
            6,
            lambda f: f.set_status(
                NS,
                name,
                trainerStatus={
                    "progressPercentage": 40,
                    "estimatedRemainingSeconds": 90,
                    "lastUpdatedTime": "2026-12-04T00:00:00Z",
                },
            ),
        )
        api.on_get(NS, name, 8, lambda f: pods.append(f.restart_jobset(NS, name, ["c1"])))
        api.on_get(NS, name, 10, lambda f: finish(f, name, pods[-1]))
        lines: list[str] = []
        with caplog.at_level("INFO", logger="crosskd.k8s.wait"):
            result = submit(
                trainjob(name),
                namespace=NS,
                wait_timeout=20,
                client=client_for(api),
                log_sink=lines.append,
                **FAST,
            )
        assert api.errors == []
    assert result.succeeded and result.condition == "Complete"
    assert lines == ["a1", "a2", "b1", "c1"]
    assert len(set(pods)) == 2 and pods[0] != pods[1]  # the JobSet's restart renamed node 0
    progress = [r.getMessage() for r in caplog.records if "[" in r.getMessage()]
    assert any("jobs node: 1 active, 1 ready" in m for m in progress), progress
    assert any(m.endswith("[jobs node: 1 active, 1 ready; trainer 40% done]") for m in progress)
    assert not any("90" in m for m in progress)  # the time estimate: a line at every read
    assert f"TrainJob {NS}/{name}: Complete (AllJobsCompleted)" in caplog.text
    logs = [p for m, p in api.requests if "/log" in p]
    assert logs and all("-node-0-0-" in p and "container=node" in p for p in logs)


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


def test_reattach_on_409_without_a_second_job(each: FakeKubernetesApi) -> None:
    name = "crosskd-existing"
    given = job_for(each, name)
    each.add_job({**given, "metadata": {"name": name, "namespace": NS}})
    pod = running(each, name, [])
    each.on_get(NS, name, 2, lambda f: finish(f, name, pod))
    result = submit(
        given,
        namespace=NS,
        wait_timeout=20,
        client=client_for(each),
        log_sink=lambda line: None,
        **FAST,
    )
    assert result.succeeded and result.reattached
    assert each.count("POST") == 1 and each.created_total == 1


def test_a_job_being_deleted_is_not_reattached(each: FakeKubernetesApi) -> None:
    name = "crosskd-going"
    given = job_for(each, name)
    stored = each.add_job({**given, "metadata": {"name": name, "namespace": NS}})
    stored["metadata"]["deletionTimestamp"] = "2026-12-04T00:00:00Z"
    with pytest.raises(LauncherError, match=f"{each.job.kind} {NS}/{name} exists but is being"):
        submit(given, namespace=NS, wait_timeout=20, client=client_for(each), **FAST)
    assert each.created_total == 1


CHILD = r"""
import json, logging, sys
from kubernetes.client import ApiClient, Configuration
from kubeflow.training import TrainingClient
from crosskd.k8s.launcher import submit
from crosskd.k8s.result import LauncherError
from crosskd.k8s.trainjob_api import TrainJobClient
url, ns, job, delete = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4] == "1"
logging.basicConfig(level=logging.INFO)
configuration = Configuration(host=url)
if job["kind"] == "TrainJob":
    client = TrainJobClient(ns, api=ApiClient(configuration))
else:
    client = TrainingClient(client_configuration=configuration, namespace=ns)
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
        [sys.executable, "-c", CHILD, api.url, NS, json.dumps(job_for(api, name)), "01"[delete]],
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


def test_sigkill_leaves_the_job_and_the_next_launcher_reattaches(each: FakeKubernetesApi) -> None:
    name = "crosskd-killed"
    pods: list[str] = []
    each.on_get(NS, name, 1, lambda f: pods.append(running(f, name, ["before the kill"])))
    child = start_child(each, name)
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=10)
    assert child.returncode == -signal.SIGKILL
    assert (NS, name) in each.jobs and each.count("DELETE") == 0
    each.log(NS, pods[0], "after the relaunch")
    each.on_get(NS, name, each.gets(NS, name) + 3, lambda f: finish(f, name, pods[0]))
    lines: list[str] = []
    result = submit(
        job_for(each, name),
        namespace=NS,
        wait_timeout=20,
        client=client_for(each),
        log_sink=lines.append,
        **FAST,
    )
    assert result.succeeded and result.reattached
    assert each.count("POST") == 2 and each.created_total == 1  # one job, two launchers
    assert lines == ["before the kill", "after the relaunch"]  # a reattach shows the log


@pytest.mark.parametrize("delete", [True, False], ids=["deletes", "keeps"])
def test_sigterm_deletes_the_job(each: FakeKubernetesApi, delete: bool) -> None:
    name = f"crosskd-cancelled-{int(delete)}"
    each.on_get(NS, name, 1, lambda f: running(f, name, ["training"]))
    child = start_child(each, name, delete=delete)
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=10)
    assert child.returncode == JobCancelled.exit_code == 143, err
    assert err.strip().splitlines()[-1].startswith("crosskd: error: SIGTERM")
    if delete:
        assert each.count("DELETE", each.job_path(NS, name)) == 1
        assert (NS, name) not in each.jobs and not each.pods  # no pod keeps its GPUs
        if each.job is TRAINJOB:  # the JobSet, its Jobs and pods go with the TrainJob
            assert each.deletions == [("trainjobs", NS, name, "Background")]
    else:
        assert each.count("DELETE") == 0 and (NS, name) in each.jobs
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


def test_bad_trainjobs_are_refused_before_submission() -> None:
    from kubeflow.training import TrainingClient

    bad = trainjob()
    bad["spec"]["trainer"]["numNode"] = 2  # misspelt: the model would drop it
    with pytest.raises(ConfigError, match=r"spec\.trainer\.numNode"):
        submit(bad, namespace=NS, wait_timeout=1, client=object())
    with pytest.raises(ConfigError, match="TrainJob name 'Crosskd_Run' is not a DNS-1035"):
        submit(trainjob("Crosskd_Run"), namespace=NS, wait_timeout=1, client=object())
    other = trainjob()
    other["metadata"]["namespace"] = "elsewhere"
    with pytest.raises(ConfigError, match="elsewhere"):
        submit(other, namespace=NS, wait_timeout=1, client=object())
    incomplete = trainjob()
    del incomplete["spec"]["runtimeRef"]
    with pytest.raises(ConfigError, match="malformed: field 'runtimeRef'"):
        submit(incomplete, namespace=NS, wait_timeout=1, client=object())
    with pytest.raises(
        ConfigError,
        match=r"submits kubeflow\.org/v1 PyTorchJob or trainer\.kubeflow\.org/v1alpha1 TrainJob",
    ):
        submit(
            {**trainjob(), "apiVersion": "trainer.kubeflow.org/v1"},
            namespace=NS,
            wait_timeout=1,
            client=object(),
        )
    # A PyTorchJob's client for a TrainJob (and the other way round): refused before submission.
    training = TrainingClient(client_configuration=Configuration(host="http://127.0.0.1:9"))
    with pytest.raises(ConfigError, match="TrainJob is submitted with a TrainJobClient"):
        submit(trainjob(), namespace=NS, wait_timeout=1, client=training)
    trainjobs = TrainJobClient(NS, api=ApiClient(Configuration(host="http://127.0.0.1:9")))
    with pytest.raises(ConfigError, match="PyTorchJob is submitted with a TrainingClient"):
        submit(manifest(), namespace=NS, wait_timeout=1, client=trainjobs)


def test_a_trainjob_the_model_cannot_read_is_an_error_not_a_retry() -> None:
    # A status the installed kubeflow_trainer_api cannot read (a newer Trainer's, say) would
    # read the same at every poll: one clear error, not a wait until wait_timeout.
    name = "crosskd-unreadable"
    with FakeKubernetesApi(job=TRAINJOB) as api:
        api.on_get(NS, name, 2, lambda f: f.set_status(NS, name, jobsStatus=[{"name": 7}]))
        with pytest.raises(LauncherError, match=f"reading TrainJob {NS}/{name} failed: .*model"):
            submit(
                trainjob(name),
                namespace=NS,
                wait_timeout=math.inf,
                client=client_for(api),
                stream_logs=False,
                **FAST,
            )
        assert api.gets(NS, name) == 2 and api.errors == []


def test_a_trainjob_model_gets_its_api_version_and_kind() -> None:
    from kubeflow_trainer_api import models as tr

    from crosskd.k8s.trainjob_api import trainjob_to_submit

    given = tr.TrainerV1alpha1TrainJob.from_dict(trainjob())
    given.api_version = given.kind = None
    model = trainjob_to_submit(given, NS)
    assert (model.api_version, model.kind) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert given.kind is None  # the caller's object is not changed
    given.kind = "PyTorchJob"
    with pytest.raises(ConfigError, match=r"TrainJob model has apiVersion .* kind 'PyTorchJob'"):
        trainjob_to_submit(given, NS)
