"""Whether a run's speed was its own: the signs that it shared its machine with other work.

A training step on the CPU records its **CPU share** (:func:`cpu_share`): the CPU seconds the
process spent in the step over the step's wall seconds times the threads it can use at once
(torch's intra-op threads, at most the cores the process may run on). A process alone on its
cores keeps them busy through a step (about 1); one that shares them with another busy process
gets about its share of them (about 0.5 beside one other). On a GPU the process waits on the
device, so the share says nothing there and is not recorded, and only the second sign counts:
the **spread of its step times** (the 95th percentile over the median), which work that comes
and goes on the machine widens.

:func:`contention` reads both from a run's step records; the run report marks a run it names
next to its speed, so a slow run is not read as the method's cost.
"""

from __future__ import annotations

import math
import os
import statistics

import torch

SHARE_BELOW = 0.75
"""A CPU run whose median CPU share is below this shared its cores."""
SPREAD_ABOVE = 1.5
"""A run whose 95th-percentile step time is more than this times its median had uneven
steps."""


def usable_threads() -> int:
    """The threads a step can keep busy at once: torch's intra-op threads, at most the cores
    this process may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(torch.get_num_threads(), cores or 1))


def cpu_share(cpu_seconds: float, seconds: float, threads: int | None = None) -> float:
    """The CPU seconds a step used over its wall ``seconds`` times ``threads`` (default
    :func:`usable_threads`): about 1 for a CPU step alone on its cores."""
    return cpu_seconds / (max(seconds, 1e-9) * (threads or usable_threads()))


def nearest_rank(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of the sorted, non-empty ``ordered`` by the nearest-rank rule."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def contention(history: list[dict]) -> list[str]:
    """What in a run's step records (``seconds``, and ``cpu_share`` on the CPU) says it shared
    its machine: each sign as a phrase, none when its speed was its own."""
    seconds = sorted(float(h["seconds"]) for h in history if h.get("seconds"))
    signs = []
    shares = [float(h["cpu_share"]) for h in history if "cpu_share" in h]
    if shares and (share := statistics.median(shares)) < SHARE_BELOW:
        signs.append(f"median CPU share {share:.2f} of its threads (alone: about 1)")
    if len(seconds) >= 4:
        p50, p95 = nearest_rank(seconds, 0.5), nearest_rank(seconds, 0.95)
        if p95 > SPREAD_ABOVE * p50:
            signs.append(f"step time p95 {p95 / p50:.1f}x its median")
    return signs
