"""Bringing a teacher server up for a training run and taking it down after: what the pipeline's
``start_teacher_server`` and ``stop_teacher_server`` steps call.

:func:`start_server` creates the objects of :mod:`crosskd.k8s.serve` for one
:class:`~crosskd.k8s.serve.TeacherServerConfig` in one namespace, under the config's ``name``
(which the caller derives from the run, so a retried step finds them):

* the **Deployment** first, then the **ConfigMap** (``serve.yaml``: the ``crosskd serve``
  config, named as the server), the **Service**, the **PodDisruptionBudget** and, when asked,
  the **PodMonitor**, each with an ``ownerReference`` to the Deployment: deleting the Deployment
  (:func:`stop_server`, or ``kubectl delete deployment NAME``) lets the garbage collector remove
  them all. A pod that starts before its ConfigMap exists waits for it (``ContainerCreating``).
* **Reattach**: an object of that name that exists (409) is read back and kept when it is the
  run's (a Deployment not being deleted; the others owned by that Deployment); anything else is
  refused, naming the object and the ``kubectl`` command that removes it.
* **Ready**: the Deployment is read every ``poll_interval`` seconds until it has observed its
  spec and ``replicas`` replicas are updated and ready (a replica is ready when its ``/readyz``
  answers 200: the teacher is loaded). ``ready_timeout`` bounds the whole call; past it, or once
  the Deployment reports ``ProgressDeadlineExceeded``, :class:`ServerNotReady` says, per pod,
  what holds it (unschedulable: the scheduler's message, e.g. too few GPUs; an image that cannot
  be pulled; a crash loop and its last exit; a missing Secret or ConfigMap; still loading). The
  objects are left for :func:`stop_server` (the pipeline's exit handler).
* **SIGTERM** while waiting (a cancelled run) deletes the server unless
  ``delete_on_sigterm=False`` and raises :class:`~crosskd.k8s.result.JobCancelled`.

The server answers at :func:`server_url`, ``http://<name>.<namespace>.svc:<port>``.

:func:`stop_server` deletes the Deployment with ``propagationPolicy: Background`` (its
ReplicaSet, pods and the owned objects follow); one that is gone already is no error, so the
step can run twice (after training, and again in the exit handler).

The service account needs exactly ``manifests/serve/launcher-rbac.yaml``: create and get on
deployments, configmaps, services, poddisruptionbudgets (and podmonitors), delete on
deployments only, list on pods (for the diagnosis). Tested against
``tests/k8s_fake.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import yaml
from kubernetes import client as k8s

from crosskd.errors import ConfigError
from crosskd.k8s.client import api_client
from crosskd.k8s.result import JobCancelled, LauncherError
from crosskd.k8s.serve import (
    SERVE_CONFIG_KEY,
    TeacherServerConfig,
    build_deployment,
    build_disruption_budget,
    build_pod_monitor,
    build_service,
    selector_labels,
)
from crosskd.k8s.status import http_status, is_transient
from crosskd.k8s.wait import SigtermFlag, sleep_unless_cancelled

logger = logging.getLogger(__name__)

MONITORING_GROUP = "monitoring.coreos.com"
MONITORING_VERSION = "v1"
_WAITING_OK = {"ContainerCreating", "PodInitializing"}


class ServerNotReady(LauncherError):
    """The teacher server did not get its replicas ready in time (the message says why, per
    pod); its objects are left in place."""

    exit_code = 1


@dataclasses.dataclass(frozen=True)
class TeacherServer:
    """A teacher server whose replicas are ready."""

    name: str
    """The Deployment's, Service's and ConfigMap's name."""
    namespace: str
    """Their namespace."""
    url: str
    """``http://<name>.<namespace>.svc:<port>``: a training run's ``teachers`` entry."""
    replicas: int
    """Ready replicas when the wait ended."""
    reattached: bool
    """Whether the Deployment existed already (a retried step)."""
    waited_s: float
    """Seconds waited for the replicas to be ready."""


