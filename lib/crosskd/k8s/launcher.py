"""Submit a PyTorchJob or a TrainJob, wait for it, stream rank 0's log: a launcher that never
lies.

:func:`submit` is what ``crosskd job submit`` and the KFP training component call. It composes
modules of one concern each, whose docstrings hold their part of the contract:

* :mod:`crosskd.k8s.kinds`: the two job APIs, ``kubeflow.org/v1`` PyTorchJob (the Training
  Operator, through ``kubeflow-training``'s ``TrainingClient``) and
  ``trainer.kubeflow.org/v1alpha1`` TrainJob (Kubeflow Trainer v2, through
  :class:`~crosskd.k8s.trainjob_api.TrainJobClient`), and what differs between them; the
  contract below holds for both.
* :mod:`crosskd.k8s.manifest`, :mod:`crosskd.k8s.trainjob_api`: the job is checked (a fixed
  DNS-1035 name, no field the client library would drop) and its manifest (camelCase, as
  ``kubectl`` would read it) is written to ``manifest_path`` before submission when one is
  given.
* :mod:`crosskd.k8s.create`: **one job per run**: the job is created under its own name, and a
  retried launcher whose job exists (409) reattaches to it instead of starting a second.
* :mod:`crosskd.k8s.logs`: rank 0's log (a PyTorchJob's Master, a TrainJob's node 0) is
  streamed line by line, across container restarts and recreated pods.
* :mod:`crosskd.k8s.wait`: **one explicit deadline** (``wait_timeout``, queueing included),
  **never a false success** (only the kind's success condition returns: ``Succeeded``,
  ``Complete``), and **cancellation**
  (SIGTERM deletes the job unless ``delete_on_sigterm=False``). A launcher that merely dies
  (SIGKILL, OOM, a lost node) leaves the job alone: the retried launcher reattaches.
* :mod:`crosskd.k8s.result`: the :class:`~crosskd.k8s.result.JobResult` returned, and the
  :class:`~crosskd.k8s.result.LauncherError` raised otherwise (a
  :class:`~crosskd.errors.CrosskdError`, so the CLI prints one line and exits non-zero).

**Cleanup** of a PyTorchJob is left to its ``runPolicy.ttlSecondsAfterFinished`` unless
``delete_when_done=True`` asks to delete the job once it has finished. A TrainJob has no TTL
(:mod:`crosskd.k8s.trainjob`): it stays, its pods exited, until ``delete_when_done`` or
someone deletes it.

Everything here is tested against ``tests/k8s_fake.py``, a fake that speaks the subset of the
Kubernetes REST API used here (no API server runs in the tests).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from crosskd.errors import ConfigError
from crosskd.k8s.create import create_or_reattach, delete_finished
from crosskd.k8s.kinds import JobKind, check_client, kind_of
from crosskd.k8s.logs import LogFollower, log_to_pod_logger
from crosskd.k8s.manifest import write_manifest
from crosskd.k8s.result import JobResult
from crosskd.k8s.wait import JobWatch, SigtermFlag, wait_for_job


def submit(
    job: Mapping[str, Any] | Any,
    *,
    namespace: str,
    wait_timeout: float,
    client: Any | None = None,
    manifest_path: str | os.PathLike[str] | None = None,
    delete_on_sigterm: bool = True,
    delete_when_done: bool = False,
    poll_interval: float = 10.0,
    request_timeout: float = 30.0,
    log_sink: Callable[[str], None] | None = None,
    stream_logs: bool = True,
    log_drain_timeout: float = 10.0,
    final_model_uri: str | None = None,
) -> JobResult:
    """Submit ``job`` (or reattach to it) and wait until it succeeds; see the module docstring.

    Args:
        job: A PyTorchJob (``kubeflow.org/v1``) or TrainJob (``trainer.kubeflow.org/v1alpha1``),
            a camelCase manifest or the client library's model, its ``metadata.name`` set and
            deterministic for the run (a DNS-1035 label, at most 63 characters).
        namespace: The namespace to run it in; ``metadata.namespace``, when set, must match.
        wait_timeout: Seconds the whole call may take, submission included, before
            :class:`~crosskd.k8s.result.JobTimeout` (``math.inf`` waits for ever). Queueing
            counts.
        client: The client of the job's API (``TrainingClient`` for a PyTorchJob,
            :class:`~crosskd.k8s.trainjob_api.TrainJobClient` for a TrainJob); by default one
            built from the kube-config or the in-cluster service account.
        manifest_path: Where to keep the submitted manifest as YAML (written before submission).
        delete_on_sigterm: Delete the job when the launcher gets SIGTERM.
        delete_when_done: Delete the job once it has succeeded or failed (else a PyTorchJob's
            ``ttlSecondsAfterFinished`` does; a TrainJob stays).
        poll_interval: Seconds between two reads of the job's status (the log follower looks
            for a new container every ``min(poll_interval, 2)`` seconds).
        request_timeout: Seconds one API request may take (not the wait).
        log_sink: Called with each line (no newline) of rank 0's log; by default the
            ``crosskd.k8s.pod`` logger at INFO.
        stream_logs: Stream rank 0's log at all.
        log_drain_timeout: Seconds the log stream may go on after the job has finished.
        final_model_uri: The final model's URI, returned in the result (else the job's
            :data:`~crosskd.k8s.result.FINAL_MODEL_URI_ANNOTATION` annotation, if any).

    Returns:
        The :class:`~crosskd.k8s.result.JobResult` of a job that has its kind's success
        condition (``Succeeded``, ``Complete``).

    Raises:
        JobFailed: The job has the condition ``Failed``.
        JobTimeout: ``wait_timeout`` passed; the job is left running.
        JobDisappeared: The job was deleted while the launcher waited.
        JobCancelled: SIGTERM came (the job deleted unless ``delete_on_sigterm=False``).
        LauncherError: The API refused the job or the access (e.g. 403, 422), or the job of that
            name is being deleted.
        ConfigError: The job or the arguments are malformed, or ``client`` does not speak its API.
    """
    started = time.monotonic()
    _check_seconds(wait_timeout, poll_interval, request_timeout)
    kind, model, client = _to_submit(job, namespace, client)
    if manifest_path is not None:
        write_manifest(manifest_path, kind.to_manifest(model))
    with SigtermFlag() as cancel, contextlib.ExitStack() as cleanup:
        reattached = create_or_reattach(client, model, kind, request_timeout)
        watch = JobWatch.of(client, kind, model, started, reattached, final_model_uri)
        follower: LogFollower | None = None
        if stream_logs:
            sink = log_sink or log_to_pod_logger
            follower = _follow(watch, model, sink, poll_interval, request_timeout)
            cleanup.callback(follower.stop)
        return wait_for_job(
            watch,
            wait_timeout=wait_timeout,
            poll_interval=poll_interval,
            request_timeout=request_timeout,
            cancel=cancel,
            delete_on_sigterm=delete_on_sigterm,
            on_finished=functools.partial(
                _finished, watch, follower, log_drain_timeout, delete_when_done
            ),
        )


def _to_submit(job: Any, namespace: str, client: Any | None) -> tuple[JobKind, Any, Any]:
    """``job``'s kind, ``job`` as that kind's model to create (checked, in ``namespace``), and
    the client of its API (``client``, else one from the kube-config).

    Raises:
        ConfigError: The job is malformed, or ``client`` does not speak its API.
    """
    kind = kind_of(job)
    model = kind.to_submit(job, namespace)
    client = kind.new_client(namespace) if client is None else client
    check_client(kind, client)
    return kind, model, client


def _follow(
    watch: JobWatch,
    job: Any,
    sink: Callable[[str], None],
    poll_s: float,
    request_timeout: float,
) -> LogFollower:
    """Start following rank 0's log of ``job`` (its kind's model) into ``sink``."""
    follower = LogFollower(
        watch.client,
        watch.name,
        watch.namespace,
        sink,
        poll_s,
        request_timeout,
        watch.kind.log_selector(job),
        watch.kind.container,
    )
    follower.start()
    return follower


def _finished(watch: JobWatch, follower: LogFollower | None, drain_s: float, delete: bool) -> None:
    """The job ended: give its log ``drain_s`` seconds to drain, delete it when ``delete``."""
    if follower is not None:
        follower.finish(drain_s)
    if delete:
        delete_finished(watch.client, watch.name, watch.namespace, watch.kind)


def _check_seconds(wait_timeout: float, poll_interval: float, request_timeout: float) -> None:
    """Refuse a ``wait_timeout`` that is not seconds > 0 (``math.inf``: none), and a
    ``poll_interval`` or ``request_timeout`` that is not seconds > 0."""
    if not isinstance(wait_timeout, int | float) or math.isnan(wait_timeout) or wait_timeout <= 0:
        raise ConfigError(f"wait_timeout is {wait_timeout!r}; give seconds > 0 (math.inf: none).")
    if poll_interval <= 0 or request_timeout <= 0:
        raise ConfigError(
            f"poll_interval ({poll_interval}) and request_timeout ({request_timeout}) must be "
            "seconds > 0."
        )
