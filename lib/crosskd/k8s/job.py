"""The one PyTorchJob spec of a crosskd training run (``crosskd job render``).

``build_job(config)`` turns a :class:`JobConfig` into a ``kubeflow.org/v1`` ``PyTorchJob``
built only from the official models (``kubeflow.training.models`` and ``kubernetes.client``);
``job_manifest(config)`` is the same job as the camelCase mapping the API server takes
(``ApiClient().sanitize_for_serialization``: never ``to_dict()``, whose keys are snake_case).
The launcher submits it, and ``manifests/base/pytorchjob.yaml`` is generated from it.

The job's shape:

* ``nodes`` pods; each runs ``crosskd train --config /etc/crosskd/train.yaml --nproc-per-node N
  metrics_port=<metrics_port>`` (torch's elastic agent around ``N`` workers,
  :mod:`crosskd.train.launch`), ``N`` = ``gpus_per_node`` on GPU (``cpu_procs_per_node`` on
  CPU), which is also ``spec.nprocPerNode`` and the ``nvidia.com/gpu`` limit: the job config is
  the one source of the GPU count. Nothing passes a node rank; the operator injects it.
* By default a ``Master`` (1 replica) and ``nodes - 1`` ``Worker`` replicas (no Worker entry on
  one node): the operator sets ``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``/``RANK`` only when
  a Master exists, and the entry point uses a static rendezvous from them, ``PET_NNODES`` and
  ``PET_NODE_RANK``. ``elastic: true`` renders ``nodes`` Workers and an ``elasticPolicy`` (c10d
  on ``<job>-worker-0``, ``PET_RDZV_*``): losing one pod then restarts them all.
* Restart policy ``ExitCode``: codes >= 128 recreate the pod, 1..127 fail the job (the table of
  :mod:`crosskd.train.launch`); the job succeeds when the Master exits 0.
* Metrics: worker ``LOCAL_RANK = i`` serves ``/metrics`` on ``metrics_port + i``; each pod has
  one named container port ``metrics-i`` per local rank (plus the operator's
  ``pytorchjob-port`` 23456). A PodMonitor selects the pods by ``app.kubernetes.io/name:
  crosskd`` and ``crosskd.dev/run: <run_id>`` (or the operator's
  ``training.kubeflow.org/job-name``) and scrapes ``metrics-0`` ... ``metrics-{N-1}``.
* The train config is the ConfigMap ``train_config_map`` (key ``train.yaml``) mounted at
  ``/etc/crosskd/train.yaml``, or, with ``train_config_uri``, a file on object storage (the
  pipeline's training step writes it next to the run); S3 credentials come only from
  ``secretKeyRef`` env.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import yaml
from kubeflow.training import models as kf
from kubernetes import client as k8s
from kubernetes.utils import parse_quantity

from crosskd.config import load_config
from crosskd.errors import ConfigError, CrosskdError
from crosskd.parallel.layout import ParallelLayout
from crosskd.ranges import NODE_CACHE_BYTES_ENV, NODE_CACHE_ENV

CONTAINER = "pytorch"
"""The container name the Training Operator requires."""
OPERATOR_PORT = 23456
"""The operator's rendezvous port (named ``pytorchjob-port``)."""
TRAIN_CONFIG_DIR = "/etc/crosskd"
TRAIN_CONFIG_KEY = "train.yaml"
TRAIN_CONFIG_PATH = f"{TRAIN_CONFIG_DIR}/{TRAIN_CONFIG_KEY}"
HOME = "/home/crosskd"
CACHE = "/cache"
NODE_CACHE = "/node-cache"
"""Where the pod's workers share the byte ranges of data and cache shards they fetch
(:class:`crosskd.ranges.NodeCache`)."""
NODE_CACHE_PERCENT = 90
"""The percentage of ``node_cache_size`` the ranges may fill (the rest: files being written)."""
USER_ID = 1000
RUN_LABEL = "crosskd.dev/run"
NAME_LABELS = {"app.kubernetes.io/name": "crosskd", "app.kubernetes.io/component": "trainer"}
KUEUE_LABEL = "kueue.x-k8s.io/queue-name"
MAX_NAME = 52
"""A job name's limit: the operator names Services ``<job>-worker-<i>``, a DNS-1035 label of at
most 63 characters, so 52 leaves room for ``-worker-999``."""
CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
TEACHER_TOKEN_ENV = "CROSSKD_TEACHER_TOKEN"
"""The teacher servers' bearer token in a training pod (``crosskd.teacher.remote`` reads it)."""

