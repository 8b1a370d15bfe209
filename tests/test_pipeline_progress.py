"""The local pipeline's terminal output: one line per step event, the rest in a log file."""

from __future__ import annotations

import subprocess
import sys

from crosskd.pipeline.progress import step_line

LOG = """\
\x1b[0m16:40:18.844 - INFO - Running pipeline: \x1b[95m'crosskd-distill'\x1b[0m
16:40:18.849 - INFO - Executing task \x1b[96m'validate-inputs'\x1b[0m
    [KFP Executor 2026-12-02 16:40:18,897 INFO]: Got executor_input:
16:40:32.820 - INFO - Task \x1b[96m'validate-inputs'\x1b[0m finished with status \
\x1b[92mSUCCESS\x1b[0m
16:41:25.094 - INFO - Executing task 'train'
16:41:25.095 - INFO - Executing task 'train'
16:44:04.407 - INFO - Task 'train' finished with status SUCCESS
16:44:09.001 - INFO - Task 'train' finished with status FAILURE
16:44:10.000 - INFO - Task prepare cache hit (key=0123456789ab); skipping execution.
23:59:59.000 - INFO - Executing task 'report'
00:00:03.000 - INFO - Task 'report' finished with status SUCCESS
00:00:03.100 - INFO - Pipeline 'crosskd-distill' finished with status SUCCESS
"""


def test_step_lines_worked_by_hand():
    started: dict = {}
    lines = [step_line(x, started) for x in LOG.splitlines()]
    assert [x for x in lines if x] == [
        "16:40:18 validate-inputs: started",
        "16:40:32 validate-inputs: SUCCESS (14 s)",
        "16:41:25 train: started",
        "16:41:25 train: started",
        "16:44:04 train: SUCCESS (159 s)",
        "16:44:09 train: FAILURE (164 s)",
        "16:44:10 prepare: taken from the cache",
        "23:59:59 report: started",
        "00:00:03 report: SUCCESS (4 s)",  # past midnight
        "00:00:03 pipeline: SUCCESS",
    ]
    assert lines[0] is None and lines[2] is None


def test_the_output_of_child_processes_goes_to_the_log(tmp_path):
    """In a process of its own (as the CLI runs it): its prints, a child process's output and
    standard error go to the log; the step lines, then what is printed after, to the
    terminal."""
    log = tmp_path / "logs" / "run.log"
    child = (
        "import sys; print('    [KFP Executor] Got executor_input:'); "
        "print(\"16:40:18.849 - INFO - Executing task 'prepare'\"); "
        "print('warning', file=sys.stderr)"
    )
    script = f"""
import subprocess, sys
from pathlib import Path
from crosskd.pipeline.progress import steps_to_log
with steps_to_log(Path({str(log)!r})):
    print("12:00:00.000 - INFO - Task 'prepare' finished with status SUCCESS")
    subprocess.run([sys.executable, "-c", {child!r}], check=True)
    print("12:00:01.000 - INFO - Pipeline 'p' finished with status SUCCESS")
print("after")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    text = log.read_text()
    assert "Got executor_input" in text and "warning" in text and "after" not in text
    assert done.stdout.splitlines() == [
        "12:00:00 prepare: SUCCESS (0 s)",
        "16:40:18 prepare: started",
        "12:00:01 pipeline: SUCCESS",
        "after",
    ]
    assert done.stderr == ""
