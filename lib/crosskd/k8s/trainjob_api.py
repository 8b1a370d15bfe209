"""TrainJobs through the Kubernetes API: the client the launcher submits a TrainJob with, and the
TrainJob it submits.

:class:`TrainJobClient` has the surface of ``kubeflow-training``'s ``TrainingClient`` that the
launcher uses (``create_job``, ``get_job``, ``delete_job``, ``core_api``), over the
``trainer.kubeflow.org/v1alpha1`` ``trainjobs`` custom-object paths, and raises as it does: a
``RuntimeError`` whose ``__cause__`` is the ``ApiException`` (with its HTTP ``status``). The
objects are the Trainer API's own models (``kubeflow_trainer_api``, the package the ``kubeflow``
SDK builds on).

**Why not the ``kubeflow`` SDK's ``TrainerClient``** (checked against ``kubeflow`` 0.5.0):

* ``train()`` builds the TrainJob itself from the SDK's trainer types (a function, a container,
  a built-in trainer) and options; it cannot submit a rendered TrainJob manifest as it is, and
  the crosskd job needs ``runtimePatches`` and ``spec.trainer`` fields together;
* its ``get_job()`` gives the SDK's summary (a ``status`` string of Created, Running, Complete,
  Failed): the conditions' reasons and messages are gone, so a failure cannot be explained, and
  each read also fetches the runtime and lists the pods (more requests, more RBAC);
* its constructor reads a ConfigMap in ``kubeflow-system`` (RBAC the launcher has no need for),
  ``wait_for_job_status`` takes whole seconds and cannot be cancelled, ``get_job_logs`` opens
  one pod's stream and does not follow a restarted node;
* both it and ``kubeflow-training`` install into the ``kubeflow`` package (``kubeflow/__init__.py``)
  while crosskd needs ``kubeflow-training`` for the PyTorchJob.

Node 0's pod (whose log the launcher follows) is the one the JobSet labels with the TrainJob's
name, the replicated job ``node``, Job index 0 and completion index 0
(:func:`node0_selector`).
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping
from typing import Any

from kubeflow_trainer_api import models as tr
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from crosskd.errors import ConfigError
from crosskd.k8s.client import api_client
from crosskd.k8s.manifest import check_name, dropped_keys
from crosskd.k8s.trainjob import API_VERSION, NODE

logger = logging.getLogger(__name__)

GROUP, VERSION = API_VERSION.split("/")
PLURAL = "trainjobs"
KIND = "TrainJob"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
"""The label JobSet puts on its pods: the JobSet's name, which is the TrainJob's."""
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
"""The node's rank within the replicated job ``node`` (the torch plugin's ``PET_NODE_RANK``)."""


class TrainJobClient:
    """TrainJobs in a namespace, with the calls of ``TrainingClient`` the launcher makes.

    Args:
        namespace: The default namespace (each call names its own).
        api: The Kubernetes API client; by default :func:`crosskd.k8s.client.api_client` (the
            pod's service account inside a cluster, else the kube-config).
    """

    def __init__(self, namespace: str = "default", *, api: k8s.ApiClient | None = None) -> None:
        api = api or api_client()
        self.namespace = namespace
        self.custom_api = k8s.CustomObjectsApi(api)
        self.core_api = k8s.CoreV1Api(api)

    def create_job(self, job: tr.TrainerV1alpha1TrainJob, namespace: str | None = None) -> None:
        """Create ``job`` in ``namespace`` (default: the client's).

        Raises:
            RuntimeError: The API refused it; ``__cause__`` is the ``ApiException`` (409: a
                TrainJob of that name exists).
        """
        where = f"{namespace or self.namespace}/{job.metadata.name}"
        body = self.custom_api.api_client.sanitize_for_serialization(job.to_dict())
        try:
            self.custom_api.create_namespaced_custom_object(
                GROUP, VERSION, namespace or self.namespace, PLURAL, body
            )
        except Exception as exc:  # the launcher reads the HTTP status from __cause__
            raise RuntimeError(f"creating {KIND} {where} failed: {_reason(exc)}") from exc
        logger.debug("%s %s created", KIND, where)

    def get_job(
        self, name: str, namespace: str | None = None, timeout: float | None = None
    ) -> tr.TrainerV1alpha1TrainJob:
        """The TrainJob ``name`` as the API has it now (status included); ``timeout``: seconds
        the request may take.

        Raises:
            RuntimeError: Reading it failed; ``__cause__`` is the ``ApiException`` (404: gone),
                or the connection's error.
            ValueError: The API's answer is not a TrainJob the Trainer API's models can read
                (a newer Trainer's, say): reading it again would not help.
        """
        where = f"{namespace or self.namespace}/{name}"
        try:
            found = self.custom_api.get_namespaced_custom_object(
                GROUP, VERSION, namespace or self.namespace, PLURAL, name, _request_timeout=timeout
            )
        except Exception as exc:  # the launcher reads the HTTP status from __cause__
            raise RuntimeError(f"reading {KIND} {where} failed: {_reason(exc)}") from exc
        try:
            return tr.TrainerV1alpha1TrainJob.from_dict(found)
        except ValidationError as exc:
            raise ValueError(
                f"{KIND} {where} as the API gave it does not fit kubeflow_trainer_api's model "
                f"({_first_error(exc)}); is the Trainer newer than that package?"
            ) from exc

    def delete_job(self, name: str, namespace: str | None = None) -> None:
        """Delete the TrainJob ``name`` and, in the background, what it owns (its JobSet, the
        JobSet's Jobs and pods).

        Raises:
            RuntimeError: The API refused it; ``__cause__`` is the ``ApiException`` (404: gone).
        """
        where = f"{namespace or self.namespace}/{name}"
        try:
            self.custom_api.delete_namespaced_custom_object(
                GROUP,
                VERSION,
                namespace or self.namespace,
                PLURAL,
                name,
                body=k8s.V1DeleteOptions(propagation_policy="Background"),
            )
        except Exception as exc:  # the launcher reads the HTTP status from __cause__
            raise RuntimeError(f"deleting {KIND} {where} failed: {_reason(exc)}") from exc


def trainjob_to_submit(
    job: Mapping[str, Any] | tr.TrainerV1alpha1TrainJob, namespace: str
) -> tr.TrainerV1alpha1TrainJob:
    """A copy of ``job`` as the Trainer API's model with ``metadata.namespace`` set to
    ``namespace`` (and, on a model that leaves them unset, ``apiVersion`` and ``kind``).

    Raises:
        ConfigError: ``job`` is not a ``trainer.kubeflow.org/v1alpha1`` TrainJob, is incomplete,
            has fields the model would drop, has no DNS-1035 ``metadata.name`` (at most 63
            characters) or names another namespace.
    """
    if isinstance(job, tr.TrainerV1alpha1TrainJob):
        model = job.model_copy(deep=True)  # the launcher sets metadata.namespace on its own copy
        given = (model.api_version or API_VERSION, model.kind or KIND)
        if given != (API_VERSION, KIND):
            raise ConfigError(
                f"the TrainJob model has apiVersion {given[0]!r} and kind {given[1]!r}; leave "
                f"them unset or give {API_VERSION} {KIND}."
            )
        model.api_version, model.kind = API_VERSION, KIND
    else:
        model = _parsed(job)
    meta = model.metadata
    check_name(KIND, meta.name if meta else None, meta.namespace if meta else None, namespace)
    model.metadata.namespace = namespace
    return model


def trainjob_to_manifest(job: tr.TrainerV1alpha1TrainJob) -> dict[str, Any]:
    """The camelCase manifest of ``job``, as ``kubectl`` would read it (no None values)."""
    return k8s.ApiClient().sanitize_for_serialization(job.to_dict())


def node0_selector(job: tr.TrainerV1alpha1TrainJob) -> str:
    """The label selector of the pod of node 0 of ``job`` (rank 0 runs there)."""
    return (
        f"{JOBSET_NAME_LABEL}={job.metadata.name},{REPLICATED_JOB_LABEL}={NODE},"
        f"{JOB_INDEX_LABEL}=0,{COMPLETION_INDEX_LABEL}=0"
    )


def trainjob_progress(job: tr.TrainerV1alpha1TrainJob) -> str:
    """What the TrainJob's status says besides its conditions, as a short phrase: its child
    Jobs (``jobsStatus``: active, ready, succeeded, failed, suspended) and, when the training
    code reports it to the Trainer (crosskd's does not yet), the percentage done
    (``trainerStatus``; not its time estimate, which would change at every read); ``""`` when
    it says nothing yet."""
    status = job.status
    if status is None:
        return ""
    parts = []
    for child in status.jobs_status or []:
        counts = ", ".join(
            f"{getattr(child, key)} {key}"
            for key in ("active", "ready", "succeeded", "failed", "suspended")
            if getattr(child, key)
        )
        parts.append(f"jobs {child.name}: {counts or 'none yet'}")
    trainer = status.trainer_status
    if trainer is not None and trainer.progress_percentage is not None:
        parts.append(f"trainer {trainer.progress_percentage}% done")
    return "; ".join(parts)


def _parsed(job: Any) -> tr.TrainerV1alpha1TrainJob:
    """The manifest ``job`` as the model; a manifest whose fields the model would drop is
    refused."""
    if not isinstance(job, Mapping):
        raise ConfigError(
            f"the job to submit is a {type(job).__name__}; give a TrainJob manifest (a dict) or "
            "a kubeflow_trainer_api TrainerV1alpha1TrainJob."
        )
    if job.get("apiVersion") != API_VERSION or job.get("kind") != KIND:
        raise ConfigError(
            f"the job to submit has apiVersion {job.get('apiVersion')!r} and kind "
            f"{job.get('kind')!r}, not {API_VERSION} {KIND}."
        )
    body = {key: value for key, value in copy.deepcopy(dict(job)).items() if key != "status"}
    try:
        model = tr.TrainerV1alpha1TrainJob.from_dict(body)
    except ValidationError as exc:  # a required field is missing or of the wrong type
        raise ConfigError(
            f"the TrainJob manifest is malformed: {_first_error(exc)}; compare it with "
            "`crosskd job render --kind trainjob`."
        ) from exc
    dropped = dropped_keys(body, trainjob_to_manifest(model))
    if dropped:
        raise ConfigError(
            f"the TrainJob manifest has fields the {API_VERSION} model does not know, which "
            f"would be dropped on submission: {', '.join(dropped[:10])}; fix their spelling."
        )
    return model


def _first_error(exc: ValidationError) -> str:
    """The first of pydantic's errors: ``field 'a.b': <message>`` (the field's place within
    the innermost object: the models nest)."""
    first = exc.errors()[0]
    return f"field {'.'.join(str(part) for part in first['loc'])!r}: {first['msg']}"


def _reason(exc: BaseException) -> str:
    """An API error in a few words: ``409 Conflict: <the Status's message>`` for an
    ``ApiException``, else the error itself."""
    if not isinstance(exc, ApiException):
        return f"{type(exc).__name__}: {exc}"
    try:
        message = json.loads(exc.body or "{}").get("message") or ""
    except (ValueError, AttributeError):
        message = str(exc.body or "")
    return f"{exc.status} {exc.reason}: {message}".rstrip(": ")