T = TypeVar("T")

_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
_TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds"}


@dataclass
class JobConfig:
    """One training run as a PyTorchJob. Sizes are Kubernetes quantities (``16Gi``, ``500m``)."""

    run_id: str
    """The run this job trains: the job's name derives from it (:func:`job_name`, so a retried
    launcher finds its job) and pods carry it as the label ``crosskd.dev/run`` (a label value:
    at most 63 letters, digits, ``-_.``, starting and ending alphanumeric)."""
    image: str
    """The crosskd image (``images/``), e.g. ``registry.example.com/crosskd:0.1.0-cuda``."""
    image_pull_policy: str = "IfNotPresent"
    """``Always``, ``IfNotPresent`` or ``Never``."""
    image_pull_secrets: list[str] = field(default_factory=list)
    """Names of docker-registry Secrets for a private registry."""
    name: str | None = None
    """The job's name (a DNS-1035 label of at most 52 characters); None: ``job_name(run_id)``."""
    namespace: str | None = None
    """``metadata.namespace``; None: the namespace it is applied to (kustomize's, the
    launcher's)."""
    nodes: int = 1
    """Pods (one per node); the world is ``nodes * procs per node`` workers."""
    gpus_per_node: int = 0
    """GPUs per pod: the ``nvidia.com/gpu`` limit, ``spec.nprocPerNode`` and the entry point's
    ``--nproc-per-node``. 0: a CPU job."""
    cpu_procs_per_node: int = 1
    """Workers per pod of a CPU job (``gpus_per_node: 0``); unused on GPU."""
    gpu_resource: str = "nvidia.com/gpu"
    """The extended resource name of a GPU."""
    elastic: bool = False
    """Worker-only replicas with an elastic c10d rendezvous (``elasticPolicy``) instead of
    Master + Workers; one lost pod restarts every pod's workers."""
    min_nodes: int | None = None
    """Elastic only: the fewest pods the rendezvous accepts (``minReplicas``); None: ``nodes``."""
    cpu: str = "4"
    """CPU request per pod."""
    memory: str = "16Gi"
    """Memory request per pod."""
    memory_limit: str | None = None
    """Memory limit per pod (``/dev/shm`` use counts against it); None: ``memory``."""
    node_selector: dict[str, str] = field(default_factory=dict)
    """Node labels a pod needs, e.g. ``{nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}``."""
    tolerations: list[dict] = field(default_factory=list)
    """Pod tolerations as Kubernetes writes them (``key``, ``operator``, ``value``,
    ``effect``, ``tolerationSeconds``), e.g. ``[{key: nvidia.com/gpu, operator: Exists,
    effect: NoSchedule}]``."""
    priority_class: str | None = None
    """The pods' ``priorityClassName`` (and the gang's, with ``gang_scheduling``)."""
    queue_name: str | None = None
    """A Kueue LocalQueue: the job's label ``kueue.x-k8s.io/queue-name``."""
    gang_scheduling: bool = False
    """Set ``runPolicy.schedulingPolicy`` (all ``nodes`` pods start together; needs the
    operator's gang scheduler, Volcano or scheduler-plugins)."""
    scheduling_queue: str | None = None
    """The gang scheduler's queue (``schedulingPolicy.queue``, Volcano)."""
    schedule_timeout_seconds: int | None = None
    """How long the gang may wait to be scheduled (``schedulingPolicy.scheduleTimeoutSeconds``)."""
    shm_size: str = "8Gi"
    """Size limit of ``/dev/shm`` (an emptyDir in memory; NCCL and DataLoader workers use it)."""
    cache_size: str = "50Gi"
    """Size limit of the emptyDir at ``/cache`` (``CROSSKD_CACHE_DIR``, ``HF_HOME``)."""
    node_cache_size: str = "20Gi"
    """Size limit of the emptyDir at ``/node-cache`` (``CROSSKD_NODE_CACHE``): the byte ranges
    of prepared-data and teacher-cache shards the pod's workers fetched from object storage,
    each fetched once per pod and shared, the least recently used dropped past 90% of it."""
    nccl_debug: str = "WARN"
    """``NCCL_DEBUG``: ``VERSION``, ``WARN``, ``INFO`` or ``TRACE``."""
    nccl_trace_buffer_size: int = 2000
    """``TORCH_NCCL_TRACE_BUFFER_SIZE``: collectives the flight recorder keeps (dumped on a
    timeout, ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``); 0 turns it off."""
    env: dict[str, str] = field(default_factory=dict)
    """More plain environment variables (e.g. ``NCCL_SOCKET_IFNAME``); never credentials."""
    s3_secret: str | None = None
    """A Secret with keys ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY`` (optionally
    ``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``), read as ``secretKeyRef`` env. None: no keys
    (e.g. IAM roles for service accounts)."""
    s3_endpoint_url: str | None = None
    """``AWS_ENDPOINT_URL`` as a plain value (MinIO, Ceph); None: the Secret's, if any."""
    s3_region: str | None = None
    """``AWS_DEFAULT_REGION`` as a plain value; None: the Secret's, if any."""
    teacher_token_secret: str | None = None
    """A Secret holding the bearer token of the teacher servers the train config's
    ``teachers:`` URLs name, read as the ``secretKeyRef`` env ``CROSSKD_TEACHER_TOKEN``. None:
    no token (cached teachers, or servers with ``auth: none``)."""
    teacher_token_key: str = "token"
    """The token's key in ``teacher_token_secret``."""
    train_config_map: str = "crosskd-train"
    """The ConfigMap whose key ``train.yaml`` is the train config (``crosskd train`` keys),
    mounted at ``/etc/crosskd/train.yaml``. Its ``metrics_port`` is overridden on the command
    line by this job's."""
    train_config_uri: str | None = None
    """Read the train config from this fsspec URI (e.g. ``s3://bucket/runs/RUN/kd/train.yaml``,
    written by the pipeline's training step) instead of the ConfigMap: no ConfigMap is mounted.
    None: the ConfigMap ``train_config_map``."""
    train_overrides: list[str] = field(default_factory=list)
    """``key=value`` overrides appended to the train command (e.g. ``steps=2000``,
    ``parallel.dp_shard=8``). Its ``parallel.*`` keys, over the train config's ``parallel:``
    where that is known (:func:`job_layout`), must fit the job's ``nodes * procs per node``
    workers."""
    metrics_port: int = 9400
    """Base Prometheus port: local rank ``i`` serves ``metrics_port + i`` (port ``metrics-i``)."""
    grace_seconds: int = 120
    """``terminationGracePeriodSeconds``, also given as ``CROSSKD_GRACE_SECONDS``: after SIGTERM
    the workers finish their step and checkpoint within it (then SIGKILL)."""
    restart_policy: str = "ExitCode"
    """``ExitCode`` (>= 128 retried, 1..127 permanent), ``OnFailure``, ``Never`` or ``Always``."""
    backoff_limit: int = 3
    """``runPolicy.backoffLimit`` (counted under ``OnFailure``; ``ExitCode`` ignores it and
    crosskd's own restart budget, ``max_restarts`` of the train config, applies)."""
    active_deadline_seconds: int | None = 7 * 24 * 3600
    """``runPolicy.activeDeadlineSeconds``: the job fails past it; None: no deadline."""
    ttl_seconds_after_finished: int | None = 24 * 3600
    """``runPolicy.ttlSecondsAfterFinished``: the finished job (and pods) are deleted after it;
    None: kept."""
    clean_pod_policy: str = "Running"
    """``runPolicy.cleanPodPolicy`` at the end: ``Running`` (delete pods still running),
    ``All`` or ``None``."""
    service_account: str | None = None
    """The pods' service account (e.g. one with an IAM role for S3); None: the namespace's
    ``default``. Its token is not mounted (the trainer never calls the Kubernetes API)."""
    ipc_lock: bool = False
    """Add the ``IPC_LOCK`` capability (and only it; every other one stays dropped): RDMA /
    InfiniBand overlays pin memory with it."""
    labels: dict[str, str] = field(default_factory=dict)
    """More labels for the job and its pods."""

    def __post_init__(self) -> None:
        self.check()

    @property
    def procs_per_node(self) -> int:
        """Workers per pod: ``gpus_per_node`` on GPU, ``cpu_procs_per_node`` on CPU."""
        return self.gpus_per_node or self.cpu_procs_per_node

    def check(self) -> None:
        """Refuse bad values naming the key."""
        self._check_names()
        self._check_numbers()
        self._check_quantities()
        self._check_strings()
        self._check_tolerations()

    def _check_names(self) -> None:
        """Refuse a bad ``run_id``, ``image`` or ``name``, or a value outside its choices."""
        if (
            not isinstance(self.run_id, str)
            or not self.run_id
            or len(self.run_id) > 63
            or not _LABEL_VALUE.fullmatch(self.run_id)
        ):
            raise ConfigError(
                f"run_id is {self.run_id!r}; it must be a label value: 1..63 letters, digits, "
                f"'-', '_' or '.', starting and ending with a letter or digit."
            )
        _str("image", self.image)
        if any(c.isspace() for c in self.image):
            raise ConfigError(f"image is {self.image!r}; it must not contain spaces.")
        _choice("image_pull_policy", self.image_pull_policy, ("Always", "IfNotPresent", "Never"))
        _choice("restart_policy", self.restart_policy, ("ExitCode", "OnFailure", "Never", "Always"))
        _choice("clean_pod_policy", self.clean_pod_policy, ("Running", "All", "None"))
        _choice("nccl_debug", self.nccl_debug, ("VERSION", "WARN", "INFO", "TRACE"))
        if self.name is not None and (
            not isinstance(self.name, str)
            or len(self.name) > MAX_NAME
            or not _DNS1035.fullmatch(self.name)
        ):
            raise ConfigError(
                f"name is {self.name!r}; it must be a DNS-1035 label of at most {MAX_NAME} "
                f"characters (lowercase letters, digits, '-', starting with a letter), or unset."
            )

    def _check_numbers(self) -> None:
        """Refuse bad counts, ports, seconds and switches."""
        for key in ("nodes", "cpu_procs_per_node"):
            _int(key, getattr(self, key), 1)
        for key in ("gpus_per_node", "nccl_trace_buffer_size", "backoff_limit"):
            _int(key, getattr(self, key), 0)
        _int("grace_seconds", self.grace_seconds, 1)
        _int("metrics_port", self.metrics_port, 1)
        if self.metrics_port + self.procs_per_node - 1 > 65535 or OPERATOR_PORT in range(
            self.metrics_port, self.metrics_port + self.procs_per_node
        ):
            raise ConfigError(
                f"metrics_port is {self.metrics_port}; ports metrics_port .. metrics_port + "
                f"{self.procs_per_node - 1} must be <= 65535 and leave out {OPERATOR_PORT}."
            )
        for key in (
            "active_deadline_seconds",
            "ttl_seconds_after_finished",
            "schedule_timeout_seconds",
        ):
            if getattr(self, key) is not None:
                _int(key, getattr(self, key), 0 if key == "ttl_seconds_after_finished" else 1)
        if self.min_nodes is not None:
            _int("min_nodes", self.min_nodes, 1)
            if not self.elastic or self.min_nodes > self.nodes:
                raise ConfigError(
                    f"min_nodes is {self.min_nodes}; it needs elastic: true and must be <= "
                    f"nodes ({self.nodes})."
                )
        for key in ("elastic", "gang_scheduling", "ipc_lock"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key} is {getattr(self, key)!r}; it must be true or false.")

    def _check_quantities(self) -> None:
        """Refuse sizes that are not Kubernetes quantities (numbers become strings)."""
        for key in ("cpu", "memory", "memory_limit", "shm_size", "cache_size", "node_cache_size"):
            value = getattr(self, key)
            if value is not None or key != "memory_limit":
                setattr(self, key, quantity(key, value))

    def _check_strings(self) -> None:
        """Refuse bad strings, maps and lists, and credentials given as plain ``env``."""
        for key in ("gpu_resource", "train_config_map", "teacher_token_key"):
            _str(key, getattr(self, key))
        if self.train_config_uri is not None:
            _str("train_config_uri", self.train_config_uri)
            if any(c.isspace() for c in self.train_config_uri):
                raise ConfigError(
                    f"train_config_uri is {self.train_config_uri!r}; it must not contain spaces."
                )
        for key in (
            "namespace",
            "priority_class",
            "queue_name",
            "scheduling_queue",
            "s3_secret",
            "s3_endpoint_url",
            "s3_region",
            "service_account",
            "teacher_token_secret",
        ):
            if getattr(self, key) is not None:
                _str(key, getattr(self, key))
        for key in ("node_selector", "env", "labels"):
            _str_map(key, getattr(self, key))
        for key in ("image_pull_secrets", "train_overrides"):
            value = getattr(self, key)
            if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                raise ConfigError(f"{key} is {value!r}; it must be a list of strings.")
        for i, item in enumerate(self.train_overrides):
            if "=" not in item:
                raise ConfigError(f"train_overrides[{i}] is {item!r}; write it as key=value.")
        if any(item.startswith("parallel.") for item in self.train_overrides):
            job_layout(self)
        refused = sorted(
            set(self.env)
            & {*CREDENTIAL_ENV, "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", TEACHER_TOKEN_ENV}
        )
        if refused:
            raise ConfigError(
                f"env sets {', '.join(refused)}; give credentials through s3_secret and "
                f"teacher_token_secret (Secrets) and the endpoint/region as s3_endpoint_url / "
                f"s3_region."
            )

    def _check_tolerations(self) -> None:
        """Refuse tolerations Kubernetes would not take."""
        check_tolerations(self.tolerations)


