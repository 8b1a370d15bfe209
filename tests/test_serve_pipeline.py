"""Teacher servers in the pipeline: the steps ``start_teacher_servers`` /
``stop_teacher_servers`` and their components against FakeKubernetesApi (``tests/k8s_fake.py``;
the component bodies find it through a kube-config, as they would a cluster's), and the compiled
``distill_served`` pipeline: no scoring, the start task feeds the training runs the servers'
URLs, a stop task after training and the exit handler's stop task whatever happens, and the
default pipeline unchanged beside it."""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import pytest
import yaml
from k8s_fake import FakeKubernetesApi
from kubernetes import client as k8s

from crosskd.errors import ConfigError
from crosskd.k8s.result import JobCancelled
from crosskd.pipeline.run import compile_pipeline
from crosskd.steps import plan_training, start_teacher_servers, stop_teacher_servers
from crosskd.steps.config import load_run_config
from crosskd.steps.serve import server_name

ROOT = Path(__file__).resolve().parents[1]
NS = "team-a"
RUN = "5f1e0c2a-9d4b-4c1e-8f00-aa11bb22cc33"
TEACHERS = [
    {"index": 0, "ref": "s3://b/teachers/qwen", "fingerprint": "f0", "same_tokenizer": False},
    {"index": 1, "ref": "s3://b/teachers/llama", "fingerprint": "f1", "same_tokenizer": True},
]
PLAN = {"root": "s3://b/run", "student": "s3://b/student", "teachers": TEACHERS}
SCORING = {"k": 16, "tau": 2.0, "encoding": "lossless", "token_budget": 1024, "device": None}
JOB = {"namespace": NS, "teacher_token_secret": "crosskd-serve-token"}
FAST = {"poll_interval": 0.05}


@pytest.fixture
def fake():
    with FakeKubernetesApi() as api:
        yield api
        assert api.errors == []


def client_for(api: FakeKubernetesApi) -> k8s.ApiClient:
    return k8s.ApiClient(k8s.Configuration(host=api.url))


def all_ready(api: FakeKubernetesApi, run: str = RUN) -> None:
    """Timeline: each teacher's server ready when its Deployment is first read."""
    for index in range(len(TEACHERS)):
        name = server_name(run, index)
        api.on_read(
            "deployments",
            NS,
            name,
            1,
            lambda f, name=name: f.set_deployment_status(NS, name, ready=1),
        )


def test_server_names_are_dns_labels_derived_from_the_run() -> None:
    assert server_name(RUN, 1) == f"crosskd-teacher-1-{RUN}"
    long = server_name("X" * 80, 0)
    assert len(long) == 63 and long.startswith("crosskd-teacher-0-xxx")
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", long)
    assert server_name("X" * 80, 0) == long != server_name("X" * 80, 1)


def test_start_gives_each_teacher_its_server_and_stop_takes_them_down(fake) -> None:
    all_ready(fake)
    servers = start_teacher_servers(
        PLAN,
        SCORING,
        {"replicas": 1, "serve": {"max_batch_tokens": 4096}},
        JOB,
        RUN,
        image="reg/crosskd:1",
        executor="cluster",
        client=client_for(fake),
        **FAST,
    )
    names = [server_name(RUN, i) for i in range(2)]
    assert servers == [
        {"index": i, "server": f"http://{names[i]}.{NS}.svc:8080", "name": names[i]}
        for i in range(2)
    ]
    for teacher, name in zip(TEACHERS, names, strict=True):
        config_map = fake.objects[("configmaps", NS, name)]
        assert yaml.safe_load(config_map["data"]["serve.yaml"]) == {
            "teacher": teacher["ref"],
            "k": 16,
            "tau": 2.0,
            "encoding": "lossless",
            "max_batch_tokens": 4096,
        }
        pod = fake.objects[("deployments", NS, name)]["spec"]["template"]["spec"]
        assert pod["containers"][0]["image"] == "reg/crosskd:1-cuda"  # gpus: 1 by default
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # Both created before either is waited on: they load at once.
    posts = [i for i, (m, p) in enumerate(fake.requests) if m == "POST" and "deployments" in p]
    first_read = next(i for i, (m, p) in enumerate(fake.requests) if m == "GET")
    assert len(posts) == 2 and max(posts) < first_read
    assert stop_teacher_servers(2, RUN, job=JOB, client=client_for(fake)) == names
    assert fake.objects == {}
    assert stop_teacher_servers(2, RUN, job=JOB, client=client_for(fake)) == []


