"""``manifests/monitoring/``: built with the real ``kubectl kustomize``; the PodMonitors select
exactly the pods crosskd makes (the PyTorchJob's pods from ``crosskd.k8s.job``, the pipeline's
step pods from the compiled ``pipelines/distill.yaml``) and scrape the ports those pods serve;
the step PodMonitor's relabelings (it scrapes an undeclared port) give one target per pod at
port 9400, checked by hand and by ``promtool check config``; the kube-prometheus-stack
``release`` label; the objects against prometheus-operator's CRD schemas made strict where the
vendored CRDs are present."""

from __future__ import annotations

import copy
import functools
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from kube_tools import kustomize, strict_schema
from monitoring import relabel

from crosskd.k8s.job import JobConfig, job_manifest
from crosskd.k8s.trainjob import PROCS_LABEL, runtime_manifest, trainjob_manifest

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "manifests" / "monitoring"
VENDOR = ROOT.parent / "shared" / "vendor"
CRDS = {
    "PodMonitor": "monitoring.coreos.com_podmonitors.yaml",
    "PrometheusRule": "monitoring.coreos.com_prometheusrules.yaml",
}
STEP_PORT = 9400
JOBSET_LABELS = ("jobset.sigs.k8s.io/jobset-name", "jobset.sigs.k8s.io/job-index")
"""What JobSet labels a TrainJob's pods with (its JobSet's name, the TrainJob's; the node)."""
OPERATOR_LABELS = (
    "training.kubeflow.org/job-name",
    "training.kubeflow.org/replica-type",
    "training.kubeflow.org/replica-index",
)
JOBS = {  # name: (JobConfig keys, local ranks per pod)
    "cpu-1x1": ({"cpu_procs_per_node": 1}, 1),
    "cpu-2x2": ({"nodes": 2, "cpu_procs_per_node": 2}, 2),
    "gpu-4x8": ({"nodes": 4, "gpus_per_node": 8}, 8),
    "cpu-1x12": ({"cpu_procs_per_node": 12}, 12),  # more ranks than a GPU node has
}


@functools.cache
def _built() -> tuple[dict, ...]:
    return kustomize(MONITORING)


def _monitors() -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in _built() if d["kind"] == "PodMonitor"}


def _selects(monitor: dict, labels: dict[str, str]) -> bool:
    """Whether the PodMonitor's label selector selects a pod with ``labels``."""
    selector = monitor["spec"]["selector"]
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    tests = {
        "In": lambda v, vs: v in vs,
        "NotIn": lambda v, vs: v not in vs,
        "Exists": lambda v, vs: v is not None,
        "DoesNotExist": lambda v, vs: v is None,
    }
    return all(
        tests[e["operator"]](labels.get(e["key"]), e.get("values", []))
        for e in selector.get("matchExpressions", [])
    )


def _training_pods(keys: dict) -> list[tuple[dict[str, str], dict]]:
    """``(labels, container)`` of each replica's pod: the template's labels plus the ones the
    Training Operator sets."""
    job = job_manifest(JobConfig(run_id="run-1", image="crosskd:test", **keys))
    pods = []
    for kind, spec in job["spec"]["pytorchReplicaSpecs"].items():
        template = spec["template"]
        labels = dict(template["metadata"]["labels"]) | dict(
            zip(OPERATOR_LABELS, (job["metadata"]["name"], kind.lower(), "0"), strict=True)
        )
        (container,) = template["spec"]["containers"]
        pods.append((labels, container))
    return pods


def _step_pod_labels() -> dict[str, dict[str, str]]:
    """The pod labels the compiled pipeline gives each task (kfp-kubernetes podMetadata)."""
    compiled = list(yaml.safe_load_all((ROOT / "pipelines" / "distill.yaml").read_text()))
    executors = compiled[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    return {
        name.removeprefix("exec-"): e.get("podMetadata", {}).get("labels", {})
        for name, e in executors.items()
    }


def test_the_build_is_the_monitors_the_rule_and_the_dashboards():
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in _built())
    assert [k for k in kinds if k[0] != "ConfigMap"] == [
        ("PodMonitor", "crosskd-steps"),
        ("PodMonitor", "crosskd-training"),
        ("PodMonitor", "crosskd-trainjob"),
        ("PrometheusRule", "crosskd"),
    ]
    dashboards = [d for d in _built() if d["kind"] == "ConfigMap"]
    assert dashboards and all(
        d["metadata"]["labels"]["grafana_dashboard"] == "1" for d in dashboards
    )


