"""Whether a run's speed was its own: the signs that it shared its machine with other work.

A training step on the CPU records its **CPU share** (:func:`cpu_share`): the CPU seconds the
process spent in the step (every thread of it: the input and metrics threads count too) over
the step's wall seconds times the threads it can use at once (torch's intra-op threads, at most
the cores the process may run on and its container's CPU quota). A process alone on its cores
keeps them busy through a step (about 1); one that shares them with another busy process gets
about its share of them (about 0.5 beside one other). Waits lower it too (for inputs, or for a
peer in a collective), so it is a sign, not a proof. On a GPU the process waits on the device,
so the share says nothing there and is not recorded, and only the second sign counts: the
**spread of its step times** (the 95th percentile over the median), which work that comes and
goes on the machine widens.

:func:`contention` reads both from a run's step records; the run report marks a run it names
next to its speed, so a slow run is not read as the method's cost.
"""

from __future__ import annotations

import math
import os
import statistics
from pathlib import Path

import torch

SHARE_BELOW = 0.75
"""A CPU run whose median CPU share is below this shared its cores."""
SPREAD_ABOVE = 1.5
"""A run whose 95th-percentile step time is more than this times its median had uneven
steps."""
SPREAD_STEPS = 20
"""The timed steps (after the first) a run needs before the spread of its step times counts."""


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
"""cgroup v2's CPU quota of this container: ``"<quota> <period>"`` in microseconds, or
``"max <period>"`` without one (a pod's CPU limit)."""


def usable_threads(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The threads a step can keep busy at once: torch's intra-op threads, at most the cores
    this process may run on and the CPU quota of its container (``cpu_max``, rounded up)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    limit = cores or 1
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        quota = "max"
    if quota != "max":
        limit = min(limit, math.ceil(int(quota) / int(period)))
    return max(1, min(torch.get_num_threads(), limit))


def cpu_share(cpu_seconds: float, seconds: float, threads: int | None = None) -> float:
    """The CPU seconds a step used over its wall ``seconds`` times ``threads`` (default
    :func:`usable_threads`): about 1 for a CPU step alone on its cores."""
    return cpu_seconds / (max(seconds, 1e-9) * (threads or usable_threads()))


def nearest_rank(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of the sorted, non-empty ``ordered`` by the nearest-rank rule."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def contention(history: list[dict]) -> list[str] | None:
    """What in a run's step records (``seconds``, and ``cpu_share`` on the CPU) says it shared
    its machine: each sign as a phrase, none when its speed was its own; None without timed
    steps. The first step (warm-up) is left out; the spread counts from :data:`SPREAD_STEPS`
    steps on (fewer make the 95th percentile the slowest step)."""
    timed = [h for h in history if h.get("seconds")][1:]
    if not timed:
        return None
    seconds = sorted(float(h["seconds"]) for h in timed)
    signs = []
    shares = [float(h["cpu_share"]) for h in timed if "cpu_share" in h]
    if shares and (share := statistics.median(shares)) < SHARE_BELOW:
        signs.append(f"median CPU share {share:.2f} of its threads (alone: about 1)")
    if len(seconds) >= SPREAD_STEPS:
        p50, p95 = nearest_rank(seconds, 0.5), nearest_rank(seconds, 0.95)
        if p95 > SPREAD_ABOVE * p50:
            signs.append(f"step time p95 {p95 / p50:.1f}x its median")
    return signs
