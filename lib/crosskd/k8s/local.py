"""Running a rendered PyTorchJob on this machine the way the Training Operator would
(``crosskd job run-local``), so that a manifest's own command line is tested for real where no
cluster exists.

What it does, replica by replica (Master first, then Workers, ``replicas`` of each):

* one process group per replica (a "pod"), running **the container's own command and args**
  from the manifest (the ``pytorch`` container);
* the environment is the container's ``env`` (``value``; ``secretKeyRef`` values taken from this
  machine's environment under the same variable name, refused by name when missing unless
  ``optional``; ``configMapKeyRef`` from the job's ConfigMaps) plus **exactly what the operator
  injects** (training-operator v1.9 ``pkg/controller.v1/pytorch/envvar.go``): with a Master,
  ``MASTER_ADDR`` / ``PET_MASTER_ADDR`` (here 127.0.0.1), ``MASTER_PORT`` / ``PET_MASTER_PORT``
  (a free port here, standing for ``pytorchjob-port``), ``WORLD_SIZE`` (replicas x
  ``nprocPerNode``), ``RANK`` and ``PET_NODE_RANK`` (Master 0, Worker i: i + 1);
  ``PET_NPROC_PER_NODE``; ``PET_NNODES`` (the replica count) without an elastic policy, the
  ``PET_RDZV_*`` variables with one; ``PYTHONUNBUFFERED``. Of this machine's own environment only
  ``PATH``, ``LANG`` / ``LC_ALL``, ``TMPDIR``, ``VIRTUAL_ENV`` and ``PYTHONPATH`` pass (a container
  has its image's), so a variable the cluster would not set is not silently supplied here;
* volumes: a ConfigMap volume's files are written into a folder of the run, an ``emptyDir`` is a
  fresh folder per replica, and any argument or ``env`` value under a mount path is mapped to
  that folder (the only rewriting of the command line). So that replicas on one host do not
  collide, ``metrics_port`` (a ``metrics_port=N`` argument, or the key of a train config in a
  ConfigMap) is shifted by ``rank * nprocPerNode`` in each replica;
* the result by the operator's rule: **Succeeded when the Master exits 0**; under the
  ``ExitCode`` restart policy a replica exiting with a code >= 128 is recreated (it resumes from
  its checkpoint), one exiting 1..127 fails the job at once (the others are stopped); under
  ``OnFailure`` every non-zero exit is recreated, under ``Never`` none. ``max_recreations``
  bounds the recreations of the whole job (crosskd's own restart budget in the pod is the
  first bound, :mod:`crosskd.train.launch`).

:func:`run_local` answers with the :class:`~crosskd.k8s.result.JobResult` the cluster launcher
gives (namespace ``local``, each replica's exit codes); :func:`run_local_job` is the launcher's
``local`` mode: the same job and result as :func:`crosskd.k8s.launcher.submit` (or
:class:`~crosskd.k8s.result.JobFailed` / :class:`~crosskd.k8s.result.JobTimeout`), run here.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from crosskd.errors import ConfigError
from crosskd.k8s.job import TRAIN_CONFIG_KEY
from crosskd.k8s.result import FINAL_MODEL_URI_ANNOTATION, JobFailed, JobResult, JobTimeout
from crosskd.k8s.trainjob import NODE, permanent_exit_codes, trainer_pod

log = logging.getLogger(__name__)

HOST_ENV = ("PATH", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV", "PYTHONPATH")
"""The only variables of this machine's environment a local replica inherits."""
CONTAINER = "pytorch"


