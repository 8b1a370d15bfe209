"""Running one function over a stream of tasks in worker processes, results in task order.

``crosskd prepare`` prepares its input windows this way (``prepare.workers``): each worker is a
forked copy of the process (so the tokenizers it loaded are shared, not loaded again), takes
one task at a time over its own pipe, and sends back the result or the exception the task
raised. The parent reads tasks lazily and keeps at most two per worker in flight or waiting to
be yielded, so memory stays bounded whatever the length of the stream.

A worker that dies on a task (killed by the kernel for memory, or by a signal) is replaced and
its task sent again to the new worker, up to ``retries`` times per task; an exception the task
raises is not retried: it is raised in the parent once every result before it has been yielded
(as one process would have raised it), and the workers are stopped.

Each worker runs the tokenizers single-threaded (``TOKENIZERS_PARALLELISM=false``): with
``workers`` processes the pod's cores are the workers, not the tokenizers' threads.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import Connection, wait
from typing import TypeVar

from crosskd.errors import DataError

T = TypeVar("T")
R = TypeVar("R")


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, context: multiprocessing.context.BaseContext, work: Callable) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, work), daemon=True)
        self.process.start()
        child.close()

    def stop(self) -> None:
        """End the process (it holds no state worth keeping) and close the pipe."""
        if self.process.is_alive():
            self.process.terminate()
        self.process.join()
        self.conn.close()


def _serve(conn: Connection, work: Callable) -> None:
    """A worker's loop: run ``work`` on each task received until the pipe closes. Ctrl-C is the
    parent's to handle (it stops the workers), so a worker ignores it rather than print a
    traceback of its own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        try:
            result = ("ok", work(task))
        except Exception as exc:  # the parent raises it
            result = ("error", exc)
        try:
            conn.send(result)
        except Exception as exc:  # an exception that does not pickle: send its text
            conn.send(("error", RuntimeError(f"{type(result[1]).__name__}: {result[1]} ({exc})")))


def ordered_map(
    work: Callable[[T], R],
    tasks: Iterable[T],
    workers: int,
    *,
    retries: int = 2,
    describe: Callable[[T], str] = str,
) -> Iterator[R]:
    """``work(task)`` for every task of ``tasks``, yielded in task order, computed in
    ``workers`` forked processes (1: in this process, with no worker). A task whose worker dies
    runs again in a new worker, at most ``retries`` times; then a
    :class:`~crosskd.errors.DataError` names it (``describe(task)``) and the exit code. An
    exception raised by ``work`` is raised here, after the results of the tasks before it."""
    if workers < 1:
        raise ValueError(f"workers is {workers}; it must be at least 1")
    if workers == 1:
        for task in tasks:
            yield work(task)
        return
    context = multiprocessing.get_context("fork")
    idle: list[_Worker] = []
    started = 0
    busy: dict[_Worker, tuple[int, T]] = {}
    done: dict[int, tuple[str, R | Exception]] = {}
    failures: dict[int, int] = {}
    stream = iter(tasks)
    read = head = 0
    exhausted = False
    try:
        while True:
            while (
                (idle or started < workers)
                and not exhausted
                and len(busy) + len(done) < 2 * workers
            ):
                try:
                    task = next(stream)
                except StopIteration:
                    exhausted = True
                    break
                if not idle:  # started when a task needs it: a short stream forks fewer
                    idle.append(_Worker(context, work))
                    started += 1
                worker = idle.pop()
                worker.conn.send(task)
                busy[worker] = (read, task)
                read += 1
            while head in done:
                status, value = done.pop(head)
                if status == "error":
                    raise value
                yield value
                head += 1
            if not busy:
                if exhausted:
                    return
                continue  # the results just yielded made room for more tasks
            ready = set(wait([w.conn for w in busy] + [w.process.sentinel for w in busy]))
            for worker in list(busy):
                if worker.conn not in ready and worker.process.sentinel not in ready:
                    continue
                index, task = busy.pop(worker)
                try:
                    status, value = worker.conn.recv() if worker.conn.poll() else (None, None)
                except EOFError:
                    status, value = None, None
                if status is not None:
                    done[index] = (status, value)
                    idle.append(worker)
                    continue
                worker.stop()
                failures[index] = failures.get(index, 0) + 1
                if failures[index] > retries:
                    raise DataError(
                        f"{describe(task)}: its worker process died {failures[index]} times "
                        f"(last exit code {worker.process.exitcode}; -9 is a kill, often for "
                        f"memory); give the pod more memory or prepare smaller windows "
                        f"(shard_rows)."
                    )
                replacement = _Worker(context, work)
                replacement.conn.send(task)
                busy[replacement] = (index, task)
    finally:
        for worker in [*idle, *busy]:
            worker.stop()
