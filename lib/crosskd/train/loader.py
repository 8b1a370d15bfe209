"""The input side of training, off the step's critical path.

:class:`Prefetcher` runs ``produce(step)`` (read the step's rows, collate them, read or compute
the teacher signal and plan the loss of every micro-batch) for the steps in order in a
background thread, at most ``depth`` steps ahead of the training loop, so that a step only
waits for its inputs when producing them is slower than the model (``depth`` 0: no thread,
each step's inputs are produced when it asks for them). It is a thread, not worker
processes: no filesystem object (fsspec, s3fs) crosses a fork, the shards a window reads are
read once per process, and the online teacher (a model on the training device) can run there
too. An error in ``produce`` is raised by :meth:`Prefetcher.get` of that step, in the training
loop; :meth:`Prefetcher.close` stops the thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class Prefetcher(Generic[T]):
    """``produce(step)`` for each of ``steps`` in a background thread, ``depth`` ahead."""

    def __init__(self, produce: Callable[[int], T], steps: Iterable[int], depth: int) -> None:
        self._produce = produce
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread = None
        if depth > 0:
            self._thread = threading.Thread(
                target=self._run, args=(produce, list(steps)), name="crosskd-input", daemon=True
            )
            self._thread.start()

    def _run(self, produce: Callable[[int], T], steps: list[int]) -> None:
        for step in steps:
            try:
                item = (step, produce(step), None)
            except BaseException as exc:  # raised by get(), in the training loop
                item = (step, None, exc)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set() or item[2] is not None:
                return

    def get(self, step: int) -> tuple[T, float]:
        """The inputs of ``step`` (the next step in order) and the seconds this call waited
        for them."""
        started = time.perf_counter()
        if self._thread is None:
            return self._produce(step), time.perf_counter() - started
        got, value, error = self._queue.get()
        waited = time.perf_counter() - started
        if error is not None:
            raise error
        if got != step:
            raise RuntimeError(f"the input thread produced step {got}, the loop asked for {step}")
        return value, waited

    def close(self) -> None:
        """Stop the thread (it finishes the step it is producing) and wait for it."""
        self._stop.set()
        while self._thread is not None and self._thread.is_alive():
            try:
                self._queue.get_nowait()
            except queue.Empty:
                self._thread.join(timeout=0.1)
