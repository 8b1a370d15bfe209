"""The teacher server's launcher (:mod:`crosskd.k8s.serve_launcher`) against FakeKubernetesApi
(``tests/k8s_fake.py``), the real ``kubernetes`` client unchanged.

The contract checked here: the Deployment and the objects it owns are created once under the
run's name, each owned by the Deployment (so deleting it removes them all), the ConfigMap holds
the ``crosskd serve`` config; a retried start reattaches instead of creating a second and
refuses an object of that name that is not the server's; only ready replicas return (a
transient API error is retried); past the timeout, or once the rollout's progress deadline
passes, the error names what holds each pod; SIGTERM deletes the server; the take-down can run
twice; and ``manifests/serve/launcher-rbac.yaml`` grants exactly the requests made.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from k8s_fake import OBJECTS, FakeKubernetesApi
from kubernetes import client as k8s

from crosskd.errors import ConfigError
from crosskd.k8s.result import JobCancelled, LauncherError
from crosskd.k8s.serve import (
    SERVE_CONFIG_KEY,
    TeacherServerConfig,
    build_deployment,
    selector_labels,
)
from crosskd.k8s.serve_launcher import (
    ServerNotReady,
    TeacherServer,
    server_url,
    start_server,
    stop_server,
)

NS = "team-a"
NAME = "crosskd-teacher-0-run-1"
FAST = {"poll_interval": 0.05, "request_timeout": 5.0}
SERVE = {"teacher": "s3://bucket/teacher", "k": 16, "tau": 1.0, "encoding": "lossless"}
RBAC = Path(__file__).resolve().parents[1] / "manifests" / "serve" / "launcher-rbac.yaml"
OWNED = ("configmaps", "services", "poddisruptionbudgets", "podmonitors")


@pytest.fixture
def fake():
    with FakeKubernetesApi() as api:
        yield api
        assert api.errors == []


def server(**keys) -> TeacherServerConfig:
    """A CPU server of ``replicas`` (default 1) under NAME, its ConfigMap named as it."""
    values = {"image": "crosskd:test", "name": NAME, "serve_config_map": NAME, "gpus": 0}
    return TeacherServerConfig(**{**values, **keys})


def client_for(api: FakeKubernetesApi) -> k8s.ApiClient:
    return k8s.ApiClient(k8s.Configuration(host=api.url))


def ready_at(api: FakeKubernetesApi, n: int, replicas: int = 1) -> None:
    """Timeline: every replica ready when the Deployment is read the ``n``-th time."""
    api.on_read(
        "deployments", NS, NAME, n, lambda f: f.set_deployment_status(NS, NAME, ready=replicas)
    )


def start(api: FakeKubernetesApi, config: TeacherServerConfig, **keys) -> TeacherServer:
    values = {"namespace": NS, "ready_timeout": 20, "client": client_for(api), **FAST, **keys}
    return start_server(config, SERVE, **values)


def pod_status(phase: str, **container) -> dict:
    """A pod's status with one container ``server`` (its ``state``, ``restartCount``, ...)."""
    status = {"name": "server", "image": "crosskd:test", "imageID": "", "ready": False}
    status["restartCount"] = 0
    return {"phase": phase, "containerStatuses": [{**status, **container}]}


def test_create_wait_ready_url_and_ownership(fake: FakeKubernetesApi) -> None:
    config = server()
    ready_at(fake, 3)
    fake.fail_next("GET", fake.object_path("deployments", NS, NAME), 503)  # retried
    result = start(fake, config, pod_monitor=True)
    assert result.url == f"http://{NAME}.{NS}.svc:8080" == server_url(config, NS)
    assert (result.name, result.namespace, result.replicas, result.reattached) == (
        NAME,
        NS,
        1,
        False,
    )
    assert fake.reads("deployments", NS, NAME) == 3
    for plural in OBJECTS:
        assert fake.count("POST", fake.object_path(plural, NS)) == 1, plural
    deployment = fake.objects[("deployments", NS, NAME)]
    expected = k8s.ApiClient().sanitize_for_serialization(build_deployment(config))
    assert deployment["spec"] == expected["spec"]
    owner = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": NAME,
        "uid": deployment["metadata"]["uid"],
    }
    for plural in OWNED:
        obj = fake.objects[(plural, NS, NAME)]
        assert obj["metadata"]["ownerReferences"] == [owner], plural
        if plural != "podmonitors":  # the monitoring stack's labels
            assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == NAME
    config_map = fake.objects[("configmaps", NS, NAME)]
    assert yaml.safe_load(config_map["data"][SERVE_CONFIG_KEY]) == SERVE
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert {"name": "serve-config", "configMap": {"name": NAME, "items": [
        {"key": SERVE_CONFIG_KEY, "path": SERVE_CONFIG_KEY}
    ]}} in volumes  # fmt: skip


def test_without_pod_monitor_none_is_made(fake: FakeKubernetesApi) -> None:
    ready_at(fake, 1)
    start(fake, server())
    assert fake.count("POST", fake.object_path("podmonitors", NS)) == 0
    assert {p for p, _, _ in fake.objects} == {"deployments", *OWNED} - {"podmonitors"}


