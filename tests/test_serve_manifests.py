"""``manifests/serve/``: the teacher server's Deployment, Service, PodDisruptionBudget and
PodMonitor (``crosskd.k8s.serve``), built with the real ``kubectl kustomize``: the generated
files are the builder's (``crosskd job serve-manifests --check``), the built objects are the
builder's but for the ConfigMap's hash-suffixed name, every built-in kind and the pod validate
with ``kubernetes-validate --strict``, the PodMonitor against prometheus-operator's CRD schema
made strict and selecting exactly the server's pods, the pod's security settings, the token only
from a ``secretKeyRef``, the probes and the monitor on the port and paths the server serves, and
every bad config refused naming its key."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kube_tools import kustomize
from test_manifests import K8S_VERSIONS, _one
from test_monitoring_manifests import _monitors, _selects, _training_pods
from test_monitoring_manifests import _validator as _crd_validator
from test_teacher_cache import tiny_teacher  # noqa: F401 (a fixture, used by name)

from crosskd.cli import main
from crosskd.config import load_config
from crosskd.errors import ConfigError
from crosskd.k8s.cli import SERVE_FILES, SERVER_FILE, serve_generated_files
from crosskd.k8s.job import CREDENTIAL_ENV, TEACHER_TOKEN_ENV, JobConfig, job_manifest
from crosskd.k8s.serve import (
    HEALTHZ,
    METRICS,
    READYZ,
    TOKEN_ENV,
    TeacherServerConfig,
    load_server_config,
    serve_manifests,
)
from crosskd.serve.config import ServeConfig
from crosskd.serve.server import TOKEN_ENV as server_token_env
from crosskd.teacher.remote import TOKEN_ENV as client_token_env

REPO = Path(__file__).parents[1]
SERVE = REPO / "manifests" / "serve"
SERVER = yaml.safe_load((SERVE / SERVER_FILE).read_text(encoding="utf-8"))
SELECTOR = {
    "app.kubernetes.io/name": "crosskd",
    "app.kubernetes.io/component": "teacher-server",
    "app.kubernetes.io/instance": "crosskd-teacher-server",
}
WORDS = ("KEY", "SECRET", "TOKEN", "PASSWORD")


@functools.cache
def _built() -> tuple[dict, ...]:
    return kustomize(SERVE)


@functools.cache
def _built_monitor() -> dict:
    (monitor,) = kustomize(SERVE / "monitoring")
    return monitor


def _pod(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def _container(deployment: dict) -> dict:
    (container,) = _pod(deployment)["containers"]
    return container


def _command_values(container: dict) -> dict[str, str]:
    """The ``key=value`` overrides of the container's ``crosskd serve`` command."""
    return dict(a.split("=", 1) for a in container["command"] if "=" in a)


def _as_pod(deployment: dict) -> dict:
    template = deployment["spec"]["template"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "teacher-server-0", **template["metadata"]},
        "spec": template["spec"],
    }


def test_generated_files_are_fresh():
    stale = [
        str(p.relative_to(REPO))
        for p, text in serve_generated_files(SERVE).items()
        if not p.is_file() or p.read_text(encoding="utf-8") != text
    ]
    assert not stale, (
        f"stale generated manifests {stale}; regenerate them with `crosskd job serve-manifests`"
    )
    assert sorted(SERVE_FILES.values()) == sorted(
        str(p.relative_to(SERVE)) for p in serve_generated_files(SERVE)
    )


def test_check_reports_an_edit_and_regenerating_fixes_it(tmp_path, capsys):
    root = tmp_path / "manifests" / "serve"
    shutil.copytree(SERVE, root)
    assert main(["job", "serve-manifests", "--root", str(root), "--check"]) == 0
    config = root / SERVER_FILE
    config.write_text(config.read_text() + "replicas: 5\n", encoding="utf-8")
    service = root / "service.yaml"
    service.write_text(service.read_text().replace("port: 8080", "port: 8081"), encoding="utf-8")
    before = {p: p.read_text() for p in root.rglob("*.yaml")}
    assert main(["job", "serve-manifests", "--root", str(root), "--check"]) == 1
    err = capsys.readouterr().err
    assert "deployment.yaml" in err and "service.yaml" in err
    assert "poddisruptionbudget.yaml" not in err and "podmonitor.yaml" not in err
    assert f"crosskd job serve-manifests --root {root}" in err
    assert {p: p.read_text() for p in root.rglob("*.yaml")} == before  # --check wrote nothing
    assert main(["job", "serve-manifests", "--root", str(root)]) == 0
    assert main(["job", "serve-manifests", "--root", str(root), "--check"]) == 0
    assert yaml.safe_load((root / "deployment.yaml").read_text())["spec"]["replicas"] == 5
    assert (root / "service.yaml").read_text() == (SERVE / "service.yaml").read_text()


