"""Submit a PyTorchJob, wait for it, stream its master's logs: a launcher that never lies.

The contract of :func:`submit` (what ``crosskd job submit`` and the KFP training component call):

* **One job per run.** The job is created with ``TrainingClient.create_job`` under its own
  ``metadata.name``, which the caller derives deterministically from the run. When that name
  exists already (HTTP 409, which ``create_job`` wraps in a ``RuntimeError`` whose ``__cause__``
  has ``.status == 409``), the launcher reads the job back and waits on *it*: a retried launcher
  reattaches instead of starting a second job. A job that is being deleted is refused.
* **One explicit deadline.** ``wait_timeout`` (seconds) bounds the whole wait, from submission
  to a final condition; there is no separate "until Running" deadline, since GPU clusters may
  keep a job Created/Pending (queued) for a long time. ``request_timeout`` bounds each API call
  only. Transient API errors (5xx, 429, a per-request timeout, a refused connection) are logged
  and retried at the next poll; 401/403 end the wait at once.
* **Never a false success.** The result is returned only when the job has the condition
  ``Succeeded`` with status ``"True"``. ``Failed`` raises :class:`JobFailed` (its message names
  the job and the condition's reason and message), the deadline raises :class:`JobTimeout`
  (the job is left running, for a retried launcher to reattach), a job that is deleted while
  the launcher waits (404) raises :class:`JobDisappeared`. All are :class:`LauncherError`, a
  :class:`~crosskd.errors.CrosskdError`, so the CLI prints one line and exits non-zero.
* **Cancellation.** On SIGTERM (a cancelled pipeline run, a drained node) the launcher deletes
  its job (``delete_on_sigterm=True``, the default) so no GPUs keep running for a run nobody
  waits for, then raises :class:`JobCancelled` (exit status 143). A launcher that merely dies
  (SIGKILL, OOM, a lost node) cannot do anything and leaves the job alone: the retried launcher
  reattaches. SIGTERM is handled only when :func:`submit` runs in the main thread (Python
  delivers signals there); elsewhere the caller must cancel by its own means.
* **Logs.** Once the master pod's container runs (pods labelled
  ``training.kubeflow.org/job-name=<name>`` and ``training.kubeflow.org/replica-type=master``;
  in a Worker-only elastic job, which has no Master, ``replica-type=worker`` and
  ``replica-index=0``) its log is streamed with ``CoreV1Api.read_namespaced_pod_log(follow=True,
  _preload_content=False)``, line by line, to ``log_sink`` (the ``crosskd.k8s.pod`` logger by
  default), in a background thread; nothing is kept but the line being assembled. Container
  restarts (a higher ``restartCount``) and recreated pods (a new pod ``uid``, the ``ExitCode``
  restart policy) are followed, each container instance streamed once; a stream that breaks
  while its container still runs is reopened and the lines already given are skipped. A
  container instance that starts and ends between two pod polls (``poll_interval``, at most
  2 s) is not seen, and log lines the kubelet rotated away cannot be replayed.
  ``kubeflow-training``'s ``get_job_logs(follow=True)`` is not used: it returns at once for a
  Pending pod, keeps every line in memory and stops at a container restart.
* **The manifest** that is submitted (camelCase, as ``kubectl`` would read it) is written to
  ``manifest_path`` before submission when one is given.
* **Cleanup** is left to the job's ``runPolicy.ttlSecondsAfterFinished`` unless
  ``delete_when_done=True`` asks to delete the job once it has finished.

Everything here is tested against ``tests/k8s_fake.py``, a fake that speaks the subset of the
Kubernetes REST API used here (no API server runs in the tests).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import os
import re
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from crosskd.errors import ConfigError, CrosskdError

if TYPE_CHECKING:
    from kubeflow.training import KubeflowOrgV1PyTorchJob, TrainingClient

__all__ = [
    "FINAL_MODEL_URI_ANNOTATION",
    "MASTER_CONTAINER",
    "JobCancelled",
    "JobDisappeared",
    "JobFailed",
    "JobResult",
    "JobTimeout",
    "LauncherError",
    "master_pod_selector",
    "submit",
    "to_manifest",
]

logger = logging.getLogger(__name__)
pod_logger = logging.getLogger("crosskd.k8s.pod")

#: The container that runs crosskd in every replica (the Training Operator requires this name).
MASTER_CONTAINER = "pytorch"
#: Optional job annotation naming the final model's URI, returned in :class:`JobResult`.
FINAL_MODEL_URI_ANNOTATION = "crosskd/final-model-uri"

# Label keys and values the Training Operator puts on every pod it creates
# (kubeflow.training.constants; TO pkg/controller.v1/common/job_controller.go).
_JOB_NAME_LABEL = "training.kubeflow.org/job-name"
_REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
_REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
_MASTER_REPLICA_TYPE = "master"

_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_MAX_LINE_BYTES = 64 * 1024  # a longer line (a progress bar without newlines) is cut here
_LOG_POLL_MAX_S = 2.0  # the log follower looks for a new container at least this often
_LOG_READ_TIMEOUT_S = 600.0  # a silent log stream is reopened after this long
_SLEEP_SLICE_S = 0.2  # the wait loop notices SIGTERM within this long


# ----------------------------------------------------------------------------- results, errors


@dataclasses.dataclass(frozen=True)
class JobResult:
    """How a PyTorchJob ended (or stood when the launcher stopped waiting).

    Attributes:
        name: The job's ``metadata.name``.
        namespace: The job's namespace.
        condition: The type of the job's latest condition whose status is ``"True"``
            (``Succeeded``, ``Failed``, ``Running``, ``Created``, ``Restarting``), or ``None``
            when it has none yet.
        reason: That condition's ``reason`` (e.g. ``PyTorchJobFailed``), or ``None``.
        message: That condition's ``message``, or a sentence of the launcher's own.
        succeeded: ``True`` only when the job has the condition ``Succeeded`` = ``"True"``.
        reattached: ``True`` when the job existed already (409) and this launcher reattached.
        final_model_uri: The final model's URI when the caller gave one or the job carries the
            :data:`FINAL_MODEL_URI_ANNOTATION` annotation, else ``None``.
        elapsed_s: Seconds from the call of :func:`submit` to this result.
    """

    name: str
    namespace: str
    condition: str | None
    reason: str | None
    message: str
    succeeded: bool
    reattached: bool = False
    final_model_uri: str | None = None
    elapsed_s: float = 0.0


class LauncherError(CrosskdError):
    """The launcher could not submit a job or the job did not succeed; ``result`` says how far."""

    def __init__(self, message: str, result: JobResult | None = None) -> None:
        super().__init__(message)
        self.result = result


class JobFailed(LauncherError):
    """The job reached the condition ``Failed``."""

    exit_code = 1


class JobTimeout(LauncherError):
    """``wait_timeout`` passed before the job finished; the job is left running."""

    exit_code = 1


class JobDisappeared(LauncherError):
    """The job was deleted (404) while the launcher waited on it."""

    exit_code = 1


class JobCancelled(LauncherError):
    """The launcher got SIGTERM; its job was deleted unless ``delete_on_sigterm=False``."""

    exit_code = 143


# ----------------------------------------------------------------------------- manifest


def to_manifest(job: Mapping[str, Any] | KubeflowOrgV1PyTorchJob) -> dict[str, Any]:
    """The camelCase manifest of ``job`` (``ApiClient().sanitize_for_serialization``), no Nones."""
    from kubernetes.client import ApiClient

    if isinstance(job, Mapping):
        return ApiClient().sanitize_for_serialization(dict(job))
    return ApiClient().sanitize_for_serialization(job)


def _as_model(job: Mapping[str, Any] | KubeflowOrgV1PyTorchJob) -> KubeflowOrgV1PyTorchJob:
    """``job`` as the SDK's model; a manifest whose fields the model would drop is refused."""
    from kubeflow.training import KubeflowOrgV1PyTorchJob
    from kubeflow.training.api_client import ApiClient
    from kubeflow.training.utils.utils import FakeResponse

    if isinstance(job, KubeflowOrgV1PyTorchJob):
        return copy.deepcopy(job)  # the launcher sets metadata.namespace on its own copy
    if not isinstance(job, Mapping):
        raise ConfigError(
            f"the job to submit is a {type(job).__name__}; give a PyTorchJob manifest (a dict) "
            "or a kubeflow.training KubeflowOrgV1PyTorchJob."
        )
    if job.get("apiVersion") != "kubeflow.org/v1" or job.get("kind") != "PyTorchJob":
        raise ConfigError(
            f"the job to submit has apiVersion {job.get('apiVersion')!r} and kind "
            f"{job.get('kind')!r}; the launcher submits kubeflow.org/v1 PyTorchJob only."
        )
    body = {key: value for key, value in job.items() if key != "status"}
    try:
        model = ApiClient().deserialize(FakeResponse(body), "KubeflowOrgV1PyTorchJob")
    except ValueError as exc:  # a required field is missing (spec.pytorchReplicaSpecs, ...)
        raise ConfigError(f"the PyTorchJob manifest is incomplete: {exc}") from exc
    dropped = _dropped_keys(body, to_manifest(model))
    if dropped:
        raise ConfigError(
            "the PyTorchJob manifest has fields the kubeflow.org/v1 model does not know, which "
            f"would be dropped on submission: {', '.join(dropped[:10])}; fix their spelling."
        )
    return model