def test_a_retried_start_reattaches(fake: FakeKubernetesApi) -> None:
    ready_at(fake, 1)
    first = start(fake, server(), pod_monitor=True)
    before = {key: obj["metadata"]["uid"] for key, obj in fake.objects.items()}
    again = start(fake, server(), pod_monitor=True)
    assert again.reattached and not first.reattached and again.url == first.url
    assert {key: obj["metadata"]["uid"] for key, obj in fake.objects.items()} == before
    for plural in OBJECTS:
        assert fake.count("POST", fake.object_path(plural, NS)) == 2, plural  # 409 the second


def test_reattach_refuses_an_object_that_is_not_the_servers(fake: FakeKubernetesApi) -> None:
    body = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": NAME}, "spec": {}}
    k8s.CoreV1Api(client_for(fake)).create_namespaced_service(NS, body)
    with pytest.raises(LauncherError) as caught:
        start(fake, server())
    assert str(caught.value) == (
        f"Service {NS}/{NAME} exists and is not owned by the Deployment {NAME} (uid "
        f"{fake.objects[('deployments', NS, NAME)]['metadata']['uid']}): it is another's, or "
        f"left from an earlier server; delete it (kubectl -n {NS} delete service {NAME}) and "
        "start again."
    )


def test_reattach_refuses_a_deployment_being_deleted(fake: FakeKubernetesApi) -> None:
    ready_at(fake, 1)
    start(fake, server())
    fake.objects[("deployments", NS, NAME)]["metadata"]["deletionTimestamp"] = (
        "2026-01-01T00:00:00Z"
    )
    with pytest.raises(LauncherError, match=f"Deployment {NS}/{NAME} exists but is being deleted"):
        start(fake, server())


