"""The teacher server on Kubernetes: a Deployment, a Service, a PodDisruptionBudget and a
PodMonitor for ``crosskd serve`` (``crosskd job serve-manifests`` writes them to
``manifests/serve/``).

``build_deployment``, ``build_service`` and ``build_disruption_budget`` turn a
:class:`TeacherServerConfig` into the official ``kubernetes.client`` models, ``build_pod_monitor``
into the Prometheus Operator's ``monitoring.coreos.com/v1`` custom resource (a mapping: the client
has no model for it); ``serve_manifests(config)`` gives each as the camelCase mapping the API
server takes.

The shape:

* ``replicas`` pods, each running ``crosskd serve --config /etc/crosskd/serve.yaml
  port=<port> drain_timeout_s=<drain_timeout_s>``: the server config is the ConfigMap
  ``serve_config_map`` (key ``serve.yaml``; kustomize's generator gives it a hash suffix, so an
  edited config rolls the pods), and this config is the one source of the port and the drain
  time, which the probes, the Service, the PodMonitor and the grace period depend on.
* One container port ``http`` serves the API, ``/healthz``, ``/readyz`` and ``/metrics``. The
  server listens at once and answers ``/readyz`` 200 only once the teacher is loaded: the
  startup probe (``/readyz``) gives the load ``startup_timeout_s``, then restarts the container
  (a load stuck on object storage gets a fresh try); after it, the liveness probe
  (``/healthz``) restarts a process that stops answering and the readiness probe (``/readyz``)
  keeps a draining replica out of the Service.
* The bearer token ``CROSSKD_SERVE_TOKEN`` comes only from the Secret ``token_secret``
  (``secretKeyRef``), S3 keys only from ``s3_secret``.
* Shutdown: a ``preStop`` sleep of ``pre_stop_seconds`` keeps the replica answering while the
  endpoint removal reaches every node's proxy (SIGTERM comes after it), then the server drains
  (``/readyz`` 503, new work 503 + ``Retry-After``, queued work answered) within
  ``drain_timeout_s``; ``terminationGracePeriodSeconds`` covers both with a margin.
* Rollouts never lower capacity (``maxUnavailable: 0``, ``maxSurge`` replicas started first,
  so a rollout needs that many replicas' GPUs free); the PodDisruptionBudget lets voluntary
  evictions (node drains) take ``max_unavailable`` replicas at a time.
* Non-root (uid 1000), read-only root file system (emptyDirs at ``/tmp``, the home and
  ``/cache``), no privilege escalation, every capability dropped, ``RuntimeDefault`` seccomp, no
  service account token (the server never calls the Kubernetes API).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client as k8s

from crosskd.errors import ConfigError
from crosskd.k8s.job import (
    CACHE,
    CREDENTIAL_ENV,
    HOME,
    _choice,
    _int,
    _str,
    _str_map,
    check_tolerations,
    load_checked,
    pod_security_context,
    pod_tolerations,
    quantity,
    s3_env,
    secret_env,
)

CONTAINER = "server"
PORT_NAME = "http"
HEALTHZ = "/healthz"
"""Answered while the process runs, loading included (liveness probe)."""
READYZ = "/readyz"
"""200 once the teacher is loaded, 503 while loading or draining (startup and readiness
probes)."""
METRICS = "/metrics"
SERVE_CONFIG_DIR = "/etc/crosskd"
SERVE_CONFIG_KEY = "serve.yaml"
SERVE_CONFIG_PATH = f"{SERVE_CONFIG_DIR}/{SERVE_CONFIG_KEY}"
TOKEN_ENV = "CROSSKD_SERVE_TOKEN"
"""The server's bearer token (from the Secret ``token_secret``)."""
NAME_LABELS = {"app.kubernetes.io/name": "crosskd", "app.kubernetes.io/component": "teacher-server"}
INSTANCE_LABEL = "app.kubernetes.io/instance"
MONITOR_LABELS = {"app.kubernetes.io/name": "crosskd", "app.kubernetes.io/component": "monitoring"}
STARTUP_PERIOD_S = 10
"""Seconds between two startup probes (``startup_timeout_s`` sets how many may fail)."""
GRACE_MARGIN_S = 15
"""Seconds of ``terminationGracePeriodSeconds`` beyond the preStop sleep and the drain."""
COMMAND_KEYS = ("port", "drain_timeout_s")
"""Server keys the container's command line sets from this config (never ``serve_overrides``)."""

_DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DURATION = re.compile(r"[0-9]+(ms|s|m|h)")


@dataclass
class TeacherServerConfig:
    """The teacher server's Deployment, Service, PodDisruptionBudget and PodMonitor. Sizes are
    Kubernetes quantities (``16Gi``, ``500m``)."""

    image: str
    """The crosskd image (``images/``), e.g. ``registry.example.com/crosskd:0.1.0-cuda``."""
    image_pull_policy: str = "IfNotPresent"
    """``Always``, ``IfNotPresent`` or ``Never``."""
    image_pull_secrets: list[str] = field(default_factory=list)
    """Names of docker-registry Secrets for a private registry."""
    name: str = "crosskd-teacher-server"
    """The Deployment's, Service's, PodDisruptionBudget's and PodMonitor's name and the pods'
    ``app.kubernetes.io/instance`` label (a DNS-1035 label of at most 63 characters). Trainers
    reach the server at ``http://<name>.<namespace>.svc:<port>``."""
    namespace: str | None = None
    """``metadata.namespace``; None: the namespace it is applied to."""
    replicas: int = 1
    """Server pods behind the Service, each holding the whole teacher."""
    gpus: int = 1
    """GPUs per replica: the ``nvidia.com/gpu`` request and limit. 0: a CPU server."""
    gpu_resource: str = "nvidia.com/gpu"
    """The extended resource name of a GPU."""
    cpu: str = "4"
    """CPU request per replica."""
    memory: str = "32Gi"
    """Memory request per replica (the teacher's weights pass through host memory on load)."""
    memory_limit: str | None = None
    """Memory limit per replica (``/dev/shm`` use counts against it); None: ``memory``."""
    shm_size: str = "8Gi"
    """Size limit of ``/dev/shm`` (an emptyDir in memory; the runtime's default is 64 MiB)."""
    cache_size: str = "200Gi"
    """Size limit of the emptyDir at ``/cache`` (``HF_HOME``, ``CROSSKD_CACHE_DIR``): a teacher
    read from object storage or the Hub is copied there (a 70B teacher in bf16 is ~140 GB)."""
    port: int = 8080
    """The server's one port (the API, ``/healthz``, ``/readyz``, ``/metrics``): given to
    ``crosskd serve`` as ``port=``, the container port ``http`` and the Service's port."""
    drain_timeout_s: int = 60
    """Given to ``crosskd serve`` as ``drain_timeout_s=``: after SIGTERM the server answers
    what it queued within this long, then exits."""
    pre_stop_seconds: int = 5
    """The ``preStop`` sleep before SIGTERM: the replica keeps serving while its endpoint's
    removal reaches every node's proxy, so new requests go to the other replicas instead of
    being refused with 503. 0: no ``preStop`` (the clients' retries absorb the 503s)."""
    grace_seconds: int | None = None
    """``terminationGracePeriodSeconds``; None: ``pre_stop_seconds + drain_timeout_s + 15``. It
    must exceed ``pre_stop_seconds + drain_timeout_s``."""
    startup_timeout_s: int = 1800
    """How long a replica may take to load its teacher (``/readyz`` answering 200) before the
    kubelet restarts it: the startup probe's ``failureThreshold`` x 10 s. A 70B teacher read
    from object storage takes minutes. The Deployment's ``progressDeadlineSeconds`` is 600 s
    more."""
    max_surge: int = 1
    """Replicas a rollout starts above ``replicas`` (``maxUnavailable`` is 0: a rollout never
    lowers capacity, so the cluster needs this many replicas' GPUs free)."""
    max_unavailable: int = 1
    """The PodDisruptionBudget's ``maxUnavailable``: replicas a node drain may evict at once."""
    serve_config_map: str = "crosskd-serve"
    """The ConfigMap whose key ``serve.yaml`` is the server config (``crosskd serve`` keys),
    mounted at ``/etc/crosskd/serve.yaml``."""
    serve_overrides: list[str] = field(default_factory=list)
    """``key=value`` overrides appended to the serve command (not ``port`` or
    ``drain_timeout_s``, which come from this config)."""
    token_secret: str = "crosskd-serve-token"
    """The Secret holding the bearer token, read as the ``secretKeyRef`` env
    ``CROSSKD_SERVE_TOKEN`` (the pod does not start without it)."""
    token_key: str = "token"
    """The token's key in ``token_secret``."""
    s3_secret: str | None = None
    """A Secret with keys ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY`` (optionally
    ``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``), read as ``secretKeyRef`` env, for a teacher
    on object storage. None: no keys (e.g. IAM roles for service accounts)."""
    s3_endpoint_url: str | None = None
    """``AWS_ENDPOINT_URL`` as a plain value (MinIO, Ceph); None: the Secret's, if any."""
    s3_region: str | None = None
    """``AWS_DEFAULT_REGION`` as a plain value; None: the Secret's, if any."""
    env: dict[str, str] = field(default_factory=dict)
    """More plain environment variables; never credentials."""
    node_selector: dict[str, str] = field(default_factory=dict)
    """Node labels a pod needs, e.g. ``{nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}``."""
    tolerations: list[dict] = field(default_factory=list)
    """Pod tolerations as Kubernetes writes them (``key``, ``operator``, ``value``,
    ``effect``, ``tolerationSeconds``)."""
    priority_class: str | None = None
    """The pods' ``priorityClassName``."""
    service_account: str | None = None
    """The pods' service account (e.g. one with an IAM role for S3); None: the namespace's
    ``default``. Its token is not mounted."""
    scrape_interval: str = "15s"
    """The PodMonitor's scrape interval (a Prometheus duration: ``15s``, ``1m``)."""
    labels: dict[str, str] = field(default_factory=dict)
    """More labels for the objects and the pods (not part of any selector)."""

    def __post_init__(self) -> None:
        self.check()

    @property
    def grace(self) -> int:
        """``terminationGracePeriodSeconds``: ``grace_seconds`` or the preStop sleep + drain +
        15 s."""
        if self.grace_seconds is not None:
            return self.grace_seconds
        return self.pre_stop_seconds + self.drain_timeout_s + GRACE_MARGIN_S

    def check(self) -> None:
        """Refuse bad values naming the key."""
        _str("image", self.image)
        if any(c.isspace() for c in self.image):
            raise ConfigError(f"image is {self.image!r}; it must not contain spaces.")
        _choice("image_pull_policy", self.image_pull_policy, ("Always", "IfNotPresent", "Never"))
        if (
            not isinstance(self.name, str)
            or len(self.name) > 63
            or not _DNS1035.fullmatch(self.name)
        ):
            raise ConfigError(
                f"name is {self.name!r}; it must be a DNS-1035 label of at most 63 characters "
                f"(lowercase letters, digits, '-', starting with a letter)."
            )
        self._check_numbers()
        for key in ("cpu", "memory", "memory_limit", "shm_size", "cache_size"):
            value = getattr(self, key)
            if value is not None or key != "memory_limit":
                setattr(self, key, quantity(key, value))
        self._check_strings()
        check_tolerations(self.tolerations)

    def _check_numbers(self) -> None:
        """Refuse bad counts, ports and seconds, and a grace period the drain does not fit."""
        for key in ("replicas", "drain_timeout_s", "startup_timeout_s", "max_unavailable"):
            _int(key, getattr(self, key), 1)
        for key in ("gpus", "pre_stop_seconds", "max_surge"):
            _int(key, getattr(self, key), 0)
        _int("port", self.port, 1)
        if self.port > 65535:
            raise ConfigError(f"port is {self.port}; it must be <= 65535.")
        if self.max_surge == 0:
            raise ConfigError(
                "max_surge is 0; with maxUnavailable 0 a rollout could not start a new replica: "
                "give max_surge >= 1."
            )
        if self.grace_seconds is not None:
            _int("grace_seconds", self.grace_seconds, 1)
            needed = self.pre_stop_seconds + self.drain_timeout_s
            if self.grace_seconds <= needed:
                raise ConfigError(
                    f"grace_seconds is {self.grace_seconds}; it must exceed pre_stop_seconds + "
                    f"drain_timeout_s = {needed} (or leave it unset: {needed + GRACE_MARGIN_S})."
                )

    def _check_strings(self) -> None:
        """Refuse bad names, maps, overrides and credentials given as plain ``env``."""
        for key in ("gpu_resource", "serve_config_map", "token_secret", "token_key"):
            _str(key, getattr(self, key))
        for key in (
            "namespace",
            "s3_secret",
            "s3_endpoint_url",
            "s3_region",
            "priority_class",
            "service_account",
        ):
            if getattr(self, key) is not None:
                _str(key, getattr(self, key))
        if not isinstance(self.scrape_interval, str) or not _DURATION.fullmatch(
            self.scrape_interval
        ):
            raise ConfigError(
                f"scrape_interval is {self.scrape_interval!r}; it must be a duration such as "
                "15s, 1m."
            )
        for key in ("node_selector", "env", "labels"):
            _str_map(key, getattr(self, key))
        for key in ("image_pull_secrets", "serve_overrides"):
            value = getattr(self, key)
            if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                raise ConfigError(f"{key} is {value!r}; it must be a list of strings.")
        for i, item in enumerate(self.serve_overrides):
            key = item.partition("=")[0]
            if "=" not in item:
                raise ConfigError(f"serve_overrides[{i}] is {item!r}; write it as key=value.")
            if key in COMMAND_KEYS:
                raise ConfigError(
                    f"serve_overrides[{i}] sets {key}; set this config's {key} instead (the "
                    "probes, the Service and the grace period follow it)."
                )
        reserved = sorted(
            set(self.env)
            & {TOKEN_ENV, *CREDENTIAL_ENV, "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "HOME"}
        )
        if reserved:
            raise ConfigError(
                f"env sets {', '.join(reserved)}; the token comes from token_secret, S3 keys "
                "from s3_secret (endpoint and region: s3_endpoint_url / s3_region), and HOME is "
                "the pod's."
            )
        overlap = sorted(set(self.labels) & {*NAME_LABELS, INSTANCE_LABEL})
        if overlap:
            raise ConfigError(
                f"labels sets {', '.join(overlap)}; those are the selector's (give another key)."
            )


def load_server_config(
    path: str | None = None, overrides: Sequence[str] = (), values: Mapping[str, Any] | None = None
) -> TeacherServerConfig:
    """A :class:`TeacherServerConfig` from a YAML file (any fsspec URI), then ``values``, then
    ``key=value`` overrides (:func:`crosskd.config.load_config`); a bad one is a
    :class:`ConfigError`."""
    return load_checked(TeacherServerConfig, "teacher server", path, overrides, values)


def serve_command(config: TeacherServerConfig) -> list[str]:
    """The container's command: ``crosskd serve`` on the mounted config, with the port and
    drain time of this config and its ``serve_overrides``."""
    return [
        "crosskd",
        "serve",
        "--config",
        SERVE_CONFIG_PATH,
        f"port={config.port}",
        f"drain_timeout_s={config.drain_timeout_s}",
        *config.serve_overrides,
    ]


def selector_labels(config: TeacherServerConfig) -> dict[str, str]:
    """The labels the Deployment, Service, PodDisruptionBudget and PodMonitor select pods by."""
    return {**NAME_LABELS, INSTANCE_LABEL: config.name}


def build_deployment(config: TeacherServerConfig) -> k8s.V1Deployment:
    """The server's Deployment (the module docstring has its shape)."""
    selector = selector_labels(config)
    labels = {**selector, **config.labels}
    return k8s.V1Deployment(
        api_version="apps/v1",
        kind="Deployment",
        metadata=_metadata(config, labels),
        spec=k8s.V1DeploymentSpec(
            replicas=config.replicas,
            selector=k8s.V1LabelSelector(match_labels=selector),
            strategy=k8s.V1DeploymentStrategy(
                type="RollingUpdate",
                rolling_update=k8s.V1RollingUpdateDeployment(
                    max_unavailable=0, max_surge=config.max_surge
                ),
            ),
            progress_deadline_seconds=config.startup_timeout_s + 600,
            template=k8s.V1PodTemplateSpec(
                metadata=k8s.V1ObjectMeta(labels=labels),
                spec=_pod_spec(config, selector),
            ),
        ),
    )


def build_service(config: TeacherServerConfig) -> k8s.V1Service:
    """The ClusterIP Service in front of every ready replica, port ``port`` named ``http``."""
    return k8s.V1Service(
        api_version="v1",
        kind="Service",
        metadata=_metadata(config, {**selector_labels(config), **config.labels}),
        spec=k8s.V1ServiceSpec(
            type="ClusterIP",
            selector=selector_labels(config),
            ports=[
                k8s.V1ServicePort(
                    name=PORT_NAME,
                    port=config.port,
                    target_port=PORT_NAME,
                    protocol="TCP",
                    app_protocol="http",
                )
            ],
        ),
    )


def build_disruption_budget(config: TeacherServerConfig) -> k8s.V1PodDisruptionBudget:
    """The PodDisruptionBudget: voluntary evictions take at most ``max_unavailable`` replicas
    at once; a replica that is not ready (loading, crashing) may always be evicted, so it never
    blocks a node drain."""
    return k8s.V1PodDisruptionBudget(
        api_version="policy/v1",
        kind="PodDisruptionBudget",
        metadata=_metadata(config, {**selector_labels(config), **config.labels}),
        spec=k8s.V1PodDisruptionBudgetSpec(
            max_unavailable=config.max_unavailable,
            selector=k8s.V1LabelSelector(match_labels=selector_labels(config)),
            unhealthy_pod_eviction_policy="AlwaysAllow",
        ),
    )


def build_pod_monitor(config: TeacherServerConfig) -> dict[str, Any]:
    """The Prometheus Operator PodMonitor scraping ``/metrics`` on every replica's ``http``
    port; ``job`` = the server's name (its ``app.kubernetes.io/instance`` label)."""
    metadata = {"name": config.name, "labels": {**MONITOR_LABELS, **config.labels}}
    if config.namespace:
        metadata["namespace"] = config.namespace
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": metadata,
        "spec": {
            "selector": {"matchLabels": selector_labels(config)},
            "jobLabel": INSTANCE_LABEL,
            "podTargetLabels": [*NAME_LABELS, INSTANCE_LABEL],
            "podMetricsEndpoints": [
                {"port": PORT_NAME, "path": METRICS, "interval": config.scrape_interval}
            ],
        },
    }


