"""A crosskd training run as a Kubeflow Trainer v2 ``TrainJob`` (``crosskd job render --kind
trainjob``), and the ``TrainingRuntime`` it runs on (``manifests/trainjob/runtime.yaml``).

Both are built from the official models of the Trainer v2 API (``kubeflow_trainer_api``,
pydantic), whose pod parts are filled from the same Kubernetes objects the PyTorchJob's pods
are made of (:mod:`crosskd.k8s.job`); :func:`trainjob_manifest` and :func:`runtime_manifest`
are the camelCase mappings the API server takes.

**Why a runtime of crosskd's own** (``crosskd-torch``, namespaced, installed once per
namespace), not the stock ``torch-distributed`` ClusterTrainingRuntime: a TrainJob may change
its runtime's pods only through ``runtimePatches``, which reach labels, annotations, volumes,
volume mounts, security contexts, tolerations, node selectors, service accounts and image pull
secrets (and env, but not the ``node`` container's: that goes in ``spec.trainer.env``), and
nothing else. What the crosskd pod needs beyond that is in the runtime:

* the **exit-code contract** (:mod:`crosskd.train.launch`): each node's Job has
  ``backoffLimit: 0`` and a ``podFailurePolicy`` that fails the Job on the permanent codes
  (1 .. 127); the JobSet's ``failurePolicy`` then fails the whole run on a Job failed that way
  (reason ``PodFailurePolicy``) and otherwise recreates every node's pod (``RestartJobSet``,
  at most :data:`MAX_RESTARTS` times), so a retryable failure (200, a signal) resumes from the
  checkpoint. The stock runtime has neither: its JobSet fails on the first failed pod;
* the **metrics ports**: local rank ``i`` serves ``/metrics`` on ``9400 + i``, declared as
  container ports ``metrics-0`` .. ``metrics-7`` (patches cannot add ports; Prometheus's pod
  discovery targets declared ports). Pods carry the label ``crosskd.dev/procs-per-node`` and
  the PodMonitor ``crosskd-trainjob`` keeps the ports below it;
* ``automountServiceAccountToken: false`` (the trainer never calls the API server) and the
  container's ``imagePullPolicy``.

**No TTL.** The runtime's JobSet has no ``ttlSecondsAfterFinished``: Trainer v2.1 and later
recreate a TrainJob's JobSet when it disappears, so a JobSet deleted by its TTL would be made
again and train again (kubeflow/trainer#2981, #3737), and Trainer v2 has no TTL of the TrainJob
itself yet (kubeflow/trainer#4052). A finished TrainJob (its pods exited) stays until it is
deleted: ``crosskd job submit --delete-when-done``, or ``kubectl delete trainjob``.

**Differences from the PyTorchJob** (:mod:`crosskd.k8s.job`):

* a retryable failure restarts every node's pod (the JobSet is recreated), where the
  PyTorchJob's ``ExitCode`` policy recreates the failed pod alone (the others' workers then fail
  on their collectives and are recreated too, so the effect is the same on a static
  rendezvous); the JobSet counts those restarts (:data:`MAX_RESTARTS`), the PyTorchJob does not,
  and crosskd's own budget (``max_restarts`` of the train config, exit 4) applies under both;
* nodes find each other from what the Trainer's torch plugin injects (``PET_NNODES``,
  ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``:
  :func:`crosskd.parallel.rendezvous.rendezvous`);
* refused here, as a TrainJob cannot set them per job: ``elastic``, ``gang_scheduling`` (the
  runtime's ``podGroupPolicy``), ``priority_class`` (Kueue's priority label instead), an
  ``image_pull_policy`` other than the runtime's, a ``metrics_port`` other than 9400, more than
  :data:`MAX_PROCS` processes per node, ``restart_policy`` / ``backoff_limit`` /
  ``clean_pod_policy`` other than their defaults (the runtime decides those), and a
  ``ttl_seconds_after_finished`` other than its default (no TTL applies: above).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from kubeflow_trainer_api import models as tr
from kubernetes import client as k8s

from crosskd.errors import ConfigError
from crosskd.k8s.job import (
    KUEUE_LABEL,
    NAME_LABELS,
    RUN_LABEL,
    JobConfig,
    container_env,
    container_mounts,
    container_security,
    job_name,
    node_resources,
    pod_security_context,
    pod_tolerations,
    pod_volumes,
    train_command,
)

API_VERSION = "trainer.kubeflow.org/v1alpha1"
RUNTIME = "crosskd-torch"
"""The crosskd TrainingRuntime's name."""
NODE = "node"
"""The runtime's replicated job and its container (the torch plugin's trainer container)."""
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
"""The label by which the Trainer finds the trainer's replicated job (value ``trainer``)."""
PROCS_LABEL = "crosskd.dev/procs-per-node"
"""The pods' label: how many local ranks (metrics ports) the pod serves."""
MAX_PROCS = 8
"""Metrics ports the runtime declares (``metrics-0`` .. ``metrics-7``)."""
METRICS_PORT = 9400
PULL_POLICY = "IfNotPresent"
MAX_RESTARTS = 100
"""JobSet restarts (every node recreated) before the run fails; crosskd's own budget (a
failure without a new checkpoint in between, ``max_restarts``) usually stops it first."""
PERMANENT_CODES = range(1, 128)
"""Exit codes that fail the run (:mod:`crosskd.train.launch`: 1 .. 127; 128 and above, and
200, are retried)."""
MANAGER = "crosskd.dev/job"
"""``runtimePatches[].manager``: who wrote the patch."""
_DEFAULTS = {f.name: f.default for f in fields(JobConfig)}
_FIXED = ("restart_policy", "backoff_limit", "clean_pod_policy")