def test_release_label_and_no_namespace():
    """Every object carries the kube-prometheus-stack release label the kustomization sets
    (kube-prometheus-stack selects PodMonitors and PrometheusRules by it) and no namespace, so
    `kubectl apply -k ... -n NS` puts the PodMonitors next to the pods they watch; no
    PodMonitor reaches into other namespaces."""
    kustomization = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    (labels,) = kustomization["labels"]
    assert labels["pairs"] == {"release": "kube-prometheus-stack"}
    assert labels["includeSelectors"] is False
    for doc in _built():
        assert doc["metadata"]["labels"]["release"] == "kube-prometheus-stack", doc["metadata"]
        assert "namespace" not in doc["metadata"]
    for monitor in _monitors().values():
        assert "namespaceSelector" not in monitor["spec"]
        assert "release" not in str(monitor["spec"]["selector"])


def test_training_monitor_spec():
    spec = _monitors()["crosskd-training"]["spec"]
    assert spec["selector"] == {
        "matchLabels": {
            "app.kubernetes.io/name": "crosskd",
            "app.kubernetes.io/component": "trainer",
        },
        "matchExpressions": [{"key": PROCS_LABEL, "operator": "DoesNotExist"}],
    }
    assert spec["jobLabel"] == "training.kubeflow.org/job-name"
    assert spec["podTargetLabels"] == [
        "app.kubernetes.io/name",
        "app.kubernetes.io/component",
        *OPERATOR_LABELS[1:],
    ]
    (endpoint,) = spec["podMetricsEndpoints"]
    assert not {"port", "portNumber", "targetPort"} & set(endpoint)  # every declared port


@pytest.mark.parametrize("name", JOBS)
def test_training_monitor_selects_the_training_pods_and_scrapes_every_rank(name):
    keys, ranks = JOBS[name]
    monitors = _monitors()
    training = monitors["crosskd-training"]
    (endpoint,) = training["spec"]["podMetricsEndpoints"]
    pods = _training_pods(keys)
    assert len(pods) == (2 if keys.get("nodes", 1) > 1 else 1)
    for labels, container in pods:
        assert [m for m, monitor in monitors.items() if _selects(monitor, labels)] == [
            "crosskd-training"
        ]
        assert training["spec"]["jobLabel"] in labels
        assert set(training["spec"]["podTargetLabels"]) <= set(labels)
        assert labels["app.kubernetes.io/name"] == "crosskd"  # the value CrosskdTargetDown uses
        ports = {
            p["name"]: p["containerPort"]
            for p in container["ports"]
            if p["name"].startswith("metrics-")
        }
        assert ports == {f"metrics-{i}": 9400 + i for i in range(ranks)}
        # pod discovery: one target per declared port; the relabelings keep the metrics ports
        targets = [
            {
                "__address__": f"10.0.0.5:{p['containerPort']}",
                "__meta_kubernetes_pod_container_port_name": p["name"],
            }
            for p in container["ports"]
        ]
        kept = [t for t in (relabel(t, endpoint["relabelings"]) for t in targets) if t]
        assert {t["endpoint"]: t["__address__"] for t in kept} == {
            name: f"10.0.0.5:{port}" for name, port in ports.items()
        }