def test_a_missing_config_is_one_line(tmp_path, capsys):
    assert main(["job", "serve-manifests", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / SERVER_FILE} not found" in err


def test_the_build_is_the_builders_objects():
    """The kustomize build is serve_manifests of server.yaml but for the ConfigMap's
    hash-suffixed name, which reaches the Deployment's volume; no Secret, no RBAC."""
    docs = _built()
    assert sorted(d["kind"] for d in docs) == [
        "ConfigMap",
        "Deployment",
        "PodDisruptionBudget",
        "Service",
    ]
    config_map = _one(docs, "ConfigMap")
    hashed = config_map["metadata"]["name"]
    assert hashed.startswith("crosskd-serve-") and hashed != "crosskd-serve"
    assert config_map["data"] == {"serve.yaml": (SERVE / "serve.yaml").read_text()}
    volumes = {v["name"]: v for v in _pod(_one(docs, "Deployment"))["volumes"]}
    assert volumes["serve-config"]["configMap"]["name"] == hashed
    expected = serve_manifests(
        load_server_config(str(SERVE / SERVER_FILE), values={"serve_config_map": hashed})
    )
    for kind in ("Deployment", "Service", "PodDisruptionBudget"):
        assert _one(docs, kind) == expected[kind], kind
    monitor = _built_monitor()
    assert monitor["metadata"]["labels"].pop("release") == "kube-prometheus-stack"
    assert monitor == expected["PodMonitor"]


def test_builtin_kinds_and_the_pod_are_strictly_valid():
    docs = [*_built(), _as_pod(_one(_built(), "Deployment"))]
    for version in K8S_VERSIONS:
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)
    bad = copy.deepcopy(_one(_built(), "Deployment"))
    _container(bad)["readinesProbe"] = _container(bad).pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)


@pytest.mark.parametrize(
    "keys",
    [
        {"gpus": 0, "pre_stop_seconds": 0, "s3_secret": None, "tolerations": []},
        {
            "name": "llama-70b",
            "namespace": "teachers",
            "replicas": 4,
            "gpus": 8,
            "memory_limit": "300Gi",
            "grace_seconds": 200,
            "s3_endpoint_url": "https://minio.example.com",
            "s3_region": "us-east-1",
            "service_account": "teacher-reader",
            "priority_class": "inference",
            "image_pull_secrets": ["registry"],
            "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "env": {"NCCL_DEBUG": "WARN"},
            "labels": {"team": "ml"},
            "serve_overrides": ["k=64"],
        },
    ],
)
def test_other_configs_are_valid_objects(keys):
    objects = serve_manifests(load_server_config(str(SERVE / SERVER_FILE), values=keys))
    docs = [objects[k] for k in ("Deployment", "Service", "PodDisruptionBudget")]
    for version in K8S_VERSIONS:
        for doc in [*docs, _as_pod(objects["Deployment"])]:
            kubernetes_validate.validate(doc, version, strict=True)
    assert not list(_crd_validator("PodMonitor").iter_errors(objects["PodMonitor"]["spec"]))
    container = _container(objects["Deployment"])
    env = {e["name"]: e for e in container["env"]}
    if keys.get("gpus") == 0:
        assert "nvidia.com/gpu" not in str(container["resources"])
        assert "lifecycle" not in container
        assert _pod(objects["Deployment"])["terminationGracePeriodSeconds"] == 60 + 15
        assert not [n for n in env if n.startswith("AWS_")]
        assert "tolerations" not in _pod(objects["Deployment"])
    else:
        name = keys["name"]
        assert {o["metadata"]["name"] for o in objects.values()} == {name}
        assert {o["metadata"]["namespace"] for o in objects.values()} == {"teachers"}
        assert objects["PodMonitor"]["spec"]["selector"]["matchLabels"][
            "app.kubernetes.io/instance"
        ] == (name)
        assert container["resources"]["limits"] == {"memory": "300Gi", "nvidia.com/gpu": "8"}
        assert env["AWS_ENDPOINT_URL"] == {
            "name": "AWS_ENDPOINT_URL",
            "value": keys["s3_endpoint_url"],
        }
        assert set(env["AWS_SECRET_ACCESS_KEY"]) == {"name", "valueFrom"}
        assert container["command"][-1] == "k=64"
        assert _pod(objects["Deployment"])["terminationGracePeriodSeconds"] == 200
        assert objects["Deployment"]["spec"]["template"]["metadata"]["labels"]["team"] == "ml"
        assert "team" not in objects["Deployment"]["spec"]["selector"]["matchLabels"]


