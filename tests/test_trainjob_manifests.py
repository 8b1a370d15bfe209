"""``manifests/trainjob`` and ``manifests/trainjob-overlays``: the Kubeflow Trainer v2 TrainJob
and the crosskd TrainingRuntime, built with the real ``kubectl kustomize`` and validated
against the vendored Trainer v2 CRD schemas made strict (``additionalProperties: false``
wherever ``properties`` are listed); the CEL rules of those schemas that bear on what we set
checked by hand; the runtime against the stock ``torch-distributed`` one (the replicated job,
container and label the Trainer's torch plugin looks for); the pod the Trainer would make
(the runtime's pod template with the TrainJob's patch and trainer fields) validated as a Pod
with ``kubernetes-validate --strict``; the failure policy against the exit-code table; and
each key a TrainJob cannot carry refused by name."""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kube_tools import kustomize, strict_schema

from crosskd.errors import ConfigError
from crosskd.k8s.job import CREDENTIAL_ENV, load_job_config
from crosskd.k8s.trainjob import (
    ANCESTOR_LABEL,
    MAX_PROCS,
    NODE,
    PROCS_LABEL,
    RUNTIME,
    permanent_exit_codes,
    trainer_pod,
    trainjob_manifest,
)
from crosskd.train.launch import EXIT_RETRYABLE, EXIT_SIGTERM, PERMANENT

ROOT = Path(__file__).parents[1] / "manifests"
VENDOR = Path(__file__).parents[2] / "shared/vendor"
OVERLAYS = {  # overlay: (nodes, processes per node, GPUs per node)
    "cpu-smoke": (2, 1, 0),
    "gpu-1x8": (1, 8, 8),
    "gpu-4x8": (4, 8, 8),
}
K8S_VERSION = kubernetes_validate.latest_version()


@functools.cache
def _build(overlay: str) -> tuple[dict, ...]:
    return kustomize(ROOT / "trainjob-overlays" / overlay)


def _one(docs: tuple[dict, ...], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


@functools.cache
def _schema(name: str) -> dict:
    path = VENDOR / name
    if not path.is_file():
        pytest.skip(f"{path} is absent (the vendored Trainer v2 CRDs live outside the repo)")
    crd = yaml.safe_load(path.read_text(encoding="utf-8"))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return version["schema"]["openAPIV3Schema"]


def _errors(doc: dict, crd: str) -> list[str]:
    validator = jsonschema.Draft7Validator(strict_schema(_schema(crd)))
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)
    ]