def server_url(config: TeacherServerConfig, namespace: str) -> str:
    """The in-cluster URL of the server's Service: ``http://<name>.<namespace>.svc:<port>``."""
    return f"http://{config.name}.{namespace}.svc:{config.port}"


def start_server(
    config: TeacherServerConfig,
    serve_config: Mapping[str, Any],
    *,
    namespace: str,
    ready_timeout: float,
    client: k8s.ApiClient | None = None,
    pod_monitor: bool = False,
    poll_interval: float = 10.0,
    request_timeout: float = 30.0,
    delete_on_sigterm: bool = True,
) -> TeacherServer:
    """Create the teacher server (or reattach to it) and wait until its replicas are ready:
    :func:`create_server`, then :func:`wait_until_ready` (the module docstring says how)."""
    started = time.monotonic()
    _check_seconds(ready_timeout, poll_interval, request_timeout)
    client = client or api_client()
    reattached = create_server(
        config,
        serve_config,
        namespace=namespace,
        client=client,
        pod_monitor=pod_monitor,
        request_timeout=request_timeout,
    )
    return wait_until_ready(
        config,
        namespace=namespace,
        deadline=started + ready_timeout,
        client=client,
        reattached=reattached,
        poll_interval=poll_interval,
        request_timeout=request_timeout,
        delete_on_sigterm=delete_on_sigterm,
    )


def create_server(
    config: TeacherServerConfig,
    serve_config: Mapping[str, Any],
    *,
    namespace: str,
    client: k8s.ApiClient,
    pod_monitor: bool = False,
    request_timeout: float = 30.0,
) -> bool:
    """Create the server's Deployment, then the objects it owns, or reattach to those of that
    name; returns whether the Deployment existed.

    Args:
        config: The server's objects; ``serve_config_map`` must be ``name`` (the ConfigMap made
            here) and ``namespace`` None or ``namespace``.
        serve_config: The ``crosskd serve`` keys (``teacher``, ``k``, ``tau``, ...), written
            as ``serve.yaml`` into the ConfigMap.
        namespace: Where to create them.
        client: The API client (:func:`crosskd.k8s.client.api_client`).
        pod_monitor: Also create the PodMonitor (needs the Prometheus Operator's CRDs).
        request_timeout: Seconds one API request may take.

    Raises:
        LauncherError: The API refused an object or the access, or an object of that name is
            not this server's (or is being deleted).
        ConfigError: ``serve_config_map`` or ``namespace`` do not fit.
    """
    _check_names(config, namespace)
    apps = k8s.AppsV1Api(client)
    deployment, reattached = _create_deployment(apps, config, namespace, request_timeout)
    owner = k8s.V1OwnerReference(
        api_version="apps/v1", kind="Deployment", name=config.name, uid=deployment.metadata.uid
    )
    for kind, create, read, body in _owned_objects(client, config, serve_config, pod_monitor):
        _create_owned(kind, create, read, body, owner, namespace, request_timeout)
    return reattached