def load_job_config(
    path: str | None = None, overrides: Sequence[str] = (), values: Mapping[str, Any] | None = None
) -> JobConfig:
    """A :class:`JobConfig` from a YAML file (any fsspec URI), then ``values``, then ``key=value``
    overrides (:func:`crosskd.config.load_config`); a bad one is a :class:`ConfigError`."""
    return load_checked(JobConfig, "job", path, overrides, values)


def load_checked(
    cls: type[T],
    what: str,
    path: str | None = None,
    overrides: Sequence[str] = (),
    values: Mapping[str, Any] | None = None,
) -> T:
    """A ``cls`` config from a YAML file (any fsspec URI), then ``values`` (refused naming the
    ``what`` keys ``cls`` does not know), then ``key=value`` overrides
    (:func:`crosskd.config.load_config`); any bad one is a :class:`ConfigError`."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values or {}) - known)
    if unknown:
        raise ConfigError(
            f"unknown {what} key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(known))}."
        )
    try:
        return load_config(cls, path, overrides, flags=values)
    except ConfigError:
        raise
    except CrosskdError as exc:
        raise ConfigError(str(exc)) from exc


def job_name(run_id: str) -> str:
    """The job name of a run: ``crosskd-<slug>-<10 hex of sha256(run_id)>``, a DNS-1035 label of
    at most 52 characters, the same for the same ``run_id`` (a retried launcher finds its job)
    and different for ids that slug alike."""
    slug = re.sub(r"[^a-z0-9]+", "-", run_id.lower()).strip("-")[:33].rstrip("-")
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:10]
    return f"crosskd-{slug}-{digest}" if slug else f"crosskd-{digest}"


def build_job(config: JobConfig) -> kf.KubeflowOrgV1PyTorchJob:
    """The PyTorchJob of ``config`` (the module docstring has its shape)."""
    name = config.name or job_name(config.run_id)
    labels = {**NAME_LABELS, RUN_LABEL: config.run_id, **config.labels}
    job_labels = dict(labels)
    if config.queue_name:
        job_labels[KUEUE_LABEL] = config.queue_name
    if config.elastic:
        replicas = {"Worker": config.nodes}
    else:
        replicas = {"Master": 1, **({"Worker": config.nodes - 1} if config.nodes > 1 else {})}
    specs = {
        kind: kf.KubeflowOrgV1ReplicaSpec(
            replicas=count,
            restart_policy=config.restart_policy,
            template=_pod_template(config, labels),
        )
        for kind, count in replicas.items()
    }
    elastic = None
    if config.elastic:
        elastic = kf.KubeflowOrgV1ElasticPolicy(
            rdzv_backend="c10d",
            rdzv_id=name,
            min_replicas=config.min_nodes or config.nodes,
            max_replicas=config.nodes,
        )
    scheduling = None
    if config.gang_scheduling:
        scheduling = kf.KubeflowOrgV1SchedulingPolicy(
            min_available=config.nodes,
            queue=config.scheduling_queue,
            priority_class=config.priority_class,
            schedule_timeout_seconds=config.schedule_timeout_seconds,
        )
    return kf.KubeflowOrgV1PyTorchJob(
        api_version="kubeflow.org/v1",
        kind="PyTorchJob",
        metadata=k8s.V1ObjectMeta(name=name, namespace=config.namespace, labels=job_labels),
        spec=kf.KubeflowOrgV1PyTorchJobSpec(
            nproc_per_node=str(config.procs_per_node),
            elastic_policy=elastic,
            pytorch_replica_specs=specs,
            run_policy=kf.KubeflowOrgV1RunPolicy(
                backoff_limit=config.backoff_limit,
                active_deadline_seconds=config.active_deadline_seconds,
                ttl_seconds_after_finished=config.ttl_seconds_after_finished,
                clean_pod_policy=config.clean_pod_policy,
                scheduling_policy=scheduling,
            ),
        ),
    )


def job_layout(
    config: JobConfig, train_parallel: Mapping[str, Any] | None = None
) -> ParallelLayout:
    """The parallel layout the job's workers train with: ``train_parallel`` (the train config's
    ``parallel:``; None: unknown here, the defaults) with the job's ``parallel.*``
    ``train_overrides`` over it, resolved for ``nodes * procs per node`` workers; a layout that
    does not fit them is refused naming both sides."""
    values = dict(train_parallel or {})
    for item in config.train_overrides:
        key, _, raw = item.partition("=")
        if key.startswith("parallel."):
            values[key.removeprefix("parallel.")] = yaml.safe_load(raw)
    world = config.nodes * config.procs_per_node
    layout = ParallelLayout.from_mapping(values)
    layout.check()
    try:
        return layout.resolved(world)
    except ConfigError as exc:
        raise ConfigError(
            f"the train layout parallel {values} does not fit this job's {config.nodes} "
            f"node(s) x {config.procs_per_node} process(es) = {world} workers: "
            f"{exc} Change nodes / gpus_per_node or the "
            f"parallel.* train_overrides."
        ) from exc


def job_manifest(config: JobConfig) -> dict[str, Any]:
    """``build_job(config)`` as the camelCase mapping the API server takes (no None values)."""
    return k8s.ApiClient().sanitize_for_serialization(build_job(config))


def train_command(config: JobConfig) -> list[str]:
    """The container's command: the pod's entry point around ``procs_per_node`` workers."""
    return [
        "crosskd",
        "train",
        "--config",
        config.train_config_uri or TRAIN_CONFIG_PATH,
        "--nproc-per-node",
        str(config.procs_per_node),
        f"metrics_port={config.metrics_port}",
        *config.train_overrides,
    ]


def _pod_template(config: JobConfig, labels: dict[str, str]) -> k8s.V1PodTemplateSpec:
    """Every replica's pod: the ``pytorch`` container, its volumes, scheduling and security."""
    return k8s.V1PodTemplateSpec(
        metadata=k8s.V1ObjectMeta(
            labels=dict(labels), annotations={"sidecar.istio.io/inject": "false"}
        ),
        spec=k8s.V1PodSpec(
            containers=[_container(config)],
            volumes=pod_volumes(config),
            termination_grace_period_seconds=config.grace_seconds,
            node_selector=dict(config.node_selector) or None,
            tolerations=pod_tolerations(config.tolerations),
            priority_class_name=config.priority_class,
            service_account_name=config.service_account,
            automount_service_account_token=False,
            image_pull_secrets=[
                k8s.V1LocalObjectReference(name=n) for n in config.image_pull_secrets
            ]
            or None,
            security_context=pod_security_context(),
        ),
    )


