"""Waiting on a submitted job (a PyTorchJob or a TrainJob) until it has a final condition, within
one deadline, until SIGTERM.

* **One explicit deadline.** ``wait_timeout`` (seconds) bounds the whole wait, from submission
  to a final condition; there is no separate "until Running" deadline, since GPU clusters may
  keep a job Created/Pending or Suspended (queued) for a long time. ``request_timeout`` bounds
  each API call only. Transient API errors (5xx, 429, a per-request timeout, a refused
  connection) are logged and retried at the next poll; 401/403 end the wait at once.
* **Never a false success.** A result is returned only when the job has its kind's success
  condition (a PyTorchJob's ``Succeeded``, a TrainJob's ``Complete``) with status ``"True"``.
  ``Failed`` raises :class:`~crosskd.k8s.result.JobFailed`
  (its message names the job and the condition's reason and message), the deadline raises
  :class:`~crosskd.k8s.result.JobTimeout` (the job is left running, for a retried launcher to
  reattach), a job that is deleted while the launcher waits (404) raises
  :class:`~crosskd.k8s.result.JobDisappeared`.
* **Cancellation.** On SIGTERM (a cancelled pipeline run, a drained node) the job is deleted
  (unless ``delete_on_sigterm=False``) so no GPUs keep running for a run nobody waits for, then
  :class:`~crosskd.k8s.result.JobCancelled` (exit status 143) is raised. SIGTERM is handled only
  when the wait runs in the main thread (Python delivers signals there); elsewhere the caller
  must cancel by its own means.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from crosskd.k8s.create import delete_job
from crosskd.k8s.result import (
    FINAL_MODEL_URI_ANNOTATION,
    JobCancelled,
    JobDisappeared,
    JobFailed,
    JobResult,
    JobTimeout,
    LauncherError,
)
from crosskd.k8s.status import condition, http_status, is_transient, latest_condition

if TYPE_CHECKING:
    from crosskd.k8s.kinds import JobKind

logger = logging.getLogger(__name__)

_SLEEP_SLICE_S = 0.2  # the wait notices SIGTERM within this long


class SigtermFlag:
    """SIGTERM -> a flag, ``requested`` (a handler that only sets an attribute cannot
    deadlock)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> SigtermFlag:
        """:meth:`install`, for a ``with`` block."""
        self.install()
        return self

    def __exit__(self, *exc_info: object) -> None:
        """:meth:`restore` at the end of the ``with`` block."""
        self.restore()

    def install(self) -> None:
        """Handle SIGTERM from now on (in the main thread only; elsewhere nothing happens)."""
        if threading.current_thread() is not threading.main_thread():
            logger.debug("submit() runs outside the main thread: SIGTERM is not handled")
            return
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed = True

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def restore(self) -> None:
        """Give SIGTERM back to the handler it had before :meth:`install`."""
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False


@dataclasses.dataclass(frozen=True)
class JobWatch:
    """The job being waited on, and what its results say besides its conditions."""

    client: Any
    """The client of the job's API that reads (and on SIGTERM deletes) the job."""
    kind: JobKind
    """The job's API."""
    name: str
    """The job's ``metadata.name``."""
    namespace: str
    """The job's namespace."""
    started: float
    """``time.monotonic()`` when the launcher was called (results count ``elapsed_s`` from it)."""
    reattached: bool
    """Whether the job existed already and the launcher reattached to it."""
    final_model_uri: str | None
    """The final model's URI, given in the result of a job that succeeded."""

    @classmethod
    def of(
        cls,
        client: Any,
        kind: JobKind,
        job: Any,
        started: float,
        reattached: bool,
        final_model_uri: str | None,
    ) -> JobWatch:
        """The watch of ``job`` (``kind``'s model, its name and namespace set);
        ``final_model_uri``, when not given, from the job's
        :data:`~crosskd.k8s.result.FINAL_MODEL_URI_ANNOTATION`."""
        annotations = job.metadata.annotations or {}
        return cls(
            client,
            kind,
            job.metadata.name,
            job.metadata.namespace,
            started,
            reattached,
            final_model_uri or annotations.get(FINAL_MODEL_URI_ANNOTATION),
        )

    @property
    def where(self) -> str:
        """``Kind namespace/name``, as messages name the job."""
        return f"{self.kind.kind} {self.namespace}/{self.name}"

    @property
    def delete_command(self) -> str:
        """The ``kubectl`` command that deletes the job."""
        return f"kubectl -n {self.namespace} delete {self.kind.resource} {self.name}"

    def result(
        self,
        job: Any,
        message: str | None = None,
        *,
        succeeded: bool = False,
        timed_out: bool = False,
    ) -> JobResult:
        """The :class:`JobResult` of ``job`` as read last (``None``: unknown): its latest true
        condition, with ``message`` instead of the condition's when given."""
        latest = latest_condition(job) if job is not None else None
        return JobResult(
            name=self.name,
            namespace=self.namespace,
            condition=getattr(latest, "type", None),
            reason=getattr(latest, "reason", None),
            message=message or getattr(latest, "message", None) or "",
            succeeded=succeeded,
            reattached=self.reattached,
            final_model_uri=self.final_model_uri if succeeded else None,
            elapsed_s=time.monotonic() - self.started,
            timed_out=timed_out,
        )