def wait_until_ready(
    config: TeacherServerConfig,
    *,
    namespace: str,
    deadline: float,
    client: k8s.ApiClient,
    reattached: bool = False,
    poll_interval: float = 10.0,
    request_timeout: float = 30.0,
    delete_on_sigterm: bool = True,
) -> TeacherServer:
    """Read the server's Deployment every ``poll_interval`` seconds until ``config.replicas``
    replicas are updated and ready.

    Args:
        config: The server (its name, replicas, port, labels).
        namespace: Its namespace.
        deadline: ``time.monotonic()`` past which it is not waited for (``math.inf``: never).
        client: The API client (:func:`crosskd.k8s.client.api_client`).
        reattached: Given back in the result (whether :func:`create_server` found it).
        poll_interval: Seconds between two reads.
        request_timeout: Seconds one API request may take.
        delete_on_sigterm: Delete the server when SIGTERM comes while waiting.

    Raises:
        ServerNotReady: Not ready by ``deadline``, or the rollout's progress deadline passed.
        JobCancelled: SIGTERM came.
        LauncherError: Reading the Deployment failed for good (e.g. 403), or it was deleted.
    """
    waited_from = time.monotonic()
    with SigtermFlag() as cancel:
        replicas = _wait_ready(
            client,
            config,
            namespace,
            deadline,
            poll_interval,
            request_timeout,
            cancel,
            delete_on_sigterm,
        )
    server = TeacherServer(
        name=config.name,
        namespace=namespace,
        url=server_url(config, namespace),
        replicas=replicas,
        reattached=reattached,
        waited_s=time.monotonic() - waited_from,
    )
    logger.info(
        "teacher server %s/%s ready (%d replicas) after waiting %.0f s: %s",
        namespace,
        config.name,
        replicas,
        server.waited_s,
        server.url,
    )
    return server


def stop_server(
    name: str, namespace: str, *, client: k8s.ApiClient | None = None, request_timeout: float = 30.0
) -> bool:
    """Delete the server's Deployment (its pods and the objects it owns follow, through the
    garbage collector). Returns whether it existed; one that is gone already is no error.

    Raises:
        LauncherError: The API refused the deletion (e.g. 403).
    """
    apps = k8s.AppsV1Api(client or api_client())
    try:
        apps.delete_namespaced_deployment(
            name, namespace, propagation_policy="Background", _request_timeout=request_timeout
        )
    except Exception as exc:
        if http_status(exc) == 404:
            logger.info("teacher server %s/%s is gone already", namespace, name)
            return False
        raise LauncherError(
            f"deleting teacher server {namespace}/{name} failed: {_reason(exc)}; delete it "
            f"yourself: kubectl -n {namespace} delete deployment {name}"
        ) from exc
    logger.info("teacher server %s/%s deleted (its pods and objects follow)", namespace, name)
    return True


def diagnose(
    client: k8s.ApiClient,
    config: TeacherServerConfig,
    namespace: str,
    request_timeout: float,
    status: k8s.V1DeploymentStatus | None = None,
) -> str:
    """What holds the server's replicas, one clause per pod (unschedulable, image pull, crash
    loop and last exit, missing Secret or ConfigMap, loading), or why there is none (the
    Deployment ``status``'s ``ReplicaFailure``, e.g. a quota)."""
    core = k8s.CoreV1Api(client)
    selector = ",".join(f"{k}={v}" for k, v in selector_labels(config).items())
    try:
        pods = core.list_namespaced_pod(
            namespace, label_selector=selector, _request_timeout=request_timeout
        ).items
    except Exception as exc:
        return f"its pods could not be listed ({_reason(exc)})"
    if not pods:
        failure = _condition(status or k8s.V1DeploymentStatus(), "ReplicaFailure")
        hint = failure or f"kubectl -n {namespace} describe deployment {config.name}"
        return f"no pod exists ({hint})"
    return "; ".join(_pod_state(pod) for pod in sorted(pods, key=lambda p: p.metadata.name))


def _check_names(config: TeacherServerConfig, namespace: str) -> None:
    """Refuse a config whose ConfigMap is not the one made here or whose namespace is
    another."""
    if config.serve_config_map != config.name:
        raise ConfigError(
            f"serve_config_map is {config.serve_config_map!r}; the launcher makes the ConfigMap "
            f"{config.name!r} (the server's name): set serve_config_map to it."
        )
    if config.namespace not in (None, namespace):
        raise ConfigError(
            f"namespace is {config.namespace!r} but the server is started in {namespace!r}; "
            "leave it unset."
        )