def _container(config: JobConfig) -> k8s.V1Container:
    """The ``pytorch`` container: the train command, its ports, resources and mounts."""
    ports = [k8s.V1ContainerPort(name="pytorchjob-port", container_port=OPERATOR_PORT)]
    ports += [
        k8s.V1ContainerPort(name=f"metrics-{i}", container_port=config.metrics_port + i)
        for i in range(config.procs_per_node)
    ]
    return k8s.V1Container(
        name=CONTAINER,
        image=config.image,
        image_pull_policy=config.image_pull_policy,
        command=train_command(config),
        env=container_env(config),
        ports=ports,
        resources=node_resources(config),
        volume_mounts=container_mounts(config),
        security_context=container_security(config),
    )


def node_resources(config: JobConfig) -> k8s.V1ResourceRequirements:
    """A training pod's requests (``cpu``, ``memory``) and limits (memory, the GPUs)."""
    limits = {"memory": config.memory_limit or config.memory}
    if config.gpus_per_node:
        limits[config.gpu_resource] = str(config.gpus_per_node)
    return k8s.V1ResourceRequirements(
        requests={"cpu": config.cpu, "memory": config.memory}, limits=limits
    )


def container_mounts(config: JobConfig) -> list[k8s.V1VolumeMount]:
    """Where the training container mounts :func:`pod_volumes`."""
    config_mount = (
        []
        if config.train_config_uri
        else [k8s.V1VolumeMount(name="train-config", mount_path=TRAIN_CONFIG_DIR, read_only=True)]
    )
    return [
        k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm"),
        *config_mount,
        k8s.V1VolumeMount(name="home", mount_path=HOME),
        k8s.V1VolumeMount(name="cache", mount_path=CACHE),
        k8s.V1VolumeMount(name="node-cache", mount_path=NODE_CACHE),
    ]


