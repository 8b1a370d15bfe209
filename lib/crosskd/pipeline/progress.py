"""A local pipeline run's output: everything into a log file, one line per step on the terminal.

Under ``kfp.local`` every step streams its whole executor input, its logs and its outputs to
this process's output (over a thousand lines for the demo). :func:`steps_to_log` sends this
process's standard output and error (the file descriptors, which the step processes inherit
and kfp.local prints to) into a log file while the run lasts, and follows that file to write
one line per step event on the terminal: a step started, finished (its status and seconds) or
was taken from the cache, and the pipeline's end.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
_EVENT = re.compile(
    r"^(?P<clock>\d\d:\d\d:\d\d)\.\d+ - \w+ - (?:"
    r"Executing task '(?P<start>[^']+)'"
    r"|Task '(?P<end>[^']+)' finished with status (?P<status>\w+)"
    r"|Task (?P<cached>\S+) cache hit"
    r"|Pipeline '[^']+' finished with status (?P<pipeline>\w+))"
)


def step_line(line: str, started: dict[str, list[float]]) -> str | None:
    """The terminal line for one line of kfp.local's log (colour codes allowed), or None when
    it is not a step event; ``started`` (step name -> start times in seconds of the day,
    updated) gives the seconds a finished step took (steps of one name, such as a loop's, are
    taken to finish in the order they started)."""
    event = _EVENT.match(_COLOUR.sub("", line))
    if event is None:
        return None
    clock = event["clock"]
    if event["start"]:
        started.setdefault(event["start"], []).append(_seconds(clock))
        return f"{clock} {event['start']}: started"
    if event["end"]:
        begun = started.get(event["end"]) or [_seconds(clock)]
        took = (_seconds(clock) - begun.pop(0)) % 86400
        return f"{clock} {event['end']}: {event['status']} ({took:.0f} s)"
    if event["cached"]:
        return f"{clock} {event['cached']}: taken from the cache"
    return f"{clock} pipeline: {event['pipeline']}"


@contextlib.contextmanager
def steps_to_log(path: Path) -> Iterator[None]:
    """Send this process's standard output and error into ``path`` (appended) while the block
    runs, writing :func:`step_line` lines to the standard output as it was, as they appear;
    the last ones are written before the block's exception, if any, goes on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    out = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    stop = threading.Event()
    with path.open("ab") as log:
        offset = log.tell()
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    follower = threading.Thread(target=_follow, args=(path, offset, out, stop), daemon=True)
    follower.start()
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        stop.set()
        follower.join()
        out.close()


def _follow(path: Path, offset: int, out: TextIO, stop: threading.Event) -> None:
    """Write the step lines of ``path`` from byte ``offset`` on to ``out`` as the file grows,
    until ``stop`` is set and the file is read to its end."""
    started: dict[str, list[float]] = {}
    with path.open("rb") as log:
        log.seek(offset)
        pending = b""
        while True:
            done = stop.is_set()
            pending += log.read()
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                line = step_line(raw.decode("utf-8", "replace"), started)
                if line is not None:
                    out.write(line + "\n")
                    out.flush()
            if done:
                return
            time.sleep(0.2)


def _seconds(clock: str) -> float:
    hours, minutes, seconds = (int(x) for x in clock.split(":"))
    return hours * 3600 + minutes * 60 + seconds