def serve_manifests(config: TeacherServerConfig) -> dict[str, dict[str, Any]]:
    """Every object of the teacher server as the camelCase mapping the API server takes (no
    None values), by kind: ``Deployment``, ``Service``, ``PodDisruptionBudget``,
    ``PodMonitor``."""
    api = k8s.ApiClient()
    return {
        "Deployment": api.sanitize_for_serialization(build_deployment(config)),
        "Service": api.sanitize_for_serialization(build_service(config)),
        "PodDisruptionBudget": api.sanitize_for_serialization(build_disruption_budget(config)),
        "PodMonitor": build_pod_monitor(config),
    }


def _metadata(config: TeacherServerConfig, labels: dict[str, str]) -> k8s.V1ObjectMeta:
    return k8s.V1ObjectMeta(name=config.name, namespace=config.namespace, labels=labels)


def _pod_spec(config: TeacherServerConfig, selector: dict[str, str]) -> k8s.V1PodSpec:
    """The replica's pod: the ``server`` container, its volumes, scheduling and security."""
    return k8s.V1PodSpec(
        containers=[_container(config)],
        volumes=_volumes(config),
        termination_grace_period_seconds=config.grace,
        node_selector=dict(config.node_selector) or None,
        tolerations=pod_tolerations(config.tolerations),
        topology_spread_constraints=[
            k8s.V1TopologySpreadConstraint(
                max_skew=1,
                topology_key="kubernetes.io/hostname",
                when_unsatisfiable="ScheduleAnyway",
                label_selector=k8s.V1LabelSelector(match_labels=selector),
            )
        ],
        priority_class_name=config.priority_class,
        service_account_name=config.service_account,
        automount_service_account_token=False,
        enable_service_links=False,
        image_pull_secrets=[k8s.V1LocalObjectReference(name=n) for n in config.image_pull_secrets]
        or None,
        security_context=pod_security_context(),
    )


