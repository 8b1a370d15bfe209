"""Creating a PyTorchJob or reattaching to the one of that name, and deleting it.

The job is created under its own ``metadata.name``, which the caller derives deterministically
from the run. When that name exists already (HTTP 409, which ``TrainingClient.create_job`` wraps
in a ``RuntimeError`` whose ``__cause__`` has ``.status == 409``) the job is read back and the
launcher reattaches to it instead of starting a second; a job that is being deleted is refused.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from crosskd.k8s.result import LauncherError
from crosskd.k8s.status import http_status

if TYPE_CHECKING:
    from kubeflow.training import KubeflowOrgV1PyTorchJob, TrainingClient

logger = logging.getLogger(__name__)


def create_or_reattach(
    client: TrainingClient, job: KubeflowOrgV1PyTorchJob, request_timeout: float
) -> bool:
    """Create the job; on 409 read it back. Returns whether the launcher reattached.

    Args:
        client: The ``TrainingClient`` to create and read with.
        job: The job, its ``metadata.name`` and ``metadata.namespace`` set.
        request_timeout: Seconds the read-back request may take.

    Raises:
        LauncherError: The API refused the job (not 409), reading an existing job back failed,
            or the existing job is being deleted.
    """
    name, namespace = job.metadata.name, job.metadata.namespace
    where = f"{namespace}/{name}"
    try:
        client.create_job(job=job, namespace=namespace)
    except RuntimeError as exc:
        if http_status(exc) != 409:
            raise LauncherError(f"submitting PyTorchJob {where} failed: {exc}") from exc
        try:
            existing = client.get_job(name, namespace, timeout=request_timeout)
        except Exception as read_exc:
            raise LauncherError(
                f"PyTorchJob {where} exists (409) but reading it back failed: {read_exc}"
            ) from read_exc
        meta = existing.metadata
        if meta is not None and meta.deletion_timestamp is not None:
            raise LauncherError(
                f"PyTorchJob {where} exists but is being deleted (since "
                f"{meta.deletion_timestamp}); submit again once it is gone."
            ) from exc
        created = getattr(meta, "creation_timestamp", None)
        logger.warning(
            "PyTorchJob %s exists already (created %s): reattaching to it, not starting a second",
            where,
            created,
        )
        return True
    logger.info("PyTorchJob %s created", where)
    return False


def delete_job(client: TrainingClient, name: str, namespace: str) -> str | None:
    """Delete the job; returns None on success (or 404: it is gone already), else what went
    wrong."""
    try:
        client.delete_job(name, namespace)
    except Exception as exc:
        if http_status(exc) == 404:
            return None
        return str(exc)
    logger.info("PyTorchJob %s/%s deleted", namespace, name)
    return None


def delete_finished(client: TrainingClient, name: str, namespace: str) -> None:
    """Delete a job that has finished (``delete_when_done``); a failure is only logged."""
    problem = delete_job(client, name, namespace)
    if problem:
        logger.warning(
            "deleting the finished PyTorchJob %s/%s failed: %s", namespace, name, problem
        )
