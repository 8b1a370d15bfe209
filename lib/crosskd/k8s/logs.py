"""Following rank 0's pod's log while the launcher waits on its job.

Once that pod's container runs its log is streamed with
``CoreV1Api.read_namespaced_pod_log(follow=True, _preload_content=False)``, line by line, to a
sink (the ``crosskd.k8s.pod`` logger by default), in a background thread; nothing is kept but
the line being assembled. The pod is found by labels: a PyTorchJob's Master
(``training.kubeflow.org/job-name=<name>``, ``training.kubeflow.org/replica-type=master``; in a
Worker-only elastic job, which has no Master, ``replica-type=worker`` and ``replica-index=0``),
container ``pytorch``; a TrainJob's node 0 (:func:`crosskd.k8s.trainjob_api.node0_selector`),
container ``node``. Container restarts (a higher ``restartCount``) and recreated pods (a new pod
``uid``: the PyTorchJob's ``ExitCode`` restart policy, a restarted JobSet) are followed, each
container instance
streamed once; a stream that breaks while its container still runs is reopened and the lines
already given are skipped. A container instance that starts and ends between two pod polls
(``poll_interval``, at most 2 s) is not seen, and log lines the kubelet rotated away cannot be
replayed. ``kubeflow-training``'s ``get_job_logs(follow=True)`` is not used: it returns at once
for a Pending pod, keeps every line in memory and stops at a container restart.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kubeflow.training import KubeflowOrgV1PyTorchJob

logger = logging.getLogger(__name__)
pod_logger = logging.getLogger("crosskd.k8s.pod")

MASTER_CONTAINER = "pytorch"
"""The container that runs crosskd in every replica (the Training Operator requires this
name)."""

# Label keys and values the Training Operator puts on every pod it creates
# (kubeflow.training.constants; TO pkg/controller.v1/common/job_controller.go).
_JOB_NAME_LABEL = "training.kubeflow.org/job-name"
_REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
_REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
_MASTER_REPLICA_TYPE = "master"

MAX_LINE_BYTES = 64 * 1024
"""A longer line (a progress bar without newlines) is given in pieces of at most this many
bytes."""
_LOG_POLL_MAX_S = 2.0  # the log follower looks for a new container at least this often
_LOG_READ_TIMEOUT_S = 600.0  # a silent log stream is reopened after this long


def master_pod_selector(name: str, *, has_master: bool = True) -> str:
    """The label selector of the pod(s) whose log the launcher follows for the job ``name``.

    The Master replica's (``replica-type=master``), or worker 0's for a Worker-only (elastic)
    job, which has no Master (rank 0 runs there).
    """
    if has_master:
        return f"{_JOB_NAME_LABEL}={name},{_REPLICA_TYPE_LABEL}={_MASTER_REPLICA_TYPE}"
    return f"{_JOB_NAME_LABEL}={name},{_REPLICA_TYPE_LABEL}=worker,{_REPLICA_INDEX_LABEL}=0"


def log_to_pod_logger(line: str) -> None:
    """The default log sink: ``line`` to the ``crosskd.k8s.pod`` logger at INFO."""
    pod_logger.info("%s", line)


def pytorchjob_log_selector(job: KubeflowOrgV1PyTorchJob) -> str:
    """The selector of the pod whose log the launcher follows for the PyTorchJob ``job``: its
    Master's, or worker 0's when it has no Master (:func:`master_pod_selector`)."""
    replicas = (job.spec.pytorch_replica_specs if job.spec else None) or {}
    return master_pod_selector(job.metadata.name, has_master="Master" in replicas or not replicas)


class LogFollower:
    """Streams rank 0's container's log to a sink in a daemon thread, across restarts.

    Args:
        client: The job's client (``TrainingClient``, ``TrainJobClient``), whose ``core_api``
            lists the pods and reads their logs.
        name: The job's name (the thread's name; log messages).
        namespace: The job's namespace.
        sink: Called with each line of the log (no newline).
        poll_s: Seconds between two looks for a new container instance (at most 2).
        request_timeout: Seconds one pod-listing request, or the opening of a stream, may take.
        selector: The label selector of the pod(s) to follow (:func:`pytorchjob_log_selector`,
            :func:`crosskd.k8s.trainjob_api.node0_selector`).
        container: The container whose log is streamed (when the pod has it; else its first).
    """

    def __init__(
        self,
        client: Any,
        name: str,
        namespace: str,
        sink: Callable[[str], None],
        poll_s: float,
        request_timeout: float,
        selector: str,
        container: str = MASTER_CONTAINER,
    ) -> None:
        self._core = client.core_api
        self._selector = selector
        self._container = container
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
        """Start the streaming thread."""
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
        """The thread: find rank 0's current container instance, stream it, repeat."""
        while not self._abort.is_set():
            try:
                found = self._find()
            except Exception as exc:  # logs are best effort; the wait goes on
                logger.debug("listing rank 0's pod of %s failed: %s", self._name, exc)
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
        """(pod, container, instance key, state) of rank 0's current container, or None."""
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
        container = self._container if self._container in names or not names else names[0]
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


def _lines(response: Any) -> Iterator[str]:
    """The lines (no newline, UTF-8 decoded) of a streamed urllib3 response, as they arrive.

    A line longer than ``MAX_LINE_BYTES`` is given in pieces (cut at a character boundary),
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
            cut = pending.find(b"\n", 0, MAX_LINE_BYTES + 1)
            if cut >= 0:
                yield pending[:cut].decode("utf-8", "replace").rstrip("\r")
                del pending[: cut + 1]
            elif len(pending) > MAX_LINE_BYTES:
                cut = MAX_LINE_BYTES
                while cut > MAX_LINE_BYTES - 4 and (pending[cut] & 0xC0) == 0x80:
                    cut -= 1  # do not split a UTF-8 character
                yield pending[:cut].decode("utf-8", "replace")
                del pending[:cut]
            else:
                break
    if pending:
        yield pending.decode("utf-8", "replace")
