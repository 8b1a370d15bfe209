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

The rendezvous (static from the operator's environment, c10d under an elastic policy) and the
agent's shutdown timeout (``CROSSKD_GRACE_SECONDS`` minus a margin) come from
:mod:`crosskd.parallel.rendezvous`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

import fsspec
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from crosskd.errors import CrosskdError, NonFiniteLoss, Stopped
from crosskd.parallel.rendezvous import rendezvous, shutdown_timeout
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
