"""The two job APIs a training run can go to, and what differs between them.

The launcher's contract (:mod:`crosskd.k8s.launcher`) is the same for both; a :class:`JobKind`
holds the rest: how the job is rendered from a :class:`~crosskd.k8s.job.JobConfig`, what else
it needs in the namespace, how it is checked and kept as YAML, the condition that means
success, the pod and container whose log is followed, what its status says of progress, the
client that speaks its API. Each line below: the PyTorchJob's | the TrainJob's.

* API: ``kubeflow.org/v1`` ``pytorchjobs`` | ``trainer.kubeflow.org/v1alpha1`` ``trainjobs``;
* client: ``kubeflow-training``'s ``TrainingClient`` |
  :class:`~crosskd.k8s.trainjob_api.TrainJobClient`;
* success: the condition ``Succeeded`` | ``Complete``; failure: ``Failed`` for both (a
  TrainJob's copied from its JobSet);
* log of: the Master (worker 0 when there is none), container ``pytorch`` | node 0 (found by
  JobSet's labels), container ``node``;
* progress: ``status.replicaStatuses`` | ``status.jobsStatus`` and ``status.trainerStatus``;
* also in the namespace: nothing | the ``crosskd-torch`` TrainingRuntime.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from kubeflow.training import KubeflowOrgV1PyTorchJob, TrainingClient
from kubeflow_trainer_api import models as tr

from crosskd.errors import ConfigError
from crosskd.k8s import JOB_KINDS
from crosskd.k8s.job import JobConfig, job_manifest
from crosskd.k8s.logs import MASTER_CONTAINER, pytorchjob_log_selector
from crosskd.k8s.manifest import job_to_submit, to_manifest
from crosskd.k8s.trainjob import API_VERSION as TRAINJOB_API_VERSION
from crosskd.k8s.trainjob import NODE, runtime_manifest, trainjob_manifest
from crosskd.k8s.trainjob_api import (
    TrainJobClient,
    node0_selector,
    trainjob_progress,
    trainjob_to_manifest,
    trainjob_to_submit,
)


@dataclasses.dataclass(frozen=True)
class JobKind:
    """One job API, as the launcher needs to know it."""

    kind: str
    """The object's ``kind``, as messages name the job."""
    api_version: str
    """Its ``apiVersion``."""
    resource: str
    """Its ``kubectl`` resource name (``kubectl delete <resource> <name>``)."""
    success: str
    """The condition type that means the job succeeded (with status ``"True"``)."""
    container: str
    """The container of the followed pod whose log is streamed."""
    model: type
    """The client library's model of the object."""
    client_type: type
    """The client class that speaks its API."""
    to_submit: Callable[[Any, str], Any]
    """``(job, namespace)`` -> the model to create, checked (raises ``ConfigError``)."""
    to_manifest: Callable[[Any], dict[str, Any]]
    """The model -> its camelCase manifest."""
    log_selector: Callable[[Any], str]
    """The model -> the label selector of the pod whose log is followed (rank 0's)."""
    progress: Callable[[Any], str]
    """The job as read -> what its status says besides conditions (``""``: nothing yet)."""
    render: Callable[[JobConfig], dict[str, Any]]
    """A :class:`~crosskd.k8s.job.JobConfig` -> the job's manifest."""
    support: Callable[[], list[dict[str, Any]]]
    """The objects the job needs in its namespace besides its ConfigMap and Secrets (a
    TrainJob's ``crosskd-torch`` TrainingRuntime), installed once per namespace
    (``manifests/``); ``crosskd job run-local`` reads them."""

    def new_client(self, namespace: str) -> Any:
        """A client of this API for ``namespace`` from the kube-config, or the pod's service
        account inside a cluster."""
        return self.client_type(namespace=namespace)


def _pytorchjob_progress(job: KubeflowOrgV1PyTorchJob) -> str:
    """The replicas' counts (``status.replicaStatuses``): ``Master: 1 active; Worker: ...``."""
    statuses = (job.status.replica_statuses if job.status else None) or {}
    parts = []
    for replica, status in sorted(statuses.items()):
        counts = ", ".join(
            f"{getattr(status, key)} {key}"
            for key in ("active", "succeeded", "failed")
            if getattr(status, key, None)
        )
        parts.append(f"{replica}: {counts or 'none yet'}")
    return "; ".join(parts)


PYTORCHJOB = JobKind(
    kind="PyTorchJob",
    api_version="kubeflow.org/v1",
    resource="pytorchjob",
    success="Succeeded",
    container=MASTER_CONTAINER,
    model=KubeflowOrgV1PyTorchJob,
    client_type=TrainingClient,
    to_submit=job_to_submit,
    to_manifest=to_manifest,
    log_selector=pytorchjob_log_selector,
    progress=_pytorchjob_progress,
    render=job_manifest,
    support=lambda: [],
)
"""The Training Operator's PyTorchJob (:mod:`crosskd.k8s.job`)."""

TRAINJOB = JobKind(
    kind="TrainJob",
    api_version=TRAINJOB_API_VERSION,
    resource="trainjob",
    success="Complete",
    container=NODE,
    model=tr.TrainerV1alpha1TrainJob,
    client_type=TrainJobClient,
    to_submit=trainjob_to_submit,
    to_manifest=trainjob_to_manifest,
    log_selector=node0_selector,
    progress=trainjob_progress,
    render=trainjob_manifest,
    support=lambda: [runtime_manifest()],
)
"""Kubeflow Trainer v2's TrainJob (:mod:`crosskd.k8s.trainjob`)."""

KINDS = dict(zip(JOB_KINDS, (PYTORCHJOB, TRAINJOB), strict=True))
"""The kinds by their :data:`crosskd.k8s.JOB_KINDS` name."""


def kind_of(job: Mapping[str, Any] | Any) -> JobKind:
    """The kind of ``job``: a manifest (by its ``apiVersion`` and ``kind``) or a model.

    Raises:
        ConfigError: ``job`` is neither a PyTorchJob nor a TrainJob.
    """
    for kind in KINDS.values():
        if isinstance(job, kind.model):
            return kind
        if isinstance(job, Mapping) and (job.get("apiVersion"), job.get("kind")) == (
            kind.api_version,
            kind.kind,
        ):
            return kind
    given = (
        f"apiVersion {job.get('apiVersion')!r} and kind {job.get('kind')!r}"
        if isinstance(job, Mapping)
        else f"a {type(job).__name__}"
    )
    raise ConfigError(
        f"the job to submit has {given}; the launcher submits kubeflow.org/v1 PyTorchJob or "
        f"{TRAINJOB_API_VERSION} TrainJob (a manifest or the client library's model)."
    )


def check_client(kind: JobKind, client: Any) -> None:
    """Refuse a ``client`` that does not speak ``kind``'s API (a ``TrainingClient`` given for a
    TrainJob, say), before anything is submitted."""
    if not isinstance(client, kind.client_type):
        raise ConfigError(
            f"a {kind.kind} is submitted with a {kind.client_type.__name__}, not a "
            f"{type(client).__name__}; pass one, or no client (one is made from the kube-config)."
        )