def test_the_training_runs_read_the_servers(fake) -> None:
    """plan_training takes the started servers where it takes caches: each run's teachers are
    the servers' URLs, in teacher order."""
    all_ready(fake)
    servers = start_teacher_servers(
        PLAN,
        SCORING,
        {"gpus": 0},
        JOB,
        RUN,
        image="reg/crosskd:1",
        executor="cluster",
        client=client_for(fake),
        **FAST,
    )
    image = fake.objects[("deployments", NS, server_name(RUN, 0))]["spec"]["template"]["spec"]
    assert image["containers"][0]["image"] == "reg/crosskd:1"  # a CPU server: the CPU image
    config = load_run_config(None, "tiny", ["output=s3://b/run"])
    tables = [{"index": 0, "same_tokenizer": False, "s2t": "a", "t2s": "b"}]
    tables.append({"index": 1, "same_tokenizer": True})
    items = plan_training(
        config, PLAN, {"train": "s3://b/data"}, tables, list(reversed(servers)), "s3://b/r"
    )
    assert [item["train"]["teachers"] for item in items] == [[s["server"] for s in servers]] * len(
        items
    )


@pytest.mark.parametrize(
    ("server", "job", "executor", "message"),
    [
        ({}, JOB, "local", "executor is 'local'; a teacher server runs on the cluster"),
        ({}, {"namespace": NS}, "cluster", "job.teacher_token_secret is not set"),
        ({"serve": {"k": 8}}, JOB, "cluster", "server.serve sets k; the run sets teacher"),
        ({"serve": {"port": 1}}, JOB, "cluster", "server.serve sets port"),
        ({"name": "mine"}, JOB, "cluster", "server.name is set; the step names each server"),
        ({"serve": {"batch": 1}}, JOB, "cluster", "unknown server.serve key(s) batch"),
        ({"serve": {"max_wait_ms": -1}}, JOB, "cluster", "max_wait_ms is -1"),
        ({"replicas": 0}, JOB, "cluster", "replicas is 0"),
        ({"ready_timeout_s": 0}, JOB, "cluster", "server.ready_timeout_s is 0; give seconds > 0"),
        ({"ready_timeout_s": "1h"}, JOB, "cluster", "server.ready_timeout_s is '1h'"),
    ],
)
def test_bad_settings_are_refused_before_anything_is_created(
    fake, server, job, executor, message
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        start_teacher_servers(
            PLAN,
            SCORING,
            server,
            job,
            RUN,
            image="i",
            executor=executor,
            client=client_for(fake),
        )
    assert fake.requests == []


def test_sigterm_while_waiting_deletes_every_server_of_the_run(fake) -> None:
    fake.on_read(
        "deployments", NS, server_name(RUN, 0), 1, lambda f: os.kill(os.getpid(), signal.SIGTERM)
    )
    with pytest.raises(JobCancelled):
        start_teacher_servers(
            PLAN,
            SCORING,
            {"gpus": 0},
            JOB,
            RUN,
            image="i",
            executor="cluster",
            client=client_for(fake),
            **FAST,
        )
    assert fake.objects == {}
    assert [d[2] for d in fake.deletions] == [server_name(RUN, i) for i in range(2)]


def test_without_a_token_the_servers_need_auth_none(fake) -> None:
    all_ready(fake)
    start_teacher_servers(
        PLAN,
        SCORING,
        {"gpus": 0, "serve": {"auth": "none"}},
        {"namespace": NS},
        RUN,
        image="i",
        executor="cluster",
        client=client_for(fake),
        **FAST,
    )
    config_map = fake.objects[("configmaps", NS, server_name(RUN, 0))]
    assert yaml.safe_load(config_map["data"]["serve.yaml"])["auth"] == "none"


def test_the_component_bodies_on_a_kube_config(fake, tmp_path, monkeypatch) -> None:
    """The start and stop components called as plain functions, the client from the
    kube-config (as on a workstation; in a pod, the service account's)."""
    kube_config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": fake.url}}],
        "users": [{"name": "u", "user": {"token": "not-a-secret"}}],
        "contexts": [{"name": "c", "context": {"cluster": "fake", "user": "u", "namespace": NS}}],
        "current-context": "c",
    }
    (tmp_path / "config").write_text(yaml.safe_dump(kube_config))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "config"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # start_step replaces it
    from components.start_teacher_server.component import start_teacher_server
    from components.stop_teacher_server.component import stop_teacher_server

    run = "run-7"
    all_ready(fake, run)
    servers = start_teacher_server.python_func(
        plan=PLAN,
        scoring={**SCORING, "k": 16.0},  # KFP hands ints back as floats
        server={"gpus": 0.0, "ready_timeout_s": 30.0},
        job={"teacher_token_secret": "t", "namespace": NS},
        executor="cluster",
        image="i",
        pipeline_job_id=run,
    )
    assert [s["server"] for s in servers] == [
        f"http://crosskd-teacher-{i}-{run}.{NS}.svc:8080" for i in range(2)
    ]
    deleted = stop_teacher_server.python_func(
        teachers=["a", "b"], job={"namespace": NS}, pipeline_job_id=run
    )
    assert deleted == [s["name"] for s in servers] and fake.objects == {}


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[dict, dict, dict]:
    """The compiled distill_served pipeline and the default one: (served spec, its executors'
    Kubernetes settings, default spec)."""
    folder = tmp_path_factory.mktemp("served")
    compile_pipeline(str(folder / "served.yaml"), teacher_serving="server")
    spec, platform = yaml.safe_load_all((folder / "served.yaml").read_text())
    default = next(yaml.safe_load_all((ROOT / "pipelines" / "distill.yaml").read_text()))
    return spec, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"], default


