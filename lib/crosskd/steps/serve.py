"""Steps ``start_teacher_servers`` and ``stop_teacher_servers``: a teacher server per teacher of
the run (``crosskd serve`` on Kubernetes, :mod:`crosskd.k8s.serve_launcher`) brought up before
training, in place of the scored caches, and taken down after it.

Each server is named after the run and the teacher's index (:func:`server_name`), so a retried
start reattaches to it and the stop step finds it from the run id and the number of teachers
alone (a KFP exit task takes no other task's output). It scores with the run's ``k``, ``tau``
and ``encoding`` (and ``device``, when the run sets one): what the trainer checks a server
against at setup."""

from __future__ import annotations

import logging
import time
from typing import Any

from crosskd.errors import ConfigError
from crosskd.steps.train import job_run_id

log = logging.getLogger(__name__)

SERVER_PREFIX = "crosskd-teacher"
READY_TIMEOUT_S = 3600
"""Seconds the start step waits for the servers by default (``server.ready_timeout_s``)."""
RUN_KEYS = ("teacher", "k", "tau", "encoding", "port", "drain_timeout_s")
"""``crosskd serve`` keys ``server.serve`` may not set: the run's (teacher, k, tau, encoding)
and the server config's (port, drain time)."""


def server_name(run_id: str, index: int) -> str:
    """The teacher server of teacher ``index`` in run ``run_id``: ``crosskd-teacher-<index>-<run
    id>`` (its Deployment, Service and ConfigMap), shortened as
    :func:`crosskd.steps.train.job_run_id` does past 63 characters."""
    return job_run_id(SERVER_PREFIX, str(index), run_id.lower())


def start_teacher_servers(
    plan: dict[str, Any],
    scoring: dict[str, Any],
    server: dict[str, Any],
    job: dict[str, Any],
    run_id: str,
    *,
    image: str,
    executor: str,
    namespace: str | None = None,
    client: Any = None,
    poll_interval: float = 10.0,
) -> list[dict[str, Any]]:
    """Start one teacher server per teacher of ``plan`` (all created first, then waited on,
    so they load at once) and return, per teacher, ``{"index", "server": URL, "name"}``
    (:func:`crosskd.steps.plan_training` takes them in place of caches).

    Args:
        plan: :func:`crosskd.steps.validate_inputs`'s plan (``teachers``: ``index``, ``ref``).
        scoring: The run's ``k``, ``tau``, ``encoding``, ``device``
            (:meth:`crosskd.steps.RunConfig.scoring`).
        server: :class:`~crosskd.k8s.serve.TeacherServerConfig` keys for every server (not
            ``name``, ``serve_config_map``, ``namespace``: set here; without ``image``:
            ``image``, or ``image-cuda`` when ``gpus`` > 0), and three keys of this step's:
            ``serve``, ``crosskd serve`` keys beside the run's (batching, queue, dtype, auth,
            ...; not :data:`RUN_KEYS`); ``pod_monitor``, also create a PodMonitor (default
            false); ``ready_timeout_s``, seconds to wait for every replica of every server
            (default :data:`READY_TIMEOUT_S`).
        job: The training job's JobConfig keys: its ``namespace`` (default: this pod's) is the
            servers' too, and it must name ``teacher_token_secret`` unless the servers run
            with ``auth: none``.
        run_id: The pipeline run's id (the servers' names derive from it).
        image: The pipeline's crosskd image.
        executor: Must be ``cluster`` (a PyTorchJob reaches the servers by their Service).
        namespace: Overrides the namespace.
        client: A ``kubernetes.client.ApiClient``; by default the pod's service account's.
        poll_interval: Seconds between two reads of a server's Deployment.

    Raises:
        ConfigError: A bad key, another executor, a missing token Secret.
        LauncherError: A server could not be created or did not get ready (its diagnosis).
    """
    # lazy: crosskd.k8s imports the kubernetes client (~0.4 s); every pipeline step imports
    # crosskd.steps, and only these two steps need it
    from crosskd.k8s.cli import current_namespace
    from crosskd.k8s.client import api_client
    from crosskd.k8s.result import JobCancelled
    from crosskd.k8s.serve_launcher import create_server, wait_until_ready

    started = time.monotonic()
    if executor != "cluster":
        raise ConfigError(
            f"executor is {executor!r}; a teacher server runs on the cluster, so training must "
            "too (executor cluster), or score the teachers into caches."
        )
    settings = dict(server)
    serve = dict(settings.pop("serve", None) or {})
    pod_monitor = bool(settings.pop("pod_monitor", False))
    ready_timeout = settings.pop("ready_timeout_s", READY_TIMEOUT_S)
    number = isinstance(ready_timeout, int | float) and not isinstance(ready_timeout, bool)
    if not number or not ready_timeout > 0:
        raise ConfigError(
            f"server.ready_timeout_s is {server.get('ready_timeout_s')!r}; give seconds > 0."
        )
    if serve.get("auth", "bearer") == "bearer" and not job.get("teacher_token_secret"):
        secret = settings.get("token_secret", "crosskd-serve-token")
        raise ConfigError(
            "job.teacher_token_secret is not set; the training pods need the servers' bearer "
            f"token: set it to the servers' token Secret ({secret}), or run the servers with "
            "server.serve.auth none."
        )
    namespace = namespace or job.get("namespace") or current_namespace()
    servers = [
        _server(teacher, scoring, settings, serve, run_id, image) for teacher in plan["teachers"]
    ]
    client = client or api_client()
    for config, serve_config in servers:
        create_server(
            config, serve_config, namespace=namespace, client=client, pod_monitor=pod_monitor
        )
    started_servers = []
    try:
        for config, _ in servers:
            started_servers.append(
                wait_until_ready(
                    config,
                    namespace=namespace,
                    deadline=started + ready_timeout,
                    client=client,
                    poll_interval=poll_interval,
                    delete_on_sigterm=False,
                )
            )
    except JobCancelled:
        stop_teacher_servers(len(servers), run_id, namespace=namespace, client=client)
        raise
    return [
        {"index": int(t["index"]), "server": s.url, "name": s.name}
        for t, s in zip(plan["teachers"], started_servers, strict=True)
    ]