def _dropped_keys(given: Any, kept: Any, path: str = "") -> list[str]:
    """The key paths of ``given`` (a manifest) that are missing from ``kept`` (its round trip)."""
    out: list[str] = []
    if isinstance(given, Mapping):
        kept_map = kept if isinstance(kept, Mapping) else {}
        for key, value in given.items():
            where = f"{path}.{key}" if path else str(key)
            if value is None:
                continue
            if key not in kept_map:
                out.append(where)
            # Free-form maps (labels, limits, ...) round-trip by construction.
            else:
                out.extend(_dropped_keys(value, kept_map[key], where))
    elif isinstance(given, list) and isinstance(kept, list):
        for index, (item, kept_item) in enumerate(zip(given, kept, strict=False)):
            out.extend(_dropped_keys(item, kept_item, f"{path}[{index}]"))
    return out


def _write_manifest(path: str | os.PathLike[str], manifest: Mapping[str, Any]) -> Path:
    """Write ``manifest`` as YAML to ``path`` atomically; returns the path."""
    import yaml

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(dict(manifest), sort_keys=False, default_flow_style=False)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


# ----------------------------------------------------------------------------- API helpers


def master_pod_selector(name: str, *, has_master: bool = True) -> str:
    """The label selector of the pod(s) whose log the launcher follows for the job ``name``.

    The Master replica's (``replica-type=master``), or worker 0's for a Worker-only (elastic)
    job, which has no Master (rank 0 runs there).
    """
    if has_master:
        return f"{_JOB_NAME_LABEL}={name},{_REPLICA_TYPE_LABEL}={_MASTER_REPLICA_TYPE}"
    return f"{_JOB_NAME_LABEL}={name},{_REPLICA_TYPE_LABEL}=worker,{_REPLICA_INDEX_LABEL}=0"