def _pod_patch(job: dict) -> dict:
    (patch,) = job["spec"]["runtimePatches"]
    (replicated,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert replicated["name"] == NODE
    return replicated["template"]["spec"]["template"]


def _runtime_job(runtime: dict) -> dict:
    (replicated,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    return replicated


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_trainjob_and_runtime_fit_the_strict_crd_schemas(overlay):
    docs = _build(overlay)
    assert _errors(_one(docs, "TrainJob"), "trainer.kubeflow.org_trainjobs.yaml") == []
    runtime = _one(docs, "TrainingRuntime")
    assert _errors(runtime, "trainer.kubeflow.org_trainingruntimes.yaml") == []


def test_the_strict_schema_refuses_a_misspelt_patch_field():
    job = copy.deepcopy(_one(_build("gpu-4x8"), "TrainJob"))
    _pod_patch(job)["spec"]["containers"][0]["ports"] = [{"containerPort": 9400}]
    job["spec"]["trainer"]["numProcsPerNode"] = 8
    errors = _errors(job, "trainer.kubeflow.org_trainjobs.yaml")
    assert any("ports" in e for e in errors) and any("numProcsPerNode" in e for e in errors)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_cel_rules_we_depend_on_by_hand(overlay):
    """The schemas' rules that JSON Schema does not run, where they bear on what we set:
    ``numProcPerNode >= 1``; ``managedBy`` unset or one of two controllers; one ML policy;
    ``envInjection`` never naming the ``node`` container; and (the Job API's own rule) an
    ``In`` exit-code requirement without 0, at most 255 values."""
    docs = _build(overlay)
    job, runtime = _one(docs, "TrainJob"), _one(docs, "TrainingRuntime")
    assert job["spec"]["trainer"]["numProcPerNode"] >= 1
    assert job["spec"].get("managedBy") in (
        None,
        "trainer.kubeflow.org/trainjob-controller",
        "kueue.x-k8s.io/multikueue",
    )
    policy = runtime["spec"]["mlPolicy"]
    assert [k for k in ("torch", "mpi", "jax", "xgboost", "flux") if k in policy] == ["torch"]
    targets = (policy["torch"].get("envInjection") or {}).get("targets") or []
    assert not any(NODE in t.get("containerNames", []) for t in targets)
    (rule,) = _runtime_job(runtime)["template"]["spec"]["podFailurePolicy"]["rules"]
    codes = rule["onExitCodes"]
    assert codes["operator"] == "In" and 0 not in codes["values"] and len(codes["values"]) <= 255


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_trainer_webhook_rules_by_hand(overlay):
    """Rules of Trainer v2's admission webhook that no schema states (kubeflow/trainer
    pkg/runtime/framework/plugins/jobset/jobset.go, torch/torch.go): a patch's ``manager`` is a
    domain-prefixed path; it patches only replicated jobs and containers the runtime has (a
    patch cannot add a container); it sets no ``env`` on the ``node`` container (that goes in
    ``spec.trainer.env``); and ``spec.trainer.env`` uses none of the names the torch plugin
    injects."""
    docs = _build(overlay)
    job, runtime = _one(docs, "TrainJob"), _one(docs, "TrainingRuntime")
    replicated = {r["name"]: r for r in runtime["spec"]["template"]["spec"]["replicatedJobs"]}
    for patch in job["spec"]["runtimePatches"]:
        prefix, _, path = patch["manager"].partition("/")
        assert path and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9-]+)+", prefix)
        for change in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
            assert change["name"] in replicated
            pod = replicated[change["name"]]["template"]["spec"]["template"]["spec"]
            names = {c["name"] for c in pod["containers"]}
            for container in change["template"]["spec"]["template"]["spec"]["containers"]:
                assert container["name"] in names
                assert not (container["name"] == NODE and "env" in container)
    injected = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR"}
    injected.add("PET_MASTER_PORT")
    env = {e["name"] for e in job["spec"]["trainer"]["env"]}
    assert {"HOME", "CROSSKD_GRACE_SECONDS"} <= env and not env & injected


def test_the_runtime_has_what_the_stock_torch_runtime_has():
    """The stock ``torch-distributed`` ClusterTrainingRuntime (the one a Trainer install
    ships) fits its CRD; ours keeps what the torch plugin looks for in it: the torch policy, the
    replicated job ``node`` labelled as the trainer step, its container ``node``."""
    path = VENDOR / "trainer-runtime-torch-distributed.yaml"
    if not path.is_file():
        pytest.skip(f"{path} is absent (the vendored Trainer v2 runtime lives outside the repo)")
    stock = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert _errors(stock, "trainer.kubeflow.org_clustertrainingruntimes.yaml") == []
    runtime = _one(_build("cpu-smoke"), "TrainingRuntime")
    for doc in (stock, runtime):
        assert "torch" in doc["spec"]["mlPolicy"]
        replicated = _runtime_job(doc)
        assert replicated["name"] == NODE
        assert replicated["template"]["metadata"]["labels"][ANCESTOR_LABEL] == "trainer"
        (container,) = replicated["template"]["spec"]["template"]["spec"]["containers"]
        assert container["name"] == NODE


def test_the_failure_policy_follows_the_exit_code_table():
    """A permanent code (1 .. 127: bad input 2, non-finite loss 3, restart budget 4) fails the
    node's Job by its pod failure policy, and that reason fails the JobSet; a retryable code
    (200, a signal: 137, SIGTERM 143) fails the Job by its backoff limit of 0, which no rule
    names, so the JobSet is recreated, at most maxRestarts times."""
    runtime = _one(_build("cpu-smoke"), "TrainingRuntime")
    template = _runtime_job(runtime)["template"]["spec"]
    (rule,) = template["podFailurePolicy"]["rules"]
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["containerName"] == NODE
    failing = set(rule["onExitCodes"]["values"])
    assert permanent_exit_codes(runtime) == failing
    assert set(PERMANENT) <= failing == set(range(1, 128))
    assert not {EXIT_RETRYABLE, EXIT_SIGTERM, 137} & failing
    assert template["backoffLimit"] == 0
    policy = runtime["spec"]["template"]["spec"]["failurePolicy"]
    assert policy["maxRestarts"] > 0
    assert [(r["action"], r["onJobFailureReasons"]) for r in policy["rules"]] == [
        ("FailJobSet", ["PodFailurePolicy"])
    ]


