"""Creating a job (a PyTorchJob or a TrainJob) or reattaching to the one of that name, and
deleting it.

The job is created under its own ``metadata.name``, which the caller derives deterministically
from the run. When that name exists already (HTTP 409, which the clients wrap in a
``RuntimeError`` whose ``__cause__`` has ``.status == 409``) the job is read back and the
launcher reattaches to it instead of starting a second; a job that is being deleted is refused.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from crosskd.k8s.result import LauncherError
from crosskd.k8s.status import http_status

if TYPE_CHECKING:
    from crosskd.k8s.kinds import JobKind

logger = logging.getLogger(__name__)


def create_or_reattach(client: Any, job: Any, kind: JobKind, request_timeout: float) -> bool:
    """Create the job; on 409 read it back. Returns whether the launcher reattached.

    Args:
        client: The client of ``kind``'s API to create and read with.
        job: The job (``kind``'s model), its ``metadata.name`` and ``metadata.namespace`` set.
        kind: The job's API.
        request_timeout: Seconds the read-back request may take.

    Raises:
        LauncherError: The API refused the job (not 409), reading an existing job back failed,
            or the existing job is being deleted.
    """
    name, namespace = job.metadata.name, job.metadata.namespace
    where = f"{kind.kind} {namespace}/{name}"
    try:
        client.create_job(job=job, namespace=namespace)
    except RuntimeError as exc:
        if http_status(exc) != 409:
            raise LauncherError(f"submitting {where} failed: {exc}") from exc
        try:
            existing = client.get_job(name, namespace, timeout=request_timeout)
        except Exception as read_exc:
            raise LauncherError(
                f"{where} exists (409) but reading it back failed: {read_exc}"
            ) from read_exc
        meta = existing.metadata
        if meta is not None and meta.deletion_timestamp is not None:
            raise LauncherError(
                f"{where} exists but is being deleted (since {meta.deletion_timestamp}); submit "
                "again once it is gone."
            ) from exc
        created = getattr(meta, "creation_timestamp", None)
        logger.warning(
            "%s exists already (created %s): reattaching to it, not starting a second",
            where,
            created,
        )
        return True
    logger.info("%s created", where)
    return False


def delete_job(client: Any, name: str, namespace: str, kind: JobKind) -> str | None:
    """Delete the job; returns None on success (or 404: it is gone already), else what went
    wrong."""
    try:
        client.delete_job(name, namespace)
    except Exception as exc:
        if http_status(exc) == 404:
            return None
        return str(exc)
    logger.info("%s %s/%s deleted", kind.kind, namespace, name)
    return None


def delete_finished(client: Any, name: str, namespace: str, kind: JobKind) -> None:
    """Delete a job that has finished (``delete_when_done``); a failure is only logged."""
    problem = delete_job(client, name, namespace, kind)
    if problem:
        logger.warning(
            "deleting the finished %s %s/%s failed: %s", kind.kind, namespace, name, problem
        )