def _check_seconds(ready_timeout: float, poll_interval: float, request_timeout: float) -> None:
    """Refuse a ``ready_timeout`` that is not seconds > 0 (``math.inf``: none), and a
    ``poll_interval`` or ``request_timeout`` that is not seconds > 0."""
    if (
        not isinstance(ready_timeout, int | float)
        or math.isnan(ready_timeout)
        or ready_timeout <= 0
    ):
        raise ConfigError(f"ready_timeout is {ready_timeout!r}; give seconds > 0 (math.inf: none).")
    if poll_interval <= 0 or request_timeout <= 0:
        raise ConfigError(
            f"poll_interval ({poll_interval}) and request_timeout ({request_timeout}) must be "
            "seconds > 0."
        )


def _create_deployment(
    apps: k8s.AppsV1Api, config: TeacherServerConfig, namespace: str, request_timeout: float
) -> tuple[k8s.V1Deployment, bool]:
    """Create the Deployment, or read back the one of that name (409); returns it and whether
    it existed."""
    where = f"{namespace}/{config.name}"
    try:
        created = apps.create_namespaced_deployment(
            namespace, build_deployment(config), _request_timeout=request_timeout
        )
    except Exception as exc:
        if http_status(exc) != 409:
            raise LauncherError(f"creating Deployment {where} failed: {_reason(exc)}") from exc
        existing = _read_back("Deployment", where, apps.read_namespaced_deployment, request_timeout)
        if existing.metadata.deletion_timestamp is not None:
            raise LauncherError(
                f"Deployment {where} exists but is being deleted (since "
                f"{existing.metadata.deletion_timestamp}); start again once it is gone."
            ) from exc
        logger.warning(
            "teacher server %s exists already (created %s): reattaching to it",
            where,
            existing.metadata.creation_timestamp,
        )
        return existing, True
    logger.info("Deployment %s created", where)
    return created, False


def _owned_objects(
    client: k8s.ApiClient,
    config: TeacherServerConfig,
    serve_config: Mapping[str, Any],
    pod_monitor: bool,
) -> list[tuple[str, Callable[..., Any], Callable[..., Any], Any]]:
    """``(kind, create(namespace, body, ...), read(name, namespace, ...), body)`` of each object
    the Deployment owns, in creation order (a PodMonitor is a mapping: the client has no model
    for it)."""
    core, policy = k8s.CoreV1Api(client), k8s.PolicyV1Api(client)
    config_map = k8s.V1ConfigMap(
        api_version="v1",
        kind="ConfigMap",
        metadata=k8s.V1ObjectMeta(
            name=config.name, labels={**selector_labels(config), **config.labels}
        ),
        data={SERVE_CONFIG_KEY: yaml.safe_dump(dict(serve_config), sort_keys=False)},
    )
    objects: list[tuple[str, Callable[..., Any], Callable[..., Any], Any]] = [
        (
            "ConfigMap",
            core.create_namespaced_config_map,
            core.read_namespaced_config_map,
            config_map,
        ),
        (
            "Service",
            core.create_namespaced_service,
            core.read_namespaced_service,
            build_service(config),
        ),
        (
            "PodDisruptionBudget",
            policy.create_namespaced_pod_disruption_budget,
            policy.read_namespaced_pod_disruption_budget,
            build_disruption_budget(config),
        ),
    ]
    if pod_monitor:
        custom = k8s.CustomObjectsApi(client)
        api = (MONITORING_GROUP, MONITORING_VERSION)

        def create(namespace: str, body: dict[str, Any], **kwargs: Any) -> Any:
            return custom.create_namespaced_custom_object(
                *api, namespace, "podmonitors", body, **kwargs
            )

        def read(name: str, namespace: str, **kwargs: Any) -> Any:
            return custom.get_namespaced_custom_object(
                *api, namespace, "podmonitors", name, **kwargs
            )

        objects.append(("PodMonitor", create, read, build_pod_monitor(config)))
    return objects