def stop_teacher_servers(
    count: int,
    run_id: str,
    *,
    job: dict[str, Any] | None = None,
    namespace: str | None = None,
    client: Any = None,
) -> list[str]:
    """Delete the teacher servers of run ``run_id``'s ``count`` teachers (each Deployment; its
    pods and objects follow); returns the names of those that existed. Ones already gone are no
    error, so this runs again safely (after training, then in the pipeline's exit handler).

    Raises:
        LauncherError: A deletion was refused (e.g. 403); the others are still deleted.
    """
    # lazy: crosskd.k8s imports the kubernetes client (~0.4 s); every pipeline step imports
    # crosskd.steps, and only these two steps need it
    from crosskd.k8s.cli import current_namespace
    from crosskd.k8s.client import api_client
    from crosskd.k8s.result import LauncherError
    from crosskd.k8s.serve_launcher import stop_server

    namespace = namespace or (job or {}).get("namespace") or current_namespace()
    client = client or api_client()
    deleted, refused = [], []
    for index in range(int(count)):
        name = server_name(run_id, index)
        try:
            if stop_server(name, namespace, client=client):
                deleted.append(name)
        except LauncherError as exc:
            refused.append(str(exc))
    if refused:
        raise LauncherError(" ".join(refused))
    log.info("teacher servers of run %s: %d deleted, the others were gone", run_id, len(deleted))
    return deleted


def _server(
    teacher: dict[str, Any],
    scoring: dict[str, Any],
    settings: dict[str, Any],
    serve: dict[str, Any],
    run_id: str,
    image: str,
) -> tuple[Any, dict[str, Any]]:
    """The server config and the ``crosskd serve`` config of one teacher, both checked."""
    # lazy: as in start_teacher_servers
    from crosskd.k8s.job import load_checked
    from crosskd.k8s.serve import load_server_config
    from crosskd.serve.config import ServeConfig

    name = server_name(run_id, int(teacher["index"]))
    for key in ("name", "serve_config_map", "namespace"):
        if key in settings:
            raise ConfigError(
                f"server.{key} is set; the step names each server after the run "
                f"({name}) and starts it in the training job's namespace."
            )
    gpus = settings.get("gpus", 1)
    default_image = f"{image}-cuda" if gpus else image
    config = load_server_config(
        values={"image": default_image, **settings, "name": name, "serve_config_map": name}
    )
    taken = sorted(set(serve) & set(RUN_KEYS))
    if taken:
        raise ConfigError(
            f"server.serve sets {', '.join(taken)}; the run sets teacher, k, tau and encoding, "
            "and server.port / server.drain_timeout_s the port and drain time."
        )
    values = {
        "teacher": teacher["ref"],
        "k": int(scoring["k"]),
        "tau": float(scoring["tau"]),
        "encoding": scoring["encoding"],
        **({"device": scoring["device"]} if scoring.get("device") else {}),
        **serve,
    }
    load_checked(ServeConfig, "server.serve", values=values).check()
    return config, values
