"""FakeKubernetesApi: a fake speaking the subset of the Kubernetes REST API the launcher uses.

It is **not** an API server and runs no controller: an ``http.server`` on 127.0.0.1 (one
thread per request) that keeps jobs of one kind (:data:`PYTORCHJOB` by default, or
:data:`TRAINJOB`) and pods in memory and answers, with the shapes the real API server uses,
exactly these requests:

* ``POST /apis/kubeflow.org/v1/namespaces/{ns}/pytorchjobs`` (201; 409 ``AlreadyExists``,
  400 ``BadRequest`` for a namespace mismatch, 422 ``Invalid`` for a bad name/kind),
* ``GET``/``DELETE /apis/kubeflow.org/v1/namespaces/{ns}/pytorchjobs/{name}`` (404
  ``NotFound``; ``DELETE`` records its ``propagationPolicy``), ``GET .../pytorchjobs`` (a
  ``PyTorchJobList``); for :data:`TRAINJOB` the same under
  ``/apis/trainer.kubeflow.org/v1alpha1/namespaces/{ns}/trainjobs``,
* ``POST``, ``GET``, ``DELETE`` of the teacher server's objects (:data:`OBJECTS`): ``apps/v1``
  Deployments, ``v1`` ConfigMaps and Services, ``policy/v1`` PodDisruptionBudgets,
  ``monitoring.coreos.com/v1`` PodMonitors (201; 409 ``AlreadyExists``; 404 ``NotFound``;
  ``DELETE`` answers a ``Status`` ``Success``). Deleting an object deletes, as the garbage
  collector would (at once here), every object whose ``ownerReferences`` name its uid, and a
  Deployment's pods (its ReplicaSet's, through their labels),
* ``GET /api/v1/namespaces/{ns}/pods?labelSelector=k=v,...`` (equality selectors),
* ``GET /api/v1/namespaces/{ns}/pods/{pod}/log?container=...&follow=true`` (chunked
  ``text/plain``, one line per chunk as it is "written"; 400 while the container waits,
  404 for a missing pod; ``previous=true`` gives the last ended instance; booleans are read
  as the API server reads them, so the client's ``follow=True`` counts).

Errors are ``Status`` objects (``kind: Status``, ``status: Failure``, ``reason``, ``code``,
``details``). Job conditions are shaped as in the vendored CRDs (``type``, ``status: "True"``,
``reason``, ``message``, ``lastTransitionTime``, and a PyTorchJob's ``lastUpdateTime``) and
replaced the way the Training Operator does (a new ``Succeeded``/``Failed`` turns ``Running`` to
``"False"``). A new PyTorchJob gets ``Created`` at once (``auto_created``); a new TrainJob gets
no condition (Trainer v2 has none until ``Suspended``, ``Complete`` or ``Failed``, which it
copies from its JobSet). A TrainJob's pods are the JobSet's: named
``<job>-node-0-<index>-<suffix>`` and labelled with the JobSet's name, replicated job, Job index
and completion index, container ``node``; a restarted JobSet makes pods of new names.

The test drives a timeline: :meth:`FakeKubernetesApi.on_get` runs an action when a job has
been read N times (before that read is answered), :meth:`FakeKubernetesApi.on_read` when an
object of another kind has, and the actions (:meth:`set_condition`, :meth:`set_status`,
:meth:`start_master`,
:meth:`log`, :meth:`restart_container`, :meth:`recreate_pod`, :meth:`finish_master`,
:meth:`remove_job`, :meth:`set_deployment_status`, :meth:`add_pod`) change the state as the
operator, the Deployment controller and the kubelet would. Actions that end a container first
wait until a log follower has been sent every line of it, so a test never depends on how fast
the launcher polls. Anything that goes wrong in the server thread is recorded in
:attr:`FakeKubernetesApi.errors`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import re
import socket
import threading
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

_PODS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods$")
_POD_LOG = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)/log$")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
OBJECTS = {
    # plural: (path prefix before /namespaces, apiVersion, kind, group of the Status details)
    "deployments": ("/apis/apps/v1", "apps/v1", "Deployment", "apps"),
    "configmaps": ("/api/v1", "v1", "ConfigMap", ""),
    "services": ("/api/v1", "v1", "Service", ""),
    "poddisruptionbudgets": ("/apis/policy/v1", "policy/v1", "PodDisruptionBudget", "policy"),
    "podmonitors": (
        "/apis/monitoring.coreos.com/v1",
        "monitoring.coreos.com/v1",
        "PodMonitor",
        "monitoring.coreos.com",
    ),
}
"""The teacher server's kinds this fake stores, by the plural of their paths."""
_OBJECT = re.compile(
    r"^(/api/v1|/apis/[^/]+/v1)/namespaces/([^/]+)/"
    r"(deployments|configmaps|services|poddisruptionbudgets|podmonitors)(?:/([^/]+))?$"
)