def container_security(config: JobConfig) -> k8s.V1SecurityContext:
    """The training container's security context: no privilege escalation, non-root, every
    capability dropped (``IPC_LOCK`` added back with ``ipc_lock``)."""
    return k8s.V1SecurityContext(
        allow_privilege_escalation=False,
        run_as_non_root=True,
        capabilities=k8s.V1Capabilities(
            drop=["ALL"], add=["IPC_LOCK"] if config.ipc_lock else None
        ),
    )


def pod_volumes(config: JobConfig) -> list[k8s.V1Volume]:
    """The pod's volumes: ``/dev/shm`` in memory, the train config's ConfigMap (unless it comes
    from ``train_config_uri``), and the emptyDirs of home, cache and node cache."""
    return [
        k8s.V1Volume(
            name="dshm",
            empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory", size_limit=config.shm_size),
        ),
        *(
            []
            if config.train_config_uri
            else [
                k8s.V1Volume(
                    name="train-config",
                    config_map=k8s.V1ConfigMapVolumeSource(
                        name=config.train_config_map,
                        items=[k8s.V1KeyToPath(key=TRAIN_CONFIG_KEY, path=TRAIN_CONFIG_KEY)],
                    ),
                )
            ]
        ),
        k8s.V1Volume(name="home", empty_dir=k8s.V1EmptyDirVolumeSource(size_limit="1Gi")),
        k8s.V1Volume(
            name="cache", empty_dir=k8s.V1EmptyDirVolumeSource(size_limit=config.cache_size)
        ),
        k8s.V1Volume(
            name="node-cache",
            empty_dir=k8s.V1EmptyDirVolumeSource(size_limit=config.node_cache_size),
        ),
    ]