def _dag(spec: dict, component: str) -> dict:
    return spec["components"][component]["dag"]["tasks"]


def test_compiled_served_pipeline_starts_trains_and_stops(served) -> None:
    spec, executors, default = served
    root = spec["root"]["dag"]["tasks"]
    assert not {"plan-scoring", "merge-cache"} & set(root)
    assert "score-teacher" not in yaml.safe_dump(spec)
    (handler,) = [t for t in root.values() if t["taskInfo"]["name"] == "teacher-servers"]
    inner = _dag(spec, handler["componentRef"]["name"])
    # The exit task: after the handler's group whatever its end, on pipeline parameters only.
    stop = root["stop-teacher-server"]
    assert stop["dependentTasks"] == [
        k for k, t in root.items() if t["taskInfo"]["name"] == "teacher-servers"
    ]
    assert stop["triggerPolicy"] == {"strategy": "ALL_UPSTREAM_TASKS_COMPLETED"}
    parameters = stop["inputs"]["parameters"]
    assert parameters["teachers"] == {"componentInputParameter": "teachers"}
    assert parameters["job"] == {"componentInputParameter": "job"}
    assert parameters["pipeline_job_id"] == {
        "runtimeValue": {"constant": "{{$.pipeline_job_uuid}}"}
    }
    # Inside: start -> plan_training on the servers -> train loop -> stop -> evaluate -> report.
    start = inner["start-teacher-server"]
    assert start["inputs"]["parameters"]["server"] == {
        "componentInputParameter": "pipelinechannel--server"  # the pipeline parameter
    }
    caches = inner["plan-training"]["inputs"]["parameters"]["caches"]
    assert caches == {
        "taskOutputParameter": {
            "outputParameterKey": "Output",
            "producerTask": "start-teacher-server",
        }
    }
    (loop,) = [k for k, t in inner.items() if t["taskInfo"]["name"] == "runs"]
    assert "train" in _dag(spec, inner[loop]["componentRef"]["name"])
    assert inner["stop-teacher-server-2"]["dependentTasks"] == [loop]
    assert "stop-teacher-server-2" in inner["evaluate"]["dependentTasks"]
    assert "report" in inner
    # Caching off and retried (it reattaches); no GPU on the launcher pods.
    assert start["retryPolicy"]["backoffMaxDuration"] == "1209600s"
    for task in (start, stop, inner["stop-teacher-server-2"]):
        assert not task.get("cachingOptions", {}).get("enableCache")
    resources = spec["deploymentSpec"]["executors"]["exec-start-teacher-server"]["container"]
    assert "accelerator" not in resources.get("resources", {})
    assert "exec-start-teacher-server" not in executors  # no Secret, node selector, volume
    # The same parameters and defaults as the default pipeline, plus server; no output.
    served_inputs = spec["root"]["inputDefinitions"]["parameters"]
    assert {k: v for k, v in served_inputs.items() if k != "server"} == default["root"][
        "inputDefinitions"
    ]["parameters"]
    assert served_inputs["server"]["defaultValue"]["gpus"] == 0
    assert "outputDefinitions" not in spec["root"]
