"""The data order of a training run, and what fixes it.

The order depends on four things only: the prepared data (its fingerprint, and the packed rows
of each shard), the seed, ``window_shards`` and ``global_batch_rows`` (packed rows per optimizer
step over all processes). It is **shard-local** (:class:`ShardOrder`): epoch ``e`` is a seeded
permutation of the shards, cut into windows of ``window_shards`` shards, and within each window a
seeded permutation of its packed rows; step ``s`` reads positions ``s * G .. (s + 1) * G - 1``
of the endless sequence of epochs. So the steps of one window read only that window's shards:
each shard is read once per epoch by each process that keeps two windows of shards
(:class:`crosskd.data.rows.PackedRows`). How the step's rows are split over processes and
micro-batches does not change which rows a step trains on (:func:`rank_micro_batches`):
micro-batch ``m`` of data-parallel rank ``r`` takes the step's rows
``[(m * dp + r) * R, (m * dp + r + 1) * R)`` with ``R = micro_batch_rows``, so over all ranks
micro-batch ``m`` is the step's rows ``[m * dp * R, (m + 1) * dp * R)`` whatever ``dp`` is, as
long as ``dp * R`` stays the same (the dynamic ``kd_scale`` of a micro-batch then stays the same
too). Ranks of one tensor- or sequence-parallel group share one data-parallel index and so read
the same rows.

A checkpoint records the :class:`DataOrder`; a resume that would read another order (another
global batch, data, window or seed) is refused by :meth:`DataOrder.require`, naming what
differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from crosskd.errors import ConfigError


@dataclass(frozen=True)
class DataOrder:
    """What fixes the data order: ``global_batch_rows``, the prepared data's
    ``data_fingerprint`` and number of packed ``rows``, the ``seed`` and ``window_shards``."""

    global_batch_rows: int
    data_fingerprint: str
    rows: int
    seed: int
    window_shards: int

    def to_json(self) -> dict:
        """The JSON-able form recorded in ``state.json``."""
        return asdict(self)

    def require(self, recorded: dict, where: str) -> None:
        """Refuse to resume the run recorded at ``where`` (its ``state.json`` ``data_order``)
        with another order, naming each key that differs and both values."""
        differ = [
            f"{key} {recorded.get(key)!r} there, {value!r} now"
            for key, value in self.to_json().items()
            if recorded.get(key) != value
        ]
        if differ:
            raise ConfigError(
                f"the run in {where} was started with another data order ({'; '.join(differ)}); "
                f"a resume must keep global_batch_rows, the prepared data, seed and "
                f"window_shards. Use the run's "
                f"values, or a new output for a new run."
            )


class ShardOrder:
    """The shard-local order of packed rows (module docstring). ``shard_rows``: packed rows of
    each prepared shard, in shard order (rows are numbered across shards in that order)."""

    def __init__(self, shard_rows: Sequence[int], seed: int, window_shards: int) -> None:
        self.sizes = np.asarray(shard_rows, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)])
        self.rows = int(self.starts[-1])
        if self.rows == 0:
            raise ConfigError("the prepared data has no packed rows; prepare some data.")
        self.seed, self.window = seed, window_shards
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._windows: dict[tuple[int, int], np.ndarray] = {}

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Epoch ``epoch``'s shard order and the end position of each window in it."""
        if epoch not in self._epochs:
            shards = np.random.default_rng([self.seed, epoch]).permutation(len(self.sizes))
            sizes = self.sizes[shards]
            ends = np.cumsum(
                [sizes[i : i + self.window].sum() for i in range(0, len(shards), self.window)]
            )
            self._epochs = {epoch: (shards, ends)}  # one epoch at a time
        return self._epochs[epoch]

    def window_rows(self, epoch: int, window: int) -> np.ndarray:
        """The packed rows (global numbers) of window ``window`` of epoch ``epoch``, in the
        order they are read."""
        key = (epoch, window)
        if key not in self._windows:
            shards, _ = self._epoch(epoch)
            group = shards[window * self.window : (window + 1) * self.window]
            rows = np.concatenate([np.arange(self.starts[s], self.starts[s + 1]) for s in group])
            if len(self._windows) >= 4:
                self._windows.pop(next(iter(self._windows)))
            self._windows[key] = np.random.default_rng([self.seed, epoch, window]).permutation(rows)
        return self._windows[key]

    def step_rows(self, step: int, per_step: int) -> list[int]:
        """The packed rows of optimizer step ``step`` (``per_step`` = the global batch)."""
        out = []
        for position in range(step * per_step, (step + 1) * per_step):
            epoch, offset = divmod(position, self.rows)
            _, ends = self._epoch(epoch)
            window = int(np.searchsorted(ends, offset, side="right"))
            before = int(ends[window - 1]) if window else 0
            out.append(int(self.window_rows(epoch, window)[offset - before]))
        return out

    def locate(self, row: int) -> tuple[int, int]:
        """``(shard, packed row within the shard)`` of global packed row ``row``."""
        shard = int(np.searchsorted(self.starts, row, side="right")) - 1
        return shard, row - int(self.starts[shard])


def rank_micro_batches(
    rows: list[int], dp_rank: int, dp_size: int, micro_batch_rows: int
) -> list[list[int]]:
    """Data-parallel rank ``dp_rank``'s micro-batches of one step's ``rows`` (see the module
    docstring); ``len(rows)`` must be a multiple of ``dp_size * micro_batch_rows``."""
    per_micro = dp_size * micro_batch_rows
    if len(rows) % per_micro:
        raise ConfigError(
            f"a step of {len(rows)} rows does not split into micro-batches of "
            f"{micro_batch_rows} rows on {dp_size} data-parallel rank(s)."
        )
    return [
        rows[start + dp_rank * micro_batch_rows : start + (dp_rank + 1) * micro_batch_rows]
        for start in range(0, len(rows), per_micro)
    ]