def _status_of(exc: BaseException) -> int | None:
    """The HTTP status behind an SDK error (``ApiException`` or the ``RuntimeError`` around it)."""
    for candidate in (exc, exc.__cause__):
        status = getattr(candidate, "status", None)
        if isinstance(status, int):
            return status
    return None


def _is_transient(exc: BaseException) -> bool:
    """Whether an API error may pass by itself (the call is retried at the next poll)."""
    status = _status_of(exc)
    if status is None:  # a per-request timeout, a refused or reset connection
        return isinstance(exc, TimeoutError | RuntimeError | OSError)
    return status == 429 or status >= 500


def _true_conditions(job: Any) -> list[Any]:
    status = getattr(job, "status", None)
    conditions = getattr(status, "conditions", None) or []
    return [c for c in conditions if str(getattr(c, "status", "")) == "True"]


def _has(job: Any, kind: str) -> Any | None:
    for condition in _true_conditions(job):
        if condition.type == kind:
            return condition
    return None


def _latest(job: Any) -> Any | None:
    conditions = _true_conditions(job)
    return conditions[-1] if conditions else None


# ----------------------------------------------------------------------------- log follower


def _default_sink(line: str) -> None:
    pod_logger.info("%s", line)


class _LogFollower:
    """Streams the master container's log to a sink in a daemon thread, across restarts."""

    def __init__(
        self,
        client: TrainingClient,
        name: str,
        namespace: str,
        sink: Callable[[str], None],
        poll_s: float,
        request_timeout: float,
        selector: str,
    ) -> None:
        self._core = client.core_api
        self._selector = selector
        self._name = name
        self._namespace = namespace
        self._sink = sink
        self._poll_s = max(0.01, min(poll_s, _LOG_POLL_MAX_S))
        self._request_timeout = request_timeout
        self._final = threading.Event()  # the job ended: stream what is left, then stop
        self._abort = threading.Event()  # stop now
        self._response: Any = None
        self._emitted: dict[tuple[str, int], int] = {}  # lines given per container instance
        self._done: set[tuple[str, int]] = set()  # instances streamed to their end
        self._clean_eof: tuple[str, int] | None = None  # the last stream read to its end
        self._thread = threading.Thread(target=self._run, name=f"crosskd-logs-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def finish(self, timeout: float) -> None:
        """The job ended: give the stream up to ``timeout`` seconds to drain, then stop it."""
        self._final.set()
        self._thread.join(timeout)
        self.stop()

    def stop(self) -> None:
        """Stop streaming now (an open stream is shut down)."""
        self._abort.set()
        response = self._response
        if response is not None:
            with contextlib.suppress(Exception):  # the stream is being abandoned anyway
                getattr(response, "shutdown", response.close)()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(2.0)

    # -- the thread

    def _run(self) -> None:
        while not self._abort.is_set():
            try:
                found = self._find()
            except Exception as exc:  # logs are best effort; the wait goes on
                logger.debug("listing the master pod of %s failed: %s", self._name, exc)
                found = None
            if found is None or found[2] in self._done or found[3] == "waiting":
                if self._final.is_set():
                    return
                self._abort.wait(self._poll_s)
                continue
            pod, container, key, state = found
            if state == "terminated" and self._clean_eof == key:
                self._done.add(key)  # streamed to its end, and the container has ended
                continue
            self._clean_eof = key if self._stream(pod, container, key) else None
            self._abort.wait(self._poll_s)

    def _find(self) -> tuple[str, str, tuple[str, int], str] | None:
        """(pod, container, instance key, state) of the master's current container, or None."""
        pods = self._core.list_namespaced_pod(
            self._namespace,
            label_selector=self._selector,
            _request_timeout=self._request_timeout,
        ).items
        live = [p for p in pods if p.metadata and p.metadata.deletion_timestamp is None]
        candidates = live or pods
        if not candidates:
            return None
        stamped = [c for c in candidates if c.metadata.creation_timestamp is not None]
        pod = max(stamped, key=lambda c: c.metadata.creation_timestamp, default=candidates[-1])
        statuses = (pod.status.container_statuses if pod.status else None) or []
        names = [c.name for c in (pod.spec.containers if pod.spec else None) or []]
        container = MASTER_CONTAINER if MASTER_CONTAINER in names or not names else names[0]
        status = next((s for s in statuses if s.name == container), None)
        if status is None or status.state is None:
            return None
        if status.state.running is not None:
            state = "running"
        elif status.state.terminated is not None:
            state = "terminated"
        else:
            state = "waiting"
        key = (pod.metadata.uid or pod.metadata.name, int(status.restart_count or 0))
        return pod.metadata.name, container, key, state

    def _stream(self, pod: str, container: str, key: tuple[str, int]) -> bool:
        """Stream one container instance's log to the sink, skipping lines given before.

        Returns whether the stream was read to its end (not broken, not stopped).
        """
        skip = max(self._emitted.get(key, 0), 0)
        self._emitted[key] = skip
        try:
            response = self._core.read_namespaced_pod_log(
                pod,
                self._namespace,
                container=container,
                follow=True,
                _preload_content=False,
                _request_timeout=(self._request_timeout, _LOG_READ_TIMEOUT_S),
            )
        except Exception as exc:  # e.g. 400 "waiting to start", 404 pod gone
            logger.debug("opening the log of %s/%s failed: %s", self._namespace, pod, exc)
            return False
        self._response = response
        seen = 0
        try:
            for line in _lines(response):
                if self._abort.is_set():
                    return False
                seen += 1
                if seen <= skip:
                    continue
                self._emitted[key] = seen
                try:
                    self._sink(line)
                except Exception:  # a broken sink must not end the wait
                    logger.exception("the log sink failed on a line of %s", pod)
        except Exception as exc:  # a broken stream is reopened by _run
            if not self._abort.is_set():
                logger.debug("the log stream of %s/%s broke: %s", self._namespace, pod, exc)
            return False
        finally:
            self._response = None
            with contextlib.suppress(Exception):
                response.release_conn()
        return not self._abort.is_set()


def _lines(response: Any) -> Any:
    """The lines (no newline, UTF-8 decoded) of a streamed urllib3 response, as they arrive.

    A line longer than ``_MAX_LINE_BYTES`` is given in pieces (cut at a character boundary),
    so that memory stays bounded whatever the pod writes.
    """
    if getattr(response, "chunked", False) and response.supports_chunked_reads():
        chunks = response.read_chunked(decode_content=True)
    else:
        chunks = iter(lambda: response.read1(65536), b"")
    pending = bytearray()
    for chunk in chunks:
        pending += chunk
        while pending:
            cut = pending.find(b"\n", 0, _MAX_LINE_BYTES + 1)
            if cut >= 0:
                yield pending[:cut].decode("utf-8", "replace").rstrip("\r")
                del pending[: cut + 1]
            elif len(pending) > _MAX_LINE_BYTES:
                cut = _MAX_LINE_BYTES
                while cut > _MAX_LINE_BYTES - 4 and (pending[cut] & 0xC0) == 0x80:
                    cut -= 1  # do not split a UTF-8 character
                yield pending[:cut].decode("utf-8", "replace")
                del pending[:cut]
            else:
                break
    if pending:
        yield pending.decode("utf-8", "replace")


# ----------------------------------------------------------------------------- submit


class _Cancel:
    """SIGTERM -> a flag (a handler that only sets an attribute cannot deadlock)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.debug("submit() runs outside the main thread: SIGTERM is not handled")
            return
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed = True

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def restore(self) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False


def submit(
    job: Mapping[str, Any] | KubeflowOrgV1PyTorchJob,
    *,
    namespace: str,
    wait_timeout: float,
    client: TrainingClient | None = None,
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
        job: The PyTorchJob: a camelCase manifest (``apiVersion: kubeflow.org/v1``, ``kind:
            PyTorchJob``) or a ``KubeflowOrgV1PyTorchJob``. Its ``metadata.name`` must be set
            and deterministic for the run (a DNS-1035 label, at most 63 characters).
        namespace: The namespace to run it in; ``metadata.namespace``, when set, must match.
        wait_timeout: Seconds the whole call may take, submission included, before
            :class:`JobTimeout` (``math.inf`` waits for ever). Queueing counts.
        client: The ``TrainingClient`` to use; by default one built from the kube-config or
            the in-cluster service account.
        manifest_path: Where to keep the submitted manifest as YAML (written before submission).
        delete_on_sigterm: Delete the job when the launcher gets SIGTERM.
        delete_when_done: Delete the job once it has succeeded or failed (else its
            ``ttlSecondsAfterFinished`` does).
        poll_interval: Seconds between two reads of the job's status (the log follower looks
            for a restarted container every ``min(poll_interval, 2)`` seconds).
        request_timeout: Seconds one API request may take (not the wait).
        log_sink: Called with each line (no newline) of the master's log; by default the
            ``crosskd.k8s.pod`` logger at INFO.
        stream_logs: Stream the master's log at all.
        log_drain_timeout: Seconds the log stream may go on after the job has finished.
        final_model_uri: The final model's URI, returned in the result (else the job's
            :data:`FINAL_MODEL_URI_ANNOTATION` annotation, if any).

    Returns:
        The :class:`JobResult` of a job that has the condition ``Succeeded``.

    Raises:
        JobFailed: The job has the condition ``Failed``.
        JobTimeout: ``wait_timeout`` passed; the job is left running.
        JobDisappeared: The job was deleted while the launcher waited.
        JobCancelled: SIGTERM came (the job deleted unless ``delete_on_sigterm=False``).
        LauncherError: The API refused the job or the access (e.g. 403, 422), or the job of that
            name is being deleted.
        ConfigError: The job or the arguments are malformed.
    """
    started = time.monotonic()
    if not isinstance(wait_timeout, int | float) or math.isnan(wait_timeout) or wait_timeout <= 0:
        raise ConfigError(f"wait_timeout is {wait_timeout!r}; give seconds > 0 (math.inf: none).")
    if poll_interval <= 0 or request_timeout <= 0:
        raise ConfigError(
            f"poll_interval ({poll_interval}) and request_timeout ({request_timeout}) must be "
            "seconds > 0."
        )
    model = _as_model(job)
    if model.metadata is None or not model.metadata.name:
        raise ConfigError("the PyTorchJob has no metadata.name; the launcher needs a fixed one.")
    name = model.metadata.name
    if len(name) > 63 or not _DNS1035_LABEL.match(name):
        raise ConfigError(
            f"the PyTorchJob name {name!r} is not a DNS-1035 label (lower-case letters, digits "
            "and '-', starting with a letter, at most 63 characters)."
        )
    if model.metadata.namespace and model.metadata.namespace != namespace:
        raise ConfigError(
            f"the PyTorchJob {name} names namespace {model.metadata.namespace!r} but is "
            f"submitted to {namespace!r}; drop metadata.namespace or make them agree."
        )
    model.metadata.namespace = namespace
    annotations = model.metadata.annotations or {}
    final_model_uri = final_model_uri or annotations.get(FINAL_MODEL_URI_ANNOTATION)
    where = f"{namespace}/{name}"
    if manifest_path is not None:
        kept = _write_manifest(manifest_path, to_manifest(model))
        logger.info("PyTorchJob %s: manifest kept in %s", where, kept)
    if client is None:
        from kubeflow.training import TrainingClient

        client = TrainingClient(namespace=namespace)

    def result(job_now: Any, message: str | None = None, *, succeeded: bool = False) -> JobResult:
        latest = _latest(job_now) if job_now is not None else None
        return JobResult(
            name=name,
            namespace=namespace,
            condition=getattr(latest, "type", None),
            reason=getattr(latest, "reason", None),
            message=message or getattr(latest, "message", None) or "",
            succeeded=succeeded,
            reattached=reattached,
            final_model_uri=final_model_uri if succeeded else None,
            elapsed_s=time.monotonic() - started,
        )

    cancel = _Cancel()
    cancel.install()
    follower: _LogFollower | None = None
    reattached = False
    try:
        reattached = _create_or_reattach(client, model, name, namespace, request_timeout)
        replicas = (model.spec.pytorch_replica_specs if model.spec else None) or {}
        follower = (
            _LogFollower(
                client,
                name,
                namespace,
                log_sink or _default_sink,
                poll_interval,
                request_timeout,
                master_pod_selector(name, has_master="Master" in replicas or not replicas),
            )
            if stream_logs
            else None
        )
        if follower is not None:
            follower.start()
        deadline = started + wait_timeout
        last_seen: tuple[str | None, str | None] | None = None
        last_error: BaseException | None = None
        while True:
            if cancel.requested:
                raise _cancelled(client, name, namespace, delete_on_sigterm, result)
            try:
                current = client.get_job(name, namespace, timeout=request_timeout)
                last_error = None
            except Exception as exc:  # classified below
                status = _status_of(exc)
                if status == 404:
                    raise JobDisappeared(
                        f"PyTorchJob {where} was deleted while the launcher waited on it "
                        "(404); it did not finish. Resubmit to run it again.",
                        result(None, "deleted while waiting"),
                    ) from exc
                if not _is_transient(exc):
                    raise LauncherError(
                        f"reading PyTorchJob {where} failed: {exc}", result(None, str(exc))
                    ) from exc
                logger.warning("reading PyTorchJob %s failed (retrying): %s", where, exc)
                current, last_error = None, exc
            if current is not None:
                latest = _latest(current)
                seen = (getattr(latest, "type", None), getattr(latest, "reason", None))
                if seen != last_seen:
                    last_seen = seen
                    logger.info(
                        "PyTorchJob %s: %s%s%s",
                        where,
                        seen[0] or "no condition yet",
                        f" ({seen[1]})" if seen[1] else "",
                        f": {latest.message}" if getattr(latest, "message", None) else "",
                    )
                failed = _has(current, "Failed")
                if failed is not None:
                    if follower is not None:
                        follower.finish(log_drain_timeout)
                    _delete_if(delete_when_done, client, name, namespace)
                    raise JobFailed(
                        f"PyTorchJob {where} failed: {failed.reason or 'no reason given'}: "
                        f"{failed.message or 'no message'}",
                        dataclasses.replace(
                            result(current),
                            condition="Failed",
                            reason=failed.reason,
                            message=failed.message or "",
                        ),
                    )
                succeeded = _has(current, "Succeeded")
                if succeeded is not None:
                    if follower is not None:
                        follower.finish(log_drain_timeout)
                    _delete_if(delete_when_done, client, name, namespace)
                    done = dataclasses.replace(
                        result(current, succeeded=True),
                        condition="Succeeded",
                        reason=succeeded.reason,
                        message=succeeded.message or "",
                    )
                    logger.info("PyTorchJob %s succeeded after %.0f s", where, done.elapsed_s)
                    return done
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                state = f"{last_seen[0]} ({last_seen[1]})" if last_seen else "unknown"
                detail = f"; the last read failed: {last_error}" if last_error else ""
                raise JobTimeout(
                    f"PyTorchJob {where} did not finish within wait_timeout={wait_timeout:g} s "
                    f"(last condition: {state}{detail}); it is left running: submit again to "
                    f"reattach, or delete it (kubectl -n {namespace} delete pytorchjob {name}).",
                    result(current, "wait_timeout passed"),
                )
            _sleep(min(poll_interval, remaining), cancel)
    finally:
        cancel.restore()
        if follower is not None:
            follower.stop()


def _create_or_reattach(
    client: TrainingClient,
    model: KubeflowOrgV1PyTorchJob,
    name: str,
    namespace: str,
    request_timeout: float,
) -> bool:
    """Create the job; on 409 read it back. Returns whether the launcher reattached."""
    where = f"{namespace}/{name}"
    try:
        client.create_job(job=model, namespace=namespace)
    except RuntimeError as exc:
        if _status_of(exc) != 409:
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


def _delete(client: TrainingClient, name: str, namespace: str) -> str | None:
    """Delete the job; returns None on success (or 404), else what went wrong."""
    try:
        client.delete_job(name, namespace)
    except Exception as exc:
        if _status_of(exc) == 404:
            return None
        return str(exc)
    logger.info("PyTorchJob %s/%s deleted", namespace, name)
    return None


def _delete_if(wanted: bool, client: TrainingClient, name: str, namespace: str) -> None:
    if wanted:
        problem = _delete(client, name, namespace)
        if problem:
            logger.warning(
                "deleting the finished PyTorchJob %s/%s failed: %s", namespace, name, problem
            )


def _cancelled(
    client: TrainingClient,
    name: str,
    namespace: str,
    delete: bool,
    result: Callable[..., JobResult],
) -> JobCancelled:
    where = f"{namespace}/{name}"
    if not delete:
        return JobCancelled(
            f"SIGTERM: stopped waiting on PyTorchJob {where}, which is left running "
            "(delete_on_sigterm is off).",
            result(None, "cancelled; job left running"),
        )
    problem = _delete(client, name, namespace)
    if problem:
        return JobCancelled(
            f"SIGTERM: deleting PyTorchJob {where} failed ({problem}); it may still hold GPUs: "
            f"kubectl -n {namespace} delete pytorchjob {name}",
            result(None, "cancelled; deletion failed"),
        )
    return JobCancelled(
        f"SIGTERM: PyTorchJob {where} was deleted (the run was cancelled).",
        result(None, "cancelled; job deleted"),
    )


def _sleep(seconds: float, cancel: _Cancel) -> None:
    """Sleep ``seconds``, waking within a slice when SIGTERM comes."""
    end = time.monotonic() + seconds
    while not cancel.requested:
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, _SLEEP_SLICE_S))