@dataclass
class Replica:
    """One "pod": its replica ``kind`` (Master / Worker) and ``index``, node ``rank``, the
    command, environment and folder (its ``log.txt`` and volumes; the process runs in the
    current directory, so relative paths of a train config mean what they mean to ``crosskd
    train``), the running process and its recreations."""

    kind: str
    index: int
    rank: int
    command: list[str]
    env: dict[str, str]
    folder: Path
    process: subprocess.Popen | None = None
    recreated: int = 0
    exit_codes: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        """``master-0``, ``worker-0``, ... (the pod name's suffix)."""
        return f"{self.kind.lower()}-{self.index}"

    @property
    def log_path(self) -> Path:
        """The replica's log: every process of the "pod" writes its stdout there."""
        return self.folder / "log.txt"

    def start(self) -> None:
        """Start (or recreate) the replica's process, its stdout and stderr to ``log.txt``."""
        with self.log_path.open("a") as log_file:
            self.process = subprocess.Popen(
                self.command,
                env=self.env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the replica's entry point only (the kubelet signals PID 1)."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, sig)

    def kill_all(self) -> None:
        """SIGKILL every process of the "pod" (:func:`pod_processes`), as a container's end
        does: torch's agent starts its workers in sessions of their own, so they would outlive
        a killed process group."""
        for pid in pod_processes(self.log_path):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def pod_processes(log_path: str | Path) -> list[int]:
    """The pids of one local replica: every process whose stdout is its ``log.txt`` (the
    entry point and every worker it started inherit it), found in ``/proc``."""
    target = str(Path(log_path).resolve())
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if os.readlink(entry / "fd" / "1") == target:
                    pids.append(int(entry.name))
    return pids


def load_documents(path: str) -> list[dict]:
    """Every YAML document of a rendered job file (``crosskd job render`` or ``kubectl
    kustomize`` output); an unreadable file or one that is not YAML is a :class:`ConfigError`."""
    try:
        with open(path, encoding="utf-8") as fh:
            documents = [d for d in yaml.safe_load_all(fh) if d]
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror}).") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not YAML ({' '.join(str(exc).split())}).") from exc
    if not all(isinstance(d, dict) and "kind" in d for d in documents):
        raise ConfigError(f"{path}: every document must be a Kubernetes object with a kind.")
    return documents


def train_config_map(job: Mapping[str, Any], path: str) -> dict:
    """The ConfigMap the job mounts as its train config (the ``configMap`` volume of a
    PyTorchJob's Master's, else first Worker's, pod; of a TrainJob's patched ``node`` pod),
    holding the file at ``path`` under the mount's key (``train.yaml``): what ``kubectl create
    configmap NAME --from-file=train.yaml=PATH`` makes."""
    if job["kind"] == "TrainJob":
        (patch,) = job["spec"]["runtimePatches"]
        replicated = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        (node,) = [r for r in replicated if r["name"] == NODE]
        pod = node["template"]["spec"]["template"]["spec"]
    else:
        specs = job["spec"]["pytorchReplicaSpecs"]
        pod = specs.get("Master", specs.get("Worker"))["template"]["spec"]
    names = [v["configMap"]["name"] for v in pod.get("volumes", []) if "configMap" in v]
    if len(names) != 1:
        raise ConfigError(
            f"the job mounts {len(names)} ConfigMaps; --train-config needs exactly "
            f"one (the train config's)."
        )
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"train config {path}: cannot read it ({exc.strerror}).") from exc
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": names[0]},
        "data": {TRAIN_CONFIG_KEY: text},
    }


def run_local_job(
    documents: list[dict],
    workdir: str | Path,
    *,
    wait_timeout: float | None = None,
    max_recreations: int = 10,
) -> JobResult:
    """The launcher's ``local`` mode: run the job of ``documents`` with :func:`run_local` and
    answer as :func:`crosskd.k8s.launcher.submit` does: the :class:`JobResult` of a job that
    succeeded, its message followed by the replicas' exit codes.

    Raises:
        JobFailed: The job ended Failed (a permanent exit code, too many recreations).
        JobTimeout: ``wait_timeout`` seconds passed (the replicas are stopped).
    """
    outcome = run_local(documents, workdir, max_recreations=max_recreations, timeout=wait_timeout)
    result = replace(outcome, message=f"{outcome.message}; exit codes {outcome.exit_codes}")
    if outcome.succeeded:
        return result
    name = outcome.name
    kind = "TrainJob" if any(d.get("kind") == "TrainJob" for d in documents) else "PyTorchJob"
    first = "node-0" if kind == "TrainJob" else "master-0"
    where = Path(workdir) / first / "log.txt"
    if outcome.timed_out:
        raise JobTimeout(f"{kind} {name} (local): {outcome.message}; logs under {workdir}", result)
    raise JobFailed(
        f"{kind} {name} (local) failed: {outcome.message}; {first}'s log is {where}", result
    )


