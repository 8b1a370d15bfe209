"""The training pod's process: ``crosskd train --nproc-per-node N``, torch's elastic agent
around N workers, and the exit-code contract a Kubernetes restart policy can act on.

The Training Operator's ``ExitCode`` restart policy recreates a pod whose container exits with
a code >= 128 and fails the job on 1..127. ``torchrun`` exits 1 whatever happened to its
workers, and when one pod dies the workers of the other pods fail with a plain
``RuntimeError`` (exit 1), like a config error would. So the pod runs this entry point instead:
it starts the workers with :func:`torch.distributed.launcher.api.elastic_launch` (each worker is
``python -m crosskd.cli train --config ...`` with the agent's ``RANK`` / ``LOCAL_RANK`` /
``WORLD_SIZE``), reads each failed worker's exit code or signal from the agent's
``ChildFailedError``, and exits with one code of this table:

====  ==========================================================  ==========
code  meaning                                                     retried?
====  ==========================================================  ==========
0     the run is complete (``final/`` holds its last step)        no (done)
2     bad input: config, data, artifacts that do not fit          no
3     a non-finite loss stopped the run (a NaN stop)              no
4     the restart budget is spent (``max_restarts`` failures in   no
      a row without a new checkpoint)
143   SIGTERM (eviction, preemption): the workers stopped         yes
      together after their step and checkpointed it
200   anything unclassified: a worker crashed, was killed         yes
      (OOM, SIGKILL), lost a peer, or a collective timed out
====  ==========================================================  ==========

A worker exits with 2 or 3 itself (``crosskd train`` maps :class:`~crosskd.errors.CrosskdError`
and :class:`~crosskd.errors.NonFiniteLoss`); when several workers fail, a permanent code
wins (the worker with the real error decides, not the peers that lost it). Only a finished run
exits 0: the operator ends the job Succeeded when the Master exits 0.

The restart budget is crosskd's own (under ``ExitCode`` the operator's ``backoffLimit`` does
not count): each retryable failure other than SIGTERM is recorded in
``output/restarts/node-<rank>.json`` with the step of the latest checkpoint; a failure after a
new checkpoint starts the count again, so a long run that keeps making progress is never
stopped by it.

Rendezvous: static, from what the operator injects (``MASTER_ADDR``, ``MASTER_PORT``,
``PET_NNODES``, ``PET_NODE_RANK``; Master + Workers); c10d when ``PET_RDZV_BACKEND`` and
``PET_RDZV_ENDPOINT`` are set (the job's elastic policy); on one machine with neither, a static
rendezvous on a free loopback port. The agent's ``shutdown_timeout`` (how long it waits for the
workers after forwarding SIGTERM, then SIGKILL) is ``CROSSKD_GRACE_SECONDS`` (the pod's
``terminationGracePeriodSeconds``) minus a margin.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import uuid

import fsspec

from crosskd.errors import ConfigError, CrosskdError, NonFiniteLoss, Stopped
from crosskd.train.checkpoint import latest_step
from crosskd.train.config import TrainConfig

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_INPUT = CrosskdError.exit_code
EXIT_NONFINITE = NonFiniteLoss.exit_code
EXIT_RESTART_BUDGET = 4
EXIT_SIGTERM = Stopped.exit_code
EXIT_RETRYABLE = 200
PERMANENT = (EXIT_INPUT, EXIT_NONFINITE, EXIT_RESTART_BUDGET)
GRACE_ENV = "CROSSKD_GRACE_SECONDS"
GRACE_MARGIN_S = 5
"""Seconds of the grace period kept for the agent itself after the workers stop."""


def pod_exit_code(worker_codes: list[int]) -> int:
    """The pod's exit code from its failed workers' codes (negative: killed by that signal):
    a permanent crosskd code wins (the lowest), then SIGTERM (143 or -15, a stop), else
    retryable."""
    permanent = sorted(c for c in worker_codes if c in PERMANENT)
    if permanent:
        return permanent[0]
    if worker_codes and all(c in (EXIT_SIGTERM, -signal.SIGTERM) for c in worker_codes):
        return EXIT_SIGTERM
    return EXIT_RETRYABLE


def rendezvous(env: dict[str, str]) -> dict:
    """The rendezvous keyword arguments of :class:`LaunchConfig` from the environment the
    Training Operator injects (module docstring): ``rdzv_backend``, ``rdzv_endpoint``,
    ``rdzv_configs``, ``min_nodes``, ``max_nodes``, ``run_id``."""
    if env.get("PET_RDZV_BACKEND") and env.get("PET_RDZV_ENDPOINT"):
        low, _, high = env.get("PET_NNODES", "1").partition(":")
        return {
            "rdzv_backend": env["PET_RDZV_BACKEND"],
            "rdzv_endpoint": env["PET_RDZV_ENDPOINT"],
            "rdzv_configs": {},
            "min_nodes": int(low),
            "max_nodes": int(high or low),
            "run_id": env.get("PET_RDZV_ID", "crosskd"),
        }
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        nodes = int(env.get("PET_NNODES", "1"))
        if "PET_NODE_RANK" not in env and nodes > 1:
            raise ConfigError(
                f"PET_NNODES is {nodes} but PET_NODE_RANK is not set; the Training Operator sets "
                "it for every replica (a Master and Workers), so run the pod under a PyTorchJob."
            )
        return {
            "rdzv_backend": "static",
            "rdzv_endpoint": f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
            "rdzv_configs": {"rank": int(env.get("PET_NODE_RANK", "0"))},
            "min_nodes": nodes,
            "max_nodes": nodes,
            "run_id": "crosskd",
        }
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return {
        "rdzv_backend": "static",
        "rdzv_endpoint": f"127.0.0.1:{port}",
        "rdzv_configs": {"rank": 0},
        "min_nodes": 1,
        "max_nodes": 1,
        "run_id": uuid.uuid4().hex,
    }


def shutdown_timeout(env: dict[str, str]) -> int:
    """Seconds the agent waits for its workers after forwarding SIGTERM (then SIGKILL)."""
    grace = int(env.get(GRACE_ENV, "30"))
    return max(grace - GRACE_MARGIN_S, 1)


def record_failure(config: TrainConfig, node_rank: int) -> int:
    """Count a retryable failure of this node in ``output/restarts/node-<rank>.json``; the
    count starts again when a newer checkpoint exists than at the previous failure. Returns
    the count."""
    step = latest_step(f"{config.output}/checkpoints") or 0
    fs, root = fsspec.core.url_to_fs(f"{config.output}/restarts/node-{node_rank}.json")
    earlier = {"count": 0, "step": -1}
    if fs.exists(root):
        try:
            earlier = json.loads(fs.cat_file(root))
        except ValueError:  # a damaged record counts as none
            log.warning("%s is damaged; counting restarts from 0", root)
    count = int(earlier.get("count", 0)) + 1 if earlier.get("step") == step else 1
    fs.makedirs(root.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(root, json.dumps({"count": count, "step": step}).encode())
    return count


def launch(config: TrainConfig, worker_args: list[str], nproc_per_node: int) -> int:
    """Run ``nproc_per_node`` workers (``python -m crosskd.cli train`` + ``worker_args``) under
    torch's elastic agent; returns the pod's exit code (module docstring)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    env = dict(os.environ)
    launch_config = LaunchConfig(
        nproc_per_node=nproc_per_node,
        max_restarts=0,
        monitor_interval=0.5,
        shutdown_timeout=shutdown_timeout(env),
        start_method="spawn",
        **rendezvous(env),
    )
    node_rank = int(env.get("PET_NODE_RANK", "0"))
    try:
        elastic_launch(launch_config, sys.executable)("-m", "crosskd.cli", "train", *worker_args)
        return EXIT_OK
    except SignalException as exc:
        log.info("got %s: the workers were stopped and checkpointed", exc.sigval)
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        codes = [failure.exitcode for failure in exc.failures.values()]
        code = pod_exit_code(codes)
        log.error("worker exit codes %s: the pod exits %d", codes, code)
    if code == EXIT_RETRYABLE:
        count = record_failure(config, node_rank)
        if count > config.max_restarts:
            log.error(
                "%d retryable failures in a row without a new checkpoint (max_restarts "
                "%d): giving up",
                count,
                config.max_restarts,
            )
            return EXIT_RESTART_BUDGET
    return code