def test_nothing_deletes_the_jobset_under_its_trainjob():
    """No TTL on the runtime's JobSet or its Jobs: Trainer v2.1+ recreates a TrainJob's JobSet
    that disappears, so a TTL-deleted JobSet would train again (kubeflow/trainer#2981)."""
    runtime = _one(_build("cpu-smoke"), "TrainingRuntime")
    jobset = runtime["spec"]["template"]["spec"]
    assert "ttlSecondsAfterFinished" not in jobset
    assert "ttlSecondsAfterFinished" not in _runtime_job(runtime)["template"]["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pod_the_trainer_makes_is_a_valid_crosskd_pod(overlay):
    nodes, procs, gpus = OVERLAYS[overlay]
    docs = _build(overlay)
    job, runtime = _one(docs, "TrainJob"), _one(docs, "TrainingRuntime")
    assert job["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "TrainingRuntime",
        "name": runtime["metadata"]["name"],
    }
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (nodes, procs)
    assert trainer["command"][4:6] == ["--nproc-per-node", str(procs)]
    assert trainer["resourcesPerNode"]["limits"].get("nvidia.com/gpu") == (
        str(gpus) if gpus else None
    )
    pod = {"apiVersion": "v1", "kind": "Pod", **trainer_pod(job, runtime)}
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    (container,) = pod["spec"]["containers"]
    assert (container["image"], container["command"]) == (trainer["image"], trainer["command"])
    assert container["imagePullPolicy"] == "IfNotPresent"  # the runtime's, kept
    labels = pod["metadata"]["labels"]
    assert labels[PROCS_LABEL] == str(procs)
    assert labels["app.kubernetes.io/component"] == "trainer"
    spec = pod["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    config_map = _one(docs, "ConfigMap")["metadata"]["name"]
    assert volumes[mounts["/etc/crosskd"]]["configMap"]["name"] == config_map
    assert config_map.startswith("crosskd-train-")  # the hash suffix reached the TrainJob
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {f"metrics-{i}": 9400 + i for i in range(MAX_PROCS)}
    for env in container["env"]:
        if env["name"] in CREDENTIAL_ENV:
            assert "value" not in env and env["valueFrom"]["secretKeyRef"]["name"]


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("elastic", True, r"^elastic is set, which a TrainJob cannot carry: .* use nodes"),
        ("gang_scheduling", True, r"^gang_scheduling is set, .* podGroupPolicy"),
        ("priority_class", "high", r"^priority_class is set, .* Kueue"),
        ("restart_policy", "Never", r"^restart_policy is 'Never'; under a TrainJob the crosskd"),
        ("backoff_limit", 5, r"^backoff_limit is 5; under a TrainJob"),
        ("ttl_seconds_after_finished", 60, r"^ttl_seconds_after_finished is 60; Trainer v2 has no"),
        ("clean_pod_policy", "All", r"^clean_pod_policy is 'All';"),
        ("image_pull_policy", "Always", r"^image_pull_policy is 'Always'; a TrainJob cannot set"),
        ("metrics_port", 9500, r"^metrics_port is 9500; the crosskd-torch runtime declares"),
        ("cpu_procs_per_node", 9, r"^9 processes per node; .* at most 8\. Use more nodes"),
    ],
)
def test_what_a_trainjob_cannot_carry_is_refused_by_name(key, value, message):
    config = load_job_config(str(ROOT / "job.yaml"), values={key: value})
    with pytest.raises(ConfigError, match=message):
        trainjob_manifest(config)


def test_the_runtime_named_is_the_one_shipped():
    shipped = yaml.safe_load((ROOT / "trainjob" / "runtime.yaml").read_text(encoding="utf-8"))
    assert shipped["metadata"]["name"] == RUNTIME
    job = trainjob_manifest(load_job_config(str(ROOT / "job.yaml")))
    assert job["spec"]["runtimeRef"]["name"] == RUNTIME