def _create_owned(
    kind: str,
    create: Callable[..., Any],
    read: Callable[..., Any],
    body: Any,
    owner: k8s.V1OwnerReference,
    namespace: str,
    request_timeout: float,
) -> None:
    """Create ``body`` owned by the Deployment ``owner``; on 409 keep the existing object when
    that Deployment owns it, else refuse it."""
    name = body["metadata"]["name"] if isinstance(body, dict) else body.metadata.name
    where = f"{namespace}/{name}"
    if isinstance(body, dict):
        body["metadata"]["ownerReferences"] = [k8s.ApiClient().sanitize_for_serialization(owner)]
    else:
        body.metadata.owner_references = [owner]
    try:
        create(namespace, body, _request_timeout=request_timeout)
    except Exception as exc:
        if http_status(exc) != 409:
            raise LauncherError(f"creating {kind} {where} failed: {_reason(exc)}") from exc
        existing = _read_back(kind, where, read, request_timeout)
        if owner.uid not in _owner_uids(existing):
            raise LauncherError(
                f"{kind} {where} exists and is not owned by the Deployment {owner.name} "
                f"(uid {owner.uid}): it is another's, or left from an earlier server; delete it "
                f"(kubectl -n {namespace} delete {kind.lower()} {name}) and start again."
            ) from exc
        logger.info("%s %s exists already and is this server's: kept", kind, where)
        return
    logger.info("%s %s created", kind, where)


def _read_back(kind: str, where: str, read: Callable[..., Any], request_timeout: float) -> Any:
    """The object of that name, which a create answered 409 for."""
    namespace, name = where.split("/")
    try:
        return read(name, namespace, _request_timeout=request_timeout)
    except Exception as exc:
        raise LauncherError(
            f"{kind} {where} exists (409) but reading it back failed: {_reason(exc)}"
        ) from exc


def _owner_uids(obj: Any) -> set[str]:
    """The uids of the owners of ``obj`` (a client model or, for a custom object, a mapping)."""
    if isinstance(obj, dict):
        return {o.get("uid") for o in obj.get("metadata", {}).get("ownerReferences") or []}
    return {o.uid for o in obj.metadata.owner_references or []}


def _wait_ready(
    client: k8s.ApiClient,
    config: TeacherServerConfig,
    namespace: str,
    deadline: float,
    poll_interval: float,
    request_timeout: float,
    cancel: SigtermFlag,
    delete_on_sigterm: bool,
) -> int:
    """Read the Deployment until ``config.replicas`` replicas are updated and ready; returns
    how many are ready."""
    apps = k8s.AppsV1Api(client)
    where = f"{namespace}/{config.name}"
    last_error: BaseException | None = None
    status: k8s.V1DeploymentStatus | None = None
    ready = 0
    while True:
        if cancel.requested:
            raise _cancelled(client, config.name, namespace, delete_on_sigterm, request_timeout)
        try:
            deployment = apps.read_namespaced_deployment(
                config.name, namespace, _request_timeout=request_timeout
            )
        except Exception as exc:
            if http_status(exc) == 404:
                raise LauncherError(
                    f"Deployment {where} was deleted while waiting for it to be ready."
                ) from exc
            if not is_transient(exc):
                raise LauncherError(f"reading Deployment {where} failed: {_reason(exc)}") from exc
            logger.warning("reading Deployment %s failed (retrying): %s", where, _reason(exc))
            last_error = exc
        else:
            last_error = None
            status = deployment.status or k8s.V1DeploymentStatus()
            wanted = deployment.spec.replicas
            ready = status.ready_replicas or 0
            if (
                (status.observed_generation or 0) >= (deployment.metadata.generation or 0)
                and (status.updated_replicas or 0) >= wanted
                and ready >= wanted
            ):
                return ready
            stalled = _condition(status, "Progressing", "ProgressDeadlineExceeded")
            if stalled is not None:
                why = diagnose(client, config, namespace, request_timeout, status)
                raise ServerNotReady(
                    f"teacher server {where}: {ready}/{wanted} replicas ready and the rollout "
                    f"stopped ({stalled}): {why}."
                )
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            detail = f"; the last read failed: {_reason(last_error)}" if last_error else ""
            why = diagnose(client, config, namespace, request_timeout, status)
            raise ServerNotReady(
                f"teacher server {where}: {ready}/{config.replicas} replicas ready when its time "
                f"ran out (ready_timeout){detail}: {why}. It is left in "
                f"place (the pipeline's stop step deletes it; else kubectl -n {namespace} delete "
                f"deployment {config.name})."
            )
        sleep_unless_cancelled(min(poll_interval, remaining), cancel)


