"""Reading the Kubernetes API's answers: the HTTP status behind an SDK error (and whether the
call may be retried), and a job's conditions (a PyTorchJob's or a TrainJob's: both list
``type``, ``status``, ``reason``, ``message``)."""

from __future__ import annotations

from typing import Any


def http_status(exc: BaseException) -> int | None:
    """The HTTP status behind an SDK error (``ApiException`` or the ``RuntimeError`` around it,
    as ``TrainingClient`` and ``TrainJobClient`` raise), or ``None`` when there is none (a
    connection error)."""
    for candidate in (exc, exc.__cause__):
        status = getattr(candidate, "status", None)
        if isinstance(status, int):
            return status
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether an API error may pass by itself (5xx, 429, a per-request timeout, a refused or
    reset connection): the call is retried at the next poll."""
    status = http_status(exc)
    if status is None:
        return isinstance(exc, TimeoutError | RuntimeError | OSError)
    return status == 429 or status >= 500


def true_conditions(job: Any) -> list[Any]:
    """The conditions of ``job`` (a ``KubeflowOrgV1PyTorchJob`` or ``TrainerV1alpha1TrainJob``)
    whose status is ``"True"``, in the order its controller lists them."""
    status = getattr(job, "status", None)
    conditions = getattr(status, "conditions", None) or []
    return [c for c in conditions if str(getattr(c, "status", "")) == "True"]


def condition(job: Any, kind: str) -> Any | None:
    """The true condition of type ``kind`` (``Succeeded``, ``Failed``, ...) of ``job``, or
    ``None``."""
    for found in true_conditions(job):
        if found.type == kind:
            return found
    return None


def latest_condition(job: Any) -> Any | None:
    """The last true condition of ``job``, or ``None`` when it has none yet."""
    conditions = true_conditions(job)
    return conditions[-1] if conditions else None