def container_env(config: JobConfig) -> list[k8s.V1EnvVar]:
    plain = {
        "HOME": HOME,
        "CROSSKD_CACHE_DIR": f"{CACHE}/crosskd",
        "HF_HOME": f"{CACHE}/huggingface",
        NODE_CACHE_ENV: NODE_CACHE,
        NODE_CACHE_BYTES_ENV: str(
            int(parse_quantity(config.node_cache_size)) * NODE_CACHE_PERCENT // 100
        ),
        "CROSSKD_GRACE_SECONDS": str(config.grace_seconds),
        "NCCL_DEBUG": config.nccl_debug,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1" if config.nccl_trace_buffer_size else "0",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(config.nccl_trace_buffer_size),
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        **config.env,
    }
    env = [k8s.V1EnvVar(name=k, value=v) for k, v in plain.items()]
    if config.teacher_token_secret:
        env.append(
            secret_env(TEACHER_TOKEN_ENV, config.teacher_token_secret, config.teacher_token_key)
        )
    return env + s3_env(config.s3_secret, config.s3_endpoint_url, config.s3_region)


def secret_env(name: str, secret: str, key: str, optional: bool = False) -> k8s.V1EnvVar:
    """The env variable ``name`` read from key ``key`` of the Secret ``secret``
    (``secretKeyRef``; ``optional``: the pod starts without it)."""
    return k8s.V1EnvVar(
        name=name,
        value_from=k8s.V1EnvVarSource(
            secret_key_ref=k8s.V1SecretKeySelector(
                name=secret, key=key, optional=True if optional else None
            )
        ),
    )