def wait_for_job(
    watch: JobWatch,
    *,
    wait_timeout: float,
    poll_interval: float,
    request_timeout: float,
    cancel: SigtermFlag,
    delete_on_sigterm: bool,
    on_finished: Callable[[], None],
) -> JobResult:
    """Read the job every ``poll_interval`` seconds until it succeeds (module docstring).

    Args:
        watch: The job.
        wait_timeout: Seconds from ``watch.started`` to give up (``math.inf``: never).
        poll_interval: Seconds between two reads of the job.
        request_timeout: Seconds one read may take.
        cancel: Set by SIGTERM: the wait ends with :class:`JobCancelled`.
        delete_on_sigterm: Delete the job when ``cancel`` is set.
        on_finished: Called once the job has succeeded or failed, before the result is returned
            or :class:`JobFailed` raised (the launcher drains the log, deletes the job).

    Returns:
        The :class:`JobResult` of the job that has its kind's success condition.

    Raises:
        JobFailed, JobTimeout, JobDisappeared, JobCancelled: As the module docstring says.
        LauncherError: Reading the job failed for good (e.g. 401, 403).
    """
    deadline = watch.started + wait_timeout
    last_seen: tuple[str | None, str | None, str] | None = None
    while True:
        if cancel.requested:
            raise _cancelled(watch, delete_on_sigterm)
        current, last_error = _read(watch, request_timeout)
        if current is not None:
            last_seen = _log_change(watch, current, last_seen)
            done = _finished(watch, current, on_finished)
            if done is not None:
                return done
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            state = _described(last_seen) if last_seen else "unknown"
            detail = f"; the last read failed: {last_error}" if last_error else ""
            raise JobTimeout(
                f"{watch.where} did not finish within wait_timeout={wait_timeout:g} s "
                f"(last condition: {state}{detail}); it is left running: submit again to "
                f"reattach, or delete it ({watch.delete_command}).",
                watch.result(current, "wait_timeout passed", timed_out=True),
            )
        sleep_unless_cancelled(min(poll_interval, remaining), cancel)


def _read(watch: JobWatch, request_timeout: float) -> tuple[Any | None, BaseException | None]:
    """``(job, None)`` as the API has it now, or ``(None, error)`` after a transient error.

    Raises:
        JobDisappeared: The job is gone (404).
        LauncherError: Any other error that is not transient.
    """
    try:
        return watch.client.get_job(watch.name, watch.namespace, timeout=request_timeout), None
    except Exception as exc:  # classified below
        status = http_status(exc)
        if status == 404:
            raise JobDisappeared(
                f"{watch.where} was deleted while the launcher waited on it "
                "(404); it did not finish. Resubmit to run it again.",
                watch.result(None, "deleted while waiting"),
            ) from exc
        if not is_transient(exc):
            raise LauncherError(
                f"reading {watch.where} failed: {exc}", watch.result(None, str(exc))
            ) from exc
        logger.warning("reading %s failed (retrying): %s", watch.where, exc)
        return None, exc


def _log_change(
    watch: JobWatch, job: Any, last_seen: tuple[str | None, str | None, str] | None
) -> tuple[str | None, str | None, str]:
    """Log the job's latest condition and progress (:attr:`JobKind.progress`) when they differ
    from ``last_seen``; returns them as ``(type, reason, progress)``."""
    latest = latest_condition(job)
    progress = watch.kind.progress(job)
    seen = (getattr(latest, "type", None), getattr(latest, "reason", None), progress)
    if seen != last_seen:
        message = getattr(latest, "message", None)
        logger.info("%s: %s%s", watch.where, _described(seen), f": {message}" if message else "")
    return seen


def _described(seen: tuple[str | None, str | None, str]) -> str:
    """``(type, reason, progress)`` as words: ``Running (PyTorchJobRunning) [Master: 1
    active]``, ``no condition yet [jobs node: 1 active]``."""
    kind, reason, progress = seen
    return (
        f"{kind or 'no condition yet'}{f' ({reason})' if reason else ''}"
        f"{f' [{progress}]' if progress else ''}"
    )


def _finished(watch: JobWatch, job: Any, on_finished: Callable[[], None]) -> JobResult | None:
    """The result of ``job`` when it has succeeded, ``None`` while it has not finished.

    Raises:
        JobFailed: The job has the condition ``Failed``.
    """
    failed = condition(job, "Failed")
    if failed is not None:
        on_finished()
        raise JobFailed(
            f"{watch.where} failed: {failed.reason or 'no reason given'}: "
            f"{failed.message or 'no message'}",
            dataclasses.replace(
                watch.result(job),
                condition="Failed",
                reason=failed.reason,
                message=failed.message or "",
            ),
        )
    succeeded = condition(job, watch.kind.success)
    if succeeded is None:
        return None
    on_finished()
    done = dataclasses.replace(
        watch.result(job, succeeded=True),
        condition=watch.kind.success,
        reason=succeeded.reason,
        message=succeeded.message or "",
    )
    logger.info("%s succeeded after %.0f s", watch.where, done.elapsed_s)
    return done


def _cancelled(watch: JobWatch, delete: bool) -> JobCancelled:
    """The error that ends a wait cancelled by SIGTERM, once the job is deleted when
    ``delete``."""
    if not delete:
        return JobCancelled(
            f"SIGTERM: stopped waiting on {watch.where}, which is left running "
            "(delete_on_sigterm is off).",
            watch.result(None, "cancelled; job left running"),
        )
    problem = delete_job(watch.client, watch.name, watch.namespace, watch.kind)
    if problem:
        return JobCancelled(
            f"SIGTERM: deleting {watch.where} failed ({problem}); it may still hold "
            f"GPUs: {watch.delete_command}",
            watch.result(None, "cancelled; deletion failed"),
        )
    return JobCancelled(
        f"SIGTERM: {watch.where} was deleted (the run was cancelled).",
        watch.result(None, "cancelled; job deleted"),
    )


def sleep_unless_cancelled(seconds: float, cancel: SigtermFlag) -> None:
    """Sleep ``seconds``, waking within 0.2 s when SIGTERM comes."""
    end = time.monotonic() + seconds
    while not cancel.requested:
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, _SLEEP_SLICE_S))