@dataclasses.dataclass(frozen=True)
class JobResource:
    """A job API the fake serves: its paths, the conditions its controller sets, its pods."""

    api_version: str
    plural: str
    kind: str
    pod_label: str
    """The label naming the job on its pods (deleting the job deletes them)."""
    container: str
    """The container of its pods."""
    reasons: dict[str, tuple[str, str]]
    """Condition type -> (reason, message format with ``{ns}`` and ``{name}``)."""
    initial: str | None
    """The condition a new job gets at once (with ``auto_created``), if any."""
    final: tuple[str, ...]
    """The condition types that end the job."""

    @property
    def group(self) -> str:
        """The API group (``kubeflow.org``, ``trainer.kubeflow.org``)."""
        return self.api_version.split("/")[0]

    def base(self, namespace: str) -> str:
        """The path of the jobs of ``namespace``."""
        return f"/apis/{self.api_version}/namespaces/{namespace}/{self.plural}"


PYTORCHJOB = JobResource(
    api_version="kubeflow.org/v1",
    plural="pytorchjobs",
    kind="PyTorchJob",
    pod_label="training.kubeflow.org/job-name",
    container="pytorch",
    reasons={
        "Created": ("PyTorchJobCreated", "PyTorchJob {ns}/{name} is created."),
        "Running": ("PyTorchJobRunning", "PyTorchJob {ns}/{name} is running."),
        "Restarting": ("PyTorchJobRestarting", "PyTorchJob {ns}/{name} is restarting."),
        "Succeeded": ("PyTorchJobSucceeded", "PyTorchJob {ns}/{name} successfully completed."),
        "Failed": ("PyTorchJobFailed", "PyTorchJob {ns}/{name} has failed."),
    },
    initial="Created",
    final=("Succeeded", "Failed"),
)
"""The Training Operator's PyTorchJob (reasons and messages as its controller writes them)."""
TRAINJOB = JobResource(
    api_version="trainer.kubeflow.org/v1alpha1",
    plural="trainjobs",
    kind="TrainJob",
    pod_label="jobset.sigs.k8s.io/jobset-name",
    container="node",
    reasons={  # Complete and Failed: the JobSet's, copied by the Trainer (JobSet's constants)
        "Suspended": ("Suspended", "TrainJob is suspended"),
        "Complete": ("AllJobsCompleted", "jobset completed successfully"),
        "Failed": ("FailedJobs", "jobset failed due to one or more job failures"),
    },
    initial=None,
    final=("Complete", "Failed"),
)
"""Kubeflow Trainer v2's TrainJob."""


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _flag(value: str | None) -> bool:
    """A boolean query parameter as the API server reads it (anything but "", 0, false)."""
    return value is not None and value != "0" and value.lower() != "false"