def check_trainjob(config: JobConfig) -> None:
    """Refuse the :class:`JobConfig` keys a TrainJob cannot carry (module docstring), naming
    the key and what to do instead."""
    refused = {
        "elastic": "Trainer v2's torch policy has no elastic rendezvous; use nodes",
        "gang_scheduling": "set the runtime's podGroupPolicy instead",
        "priority_class": "label the job for Kueue (kueue.x-k8s.io/priority-class) instead",
    }
    for key, why in refused.items():
        if getattr(config, key):
            raise ConfigError(f"{key} is set, which a TrainJob cannot carry: {why}.")
    for key in _FIXED:
        if getattr(config, key) != _DEFAULTS[key]:
            raise ConfigError(
                f"{key} is {getattr(config, key)!r}; under a TrainJob the {RUNTIME} runtime "
                f"decides it (its failure policy: docs/kubernetes.md). Leave it unset."
            )
    if config.ttl_seconds_after_finished != _DEFAULTS["ttl_seconds_after_finished"]:
        raise ConfigError(
            f"ttl_seconds_after_finished is {config.ttl_seconds_after_finished!r}; Trainer v2 "
            "has no TTL for a TrainJob (docs/kubernetes.md, section 8). Leave it unset and "
            "delete the finished job (crosskd job submit --delete-when-done, or kubectl)."
        )
    if config.image_pull_policy != PULL_POLICY:
        raise ConfigError(
            f"image_pull_policy is {config.image_pull_policy!r}; a TrainJob cannot set it "
            f"(the {RUNTIME} runtime's is {PULL_POLICY}). Push a new tag instead."
        )
    if config.metrics_port != METRICS_PORT:
        raise ConfigError(
            f"metrics_port is {config.metrics_port}; the {RUNTIME} runtime declares ports "
            f"{METRICS_PORT}..{METRICS_PORT + MAX_PROCS - 1}. Leave it at {METRICS_PORT}."
        )
    if config.procs_per_node > MAX_PROCS:
        raise ConfigError(
            f"{config.procs_per_node} processes per node; the {RUNTIME} runtime declares "
            f"metrics ports for at most {MAX_PROCS}. Use more nodes."
        )