@pytest.mark.parametrize("procs", [1, 3, 8])
def test_trainjob_monitor_selects_trainjob_pods_and_scrapes_exactly_their_ranks(procs):
    """A TrainJob's pod (its runtime's ports metrics-0 .. metrics-7, its patch's labels, and
    JobSet's labels) is selected by crosskd-trainjob alone and scraped on metrics-0 ..
    metrics-{procs - 1}, however many ports the runtime declares."""
    config = JobConfig(run_id="run-1", image="crosskd:test", cpu_procs_per_node=procs)
    job = trainjob_manifest(config)
    (patch,) = job["spec"]["runtimePatches"]
    (replicated,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    labels = dict(replicated["template"]["spec"]["template"]["metadata"]["labels"])
    labels |= {JOBSET_LABELS[0]: job["metadata"]["name"], JOBSET_LABELS[1]: "0"}
    monitors = _monitors()
    assert [m for m, monitor in monitors.items() if _selects(monitor, labels)] == [
        "crosskd-trainjob"
    ]
    spec = monitors["crosskd-trainjob"]["spec"]
    assert spec["jobLabel"] == JOBSET_LABELS[0] and set(spec["podTargetLabels"]) <= set(labels)
    (container,) = _runtime_pod()["containers"]
    (endpoint,) = spec["podMetricsEndpoints"]
    meta = "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", PROCS_LABEL)
    targets = [
        {
            "__address__": f"10.0.0.5:{p['containerPort']}",
            "__meta_kubernetes_pod_container_port_name": p["name"],
            meta: labels[PROCS_LABEL],
        }
        for p in container["ports"]
    ]
    kept = [t for t in (relabel(t, endpoint["relabelings"]) for t in targets) if t]
    assert {t["endpoint"]: t["__address__"] for t in kept} == {
        f"metrics-{i}": f"10.0.0.5:{9400 + i}" for i in range(procs)
    }


def _runtime_pod() -> dict:
    """The pod spec of the crosskd TrainingRuntime's ``node`` job."""
    (replicated,) = runtime_manifest()["spec"]["template"]["spec"]["replicatedJobs"]
    return replicated["template"]["spec"]["template"]["spec"]


def test_steps_monitor_selects_the_scoring_and_prepare_pods():
    """The compiled pipeline labels the score_teacher and prepare tasks' pods; the steps
    PodMonitor selects exactly those, and no other task's pod."""
    monitors = _monitors()
    labels = _step_pod_labels()
    assert labels["score-teacher"] == {
        "app.kubernetes.io/name": "crosskd",
        "app.kubernetes.io/component": "score-teacher",
    }
    assert labels["prepare"] == {
        "app.kubernetes.io/name": "crosskd",
        "app.kubernetes.io/component": "prepare",
    }
    for task, pod_labels in labels.items():
        chosen = [m for m, monitor in monitors.items() if _selects(monitor, pod_labels)]
        assert chosen == (["crosskd-steps"] if task in ("score-teacher", "prepare") else []), task
    spec = monitors["crosskd-steps"]["spec"]
    assert spec["jobLabel"] == "pipeline/runid"
    assert spec["podTargetLabels"] == ["app.kubernetes.io/name", "app.kubernetes.io/component"]


def test_steps_port_is_the_pipelines_metrics_port():
    compiled = next(yaml.safe_load_all((ROOT / "pipelines" / "distill.yaml").read_text()))
    default = compiled["root"]["inputDefinitions"]["parameters"]["metrics_port"]["defaultValue"]
    assert int(default) == STEP_PORT
    (endpoint,) = _monitors()["crosskd-steps"]["spec"]["podMetricsEndpoints"]
    assert not {"port", "portNumber", "targetPort"} & set(endpoint)  # undeclared: relabelings
    replacements = {r.get("replacement") for r in endpoint["relabelings"]}
    assert replacements >= {f"${{1}}:{STEP_PORT}", f"[${{1}}]:{STEP_PORT}", str(STEP_PORT)}


def _kfp_pod_targets(pod_ip: str) -> list[dict[str, str]]:
    """What Prometheus's pod discovery gives for a KFP task pod (Argo containers `main` and
    `wait`, init containers `init` and `kfp-launcher`, none declaring a port): one target per
    container, addressed by the bare pod IP (prometheus discovery/kubernetes/pod.go)."""
    return [
        {
            "__address__": pod_ip,
            "__meta_kubernetes_pod_ip": pod_ip,
            "__meta_kubernetes_pod_container_name": name,
            "__meta_kubernetes_pod_container_init": init,
        }
        for name, init in (
            ("main", "false"),
            ("wait", "false"),
            ("init", "true"),
            ("kfp-launcher", "true"),
        )
    ]