def status_object(code: int, reason: str, message: str, **details: Any) -> dict[str, Any]:
    """A ``Status`` as the API server returns it for an error."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "details": details,
        "code": code,
    }


@dataclasses.dataclass
class _Instance:
    """One run of a container: its log lines, how many a follower was sent, whether it ended."""

    lines: list[str] = dataclasses.field(default_factory=list)
    ended: bool = False
    delivered: int = 0
    exit_code: int | None = None


@dataclasses.dataclass
class _Pod:
    name: str
    namespace: str
    labels: dict[str, str]
    uid: str = dataclasses.field(default_factory=lambda: str(uuid.uuid4()))
    created: str = dataclasses.field(default_factory=_now)
    container: str = "pytorch"
    state: str = "waiting"  # waiting | running | terminated
    instances: list[_Instance] = dataclasses.field(default_factory=lambda: [_Instance()])
    drops: int = 0  # bumped to break open log streams (a lost connection)

    @property
    def current(self) -> _Instance:
        return self.instances[-1]

    def to_json(self) -> dict[str, Any]:
        restart_count = len(self.instances) - 1
        if self.state == "running":
            state: dict[str, Any] = {"running": {"startedAt": self.created}}
        elif self.state == "terminated":
            code = self.current.exit_code or 0
            state = {
                "terminated": {
                    "exitCode": code,
                    "reason": "Completed" if code == 0 else "Error",
                    "startedAt": self.created,
                    "finishedAt": _now(),
                }
            }
        else:
            state = {"waiting": {"reason": "ContainerCreating"}}
        phase = {"running": "Running", "waiting": "Pending"}.get(self.state)
        if phase is None:
            phase = "Succeeded" if (self.current.exit_code or 0) == 0 else "Failed"
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "uid": self.uid,
                "labels": dict(self.labels),
                "creationTimestamp": self.created,
            },
            "spec": {"containers": [{"name": self.container, "image": "crosskd:test"}]},
            "status": {
                "phase": phase,
                "containerStatuses": [
                    {
                        "name": self.container,
                        "image": "crosskd:test",
                        "imageID": "docker-pullable://crosskd@sha256:0",
                        "ready": self.state == "running",
                        "restartCount": restart_count,
                        "state": state,
                    }
                ],
            },
        }


class FakeKubernetesApi:
    """A fake speaking the subset of the Kubernetes REST API the launcher uses (see module).

    Use it as a context manager; :attr:`url` is the ``host`` for a
    ``kubernetes.client.Configuration``.
    """

    def __init__(
        self,
        *,
        job: JobResource = PYTORCHJOB,
        auto_created: bool = True,
        delivery_timeout: float = 10.0,
    ) -> None:
        """``job``: the kind of job served; ``auto_created``: a new job gets its kind's initial
        condition at once (a PyTorchJob's ``Created``, as the operator gives it within a
        reconcile); ``delivery_timeout``: seconds an action waits for a log follower to be sent
        a container's lines before it records an error and goes on."""
        self.job = job
        self._jobs_path = re.compile(
            rf"^/apis/{re.escape(job.api_version)}/namespaces/([^/]+)/{job.plural}(?:/([^/]+))?$"
        )
        self.auto_created = auto_created
        self.delivery_timeout = delivery_timeout
        self.cond = threading.Condition(threading.RLock())
        self.jobs: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], _Pod] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path with query), in order
        self.errors: list[str] = []
        self.created_total = 0  # jobs this fake has created (a reattach must not add one)
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (plural, ns, name)
        self.other_pods: dict[tuple[str, str], dict[str, Any]] = {}  # add_pod's, as JSON
        self.deletions: list[tuple[str, str, str, str | None]] = []  # + propagationPolicy
        self._gets: Counter[tuple[str, ...]] = Counter()
        self._hooks: dict[tuple[str, ...], list[tuple[int, Callable[[FakeKubernetesApi], Any]]]]
        self._hooks = defaultdict(list)
        self._faults: list[tuple[str, str, int]] = []
        self._closing = False
        self._resource_version = 1000
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    # -- lifecycle

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeKubernetesApi:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self.cond:
            self._closing = True
            self.cond.notify_all()
        self._server.shutdown()
        self._server.server_close()

    # -- what happened

    def count(self, method: str, path_prefix: str = "") -> int:
        """How many requests with ``method`` had a path starting with ``path_prefix``."""
        with self.cond:
            return sum(1 for m, p in self.requests if m == method and p.startswith(path_prefix))

    def gets(self, namespace: str, name: str) -> int:
        """How many times the job was read (GET of the object)."""
        with self.cond:
            return self._gets[(namespace, name)]

    def job_path(self, namespace: str, name: str | None = None) -> str:
        base = self.job.base(namespace)
        return f"{base}/{name}" if name else base

    def object_path(self, plural: str, namespace: str, name: str | None = None) -> str:
        """The path of an object of :data:`OBJECTS` (or of their collection)."""
        base = f"{OBJECTS[plural][0]}/namespaces/{namespace}/{plural}"
        return f"{base}/{name}" if name else base

    def reads(self, plural: str, namespace: str, name: str) -> int:
        """How many times the object was read (GET of the object)."""
        with self.cond:
            return self._gets[(plural, namespace, name)]

    # -- the timeline

    def fail_next(self, method: str, path_prefix: str, code: int = 500) -> None:
        """Answer the next ``method`` request under ``path_prefix`` with an error ``code``."""
        with self.cond:
            self._faults.append((method, path_prefix, code))

    def on_get(
        self, namespace: str, name: str, n: int, action: Callable[[FakeKubernetesApi], Any]
    ) -> None:
        """Run ``action(self)`` when job ``namespace/name`` is read for the ``n``-th time."""
        with self.cond:
            self._hooks[(namespace, name)].append((n, action))

    def on_read(
        self,
        plural: str,
        namespace: str,
        name: str,
        n: int,
        action: Callable[[FakeKubernetesApi], Any],
    ) -> None:
        """Run ``action(self)`` when the object ``plural`` ``namespace/name`` of :data:`OBJECTS`
        is read for the ``n``-th time."""
        with self.cond:
            self._hooks[(plural, namespace, name)].append((n, action))

    def set_deployment_status(
        self,
        namespace: str,
        name: str,
        *,
        ready: int,
        updated: int | None = None,
        observed: bool = True,
        conditions: Iterable[tuple[str, str, str, str]] = (),
    ) -> None:
        """Give the Deployment the status its controller would: ``ready`` ready (and available)
        replicas, ``updated`` updated ones (default: ``spec.replicas``), its generation observed
        unless ``observed=False``, and ``conditions`` as ``(type, status, reason, message)``."""
        with self.cond:
            deployment = self.objects[("deployments", namespace, name)]
            wanted = deployment["spec"].get("replicas", 1)
            now = _now()
            status: dict[str, Any] = {
                "replicas": wanted,
                "updatedReplicas": wanted if updated is None else updated,
                "readyReplicas": ready,
                "availableReplicas": ready,
                "unavailableReplicas": max(wanted - ready, 0),
                "conditions": [
                    {
                        "type": kind,
                        "status": state,
                        "reason": reason,
                        "message": message,
                        "lastUpdateTime": now,
                        "lastTransitionTime": now,
                    }
                    for kind, state, reason, message in conditions
                ],
            }
            if observed:
                status["observedGeneration"] = deployment["metadata"]["generation"]
            if not ready:  # the API server leaves zero counts out
                del status["readyReplicas"], status["availableReplicas"]
            deployment["status"] = status
            self._bump(deployment)

    def add_pod(
        self, namespace: str, name: str, labels: dict[str, str], status: dict[str, Any]
    ) -> None:
        """Store a pod (one container ``server``) with ``labels`` and the ``status`` the kubelet
        or the scheduler gave it (``phase``, ``conditions``, ``containerStatuses``)."""
        with self.cond:
            self.other_pods[(namespace, name)] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "uid": str(uuid.uuid4()),
                    "labels": dict(labels),
                    "creationTimestamp": _now(),
                },
                "spec": {"containers": [{"name": "server", "image": "crosskd:test"}]},
                "status": status,
            }

    def set_condition(
        self,
        namespace: str,
        name: str,
        kind: str,
        *,
        reason: str | None = None,
        message: str | None = None,
    ) -> None:
        """Give the job the condition ``kind`` (status "True") as its controller's
        setCondition (a TrainJob's: ``meta.SetStatusCondition``, no ``lastUpdateTime``)."""
        with self.cond:
            job = self.jobs[(namespace, name)]
            default_reason, default_message = self.job.reasons[kind]
            pytorchjob = self.job is PYTORCHJOB
            now = _now()
            kept = []
            for c in job.setdefault("status", {}).get("conditions", []):
                if c["type"] == kind:
                    continue
                if {kind, c["type"]} == {"Running", "Restarting"}:
                    continue
                if kind in ("Succeeded", "Failed") and c["type"] == "Running":
                    c = {**c, "status": "False", "lastUpdateTime": now, "lastTransitionTime": now}
                kept.append(c)
            kept.append(
                {
                    "type": kind,
                    "status": "True",
                    "reason": reason or default_reason,
                    "message": message or default_message.format(ns=namespace, name=name),
                    **({"lastUpdateTime": now} if pytorchjob else {}),
                    "lastTransitionTime": now,
                }
            )
            job["status"]["conditions"] = kept
            if kind in self.job.final and pytorchjob:
                job["status"]["completionTime"] = now
            self._bump(job)

    def set_status(self, namespace: str, name: str, **fields: Any) -> None:
        """Set fields of the job's ``status`` besides its conditions (a TrainJob's
        ``jobsStatus``, ``trainerStatus``; a PyTorchJob's ``replicaStatuses``)."""
        with self.cond:
            job = self.jobs[(namespace, name)]
            job.setdefault("status", {}).update(json.loads(json.dumps(fields)))
            self._bump(job)

    def start_master(
        self, namespace: str, name: str, lines: Iterable[str] = (), *, replica_type: str = "master"
    ) -> str:
        """Create the job's rank-0 pod, its container running with ``lines`` logged, and return
        its name: the Master's (plus a worker-1 pod the launcher must not follow), or worker 0's
        for a Worker-only job (``replica_type="worker"``, which then has ``job-role=master``);
        a TrainJob's node 0 (and node 1)."""
        if self.job is TRAINJOB:
            return self._start_nodes(namespace, name, lines)
        pod_name = f"{name}-{replica_type}-0"
        labels = {
            "training.kubeflow.org/job-name": name,
            "training.kubeflow.org/operator-name": "pytorchjob-controller",
            "training.kubeflow.org/replica-type": replica_type,
            "training.kubeflow.org/replica-index": "0",
            "training.kubeflow.org/job-role": "master",
        }
        with self.cond:
            pod = _Pod(pod_name, namespace, labels, state="running")
            pod.current.lines.extend(lines)
            self.pods[(namespace, pod_name)] = pod
            other = _Pod(
                f"{name}-worker-{0 if replica_type == 'master' else 1}",
                namespace,
                {**labels, "training.kubeflow.org/replica-type": "worker"},
                state="running",
            )
            other.labels["training.kubeflow.org/replica-index"] = other.name[-1]
            del other.labels["training.kubeflow.org/job-role"]
            other.current.lines.append("a worker line the launcher must not show")
            self.pods[(namespace, other.name)] = other
            self.cond.notify_all()
        return pod_name

    def _start_nodes(
        self, namespace: str, name: str, lines: Iterable[str], restart_attempt: int = 0
    ) -> str:
        """A TrainJob's pods as JobSet makes them: node 0 (returned) logging ``lines``, and
        node 1 (whose log the launcher must not show), of the given restart attempt."""
        names = []
        with self.cond:
            for index in (1, 0):  # node 1 first: a selector without the index would pick it
                labels = {
                    "jobset.sigs.k8s.io/jobset-name": name,
                    "jobset.sigs.k8s.io/replicatedjob-name": "node",
                    "jobset.sigs.k8s.io/job-index": "0",
                    "jobset.sigs.k8s.io/restart-attempt": str(restart_attempt),
                    "batch.kubernetes.io/job-completion-index": str(index),
                    "trainer.kubeflow.org/trainjob-ancestor-step": "trainer",
                }
                pod = _Pod(
                    f"{name}-node-0-{index}-{uuid.uuid4().hex[:5]}",
                    namespace,
                    labels,
                    container=self.job.container,
                    state="running",
                )
                pod.current.lines.extend(lines if index == 0 else ["node 1: not shown"])
                self.pods[(namespace, pod.name)] = pod
                names.append(pod.name)
            self.cond.notify_all()
        return names[-1]

    def restart_jobset(
        self, namespace: str, name: str, lines: Iterable[str] = (), *, exit_code: int = 200
    ) -> str:
        """A node exits with a retryable ``exit_code`` once its lines were streamed; the JobSet
        is restarted: every node's pod is deleted and made anew under a new name (restart
        attempt + 1), node 0 then logging ``lines``. Returns node 0's new pod name."""
        old = [p for p in self.pods.values() if p.labels.get(self.job.pod_label) == name]
        for pod in old:
            if pod.labels["batch.kubernetes.io/job-completion-index"] == "0":
                self.wait_delivered(namespace, pod.name)  # node 1's log is never followed
        with self.cond:
            attempt = 1 + max(int(p.labels["jobset.sigs.k8s.io/restart-attempt"]) for p in old)
            for pod in old:
                pod.current.ended, pod.current.exit_code = True, exit_code
                del self.pods[(namespace, pod.name)]
        return self._start_nodes(namespace, name, lines, attempt)

    def log(self, namespace: str, pod: str, *lines: str) -> None:
        """The pod's running container writes ``lines``."""
        with self.cond:
            self.pods[(namespace, pod)].current.lines.extend(lines)
            self.cond.notify_all()

    def wait_delivered(self, namespace: str, pod: str) -> bool:
        """Wait until a log follower was sent every line of the pod's current container."""
        with self.cond:
            ok = self.cond.wait_for(
                lambda: (
                    self._closing
                    or (
                        (p := self.pods.get((namespace, pod))) is None
                        or p.current.delivered >= len(p.current.lines)
                    )
                ),
                timeout=self.delivery_timeout,
            )
            if not ok:
                p = self.pods[(namespace, pod)]
                self.errors.append(
                    f"{pod}: only {p.current.delivered} of {len(p.current.lines)} log lines "
                    f"were streamed within {self.delivery_timeout} s"
                )
            return ok

    def restart_container(
        self, namespace: str, pod: str, lines: Iterable[str] = (), *, exit_code: int = 137
    ) -> None:
        """The container exits (after its lines were streamed) and the kubelet restarts it in
        the same pod (``restartCount`` + 1), which then logs ``lines``."""
        self.wait_delivered(namespace, pod)
        with self.cond:
            p = self.pods[(namespace, pod)]
            p.current.ended, p.current.exit_code = True, exit_code
            p.instances.append(_Instance(lines=list(lines)))
            p.state = "running"
            self.cond.notify_all()

    def recreate_pod(
        self, namespace: str, pod: str, lines: Iterable[str] = (), *, exit_code: int = 137
    ) -> None:
        """The container exits (after its lines were streamed), the operator deletes the pod
        and creates a new one of the same name (a new ``uid``), which then logs ``lines``."""
        self.wait_delivered(namespace, pod)
        with self.cond:
            old = self.pods.pop((namespace, pod))
            old.current.ended, old.current.exit_code = True, exit_code
            new = _Pod(old.name, namespace, dict(old.labels), state="running")
            new.current.lines.extend(lines)
            self.pods[(namespace, pod)] = new
            self.cond.notify_all()

    def finish_master(self, namespace: str, pod: str, *, exit_code: int = 0) -> None:
        """The container exits with ``exit_code`` once its lines were streamed."""
        self.wait_delivered(namespace, pod)
        with self.cond:
            p = self.pods[(namespace, pod)]
            p.current.ended, p.current.exit_code = True, exit_code
            p.state = "terminated"
            self.cond.notify_all()

    def drop_log_streams(self, namespace: str, pod: str) -> None:
        """Break the open log streams of the pod (a lost connection; the container runs on)."""
        with self.cond:
            self.pods[(namespace, pod)].drops += 1
            self.cond.notify_all()

    def remove_job(self, namespace: str, name: str) -> None:
        """Delete the job and its pods, as someone else's ``kubectl delete`` would."""
        with self.cond:
            self.jobs.pop((namespace, name), None)
            self._delete_pods(namespace, name)

    def add_job(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Store a job as if created earlier (e.g. by a launcher that then died)."""
        with self.cond:
            return self._create(manifest["metadata"]["namespace"], manifest)

    # -- internals

    def _bump(self, obj: dict[str, Any]) -> None:
        self._resource_version += 1
        obj["metadata"]["resourceVersion"] = str(self._resource_version)

    def _create(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        job = json.loads(json.dumps(body))
        meta = job.setdefault("metadata", {})
        meta["namespace"] = namespace
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        meta["generation"] = 1
        job["status"] = {}
        self._bump(job)
        self.jobs[(namespace, meta["name"])] = job
        self.created_total += 1
        if self.auto_created and self.job.initial:
            self.set_condition(namespace, meta["name"], self.job.initial)
        return job

    def _delete_pods(self, namespace: str, name: str) -> None:
        for key, pod in list(self.pods.items()):
            if key[0] == namespace and pod.labels.get(self.job.pod_label) == name:
                pod.current.ended = True
                del self.pods[key]
        self.cond.notify_all()

    def _run_hooks(self, namespace: str, name: str, plural: str | None = None) -> None:
        key = (namespace, name) if plural is None else (plural, namespace, name)
        with self.cond:
            self._gets[key] += 1
            n = self._gets[key]
            due = [action for at, action in self._hooks[key] if at == n]
        for action in due:  # outside the lock: an action may wait for a log follower
            try:
                action(self)
            except Exception as exc:  # recorded, so that the test fails with it
                self.errors.append(f"timeline action at GET {n} of {name}: {exc!r}")

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()  # no Nagle delay between headers and body
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                fake._dispatch(self, "GET")

            def do_POST(self) -> None:
                fake._dispatch(self, "POST")

            def do_DELETE(self) -> None:
                fake._dispatch(self, "DELETE")

        return Handler

    def _dispatch(self, req: BaseHTTPRequestHandler, method: str) -> None:
        url = urlsplit(req.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        length = int(req.headers.get("Content-Length") or 0)
        raw = req.rfile.read(length) if length else b""
        with self.cond:
            self.requests.append((method, req.path))
            fault = next(
                (f for f in self._faults if f[0] == method and url.path.startswith(f[1])), None
            )
            if fault is not None:
                self._faults.remove(fault)
        if fault is not None:
            reason = {
                500: "InternalError",
                503: "ServiceUnavailable",
                429: "TooManyRequests",
                403: "Forbidden",
            }.get(fault[2], "InternalError")
            self._send(req, fault[2], status_object(fault[2], reason, f"injected {fault[2]}"))
            return
        try:
            if m := self._jobs_path.match(url.path):
                self._jobs(req, method, m.group(1), m.group(2), raw, query)
            elif (m := _OBJECT.match(url.path)) and OBJECTS[m.group(3)][0] == m.group(1):
                self._objects(req, method, m.group(3), m.group(2), m.group(4), raw, query)
            elif (m := _PODS.match(url.path)) and method == "GET":
                self._pods(req, m.group(1), query.get("labelSelector", ""))
            elif (m := _POD_LOG.match(url.path)) and method == "GET":
                self._log(req, m.group(1), m.group(2), query)
            else:
                self._send(
                    req,
                    404,
                    status_object(
                        404, "NotFound", "the server could not find the requested resource"
                    ),
                )
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as exc:
            self.errors.append(f"{method} {req.path}: {exc!r}")
            with contextlib.suppress(Exception):
                self._send(req, 500, status_object(500, "InternalError", repr(exc)))

    def _send(self, req: BaseHTTPRequestHandler, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        req.send_response(code)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        req.wfile.write(data)

    def _jobs(
        self, req, method: str, ns: str, name: str | None, raw: bytes, query: dict[str, str]
    ) -> None:
        key = (ns, name or "")
        res = self.job
        resource = f"{res.plural}.{res.group}"
        gone = status_object(
            404,
            "NotFound",
            f'{resource} "{name}" not found',
            name=name,
            group=res.group,
            kind=res.plural,
        )
        if method == "POST" and name is None:
            body = json.loads(raw or b"{}")
            job_name = (body.get("metadata") or {}).get("name") or ""
            invalid = status_object(
                422,
                "Invalid",
                f'{res.kind}.{res.group} "{job_name}" is invalid',
                name=job_name,
                group=res.group,
                kind=res.kind,
            )
            if self._refused(req, ns, body, (res.api_version, res.kind), invalid):
                return
            with self.cond:
                if (ns, job_name) in self.jobs:
                    exists = status_object(
                        409,
                        "AlreadyExists",
                        f'{resource} "{job_name}" already exists',
                        name=job_name,
                        group=res.group,
                        kind=res.plural,
                    )
                    self._send(req, 409, exists)
                    return
                job = self._create(ns, body)
                self._send(req, 201, job)
            return
        if method == "GET" and name is None:
            with self.cond:
                items = [j for (n, _), j in self.jobs.items() if n == ns]
                self._send(
                    req,
                    200,
                    {
                        "apiVersion": res.api_version,
                        "kind": f"{res.kind}List",
                        "items": items,
                        "metadata": {"resourceVersion": str(self._resource_version)},
                    },
                )
            return
        if method == "GET":
            self._run_hooks(ns, name)
            with self.cond:
                job = self.jobs.get(key)
                self._send(req, *((200, job) if job else (404, gone)))
            return
        if method == "DELETE" and name is not None:
            policy = query.get("propagationPolicy")
            if policy is None and raw:
                policy = json.loads(raw).get("propagationPolicy")
            with self.cond:
                job = self.jobs.pop(key, None)
                if job is None:
                    self._send(req, 404, gone)
                    return
                self.deletions.append((res.plural, ns, name, policy))
                self._delete_pods(ns, name)
                self._send(
                    req,
                    200,
                    status_object(200, "", "")
                    | {
                        "status": "Success",
                        "details": {
                            "name": name,
                            "group": res.group,
                            "kind": res.plural,
                            "uid": job["metadata"]["uid"],
                        },
                    },
                )
            return
        self._send(req, 405, status_object(405, "MethodNotAllowed", f"{method} not allowed"))

    def _objects(
        self,
        req,
        method: str,
        plural: str,
        ns: str,
        name: str | None,
        raw: bytes,
        query: dict[str, str],
    ) -> None:
        """POST, GET or DELETE of an object of :data:`OBJECTS`."""
        _, api_version, kind, group = OBJECTS[plural]
        resource = f"{plural}.{group}" if group else plural

        def details(item: str) -> dict[str, Any]:
            return (
                {"name": item, "group": group, "kind": plural}
                if group
                else {
                    "name": item,
                    "kind": plural,
                }
            )

        if method == "POST" and name is None:
            body = json.loads(raw or b"{}")
            item = (body.get("metadata") or {}).get("name") or ""
            invalid = status_object(422, "Invalid", f'{kind} "{item}" is invalid', **details(item))
            if self._refused(req, ns, body, (api_version, kind), invalid):
                return
            with self.cond:
                if (plural, ns, item) in self.objects:
                    self._send(
                        req,
                        409,
                        status_object(
                            409,
                            "AlreadyExists",
                            f'{resource} "{item}" already exists',
                            **details(item),
                        ),
                    )
                    return
                obj = json.loads(json.dumps(body))
                meta = obj.setdefault("metadata", {})
                meta.update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=_now())
                if plural in ("deployments", "poddisruptionbudgets", "podmonitors"):
                    meta["generation"] = 1
                if plural == "deployments":
                    obj["status"] = {}  # every field omitempty
                if plural == "poddisruptionbudgets":  # these four are not omitempty
                    obj["status"] = dict.fromkeys(
                        ("disruptionsAllowed", "currentHealthy", "desiredHealthy", "expectedPods"),
                        0,
                    )
                self._bump(obj)
                self.objects[(plural, ns, item)] = obj
                self._send(req, 201, obj)
            return
        gone = status_object(404, "NotFound", f'{resource} "{name}" not found', **details(name))
        if method == "GET" and name is not None:
            self._run_hooks(ns, name, plural)
            with self.cond:
                obj = self.objects.get((plural, ns, name))
                self._send(req, *((200, obj) if obj else (404, gone)))
            return
        if method == "DELETE" and name is not None:
            policy = query.get("propagationPolicy")
            if policy is None and raw:
                policy = json.loads(raw).get("propagationPolicy")
            with self.cond:
                obj = self.objects.pop((plural, ns, name), None)
                if obj is None:
                    self._send(req, 404, gone)
                    return
                self.deletions.append((plural, ns, name, policy))
                if policy != "Orphan":
                    self._collect(ns, obj)
                self.cond.notify_all()
                done = status_object(200, "", "") | {
                    "status": "Success",
                    "details": {**details(name), "uid": obj["metadata"]["uid"]},
                }
                self._send(req, 200, done)
            return
        self._send(req, 405, status_object(405, "MethodNotAllowed", f"{method} not allowed"))

    def _refused(
        self,
        req,
        ns: str,
        body: dict[str, Any],
        type_: tuple[str, str],
        invalid: dict[str, Any],
    ) -> bool:
        """Answer a create whose body is not of ``type_`` (apiVersion, kind) or names another
        namespace (400), or whose name is not a DNS label (``invalid``, 422); returns whether
        it was refused."""
        meta = body.get("metadata") or {}
        name = meta.get("name") or ""
        if (body.get("apiVersion"), body.get("kind")) != type_:
            self._send(req, 400, status_object(400, "BadRequest", "wrong apiVersion/kind"))
        elif meta.get("namespace") not in (None, ns):
            self._send(
                req,
                400,
                status_object(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match "
                    "the namespace sent on the request",
                ),
            )
        elif len(name) > 63 or not _NAME.match(name):
            self._send(req, 422, invalid)
        else:
            return False
        return True

    def _collect(self, ns: str, owner: dict[str, Any]) -> None:
        """The garbage collector, at once: delete what ``owner`` owns (by ``ownerReferences``
        uid, recursively) and, for a Deployment, the pods of its selector (its ReplicaSet's)."""
        uid = owner["metadata"]["uid"]
        for key, obj in list(self.objects.items()):
            refs = obj["metadata"].get("ownerReferences") or []
            if key[1] == ns and key in self.objects and any(r.get("uid") == uid for r in refs):
                del self.objects[key]
                self._collect(ns, obj)
        if owner.get("kind") == "Deployment":
            wanted = owner["spec"]["selector"]["matchLabels"]
            for key, pod in list(self.other_pods.items()):
                labels = pod["metadata"]["labels"]
                if key[0] == ns and all(labels.get(k) == v for k, v in wanted.items()):
                    del self.other_pods[key]

    def _pods(self, req, ns: str, selector: str) -> None:
        wanted = {}
        for term in filter(None, selector.split(",")):
            k, _, v = term.replace("==", "=").partition("=")
            wanted[k.strip()] = v.strip()
        with self.cond:
            items = [
                p.to_json()
                for (n, _), p in self.pods.items()
                if n == ns and all(p.labels.get(k) == v for k, v in wanted.items())
            ] + [
                p
                for (n, _), p in self.other_pods.items()
                if n == ns and all(p["metadata"]["labels"].get(k) == v for k, v in wanted.items())
            ]
            rv = str(self._resource_version)
        self._send(
            req,
            200,
            {
                "apiVersion": "v1",
                "kind": "PodList",
                "items": items,
                "metadata": {"resourceVersion": rv},
            },
        )

    def _log(self, req, ns: str, pod_name: str, query: dict[str, str]) -> None:
        follow = _flag(query.get("follow"))
        with self.cond:
            pod = self.pods.get((ns, pod_name))
            if pod is None:
                self._send(
                    req,
                    404,
                    status_object(
                        404, "NotFound", f'pods "{pod_name}" not found', name=pod_name, kind="pods"
                    ),
                )
                return
            container = query.get("container", pod.container)
            if container != pod.container:
                self._send(
                    req,
                    400,
                    status_object(
                        400, "BadRequest", f"container {container} is not valid for pod {pod_name}"
                    ),
                )
                return
            if _flag(query.get("previous")):
                if len(pod.instances) < 2:
                    self._send(
                        req,
                        400,
                        status_object(400, "BadRequest", "previous terminated container not found"),
                    )
                    return
                instance, follow = pod.instances[-2], False
            elif pod.state == "waiting":
                self._send(
                    req,
                    400,
                    status_object(
                        400,
                        "BadRequest",
                        f'container "{container}" in pod "{pod_name}" is waiting '
                        "to start: ContainerCreating",
                    ),
                )
                return
            else:
                instance = pod.current
            drops = pod.drops
        req.send_response(200)
        req.send_header("Content-Type", "text/plain")
        req.send_header("Transfer-Encoding", "chunked")
        req.end_headers()
        sent = 0
        while True:
            with self.cond:
                self.cond.wait_for(
                    lambda sent=sent: (
                        sent < len(instance.lines)
                        or instance.ended
                        or self._closing
                        or pod.drops != drops
                        or not follow
                    ),
                    timeout=0.5,
                )
                batch = instance.lines[sent:]
                broken = pod.drops != drops
                over = instance.ended or self._closing or not follow
            if broken:  # a dropped connection: no final chunk
                req.close_connection = True
                with contextlib.suppress(OSError):
                    req.connection.shutdown(2)
                return
            for line in batch:
                data = (line + "\n").encode()
                req.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            req.wfile.flush()
            sent += len(batch)
            if batch:
                with self.cond:
                    instance.delivered = max(instance.delivered, sent)
                    self.cond.notify_all()
            if over and sent >= len(instance.lines):
                break
        req.wfile.write(b"0\r\n\r\n")
        req.wfile.flush()