def build_trainjob(config: JobConfig) -> tr.TrainerV1alpha1TrainJob:
    """The TrainJob of ``config`` on the :data:`RUNTIME` runtime: ``spec.trainer`` holds the
    image, the train command, its environment (Trainer's webhook refuses ``env`` in a patch of
    the ``node`` container), ``nodes``, the processes per node and each node's resources;
    ``runtimePatches`` the pods' labels, volumes, mounts, security contexts, tolerations, node
    selector, service account and image pull secrets."""
    check_trainjob(config)
    name = config.name or job_name(config.run_id)
    labels = {**NAME_LABELS, RUN_LABEL: config.run_id, **config.labels}
    job_labels = dict(labels)
    if config.queue_name:
        job_labels[KUEUE_LABEL] = config.queue_name
    pod_labels = {**labels, PROCS_LABEL: str(config.procs_per_node)}
    container = k8s.V1Container(
        name=NODE,
        volume_mounts=container_mounts(config),
        security_context=container_security(config),
    )
    pod = k8s.V1PodSpec(
        containers=[container],
        volumes=pod_volumes(config),
        termination_grace_period_seconds=config.grace_seconds,
        node_selector=dict(config.node_selector) or None,
        tolerations=pod_tolerations(config.tolerations),
        service_account_name=config.service_account,
        image_pull_secrets=[k8s.V1LocalObjectReference(name=n) for n in config.image_pull_secrets]
        or None,
        security_context=pod_security_context(),
    )
    patch = {
        "manager": MANAGER,
        "trainingRuntimeSpec": {
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {
                            "name": NODE,
                            "template": {
                                "spec": {
                                    "template": {
                                        "metadata": {
                                            "labels": pod_labels,
                                            "annotations": {"sidecar.istio.io/inject": "false"},
                                        },
                                        "spec": _serialized(pod),
                                    }
                                }
                            },
                        }
                    ]
                }
            }
        },
    }
    return tr.TrainerV1alpha1TrainJob(
        api_version=API_VERSION,
        kind="TrainJob",
        metadata=tr.IoK8sApimachineryPkgApisMetaV1ObjectMeta(
            name=name, namespace=config.namespace, labels=job_labels
        ),
        spec=tr.TrainerV1alpha1TrainJobSpec(
            runtime_ref=tr.TrainerV1alpha1RuntimeRef(
                api_group="trainer.kubeflow.org", kind="TrainingRuntime", name=RUNTIME
            ),
            trainer=tr.TrainerV1alpha1Trainer(
                image=config.image,
                command=train_command(config),
                env=[
                    tr.IoK8sApiCoreV1EnvVar.from_dict(_serialized(e)) for e in container_env(config)
                ],
                num_nodes=config.nodes,
                num_proc_per_node=config.procs_per_node,
                resources_per_node=tr.IoK8sApiCoreV1ResourceRequirements.from_dict(
                    _serialized(node_resources(config))
                ),
            ),
            active_deadline_seconds=config.active_deadline_seconds,
            runtime_patches=[tr.TrainerV1alpha1RuntimePatch.from_dict(patch)],
        ),
    )


def trainjob_manifest(config: JobConfig) -> dict[str, Any]:
    """``build_trainjob(config)`` as the camelCase mapping the API server takes (no None
    values)."""
    return build_trainjob(config).to_dict()


def build_runtime() -> tr.TrainerV1alpha1TrainingRuntime:
    """The :data:`RUNTIME` TrainingRuntime (module docstring): one replicated job ``node`` of
    the torch policy, its Jobs failing on the permanent exit codes, the JobSet recreated on any
    other failure; the ``node`` container with the metrics ports, no service account token."""
    container = k8s.V1Container(
        name=NODE,
        image="crosskd:set-by-the-trainjob",
        image_pull_policy=PULL_POLICY,
        ports=[
            k8s.V1ContainerPort(name=f"metrics-{i}", container_port=METRICS_PORT + i)
            for i in range(MAX_PROCS)
        ],
    )
    job_spec = k8s.V1JobSpec(
        backoff_limit=0,
        pod_failure_policy=k8s.V1PodFailurePolicy(
            rules=[
                k8s.V1PodFailurePolicyRule(
                    action="FailJob",
                    on_exit_codes=k8s.V1PodFailurePolicyOnExitCodesRequirement(
                        container_name=NODE, operator="In", values=list(PERMANENT_CODES)
                    ),
                )
            ]
        ),
        template=k8s.V1PodTemplateSpec(
            spec=k8s.V1PodSpec(
                containers=[container],
                automount_service_account_token=False,
                restart_policy="Never",
            )
        ),
    )
    jobset = {
        "failurePolicy": {
            "maxRestarts": MAX_RESTARTS,
            "rules": [
                {
                    "name": "permanent-exit-code",
                    "action": "FailJobSet",
                    "onJobFailureReasons": ["PodFailurePolicy"],
                },
            ],
        },
        "replicatedJobs": [
            {
                "name": NODE,
                "replicas": 1,
                "template": {
                    "metadata": {"labels": {ANCESTOR_LABEL: "trainer"}},
                    "spec": _serialized(job_spec),
                },
            }
        ],
    }
    return tr.TrainerV1alpha1TrainingRuntime(
        api_version=API_VERSION,
        kind="TrainingRuntime",
        metadata=tr.IoK8sApimachineryPkgApisMetaV1ObjectMeta(
            name=RUNTIME,
            labels={
                "app.kubernetes.io/name": "crosskd",
                "app.kubernetes.io/component": "runtime",
                "trainer.kubeflow.org/framework": "torch",
            },
        ),
        spec=tr.TrainerV1alpha1TrainingRuntimeSpec(
            ml_policy=tr.TrainerV1alpha1MLPolicy(
                num_nodes=1, torch=tr.TrainerV1alpha1TorchMLPolicySource()
            ),
            template=tr.TrainerV1alpha1JobSetTemplateSpec.from_dict({"spec": jobset}),
        ),
    )