def run_local(
    documents: list[dict],
    workdir: str | Path,
    *,
    max_recreations: int = 10,
    timeout: float | None = None,
    settle: float = 30.0,
) -> JobResult:
    """Run the PyTorchJob of ``documents`` (with its ConfigMaps) under ``workdir`` (one folder
    per replica: ``log.txt``, mounted ConfigMaps and emptyDirs) until the job's result is known
    (module docstring); ``timeout`` seconds (None: no limit) stops and fails it. Once the Master
    has succeeded the other replicas get ``settle`` seconds to exit by themselves (their codes
    are recorded) before what is left is stopped.

    Returns:
        The job's :class:`JobResult`: namespace ``local``, condition ``Succeeded`` or ``Failed``,
        each replica's ``exit_codes``, ``timed_out`` when ``timeout`` stopped it, and
        ``final_model_uri`` from the job's ``crosskd/final-model-uri`` annotation when it
        succeeded.
    """
    started = time.monotonic()
    config_maps = {d["metadata"]["name"]: d for d in documents if d.get("kind") == "ConfigMap"}
    if any(d.get("kind") == "TrainJob" for d in documents):
        job = _only(documents, "TrainJob")
        replicas, rules = _trainjob_replicas(job, documents, config_maps, Path(workdir))
    else:
        job = _only(documents, "PyTorchJob")
        replicas = _replicas(job, config_maps, Path(workdir))
        rules = _operator_rules(job, replicas)
    for replica in replicas:
        replica.start()
    try:
        condition, message, timed_out = _supervise(
            replicas, rules, max_recreations, timeout, settle
        )
        log.info("job %s: %s", condition, message)
    finally:
        _stop(replicas)
    succeeded = condition == "Succeeded"
    annotations = job["metadata"].get("annotations") or {}
    return JobResult(
        name=job["metadata"]["name"],
        namespace="local",
        condition=condition,
        reason=None,
        message=message,
        succeeded=succeeded,
        final_model_uri=annotations.get(FINAL_MODEL_URI_ANNOTATION) if succeeded else None,
        elapsed_s=time.monotonic() - started,
        exit_codes={r.name: list(r.exit_codes) for r in replicas},
        timed_out=timed_out,
    )


@dataclass(frozen=True)
class _Rules:
    """How the controller treats the replicas' exits: ``permanent[kind]`` tells whether an
    exit code fails the job; ``restart_all``: a retryable exit recreates every replica (a
    JobSet restart) rather than the one that exited; ``done_when_master``: the job succeeds
    when the Master exits 0 (the Training Operator), else when every replica has (JobSet)."""

    permanent: dict[str, Callable[[int], bool]]
    restart_all: bool
    done_when_master: bool
    why: str
    """Why a permanent code is one, for the message (``permanent under ExitCode``)."""