def s3_env(secret: str | None, endpoint_url: str | None, region: str | None) -> list[k8s.V1EnvVar]:
    """The S3 environment of a pod: ``AWS_ENDPOINT_URL`` / ``AWS_DEFAULT_REGION`` as plain values
    where given, and with a ``secret``, ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY`` (and
    the optional endpoint and region not given as values) as ``secretKeyRef``."""
    optional = {"AWS_ENDPOINT_URL": endpoint_url, "AWS_DEFAULT_REGION": region}
    env = [k8s.V1EnvVar(name=k, value=v) for k, v in optional.items() if v is not None]
    if secret:
        keys = [(k, False) for k in CREDENTIAL_ENV[:2]]
        keys += [(k, True) for k, v in optional.items() if v is None]
        env += [secret_env(k, secret, k, optional=opt) for k, opt in keys]
    return env


def pod_security_context() -> k8s.V1PodSecurityContext:
    """A crosskd pod's security context: the image's user 1000 (non-root, checked by the
    kubelet), group 1000 owning the volumes, the ``RuntimeDefault`` seccomp profile."""
    return k8s.V1PodSecurityContext(
        run_as_non_root=True,
        run_as_user=USER_ID,
        run_as_group=USER_ID,
        fs_group=USER_ID,
        seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
    )