def _container(config: TeacherServerConfig) -> k8s.V1Container:
    """The ``server`` container: the serve command, its port, probes, resources and mounts."""
    requests = {"cpu": config.cpu, "memory": config.memory}
    limits = {"memory": config.memory_limit or config.memory}
    if config.gpus:
        requests[config.gpu_resource] = limits[config.gpu_resource] = str(config.gpus)
    return k8s.V1Container(
        name=CONTAINER,
        image=config.image,
        image_pull_policy=config.image_pull_policy,
        command=serve_command(config),
        env=_env(config),
        ports=[k8s.V1ContainerPort(name=PORT_NAME, container_port=config.port, protocol="TCP")],
        resources=k8s.V1ResourceRequirements(requests=requests, limits=limits),
        startup_probe=_probe(
            READYZ,
            period=STARTUP_PERIOD_S,
            failures=math.ceil(config.startup_timeout_s / STARTUP_PERIOD_S),
            timeout=5,
        ),
        liveness_probe=_probe(HEALTHZ, period=10, failures=6, timeout=10),
        readiness_probe=_probe(READYZ, period=5, failures=2, timeout=5),
        lifecycle=k8s.V1Lifecycle(
            pre_stop=k8s.V1LifecycleHandler(
                sleep=k8s.V1SleepAction(seconds=config.pre_stop_seconds)
            )
        )
        if config.pre_stop_seconds
        else None,
        volume_mounts=[
            k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm"),
            k8s.V1VolumeMount(name="serve-config", mount_path=SERVE_CONFIG_DIR, read_only=True),
            k8s.V1VolumeMount(name="tmp", mount_path="/tmp"),
            k8s.V1VolumeMount(name="home", mount_path=HOME),
            k8s.V1VolumeMount(name="cache", mount_path=CACHE),
        ],
        security_context=k8s.V1SecurityContext(
            allow_privilege_escalation=False,
            read_only_root_filesystem=True,
            run_as_non_root=True,
            capabilities=k8s.V1Capabilities(drop=["ALL"]),
        ),
    )