def test_pod_monitor_fits_the_strict_crd_schema_and_selects_only_the_server():
    monitor = _built_monitor()
    assert monitor["kind"] == "PodMonitor"
    assert monitor["metadata"]["name"] == "crosskd-teacher-server"
    assert "namespace" not in monitor["metadata"] and "namespaceSelector" not in monitor["spec"]
    validator = _crd_validator("PodMonitor")
    assert not [e.message for e in validator.iter_errors(monitor["spec"])]
    misspelt = copy.deepcopy(monitor["spec"])
    misspelt["podMetricsEndpoints"][0]["paht"] = METRICS
    assert list(validator.iter_errors(misspelt))
    pod_labels = _one(_built(), "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert _selects(monitor, pod_labels)
    assert [name for name, m in _monitors().items() if _selects(m, pod_labels)] == []
    for labels, _ in _training_pods({"nodes": 2}):
        assert not _selects(monitor, labels)
    assert monitor["spec"]["jobLabel"] in pod_labels
    assert set(monitor["spec"]["podTargetLabels"]) <= set(pod_labels)
    assert monitor["spec"]["podMetricsEndpoints"] == [
        {"port": "http", "path": METRICS, "interval": "15s"}
    ]


def test_the_pod_is_locked_down():
    deployment = _one(_built(), "Deployment")
    pod = _pod(deployment)
    container = _container(deployment)
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "fsGroup": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert pod["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in pod
    assert not {"hostNetwork", "hostPID", "hostIPC"} & set(pod)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert all(set(v) - {"name"} <= {"emptyDir", "configMap"} for v in volumes.values())
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    # every path the server writes under a read-only root is an emptyDir
    env = {e["name"]: e.get("value") for e in container["env"]}
    for path in ("/tmp", env["HOME"], "/cache"):
        assert "emptyDir" in mounts[path], path
    for name in ("HF_HOME", "CROSSKD_CACHE_DIR"):
        assert env[name].startswith("/cache/")
    assert mounts["/dev/shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": SERVER["shm_size"]}
    assert mounts["/etc/crosskd"]["configMap"]["items"] == [
        {"key": "serve.yaml", "path": "serve.yaml"}
    ]
    gpus = str(SERVER["gpus"])
    assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus
    assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus


def test_labels_rollout_and_disruption_budget():
    docs = _built()
    deployment = _one(docs, "Deployment")
    assert deployment["spec"]["selector"] == {"matchLabels": SELECTOR}
    assert deployment["spec"]["template"]["metadata"]["labels"] == SELECTOR
    assert deployment["spec"]["replicas"] == SERVER["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    budget = _one(docs, "PodDisruptionBudget")
    assert budget["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": SELECTOR},
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
    }
    service = _one(docs, "Service")
    assert service["spec"]["type"] == "ClusterIP" and service["spec"]["selector"] == SELECTOR
    assert service["metadata"]["name"] == "crosskd-teacher-server"
    (spread,) = _pod(deployment)["topologySpreadConstraints"]
    assert spread["labelSelector"] == {"matchLabels": SELECTOR}


def test_probes_port_and_shutdown_fit_the_server():
    """The probes, the Service and the monitor use the one port the command gives the server;
    the grace period covers the preStop sleep and the drain; a 70B teacher has 30 minutes to
    load, and the Deployment does not call that a stalled rollout."""
    docs = _built()
    deployment = _one(docs, "Deployment")
    container = _container(deployment)
    assert container["command"][:4] == ["crosskd", "serve", "--config", "/etc/crosskd/serve.yaml"]
    values = _command_values(container)
    port = int(values["port"])
    assert port == SERVER["port"] == 8080
    assert container["ports"] == [{"name": "http", "containerPort": port, "protocol": "TCP"}]
    probes = {k: container[k] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert {k: p["httpGet"] for k, p in probes.items()} == {
        "startupProbe": {"path": READYZ, "port": "http"},
        "livenessProbe": {"path": HEALTHZ, "port": "http"},
        "readinessProbe": {"path": READYZ, "port": "http"},
    }
    assert (HEALTHZ, READYZ, METRICS) == ("/healthz", "/readyz", "/metrics")
    startup = probes["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget >= SERVER["startup_timeout_s"] == 1800
    assert deployment["spec"]["progressDeadlineSeconds"] > budget
    (service_port,) = _one(docs, "Service")["spec"]["ports"]
    assert service_port == {
        "name": "http",
        "port": port,
        "targetPort": "http",
        "protocol": "TCP",
        "appProtocol": "http",
    }
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = float(values["drain_timeout_s"])
    assert pre_stop == 5 and drain == SERVER["drain_timeout_s"] == 60
    assert _pod(deployment)["terminationGracePeriodSeconds"] > pre_stop + drain


def test_the_token_comes_only_from_a_secret():
    docs = _built()
    container = _container(_one(docs, "Deployment"))
    env = {e["name"]: e for e in container["env"]}
    assert env[TOKEN_ENV] == {
        "name": TOKEN_ENV,
        "valueFrom": {"secretKeyRef": {"name": "crosskd-serve-token", "key": "token"}},
    }
    for name in CREDENTIAL_ENV[:2]:
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "crosskd-s3", "key": name}
    plain = [n for n, e in env.items() if "valueFrom" not in e and any(w in n for w in WORDS)]
    assert not plain, plain
    assert not [d for d in docs if d["kind"] == "Secret"]
    serve = yaml.safe_load((SERVE / "serve.yaml").read_text())
    assert not {"token", "auth", "port", "drain_timeout_s"} & set(serve)
    text = "".join(p.read_text() for p in SERVE.rglob("*.yaml") if "example" not in p.name)
    assert "REPLACE_ME" not in text and "stringData" not in text


def test_token_secret_example_is_valid_a_placeholder_and_in_no_kustomization():
    secret = yaml.safe_load((SERVE / "token-secret.example.yaml").read_text())
    kubernetes_validate.validate(secret, K8S_VERSIONS[0], strict=True)
    assert secret["metadata"]["name"] == SERVER["token_secret"]
    assert secret["stringData"] == {SERVER["token_key"]: "REPLACE_ME"} and "data" not in secret
    for path in (REPO / "manifests").rglob("kustomization.yaml"):
        kustomization = yaml.safe_load(path.read_text())
        assert "secretGenerator" not in kustomization, path
        assert not [r for r in kustomization.get("resources", []) if "secret" in r], path
    assert not [d for d in _built() if d["kind"] == "Secret"]


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"grace_seconds": 65}, "grace_seconds is 65; it must exceed pre_stop_seconds + "),
        ({"serve_overrides": ["port=9000"]}, "serve_overrides[0] sets port"),
        ({"serve_overrides": ["drain_timeout_s=5"]}, "serve_overrides[0] sets drain_timeout_s"),
        ({"serve_overrides": ["k"]}, "serve_overrides[0] is 'k'; write it as key=value"),
        ({"env": {TOKEN_ENV: "x"}}, f"env sets {TOKEN_ENV}"),
        ({"env": {"AWS_SECRET_ACCESS_KEY": "x"}}, "env sets AWS_SECRET_ACCESS_KEY"),
        ({"labels": {"app.kubernetes.io/instance": "x"}}, "labels sets app.kubernetes.io/instance"),
        ({"max_surge": 0}, "max_surge is 0"),
        ({"replicas": 0}, "replicas is 0; it must be an integer >= 1"),
        ({"gpus": -1}, "gpus is -1; it must be an integer >= 0"),
        ({"port": 70000}, "port is 70000; it must be <= 65535"),
        ({"name": "Teacher_1"}, "name is 'Teacher_1'; it must be a DNS-1035 label"),
        ({"memory": "lots"}, "memory is 'lots'; it must be a Kubernetes quantity"),
        ({"scrape_interval": "15"}, "scrape_interval is '15'; it must be a duration"),
        ({"tolerations": [{"key": "a", "effect": "Never"}]}, "tolerations[0].effect is 'Never'"),
        ({"image": "a b"}, "image is 'a b'; it must not contain spaces"),
        ({"replica": 2}, "unknown teacher server key(s) replica"),
    ],
)
def test_bad_config_is_refused_naming_the_key(keys, message):
    with pytest.raises(ConfigError) as info:
        load_server_config(str(SERVE / SERVER_FILE), values=keys)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_default_grace_covers_the_drain():
    config = TeacherServerConfig(image="crosskd:test", drain_timeout_s=300, pre_stop_seconds=10)
    assert config.grace == 325
    pod = _pod(serve_manifests(config)["Deployment"])
    assert pod["terminationGracePeriodSeconds"] == 325


