"""How the processes of one job find each other: the rendezvous keyword arguments of torch's
elastic agent (:class:`~torch.distributed.launcher.api.LaunchConfig`) from the environment, and
how long the agent waits for its workers after SIGTERM. Used by the training pod's entry point
(:mod:`crosskd.train.launch`) and by the sharded teacher (:mod:`crosskd.teacher.sharded`).

Static, from what the Training Operator injects (``MASTER_ADDR``, ``MASTER_PORT``,
``PET_NNODES``, ``PET_NODE_RANK``; Master + Workers) or Kubeflow Trainer v2's torch plugin
(``PET_MASTER_ADDR``, ``PET_MASTER_PORT``, ``PET_NNODES``, ``PET_NODE_RANK``: a TrainJob);
c10d when ``PET_RDZV_BACKEND`` and
``PET_RDZV_ENDPOINT`` are set (the job's elastic policy); on one machine with neither, a static
rendezvous on a free loopback port. The agent's ``shutdown_timeout`` (how long it waits for the
workers after forwarding SIGTERM, then SIGKILL) is ``CROSSKD_GRACE_SECONDS`` (the pod's
``terminationGracePeriodSeconds``) minus a margin.
"""

from __future__ import annotations

import socket
import uuid

from crosskd.errors import ConfigError

GRACE_ENV = "CROSSKD_GRACE_SECONDS"
GRACE_MARGIN_S = 5
"""Seconds of the grace period kept for the agent itself after the workers stop."""


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
    address = env.get("MASTER_ADDR") or env.get("PET_MASTER_ADDR")
    port = env.get("MASTER_PORT") or env.get("PET_MASTER_PORT")
    if address and port:
        nodes = int(env.get("PET_NNODES", "1"))
        if "PET_NODE_RANK" not in env and nodes > 1:
            raise ConfigError(
                f"PET_NNODES is {nodes} but PET_NODE_RANK is not set; the Training Operator "
                "(a PyTorchJob's Master and Workers) and Kubeflow Trainer's torch runtime (a "
                "TrainJob's nodes) set it for every pod, so run the pod under one of them."
            )
        return {
            "rdzv_backend": "static",
            "rdzv_endpoint": f"{address}:{port}",
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
