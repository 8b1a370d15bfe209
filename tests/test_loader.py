"""The input thread of training (:class:`crosskd.train.loader.Prefetcher`): steps in order, at
most ``depth`` ahead, an error raised in the loop at the step that failed, a stop mid-run."""

from __future__ import annotations

import threading
import time

import pytest

from crosskd.train.loader import Prefetcher


def test_steps_arrive_in_order_at_most_depth_ahead():
    produced = []

    def produce(step):
        produced.append(step)
        return step * 10

    inputs = Prefetcher(produce, range(3, 9), depth=2)
    time.sleep(0.3)  # the thread runs ahead and blocks on the full queue
    assert len(produced) <= 3  # two queued, one waiting to be queued
    assert [inputs.get(s)[0] for s in range(3, 9)] == [30, 40, 50, 60, 70, 80]
    assert produced == list(range(3, 9))
    inputs.close()


def test_an_error_is_raised_at_its_step_in_the_loop():
    def produce(step):
        if step == 2:
            raise ValueError("shard 7 is damaged")
        return step

    inputs = Prefetcher(produce, range(5), depth=2)
    assert [inputs.get(s)[0] for s in (0, 1)] == [0, 1]
    with pytest.raises(ValueError, match="shard 7 is damaged"):
        inputs.get(2)
    inputs.close()


def test_inline_when_depth_is_zero_and_close_mid_run():
    seen = []
    inline = Prefetcher(lambda s: seen.append(threading.current_thread().name) or s, range(2), 0)
    assert inline.get(0)[0] == 0 and seen == [threading.current_thread().name]
    inline.close()
    ahead = Prefetcher(lambda s: s, range(1000), depth=1)
    assert ahead.get(0)[0] == 0
    ahead.close()  # the thread stops though 999 steps are left
    assert not ahead._thread.is_alive()