def _supervise(
    replicas: list[Replica],
    rules: _Rules,
    max_recreations: int,
    timeout: float | None,
    settle: float,
) -> tuple[str, str, bool]:
    """Watch the started ``replicas`` by ``rules`` (module docstring), recreating those that
    exit retryably, until the job's condition is known; returns ``(condition, message,
    timed_out)``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    recreations = 0
    done: set[str] = set()
    while True:
        for replica in replicas:
            code = None if replica.process is None else replica.process.poll()
            if code is None:
                continue
            replica.exit_codes.append(code)
            replica.process = None
            replica.kill_all()  # the container ends with its main process
            if code == 0:
                done.add(replica.name)
                if rules.done_when_master and replica.kind == "Master":
                    _wait(replicas, settle)
                    return "Succeeded", "the Master exited 0", False
                if not rules.done_when_master and len(done) == len(replicas):
                    return "Succeeded", "every node exited 0", False
                continue
            if rules.permanent[replica.kind](code):
                return "Failed", f"{replica.name} exited {code} ({rules.why})", False
            recreations += 1
            if recreations > max_recreations:
                return "Failed", f"more than {max_recreations} recreations", False
            again = replicas if rules.restart_all else [replica]
            log.info("%s exited %d: recreating %s", replica.name, code, _names(again))
            if rules.restart_all:
                _stop(replicas)
                done.clear()
            for other in again:
                other.recreated += 1
                other.start()
            break
        if deadline is not None and time.monotonic() > deadline:
            return "Failed", f"not finished after {timeout} s", True
        time.sleep(0.2)


def _names(replicas: list[Replica]) -> str:
    return ", ".join(r.name for r in replicas)


def _operator_rules(job: dict, replicas: list[Replica]) -> _Rules:
    """The Training Operator's rules: each replica type's restart policy says which codes are
    permanent (:func:`_permanent`), a retryable exit recreates that replica alone, and the job
    succeeds when the Master exits 0."""
    policies = {r.kind: _restart_policy(job, r.kind) for r in replicas}
    return _Rules(
        permanent={
            kind: functools.partial(_permanent, policy) for kind, policy in policies.items()
        },
        restart_all=False,
        done_when_master=True,
        why="permanent under " + "/".join(sorted(set(policies.values()))),
    )


def _permanent(policy: str, code: int) -> bool:
    """Whether a replica that exited ``code`` fails the job under the restart ``policy`` (else
    it is recreated)."""
    if policy == "ExitCode":
        return 0 < code < 128  # negative: killed by a signal (a pod would see 128+n)
    return policy not in ("OnFailure", "Always")


def _wait(replicas: list[Replica], seconds: float) -> None:
    """Let running replicas exit by themselves for up to ``seconds``, recording their codes."""
    deadline = time.monotonic() + seconds
    for replica in replicas:
        if replica.process is None:
            continue
        try:
            replica.exit_codes.append(
                replica.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            )
            replica.process = None
        except subprocess.TimeoutExpired:
            continue


def _stop(replicas: list[Replica], grace: float = 30.0) -> None:
    """SIGTERM every running replica's entry point, then SIGKILL every process of each replica
    (its workers too) once it exited or ``grace`` seconds passed."""
    for replica in replicas:
        replica.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for replica in replicas:
        if replica.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                replica.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        replica.kill_all()
        if replica.process is not None:
            replica.process.wait()


def _only(documents: list[dict], kind: str) -> dict:
    found = [d for d in documents if d.get("kind") == kind]
    if len(found) != 1:
        raise ConfigError(f"the job file holds {len(found)} {kind} objects; give exactly one.")
    return found[0]


def _restart_policy(job: dict, kind: str) -> str:
    return job["spec"]["pytorchReplicaSpecs"][kind].get("restartPolicy", "OnFailure")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _replicas(job: dict, config_maps: dict[str, dict], workdir: Path) -> list[Replica]:
    spec = job["spec"]
    specs = spec["pytorchReplicaSpecs"]
    unknown = sorted(set(specs) - {"Master", "Worker"})
    if unknown:
        raise ConfigError(f"pytorchReplicaSpecs has {unknown}; only Master and Worker exist.")
    counts = {
        kind: int(specs[kind].get("replicas", 1)) for kind in ("Master", "Worker") if kind in specs
    }
    nproc = spec.get("nprocPerNode")
    nodes = sum(counts.values())
    operator = {"PYTHONUNBUFFERED": "1"}
    if nproc is not None:
        operator["PET_NPROC_PER_NODE"] = str(nproc)
    elastic = spec.get("elasticPolicy")
    if elastic is None:
        operator["PET_NNODES"] = str(nodes)
    else:
        port = _free_port()
        operator.update(
            {
                "PET_RDZV_BACKEND": elastic.get("rdzvBackend", "c10d"),
                "PET_RDZV_ENDPOINT": f"127.0.0.1:{port}",
                "PET_RDZV_ID": job["metadata"]["name"],
                "PET_NNODES": f"{elastic.get('minReplicas', nodes)}:"
                f"{elastic.get('maxReplicas', nodes)}",
            }
        )
    master_port = _free_port()
    per_node = int(nproc) if str(nproc).isdigit() else 1
    replicas = []
    for kind, count in counts.items():
        for index in range(count):
            rank = index if kind == "Master" else index + counts.get("Master", 0)
            env = dict(operator)
            if "Master" in counts:
                env.update(
                    {
                        "MASTER_ADDR": "127.0.0.1",
                        "PET_MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(master_port),
                        "PET_MASTER_PORT": str(master_port),
                        "WORLD_SIZE": str(nodes * per_node),
                        "RANK": str(rank),
                        "PET_NODE_RANK": str(rank),
                    }
                )
            folder = workdir / f"{kind.lower()}-{index}"
            if folder.exists():
                shutil.rmtree(folder)
            folder.mkdir(parents=True)
            replicas.append(
                _replica(
                    kind,
                    index,
                    rank,
                    specs[kind]["template"],
                    env,
                    config_maps,
                    folder,
                    rank * per_node,
                )
            )
    return replicas


def _trainjob_replicas(
    job: dict, documents: list[dict], config_maps: dict[str, dict], workdir: Path
) -> tuple[list[Replica], _Rules]:
    """The nodes of a TrainJob as Kubeflow Trainer's torch plugin starts them: ``numNodes``
    pods of its runtime's ``node`` pod with the job's patches and trainer fields
    (:func:`crosskd.k8s.trainjob.trainer_pod`), each with ``PET_NNODES``,
    ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK`` (its index), ``PET_MASTER_ADDR`` (127.0.0.1
    here, for ``<job>-node-0-0.<job>``) and ``PET_MASTER_PORT`` (a free port here, for the
    plugin's 29500). The runtime's ``FailJob`` exit codes fail the job, any other failure
    recreates every node (a JobSet restart), and the job succeeds once every node exited 0."""
    name = job["metadata"]["name"]
    ref = job["spec"].get("runtimeRef") or {}
    kind = ref.get("kind", "ClusterTrainingRuntime")
    runtimes = [
        d for d in documents if d.get("kind") == kind and d["metadata"]["name"] == ref.get("name")
    ]
    if len(runtimes) != 1:
        raise ConfigError(
            f"TrainJob {name} runs on {kind} {ref.get('name')!r}, which the job files do not "
            f"hold; add it (`kubectl kustomize manifests/trainjob-overlays/NAME` has it, or "
            f"manifests/trainjob/runtime.yaml)."
        )
    runtime = runtimes[0]
    trainer = job["spec"].get("trainer") or {}
    nodes = int(trainer.get("numNodes") or runtime["spec"]["mlPolicy"].get("numNodes") or 1)
    per_node = int(trainer.get("numProcPerNode") or 1)
    pod = trainer_pod(job, runtime)
    plugin = {
        "PYTHONUNBUFFERED": "1",
        "PET_NNODES": str(nodes),
        "PET_NPROC_PER_NODE": str(per_node),
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(_free_port()),
    }
    replicas = []
    for index in range(nodes):
        folder = workdir / f"node-{index}"
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        env = plugin | {"PET_NODE_RANK": str(index)}
        replicas.append(
            _replica("Node", index, index, pod, env, config_maps, folder, index * per_node, NODE)
        )
    codes = permanent_exit_codes(runtime)
    rules = _Rules(
        permanent={"Node": lambda code: code in codes},
        restart_all=True,
        done_when_master=False,
        why=f"a FailJob exit code of {kind} {ref.get('name')}",
    )
    return replicas, rules


def _replica(
    kind: str,
    index: int,
    rank: int,
    template: dict,
    operator_env: dict[str, str],
    config_maps: dict[str, dict],
    folder: Path,
    port_shift: int,
    container_name: str = CONTAINER,
) -> Replica:
    pod = template["spec"]
    containers = [c for c in pod["containers"] if c["name"] == container_name]
    if not containers:
        raise ConfigError(
            f"{kind} has no container named {container_name!r} (the controller needs it)."
        )
    container = containers[0]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts: dict[str, Path] = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        local = folder / "volumes" / mount["name"]
        local.mkdir(parents=True, exist_ok=True)
        if "configMap" in volume:
            wanted = volume["configMap"]["name"]
            if wanted not in config_maps:
                raise ConfigError(
                    f"{kind} mounts ConfigMap {wanted!r}, which the job files do not hold; add "
                    f"it (kubectl kustomize output has it) or give --train-config FILE."
                )
            data = config_maps[wanted].get("data", {})
            for key, text in data.items():
                (local / key).write_text(_shift_metrics_port(text, port_shift))
        mounts[mount["mountPath"].rstrip("/")] = local

    def mapped(value: str) -> str:
        for path in sorted(mounts, key=len, reverse=True):
            if value == path or value.startswith(path + "/"):
                return str(mounts[path]) + value[len(path) :]
        return value

    env = {k: os.environ[k] for k in HOST_ENV if k in os.environ}
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    for item in container.get("env", []):
        env_value = _env_value(item, config_maps)
        if env_value is not None:
            env[item["name"]] = mapped(env_value)
    env.update(operator_env)
    command = [
        _shift_metrics_arg(mapped(x), port_shift)
        for x in [*container.get("command", []), *container.get("args", [])]
    ]
    if not command:
        raise ConfigError(f"{kind}'s container has no command; crosskd's image runs `crosskd`.")
    executable = shutil.which(command[0], path=env["PATH"])
    if executable is None:
        raise ConfigError(f"{kind}'s command {command[0]!r} is not on PATH here.")
    return Replica(kind, index, rank, [executable, *command[1:]], env, folder)


def _env_value(item: dict, config_maps: dict[str, dict]) -> str | None:
    if "value" in item:
        return str(item["value"])
    source = item.get("valueFrom", {})
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        if item["name"] in os.environ:
            return os.environ[item["name"]]
        if ref.get("optional"):
            return None
        raise ConfigError(
            f"env {item['name']} comes from secret {ref.get('name')} key {ref.get('key')}; "
            f"locally it is read from this machine's {item['name']}, which is not set."
        )
    if "configMapKeyRef" in source:
        ref = source["configMapKeyRef"]
        return config_maps.get(ref["name"], {}).get("data", {}).get(ref["key"])
    return None


def _shift_metrics_arg(arg: str, shift: int) -> str:
    """A ``metrics_port=N`` override moved by ``shift`` (other arguments unchanged)."""
    key, sep, value = arg.partition("=")
    if key != "metrics_port" or not sep or not value.isdigit() or int(value) == 0:
        return arg
    return f"metrics_port={int(value) + shift}"


def _shift_metrics_port(text: str, shift: int) -> str:
    """A train config with its ``metrics_port`` moved by ``shift`` (0: any free port stays)."""
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if not isinstance(values, dict) or not values.get("metrics_port") or not shift:
        return text
    values["metrics_port"] = int(values["metrics_port"]) + shift
    return yaml.safe_dump(values, sort_keys=False)
