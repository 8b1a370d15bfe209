"""The PyTorchJob of a job config (crosskd.k8s.job): hand-worked expectations for CPU and GPU
jobs (world layout, env, ports, resources, security), job names, config errors, and
``crosskd job render``."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml
from kubeflow.training.models import KubeflowOrgV1PyTorchJob

from crosskd.cli import main
from crosskd.errors import ConfigError
from crosskd.k8s.cli import json_patch
from crosskd.k8s.job import (
    JobConfig,
    build_job,
    job_layout,
    job_manifest,
    job_name,
    load_job_config,
)
from crosskd.parallel.layout import ParallelLayout

ROOT = Path(__file__).resolve().parents[1]

BASE_ENV = {
    "HOME": "/home/crosskd",
    "CROSSKD_CACHE_DIR": "/cache/crosskd",
    "HF_HOME": "/cache/huggingface",
    "CROSSKD_NODE_CACHE": "/node-cache",
    "CROSSKD_NODE_CACHE_BYTES": str(20 * 2**30 * 90 // 100),  # 90% of node_cache_size 20Gi
    "CROSSKD_GRACE_SECONDS": "120",
    "NCCL_DEBUG": "WARN",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
}


def _pod(manifest: dict, kind: str = "Master") -> dict:
    return manifest["spec"]["pytorchReplicaSpecs"][kind]["template"]


def _container(manifest: dict, kind: str = "Master") -> dict:
    (container,) = _pod(manifest, kind)["spec"]["containers"]
    return container


def _keys(value: object) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in _keys(v)}
    return set()


def test_cpu_job_by_hand():
    """2 CPU pods x 2 processes: a Master and one Worker, nprocPerNode 2, two metrics ports,
    CPU/memory only, the secure pod, the ConfigMap at /etc/crosskd/train.yaml."""
    config = JobConfig(run_id="run-1", image="crosskd:0.1.0", nodes=2, cpu_procs_per_node=2)
    job = build_job(config)
    assert isinstance(job, KubeflowOrgV1PyTorchJob)
    m = job_manifest(config)
    name = job_name("run-1")
    assert m["apiVersion"] == "kubeflow.org/v1" and m["kind"] == "PyTorchJob"
    assert m["metadata"] == {
        "name": name,
        "labels": {
            "app.kubernetes.io/name": "crosskd",
            "app.kubernetes.io/component": "trainer",
            "crosskd.dev/run": "run-1",
        },
    }
    spec = m["spec"]
    assert spec["nprocPerNode"] == "2" and "elasticPolicy" not in spec
    replicas = spec["pytorchReplicaSpecs"]
    assert {k: (r["replicas"], r["restartPolicy"]) for k, r in replicas.items()} == {
        "Master": (1, "ExitCode"),
        "Worker": (1, "ExitCode"),
    }
    assert spec["runPolicy"] == {
        "activeDeadlineSeconds": 604800,
        "backoffLimit": 3,
        "cleanPodPolicy": "Running",
        "ttlSecondsAfterFinished": 86400,
    }
    assert _pod(m, "Master") == _pod(m, "Worker")
    pod = _pod(m)
    assert pod["metadata"]["annotations"] == {"sidecar.istio.io/inject": "false"}
    assert pod["metadata"]["labels"] == m["metadata"]["labels"]
    c = _container(m)
    assert c["name"] == "pytorch" and c["image"] == "crosskd:0.1.0"
    assert c["imagePullPolicy"] == "IfNotPresent"
    assert c["command"] == [
        "crosskd",
        "train",
        "--config",
        "/etc/crosskd/train.yaml",
        "--nproc-per-node",
        "2",
        "metrics_port=9400",
    ]
    assert "args" not in c
    assert c["ports"] == [
        {"name": "pytorchjob-port", "containerPort": 23456},
        {"name": "metrics-0", "containerPort": 9400},
        {"name": "metrics-1", "containerPort": 9401},
    ]
    assert c["resources"] == {
        "requests": {"cpu": "4", "memory": "16Gi"},
        "limits": {"memory": "16Gi"},
    }
    assert {e["name"]: e["value"] for e in c["env"]} == BASE_ENV
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert c["volumeMounts"] == [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "train-config", "mountPath": "/etc/crosskd", "readOnly": True},
        {"name": "home", "mountPath": "/home/crosskd"},
        {"name": "cache", "mountPath": "/cache"},
        {"name": "node-cache", "mountPath": "/node-cache"},
    ]
    ps = pod["spec"]
    assert ps["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "fsGroup": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert ps["terminationGracePeriodSeconds"] == 120
    assert ps["automountServiceAccountToken"] is False
    assert not {"nodeSelector", "tolerations", "serviceAccountName"} & set(ps)
    assert ps["volumes"] == [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
        {
            "name": "train-config",
            "configMap": {
                "name": "crosskd-train",
                "items": [{"key": "train.yaml", "path": "train.yaml"}],
            },
        },
        {"name": "home", "emptyDir": {"sizeLimit": "1Gi"}},
        {"name": "cache", "emptyDir": {"sizeLimit": "50Gi"}},
        {"name": "node-cache", "emptyDir": {"sizeLimit": "20Gi"}},
    ]
    # camelCase from sanitize_for_serialization, not to_dict()'s snake_case, and no nulls
    assert not [k for k in _keys(m) if "_" in k]
    assert "None" not in yaml.safe_dump(m) and "null" not in yaml.safe_dump(m)


def test_gpu_job_by_hand():
    """4 nodes x 8 GPUs: Master + 3 Workers (the operator's WORLD_SIZE 4 x 8 = 32), GPU limit
    = nprocPerNode = --nproc-per-node = metrics ports, S3 keys only from the Secret."""
    config = load_job_config(
        overrides=[
            "run_id=big",
            "image=crosskd:0.1.0-cuda",
            "nodes=4",
            "gpus_per_node=8",
            "cpu_procs_per_node=3",
            "cpu=64",
            "memory=512Gi",
            "memory_limit=600Gi",
            "shm_size=64Gi",
            "s3_secret=crosskd-s3",
            "s3_endpoint_url=http://minio:9000",
            "grace_seconds=300",
            "node_selector={nvidia.com/gpu.product: H100}",
            "image_pull_secrets=[regcred]",
            "tolerations=[{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]",
            "env={NCCL_SOCKET_IFNAME: eth0}",
            "train_overrides=[steps=2000]",
            "metrics_port=9500",
        ]
    )
    m = job_manifest(config)
    specs = m["spec"]["pytorchReplicaSpecs"]
    assert {k: r["replicas"] for k, r in specs.items()} == {"Master": 1, "Worker": 3}
    assert m["spec"]["nprocPerNode"] == "8"
    c = _container(m, "Worker")
    assert c["command"][4:] == ["--nproc-per-node", "8", "metrics_port=9500", "steps=2000"]
    assert c["resources"] == {
        "requests": {"cpu": "64", "memory": "512Gi"},
        "limits": {"memory": "600Gi", "nvidia.com/gpu": "8"},
    }
    assert [p["name"] for p in c["ports"]] == ["pytorchjob-port"] + [
        f"metrics-{i}" for i in range(8)
    ]
    assert [p["containerPort"] for p in c["ports"][1:]] == list(range(9500, 9508))
    plain = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    assert plain == {
        **BASE_ENV,
        "CROSSKD_GRACE_SECONDS": "300",
        "NCCL_SOCKET_IFNAME": "eth0",
        "AWS_ENDPOINT_URL": "http://minio:9000",
    }
    secret = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "valueFrom" in e}
    assert secret == {
        "AWS_ACCESS_KEY_ID": {"name": "crosskd-s3", "key": "AWS_ACCESS_KEY_ID"},
        "AWS_SECRET_ACCESS_KEY": {"name": "crosskd-s3", "key": "AWS_SECRET_ACCESS_KEY"},
        "AWS_DEFAULT_REGION": {"name": "crosskd-s3", "key": "AWS_DEFAULT_REGION", "optional": True},
    }
    ps = _pod(m, "Worker")["spec"]
    assert ps["terminationGracePeriodSeconds"] == 300
    assert ps["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}
    assert ps["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert ps["imagePullSecrets"] == [{"name": "regcred"}]
    assert ps["volumes"][0]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert _pod(m, "Master") == _pod(m, "Worker")


def test_one_node_has_no_worker_and_elastic_has_no_master():
    one = job_manifest(JobConfig(run_id="r", image="i", gpus_per_node=8))
    assert list(one["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    cfg = JobConfig(run_id="r", image="i", nodes=3, gpus_per_node=4, elastic=True, min_nodes=2)
    elastic = job_manifest(cfg)
    assert {k: r["replicas"] for k, r in elastic["spec"]["pytorchReplicaSpecs"].items()} == {
        "Worker": 3
    }
    assert elastic["spec"]["elasticPolicy"] == {
        "rdzvBackend": "c10d",
        "rdzvId": job_name("r"),
        "minReplicas": 2,
        "maxReplicas": 3,
    }
    assert elastic["spec"]["nprocPerNode"] == "4"
    assert "nProcPerNode" not in elastic["spec"]["elasticPolicy"]  # forbidden with nprocPerNode


def test_queue_gang_priority_and_ipc_lock():
    m = job_manifest(
        JobConfig(
            run_id="r",
            image="i",
            nodes=4,
            gpus_per_node=8,
            queue_name="team-gpus",
            gang_scheduling=True,
            scheduling_queue="vq",
            priority_class="high",
            schedule_timeout_seconds=600,
            ipc_lock=True,
            service_account="s3-reader",
            labels={"team": "nlp"},
            namespace="ml",
            name="my-job",
        )
    )
    assert m["metadata"]["name"] == "my-job" and m["metadata"]["namespace"] == "ml"
    assert m["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-gpus"
    assert m["metadata"]["labels"]["team"] == "nlp"
    pod = _pod(m)
    assert "kueue.x-k8s.io/queue-name" not in pod["metadata"]["labels"]
    assert pod["metadata"]["labels"]["team"] == "nlp"
    assert m["spec"]["runPolicy"]["schedulingPolicy"] == {
        "minAvailable": 4,
        "queue": "vq",
        "priorityClass": "high",
        "scheduleTimeoutSeconds": 600,
    }
    assert pod["spec"]["priorityClassName"] == "high"
    assert pod["spec"]["serviceAccountName"] == "s3-reader"
    assert _container(m)["securityContext"]["capabilities"] == {
        "drop": ["ALL"],
        "add": ["IPC_LOCK"],
    }


def test_job_name():
    name = job_name("run-1")
    assert name == job_name("run-1") and name.startswith("crosskd-run-1-")
    dns1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
    for run_id in ("run-1", "R" * 63, "123", "a_b", "a-b", "x.y.z", "KFP-3f2a_UUID"):
        got = job_name(run_id)
        assert dns1035.fullmatch(got) and len(got) <= 52, got
        assert len(f"{got}-worker-999") <= 63
    assert job_name("a_b") != job_name("a-b")
    assert len(job_name("R" * 63)) == 52


@pytest.mark.parametrize(
    "override, key",
    [
        ("nodes=0", "nodes"),
        ("nodes=two", "nodes"),
        ("gpus_per_node=-1", "gpus_per_node"),
        ("image_pull_policy=Sometimes", "image_pull_policy"),
        ("restart_policy=OnError", "restart_policy"),
        ("clean_pod_policy=Some", "clean_pod_policy"),
        ("memory=lots", "memory"),
        ("shm_size=1 GB", "shm_size"),
        ("run_id=not a label", "run_id"),
        ("run_id=" + "x" * 64, "run_id"),
        ("name=Upper", "name"),
        ("name=" + "a" * 53, "name"),
        ("min_nodes=1", "min_nodes"),  # needs elastic
        ("elastic=yes please", "elastic"),
        ("metrics_port=23456", "metrics_port"),
        ("metrics_port=65535", "metrics_port"),  # 2 procs: 65536 is past the range
        ("env={AWS_SECRET_ACCESS_KEY: x}", "env"),
        ("env={A: 1}", "env"),
        ("node_selector=[a]", "node_selector"),
        ("tolerations=[{key: a, operatr: Exists}]", "tolerations[0]"),
        ("tolerations=[{key: a, operator: Maybe}]", "tolerations[0].operator"),
        ("tolerations=[{key: a, effect: Never}]", "tolerations[0].effect"),
        ("train_overrides=[steps]", "train_overrides[0]"),
        ("grace_seconds=0", "grace_seconds"),
        ("nccl_debug=LOUD", "nccl_debug"),
        ("bogus=1", "bogus"),
    ],
)
def test_config_errors_name_the_key(override, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_job_config(overrides=["run_id=r", "image=i", "cpu_procs_per_node=2", override])


def test_config_from_yaml(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("run_id: r\nimage: i\ncpu: 2\nnodes: 2\n", encoding="utf-8")
    config = load_job_config(str(path), ["nodes=3"])
    assert (config.cpu, config.nodes) == ("2", 3)
    path.write_text("image: i\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="run_id"):
        load_job_config(str(path))


def test_render_cli(tmp_path, capsys):
    config = tmp_path / "job.yaml"
    config.write_text("run_id: r\nimage: crosskd:0.1.0\n", encoding="utf-8")
    assert main(["job", "render", "--config", str(config), "nodes=2"]) == 0
    out = capsys.readouterr().out
    expected = job_manifest(JobConfig(run_id="r", image="crosskd:0.1.0", nodes=2))
    assert yaml.safe_load(out) == expected
    target = tmp_path / "out.yaml"
    assert main(["job", "render", "--config", str(config), "--output", str(target)]) == 0
    assert yaml.safe_load(target.read_text()) == job_manifest(load_job_config(str(config)))
    capsys.readouterr()
    assert main(["job", "render", "--config", str(config), "nodes=0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nodes is 0" in err


def test_the_train_layout_must_fit_the_jobs_workers(tmp_path, capsys):
    """``parallel.*`` train overrides (over the train config's ``parallel:`` when render is
    given it) resolved for ``nodes * procs per node``; a layout that does not fit is refused
    at render time in one line naming both sides, a size that is no size by its key."""
    job = JobConfig(
        run_id="r", image="i", nodes=4, gpus_per_node=8, train_overrides=["parallel.dp_shard=8"]
    )
    assert job_layout(job) == ParallelLayout(dp_replicate=4, dp_shard=8)
    assert job_layout(job, {"tp": 2}) == ParallelLayout(dp_replicate=2, dp_shard=8, tp=2)
    command = build_job(job).spec.pytorch_replica_specs["Master"].template.spec.containers[0]
    assert command.command[-1] == "parallel.dp_shard=8"
    with pytest.raises(
        ConfigError,
        match=r"parallel \{'dp_shard': 3\} does not fit this job's "
        r"4 node\(s\) x 8 process\(es\) = 32",
    ):
        JobConfig(
            run_id="r", image="i", nodes=4, gpus_per_node=8, train_overrides=["parallel.dp_shard=3"]
        )
    with pytest.raises(ConfigError, match=r"^parallel.tp is 0; it must be an integer >= 1\.$"):
        JobConfig(run_id="r", image="i", train_overrides=["parallel.tp=0"])
    config = tmp_path / "job.yaml"
    config.write_text("run_id: r\nimage: i\nnodes: 2\ncpu_procs_per_node: 2\n")
    train = tmp_path / "train.yaml"
    train.write_text("parallel: {dp_replicate: 1, tp: 2}\n")
    assert main(["job", "render", "--config", str(config), "--train-config", str(train)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "2 node(s) x 2 process(es) = 4 workers" in err
    assert (
        main(
            [
                "job",
                "render",
                "--config",
                str(config),
                "--train-config",
                str(train),
                "train_overrides=[parallel.dp_shard=2]",
            ]
        )
        == 0
    )
    # The GPU overlays of manifests/ shard the student over each node's GPUs.
    for overlay, replicas in (("gpu-1x8", 1), ("gpu-4x8", 4)):
        values = {
            **yaml.safe_load((ROOT / "manifests/job.yaml").read_text()),
            **yaml.safe_load((ROOT / f"manifests/overlays/{overlay}/job.yaml").read_text()),
        }
        layout = job_layout(load_job_config(values=values))
        assert (layout.dp_replicate, layout.dp_shard) == (replicas, 8), overlay


def _apply(doc: object, ops: list[dict]) -> object:
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = [
            p.replace("~1", "/").replace("~0", "~") for p in op["path"][1:].split("/")
        ]
        target = doc
        for p in parents:
            target = target[int(p)] if isinstance(target, list) else target[p]
        key = int(last) if isinstance(target, list) else last
        if op["op"] == "remove":
            del target[key]
        else:
            target[key] = op["value"]
    return doc


def test_json_patch_turns_old_into_new():
    base = job_manifest(JobConfig(run_id="r", image="i", nodes=2))
    for overrides in (
        dict(nodes=1, gpus_per_node=8),
        dict(nodes=4, gpus_per_node=8, s3_secret="s"),
        dict(elastic=True, nodes=3),
        dict(tolerations=[{"key": "a/b"}]),
    ):
        new = job_manifest(JobConfig(run_id="r", image="i", **{"nodes": 2, **overrides}))
        ops = json_patch(base, new)
        assert _apply(base, ops) == new
        assert all(op["op"] in ("add", "remove", "replace") for op in ops)
    assert json_patch(base, base) == []