def _probe(path: str, period: int, failures: int, timeout: int) -> k8s.V1Probe:
    return k8s.V1Probe(
        http_get=k8s.V1HTTPGetAction(path=path, port=PORT_NAME),
        period_seconds=period,
        failure_threshold=failures,
        timeout_seconds=timeout,
    )


def _volumes(config: TeacherServerConfig) -> list[k8s.V1Volume]:
    """``/dev/shm`` in memory, the server config's ConfigMap, and the emptyDirs of ``/tmp``,
    the home and the cache (the root file system is read-only)."""
    return [
        k8s.V1Volume(
            name="dshm",
            empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory", size_limit=config.shm_size),
        ),
        k8s.V1Volume(
            name="serve-config",
            config_map=k8s.V1ConfigMapVolumeSource(
                name=config.serve_config_map,
                items=[k8s.V1KeyToPath(key=SERVE_CONFIG_KEY, path=SERVE_CONFIG_KEY)],
            ),
        ),
        k8s.V1Volume(name="tmp", empty_dir=k8s.V1EmptyDirVolumeSource(size_limit="4Gi")),
        k8s.V1Volume(name="home", empty_dir=k8s.V1EmptyDirVolumeSource(size_limit="1Gi")),
        k8s.V1Volume(
            name="cache", empty_dir=k8s.V1EmptyDirVolumeSource(size_limit=config.cache_size)
        ),
    ]


def _env(config: TeacherServerConfig) -> list[k8s.V1EnvVar]:
    plain = {
        "HOME": HOME,
        "CROSSKD_CACHE_DIR": f"{CACHE}/crosskd",
        "HF_HOME": f"{CACHE}/huggingface",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        **config.env,
    }
    env = [k8s.V1EnvVar(name=k, value=v) for k, v in plain.items()]
    env.append(secret_env(TOKEN_ENV, config.token_secret, config.token_key))
    return env + s3_env(config.s3_secret, config.s3_endpoint_url, config.s3_region)