def test_not_ready_in_time_names_what_holds_each_pod(fake: FakeKubernetesApi) -> None:
    config = server(replicas=5)
    labels = selector_labels(config)
    unschedulable = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
    pull = 'Back-off pulling image "crosskd:typo"'
    fake.add_pod(NS, "p1", labels, {"phase": "Pending", "conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": unschedulable}]})  # fmt: skip
    fake.add_pod(
        NS,
        "p2",
        labels,
        pod_status("Pending", state={"waiting": {"reason": "ImagePullBackOff", "message": pull}}),
    )
    fake.add_pod(NS, "p3", labels, pod_status("Running", restartCount=3, state={"waiting": {
        "reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}},
        lastState={"terminated": {"exitCode": 1, "reason": "Error"}}))  # fmt: skip
    fake.add_pod(NS, "p4", labels, pod_status("Running", state={"running": {}}))
    fake.add_pod(NS, "p5", labels, pod_status("Pending", state={"waiting": {
        "reason": "CreateContainerConfigError",
        "message": 'secret "crosskd-serve-token" not found'}}))  # fmt: skip
    fake.add_pod(NS, "other", {"app.kubernetes.io/instance": "x"}, pod_status("Running"))
    fake.on_read("deployments", NS, NAME, 1, lambda f: f.set_deployment_status(NS, NAME, ready=0))
    with pytest.raises(ServerNotReady) as caught:
        start(fake, config, ready_timeout=0.3)
    assert str(caught.value) == (
        f"teacher server {NS}/{NAME}: 0/5 replicas ready when its time ran out (ready_timeout): "
        f"p1: not scheduled (Unschedulable: {unschedulable}); "
        f"p2: Pending, ImagePullBackOff ({pull}); "
        "p3: Running, CrashLoopBackOff (back-off 40s restarting failed container), 3 restarts, "
        "last exit 1 (Error); "
        "p4: Running, not ready yet (/readyz: the teacher is loading); "
        'p5: Pending, CreateContainerConfigError (secret "crosskd-serve-token" not found). '
        f"It is left in place (the pipeline's stop step deletes it; else kubectl -n {NS} delete "
        f"deployment {NAME})."
    )
    assert caught.value.exit_code == 1
    assert ("deployments", NS, NAME) in fake.objects  # left for the stop step


def test_a_stopped_rollout_fails_before_the_timeout(fake: FakeKubernetesApi) -> None:
    stalled = ("Progressing", "False", "ProgressDeadlineExceeded", 'ReplicaSet "x" has timed out')
    quota = ("ReplicaFailure", "True", "FailedCreate", "pods is forbidden: exceeded quota: gpus")
    fake.on_read(
        "deployments",
        NS,
        NAME,
        2,
        lambda f: f.set_deployment_status(NS, NAME, ready=0, conditions=[stalled, quota]),
    )
    with pytest.raises(ServerNotReady) as caught:
        start(fake, server(), ready_timeout=600)
    assert str(caught.value) == (
        f"teacher server {NS}/{NAME}: 0/1 replicas ready and the rollout stopped "
        '(ProgressDeadlineExceeded: ReplicaSet "x" has timed out): no pod exists '
        "(FailedCreate: pods is forbidden: exceeded quota: gpus)."
    )
    assert fake.reads("deployments", NS, NAME) == 2


def test_an_unobserved_generation_is_not_ready(fake: FakeKubernetesApi) -> None:
    fake.on_read(
        "deployments",
        NS,
        NAME,
        1,
        lambda f: f.set_deployment_status(NS, NAME, ready=1, observed=False),
    )
    fake.on_read(
        "deployments", NS, NAME, 2, lambda f: f.set_deployment_status(NS, NAME, ready=1, updated=0)
    )
    ready_at(fake, 3)
    assert start(fake, server()).replicas == 1
    assert fake.reads("deployments", NS, NAME) == 3


def test_take_down_removes_everything_and_can_run_twice(fake: FakeKubernetesApi) -> None:
    config = server(replicas=2)
    ready_at(fake, 1, replicas=2)
    start(fake, config, pod_monitor=True)
    for i in range(2):
        fake.add_pod(NS, f"{NAME}-{i}", selector_labels(config), pod_status("Running"))
    fake.add_pod(NS, "bystander", {"app": "other"}, pod_status("Running"))
    assert stop_server(NAME, NS, client=client_for(fake)) is True
    assert fake.objects == {}
    assert list(fake.other_pods) == [(NS, "bystander")]
    assert fake.deletions == [("deployments", NS, NAME, "Background")]  # one delete
    assert stop_server(NAME, NS, client=client_for(fake)) is False
    assert fake.count("DELETE") == 2


def test_take_down_refused_says_how_to_do_it(fake: FakeKubernetesApi) -> None:
    fake.fail_next("DELETE", fake.object_path("deployments", NS), 403)
    with pytest.raises(LauncherError) as caught:
        stop_server(NAME, NS, client=client_for(fake))
    assert str(caught.value) == (
        f"deleting teacher server {NS}/{NAME} failed: 403 Forbidden: injected 403; delete it "
        f"yourself: kubectl -n {NS} delete deployment {NAME}"
    )


def test_a_refused_create_is_an_error(fake: FakeKubernetesApi) -> None:
    fake.fail_next("POST", fake.object_path("deployments", NS), 403)
    with pytest.raises(LauncherError, match=f"creating Deployment {NS}/{NAME} failed: 403"):
        start(fake, server())
    assert fake.objects == {}


def test_sigterm_while_waiting_deletes_the_server(fake: FakeKubernetesApi) -> None:
    before = signal.getsignal(signal.SIGTERM)
    fake.on_read("deployments", NS, NAME, 2, lambda f: os.kill(os.getpid(), signal.SIGTERM))
    with pytest.raises(JobCancelled) as caught:
        start(fake, server(), ready_timeout=600)
    assert str(caught.value) == (
        f"SIGTERM: teacher server {NS}/{NAME} was deleted (the run was cancelled)."
    )
    assert caught.value.exit_code == 143 and fake.objects == {}
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_deployment_deleted_while_waiting_is_an_error(fake: FakeKubernetesApi) -> None:
    fake.on_read("deployments", NS, NAME, 2, lambda f: f.objects.pop(("deployments", NS, NAME)))
    with pytest.raises(LauncherError, match="was deleted while waiting for it to be ready"):
        start(fake, server())


@pytest.mark.parametrize(
    ("keys", "arguments", "message"),
    [
        ({"serve_config_map": "crosskd-serve"}, {}, "serve_config_map is 'crosskd-serve'"),
        ({"namespace": "team-b"}, {}, "namespace is 'team-b' but the server is started in"),
        ({}, {"ready_timeout": 0}, "ready_timeout is 0; give seconds > 0"),
    ],
)
def test_bad_arguments_are_refused(fake: FakeKubernetesApi, keys, arguments, message) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        start(fake, server(**keys), **arguments)
    assert fake.requests == []


def _access(fake: FakeKubernetesApi) -> set[tuple[str, str, str]]:
    """``(API group, resource, verb)`` of every request the fake was sent."""
    seen = set()
    for method, path in fake.requests:
        parts = path.split("?")[0].strip("/").split("/")
        group = "" if parts[0] == "api" else parts[1]
        rest = parts[parts.index("namespaces") + 2 :]
        verb = {"POST": "create", "DELETE": "delete"}.get(
            method, "get" if len(rest) > 1 else "list"
        )
        seen.add((group, rest[0], verb))
    return seen


def test_the_role_grants_exactly_what_the_launcher_does(fake: FakeKubernetesApi) -> None:
    ready_at(fake, 1)
    start(fake, server(), pod_monitor=True)
    start(fake, server(), pod_monitor=True)  # reattach: reads every object back
    stop_server(NAME, NS, client=client_for(fake))
    with pytest.raises(ServerNotReady):  # a new Deployment, never ready: its pods are listed
        start(fake, server(), pod_monitor=True, ready_timeout=0.1)
    stop_server(NAME, NS, client=client_for(fake))
    docs = list(yaml.safe_load_all(RBAC.read_text()))
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30.0", strict=True)
    role = next(d for d in docs if d["kind"] == "Role")
    granted = {
        (g, r, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert granted == _access(fake)
    assert not [rule for rule in role["rules"] if rule.get("resourceNames") or "*" in str(rule)]
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "crosskd-launcher"}]
    assert {d["kind"] for d in docs} == {"Role", "RoleBinding"}