def test_a_training_job_reads_the_teacher_token_from_a_secret():
    """A PyTorchJob whose train config names teacher servers gets their token as the
    ``secretKeyRef`` env the client reads (the server's Secret and key by default), never as a
    plain value."""
    job = JobConfig(run_id="r", image="crosskd:test", teacher_token_secret=SERVER["token_secret"])
    (spec,) = job_manifest(job)["spec"]["pytorchReplicaSpecs"].values()
    env = {e["name"]: e for e in spec["template"]["spec"]["containers"][0]["env"]}
    assert env[TEACHER_TOKEN_ENV] == {
        "name": TEACHER_TOKEN_ENV,
        "valueFrom": {"secretKeyRef": {"name": "crosskd-serve-token", "key": SERVER["token_key"]}},
    }
    (plain,) = job_manifest(JobConfig(run_id="r", image="crosskd:test"))["spec"][
        "pytorchReplicaSpecs"
    ].values()
    assert TEACHER_TOKEN_ENV not in str(plain)
    with pytest.raises(ConfigError, match=f"env sets {TEACHER_TOKEN_ENV}; give credentials"):
        JobConfig(run_id="r", image="crosskd:test", env={TEACHER_TOKEN_ENV: "x"})
    with pytest.raises(ConfigError, match="teacher_token_secret is ''"):
        JobConfig(run_id="r", image="crosskd:test", teacher_token_secret="")