@pytest.mark.parametrize(
    ("pod_ip", "address"),
    [
        ("10.1.2.3", f"10.1.2.3:{STEP_PORT}"),
        ("fd00:10:244::7", f"[fd00:10:244::7]:{STEP_PORT}"),
    ],
)
def test_steps_relabelings_give_one_target_per_pod(pod_ip, address):
    (endpoint,) = _monitors()["crosskd-steps"]["spec"]["podMetricsEndpoints"]
    kept = [
        t
        for t in (relabel(t, endpoint["relabelings"]) for t in _kfp_pod_targets(pod_ip))
        if t is not None
    ]
    assert len(kept) == 1
    assert kept[0]["__meta_kubernetes_pod_container_name"] == "main"
    assert kept[0]["__address__"] == address
    assert kept[0]["endpoint"] == str(STEP_PORT)


def test_relabel_emulation_keeps_drops_and_replaces():
    configs = [
        {"action": "drop", "sourceLabels": ["a"], "regex": "x"},
        {
            "sourceLabels": ["a", "b"],
            "regex": "(.*);(.*)",
            "targetLabel": "c",
            "replacement": "${2}-$1",
        },
    ]
    assert relabel({"a": "x"}, configs) is None
    assert relabel({"a": "y", "b": "z"}, configs)["c"] == "z-y"
    assert relabel({"a": "ab"}, [{"action": "keep", "sourceLabels": ["a"], "regex": "a"}]) is None


def _snake(value: object) -> object:
    if isinstance(value, dict):
        return {re.sub(r"(?<!^)([A-Z])", r"_\1", k).lower(): _snake(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_snake(v) for v in value]
    return value


def test_promtool_accepts_the_steps_relabelings(tmp_path):
    """The relabelings as a Prometheus scrape config (what the operator renders them to, in
    snake case) pass ``promtool check config``; a bad regex fails it."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail(
            "promtool is not installed: install Debian's prometheus package "
            "(apt-get install --no-install-recommends prometheus; .ci/run does it)"
        )
    (endpoint,) = _monitors()["crosskd-steps"]["spec"]["podMetricsEndpoints"]
    relabel = _snake(endpoint["relabelings"])
    assert relabel[0]["source_labels"][0] == "__meta_kubernetes_pod_container_name"

    def check(configs: list[dict]) -> subprocess.CompletedProcess:
        config = {
            "scrape_configs": [
                {
                    "job_name": "podMonitor/ml/crosskd-steps/0",
                    "scrape_interval": "15s",
                    # Debian's build has no kubernetes_sd_configs; the relabelings are the same.
                    "static_configs": [{"targets": ["10.1.2.3"]}],
                    "relabel_configs": configs,
                }
            ]
        }
        path = tmp_path / "prometheus.yml"
        path.write_text(yaml.safe_dump(config), encoding="utf-8")
        return subprocess.run(
            [promtool, "check", "config", "--syntax-only", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    out = check(relabel)
    assert out.returncode == 0, out.stdout + out.stderr
    broken = copy.deepcopy(relabel)
    broken[1]["regex"] = "([^:]+"
    assert check(broken).returncode != 0


@functools.cache
def _validator(kind: str) -> jsonschema.Draft7Validator:
    path = VENDOR / CRDS[kind]
    if not path.is_file():
        pytest.skip(
            f"{path} is absent (prometheus-operator's CRDs are vendored outside the "
            f"repo: example/prometheus-operator-crd/{CRDS[kind]})"
        )
    crd = yaml.safe_load(path.read_text(encoding="utf-8"))
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = v1["schema"]["openAPIV3Schema"]
    return jsonschema.Draft7Validator(strict_schema(schema["properties"]["spec"]))


@pytest.mark.parametrize("kind", CRDS)
def test_objects_fit_the_strict_crd_schema(kind):
    docs = [d for d in _built() if d["kind"] == kind]
    assert docs
    for doc in docs:
        errors = [
            f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in _validator(kind).iter_errors(doc["spec"])
        ]
        assert errors == [], doc["metadata"]["name"]
    misspelt = copy.deepcopy(docs[0]["spec"])
    misspelt["podTargetLabel" if kind == "PodMonitor" else "group"] = []
    assert list(_validator(kind).iter_errors(misspelt))