def runtime_manifest() -> dict[str, Any]:
    """``build_runtime()`` as the camelCase mapping the API server takes."""
    return build_runtime().to_dict()


def _serialized(obj: Any) -> Any:
    """A Kubernetes client object as its camelCase mapping."""
    return k8s.ApiClient().sanitize_for_serialization(obj)


def trainer_pod(job: Mapping[str, Any], runtime: Mapping[str, Any]) -> dict[str, Any]:
    """The pod template the Trainer makes for each node of the TrainJob manifest ``job`` on its
    TrainingRuntime manifest ``runtime``: the runtime's ``node`` pod template with each of the
    job's ``runtimePatches`` merged in (mappings key by key; lists of named items, such as
    containers, volumes and env, item by item by name; other lists replaced), then the trainer's
    ``image``, ``command``, ``args``, ``env`` (upserted by name) and ``resourcesPerNode`` on the
    ``node`` container. Lists merge by the strategic-merge keys of their Go types: volume mounts
    by ``mountPath``, other lists of named items by ``name``; tolerations are replaced."""
    (replicated,) = [
        r for r in runtime["spec"]["template"]["spec"]["replicatedJobs"] if r["name"] == NODE
    ]
    pod = copy.deepcopy(replicated["template"]["spec"]["template"])
    for patch in job["spec"].get("runtimePatches") or []:
        spec = patch.get("trainingRuntimeSpec", {}).get("template", {}).get("spec", {})
        for change in spec.get("replicatedJobs") or []:
            if change["name"] == NODE:
                template = change.get("template", {}).get("spec", {}).get("template", {})
                pod = _merged(pod, template)
    trainer = job["spec"].get("trainer") or {}
    (node,) = [c for c in pod["spec"]["containers"] if c["name"] == NODE]
    for key, field_name in (("image", "image"), ("command", "command"), ("args", "args")):
        if key in trainer:
            node[field_name] = copy.deepcopy(trainer[key])
    if "env" in trainer:
        node["env"] = _merged(node.get("env") or [], trainer["env"])
    if "resourcesPerNode" in trainer:
        node["resources"] = copy.deepcopy(trainer["resourcesPerNode"])
    return pod


def permanent_exit_codes(runtime: Mapping[str, Any]) -> set[int]:
    """The exit codes of the ``node`` container that fail the run under ``runtime``: the values
    of its ``FailJob`` ``In`` rules (any other failure of the Job restarts the JobSet)."""
    (replicated,) = [
        r for r in runtime["spec"]["template"]["spec"]["replicatedJobs"] if r["name"] == NODE
    ]
    policy = replicated["template"]["spec"].get("podFailurePolicy") or {}
    codes: set[int] = set()
    for rule in policy.get("rules") or []:
        exits = rule.get("onExitCodes") or {}
        if rule.get("action") == "FailJob" and exits.get("operator") == "In":
            codes |= set(exits.get("values") or [])
    return codes


def _merged(base: Any, patch: Any, key: str = "") -> Any:
    """``patch`` merged into ``base`` (see :func:`trainer_pod`); ``key``: the field holding
    them."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for name, value in patch.items():
            out[name] = _merged(base[name], value, name) if name in base else copy.deepcopy(value)
        return out
    merge_key = _MERGE_KEYS.get(key, "name")
    keyed = isinstance(base, list) and isinstance(patch, list) and key not in _REPLACED
    keyed = keyed and all(isinstance(i, dict) and merge_key in i for i in [*base, *patch])
    if keyed:
        out = list(base)
        for item in patch:
            where = [i for i, old in enumerate(out) if old[merge_key] == item[merge_key]]
            if where:
                out[where[0]] = _merged(out[where[0]], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


_MERGE_KEYS = {"volumeMounts": "mountPath"}
"""Lists whose strategic-merge key is not ``name``."""
_REPLACED = ("tolerations",)
"""Lists a strategic merge replaces whole."""