def test_serve_yaml_with_the_command_is_a_serve_config():
    """The ConfigMap's serve.yaml under the container's ``key=value`` overrides is a valid
    ServeConfig with the manifests' port and drain time and a bearer token required; the token
    variables are the ones the server and the client read."""
    container = _container(_one(_built(), "Deployment"))
    overrides = [a for a in container["command"] if "=" in a]
    config = load_config(ServeConfig, str(SERVE / "serve.yaml"), overrides)
    config.check()
    assert (config.port, config.drain_timeout_s, config.auth) == (8080, 60, "bearer")
    assert config.host == "0.0.0.0"  # the probes and the Service reach the pod's IP
    assert server_token_env == TOKEN_ENV and client_token_env == TEACHER_TOKEN_ENV


def test_the_deployments_command_serves_its_probes(tmp_path, request):
    """The container's own command line (its config, port, drain time and token variable) run
    as a real ``crosskd serve`` on loopback (the tiny teacher on CPU, a free port): every probe
    path answers 200 without a token once ready, ``/metrics`` is Prometheus text, the API
    wants the token from the Secret's variable, and SIGTERM exits 0 (the drain)."""
    teacher = request.getfixturevalue("tiny_teacher")
    deployment = _one(_built(), "Deployment")
    container = _container(deployment)
    config = tmp_path / "serve.yaml"
    shutil.copy(SERVE / "serve.yaml", config)
    port_file = tmp_path / "port"
    command = [
        str(Path(sys.executable).parent / "crosskd"),
        *[str(config) if a == "/etc/crosskd/serve.yaml" else a for a in container["command"][1:]],
        f"teacher={teacher}",
        "k=8",
        "device=cpu",
        "host=127.0.0.1",
        "port=0",
        f"port_file={port_file}",
    ]
    env = {**os.environ, TOKEN_ENV: "test-token", "OMP_NUM_THREADS": "1"}
    with subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True) as proc:
        try:
            deadline = time.monotonic() + 300
            while not port_file.is_file() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert port_file.is_file(), proc.stderr.read() if proc.poll() is not None else ""
            base = f"http://127.0.0.1:{int(port_file.read_text())}"
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                with urllib.request.urlopen(base + container[probe]["httpGet"]["path"]) as r:
                    assert r.status == 200, probe
            (endpoint,) = _built_monitor()["spec"]["podMetricsEndpoints"]
            with urllib.request.urlopen(base + endpoint["path"]) as r:
                assert b"crosskd_serve_ready 1.0" in r.read()
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(base + "/v1/info")
            assert refused.value.code == 401
            request = urllib.request.Request(
                base + "/v1/info", headers={"Authorization": "Bearer test-token"}
            )
            with urllib.request.urlopen(request) as r:
                assert json.loads(r.read())["k"] == 8
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=_pod(deployment)["terminationGracePeriodSeconds"]) == 0
        finally:
            if proc.poll() is None:
                proc.kill()


def test_the_docs_table_has_every_server_key():
    """docs/kubernetes.md section 7's table names each TeacherServerConfig key once, and no
    other."""
    text = (REPO / "docs" / "kubernetes.md").read_text(encoding="utf-8")
    section = text[text.index("\n## 7. Serving the teacher") :]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    named = [k for row in rows for k in re.findall(r"`([a-z_0-9]+)`", row.split(" | ")[0])]
    assert sorted(named) == sorted(f.name for f in dataclasses.fields(TeacherServerConfig))
