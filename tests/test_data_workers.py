"""`ordered_map` in real forked processes: results in task order whatever order the workers
finish in, bounded reading ahead, a task's exception raised in the parent, and a worker killed
part way replaced with its task run again."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crosskd.data.workers import ordered_map
from crosskd.errors import DataError


def _slow_square(x: int) -> int:
    time.sleep(0.002 * ((7 * x) % 5))  # workers finish out of task order
    return x * x


def test_results_come_in_task_order_and_reading_ahead_is_bounded():
    read = []

    def tasks():
        for x in range(30):
            read.append(x)
            yield x

    got = []
    for result in ordered_map(_slow_square, tasks(), 3):
        got.append(result)
        # At most two tasks per worker are in flight or finished and waiting to be yielded.
        assert len(read) - len(got) <= 2 * 3
    assert got == [x * x for x in range(30)]
    assert multiprocessing.active_children() == []


def test_one_worker_runs_in_this_process():
    pid = os.getpid()
    assert list(ordered_map(lambda x: (x, os.getpid() == pid), range(3), 1)) == [
        (0, True),
        (1, True),
        (2, True),
    ]
    assert list(ordered_map(lambda x: os.getpid() == pid, range(4), 2)) == [False] * 4


def test_a_task_error_is_raised_here_and_the_workers_stop():
    def work(x: int) -> int:
        if x == 5:
            raise DataError(f"row {x} is bad; drop it")
        return x

    got = []
    with pytest.raises(DataError, match=r"^row 5 is bad; drop it$"):
        for result in ordered_map(work, range(20), 2):
            got.append(result)
    assert got == [0, 1, 2, 3, 4]
    assert multiprocessing.active_children() == []


def test_a_killed_worker_is_replaced_and_its_task_run_again(tmp_path: Path):
    def work(x: int) -> int:
        marker = tmp_path / f"killed-{x}"
        if x in (3, 7) and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return x * 10

    assert list(ordered_map(work, range(10), 2)) == [x * 10 for x in range(10)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["killed-3", "killed-7"]
    assert multiprocessing.active_children() == []


def test_a_task_that_kills_every_worker_is_named(tmp_path: Path):
    def work(x: int) -> int:
        if x == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return x

    with pytest.raises(DataError, match=r"^task 2: its worker process died 3 times \(last exit "):
        list(ordered_map(work, range(5), 2, retries=2, describe=lambda x: f"task {x}"))
    assert multiprocessing.active_children() == []


def test_workers_must_be_at_least_one():
    with pytest.raises(ValueError, match="workers is 0; it must be at least 1"):
        list(ordered_map(abs, [1], 0))


CTRL_C = """
import sys, time
from crosskd.data.workers import ordered_map
def work(x):
    time.sleep(30)
    return x
print("started", flush=True)
list(ordered_map(work, range(4), 2))
"""


def test_ctrl_c_stops_the_workers_with_one_traceback():
    """Ctrl-C reaches the whole process group: the parent stops with KeyboardInterrupt and takes
    its workers down; the workers print nothing of their own."""
    child = subprocess.Popen(
        [sys.executable, "-c", CTRL_C],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert child.stdout.readline().strip() == "started"
    time.sleep(1.0)  # the workers are forked and asleep in their tasks
    os.killpg(child.pid, signal.SIGINT)
    _, err = child.communicate(timeout=20)
    assert child.returncode != 0
    assert err.count("KeyboardInterrupt") == 1
    assert "ForkProcess" not in err
