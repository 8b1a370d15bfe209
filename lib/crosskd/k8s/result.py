"""How a job (a PyTorchJob or a TrainJob) ended, and the errors of a job that did not succeed.

:class:`JobResult` is the one answer of both executors of a job: the cluster launcher
(:func:`crosskd.k8s.launcher.submit`) and the local executor (:mod:`crosskd.k8s.local`). A job
that did not succeed raises a :class:`LauncherError` carrying the result so far.
"""

from __future__ import annotations

import dataclasses

from crosskd.errors import CrosskdError

FINAL_MODEL_URI_ANNOTATION = "crosskd/final-model-uri"
"""Optional job annotation naming the final model's URI, returned in :class:`JobResult`."""


@dataclasses.dataclass(frozen=True)
class JobResult:
    """How a job ended (or stood when its executor stopped waiting)."""

    name: str
    """The job's ``metadata.name``."""
    namespace: str
    """The job's namespace (``local`` for a job run on this machine)."""
    condition: str | None
    """The job's latest condition whose status is ``"True"`` (a PyTorchJob's ``Succeeded``,
    ``Failed``, ``Running``, ``Created``, ``Restarting``; a TrainJob's ``Complete``, ``Failed``,
    ``Suspended``), or ``None`` when it has none yet."""
    reason: str | None
    """That condition's ``reason`` (e.g. ``PyTorchJobFailed``), or ``None``."""
    message: str
    """That condition's ``message``, or a sentence of the executor's own."""
    succeeded: bool
    """``True`` only when the job has its kind's success condition (``Succeeded``,
    ``Complete``) = ``"True"`` (locally: the Master, or every node, exited 0)."""
    reattached: bool = False
    """``True`` when the job existed already (409) and the launcher reattached to it."""
    final_model_uri: str | None = None
    """The final model's URI when the job succeeded and the caller gave one or the job carries
    the :data:`FINAL_MODEL_URI_ANNOTATION` annotation, else ``None``."""
    elapsed_s: float = 0.0
    """Seconds from the executor's call to this result."""
    exit_codes: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """Local jobs: per replica (``master-0``, ``worker-0``, ...) the exit codes of its runs, in
    order (a negative code: killed by that signal); empty for a job on a cluster."""
    timed_out: bool = False
    """Whether the wait ended because its time ran out (a cluster's job is left running, a
    local job's replicas are stopped)."""


class LauncherError(CrosskdError):
    """The launcher could not submit a job or the job did not succeed; ``result`` says how far."""

    def __init__(self, message: str, result: JobResult | None = None) -> None:
        super().__init__(message)
        self.result = result


class JobFailed(LauncherError):
    """The job reached the condition ``Failed``."""

    exit_code = 1


class JobTimeout(LauncherError):
    """``wait_timeout`` passed before the job finished (a cluster's job is left running, a local
    job's replicas are stopped)."""

    exit_code = 1


class JobDisappeared(LauncherError):
    """The job was deleted (404) while the launcher waited on it."""

    exit_code = 1


class JobCancelled(LauncherError):
    """The launcher got SIGTERM; its job was deleted unless ``delete_on_sigterm=False``."""

    exit_code = 143