def pod_tolerations(tolerations: list[dict]) -> list[k8s.V1Toleration] | None:
    """Tolerations as Kubernetes writes them (checked by :func:`check_tolerations`) as the
    client's models; None for none."""
    return [
        k8s.V1Toleration(
            key=t.get("key"),
            operator=t.get("operator"),
            value=t.get("value"),
            effect=t.get("effect"),
            toleration_seconds=t.get("tolerationSeconds"),
        )
        for t in tolerations
    ] or None


def quantity(key: str, value: object) -> str:
    """``value`` as a Kubernetes quantity string (a number becomes one); refused naming
    ``key`` when it is not one."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not _QUANTITY.fullmatch(value):
        raise ConfigError(
            f"{key} is {value!r}; it must be a Kubernetes quantity such as 4, 500m, 16Gi."
        )
    return value


def check_tolerations(tolerations: object) -> None:
    """Refuse tolerations Kubernetes would not take (a list of mappings of ``key``,
    ``operator``, ``value``, ``effect``, ``tolerationSeconds``)."""
    if not isinstance(tolerations, list):
        raise ConfigError(f"tolerations is {tolerations!r}; it must be a list.")
    for i, tol in enumerate(tolerations):
        bad = sorted(set(tol) - _TOLERATION_KEYS) if isinstance(tol, dict) else None
        if bad is None or bad:
            raise ConfigError(
                f"tolerations[{i}] is {tol!r}; it must be a mapping of "
                f"{', '.join(sorted(_TOLERATION_KEYS))}."
            )
        if tol.get("operator", "Equal") not in ("Equal", "Exists"):
            raise ConfigError(
                f"tolerations[{i}].operator is {tol['operator']!r}; it must be Equal or Exists."
            )
        if tol.get("effect") not in (None, "NoSchedule", "PreferNoSchedule", "NoExecute"):
            raise ConfigError(
                f"tolerations[{i}].effect is {tol['effect']!r}; it must be "
                f"NoSchedule, PreferNoSchedule or NoExecute."
            )
        for key in ("key", "value"):
            if key in tol and not isinstance(tol[key], str):
                raise ConfigError(f"tolerations[{i}].{key} is {tol[key]!r}; it must be a string.")
        if "tolerationSeconds" in tol:
            _int(f"tolerations[{i}].tolerationSeconds", tol["tolerationSeconds"], 0)


def _str(key: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key} is {value!r}; it must be a non-empty string.")


def _int(key: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{key} is {value!r}; it must be an integer >= {low}.")


def _choice(key: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} is {value!r}; it must be one of {', '.join(allowed)}.")


def _str_map(key: str, value: object) -> None:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and k and isinstance(v, str) for k, v in value.items()
    ):
        raise ConfigError(
            f"{key} is {value!r}; it must be a mapping of strings to strings (quote numbers "
            f"and booleans in YAML)."
        )