def _condition(status: k8s.V1DeploymentStatus, kind: str, reason: str | None = None) -> str | None:
    """``<reason>: <message>`` of the Deployment's condition ``kind`` (with that ``reason``, or
    else with status ``True``), else None: ``Progressing`` / ``ProgressDeadlineExceeded`` when
    the controller gave up on the rollout, ``ReplicaFailure`` when it could not create a pod
    (e.g. a quota)."""
    for found in status.conditions or []:
        if found.type != kind or (reason is not None and found.reason != reason):
            continue
        if reason is not None or found.status == "True":
            return f"{found.reason}: {found.message or 'no message'}"
    return None


def _pod_state(pod: k8s.V1Pod) -> str:
    """Why one pod is not ready, in a clause: ``<pod>: <what>``."""
    name = pod.metadata.name
    status = pod.status or k8s.V1PodStatus()
    for found in status.conditions or []:
        if found.type == "PodScheduled" and found.status == "False":
            return f"{name}: not scheduled ({found.reason}: {found.message or 'no message'})"
    clauses = []
    for container in status.container_statuses or []:
        state = container.state or k8s.V1ContainerState()
        last = (container.last_state or k8s.V1ContainerState()).terminated
        if state.waiting is not None and state.waiting.reason not in _WAITING_OK:
            clause = f"{state.waiting.reason}" + (
                f" ({state.waiting.message})" if state.waiting.message else ""
            )
        elif state.waiting is not None:
            clause = f"{state.waiting.reason}"
        elif state.terminated is not None:
            clause = f"exited {state.terminated.exit_code} ({state.terminated.reason})"
        elif not container.ready:
            clause = "not ready yet (/readyz: the teacher is loading)"
        else:
            clause = "ready"
        if container.restart_count:
            clause += f", {container.restart_count} restarts"
            if last is not None:
                clause += f", last exit {last.exit_code} ({last.reason})"
        clauses.append(
            f"{container.name} {clause}" if len(status.container_statuses) > 1 else clause
        )
    return f"{name}: {status.phase or 'Unknown'}" + (f", {'; '.join(clauses)}" if clauses else "")


def _cancelled(
    client: k8s.ApiClient, name: str, namespace: str, delete: bool, request_timeout: float
) -> JobCancelled:
    """The error that ends a wait cancelled by SIGTERM, once the server is deleted when
    ``delete``."""
    where = f"{namespace}/{name}"
    if not delete:
        return JobCancelled(f"SIGTERM: stopped waiting on teacher server {where}, left running.")
    try:
        stop_server(name, namespace, client=client, request_timeout=request_timeout)
    except LauncherError as exc:
        return JobCancelled(f"SIGTERM: {exc}")
    return JobCancelled(f"SIGTERM: teacher server {where} was deleted (the run was cancelled).")


def _reason(exc: BaseException | None) -> str:
    """An API error in a few words: ``<status> <reason>: <the Status message>``."""
    status, body = getattr(exc, "status", None), getattr(exc, "body", None)
    if isinstance(status, int) and body:
        try:
            message = yaml.safe_load(body).get("message")
        except (yaml.YAMLError, AttributeError):
            message = None
        return f"{status} {getattr(exc, 'reason', '')}: {message or body}".strip()
    return str(exc)
