"""The data order of a training run, and what fixes it.

The order depends on three things only: the prepared data (its fingerprint and number of packed
rows), the seed and ``global_batch_rows`` (packed rows per optimizer step over all processes).
Step ``s`` reads positions ``s * G .. (s + 1) * G - 1`` of an endless sequence of epochs, each a
seeded permutation of every row (:func:`step_rows`). How those rows are split over processes
and micro-batches does not change which rows a step trains on (:func:`rank_micro_batches`):
micro-batch ``m`` of data-parallel rank ``r`` takes the step's rows
``[(m * dp + r) * R, (m * dp + r + 1) * R)`` with ``R = micro_batch_rows``, so over all ranks
micro-batch ``m`` is the step's rows ``[m * dp * R, (m + 1) * dp * R)`` whatever ``dp`` is, as
long as ``dp * R`` stays the same (the dynamic ``kd_scale`` of a micro-batch then stays the same
too). Ranks of one tensor- or sequence-parallel group share one data-parallel index and so read
the same rows.

A checkpoint records the :class:`DataOrder`; a resume that would read another order (another
global batch, data or seed) is refused by :meth:`DataOrder.require`, naming what differs.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import numpy as np

from crosskd.errors import ConfigError


@dataclass(frozen=True)
class DataOrder:
    """What fixes the data order: ``global_batch_rows``, the prepared data's
    ``data_fingerprint`` and number of packed ``rows``, and the ``seed``."""

    global_batch_rows: int
    data_fingerprint: str
    rows: int
    seed: int

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
                f"a resume must keep global_batch_rows, the prepared data and seed. Use the run's "
                f"values, or a new output for a new run."
            )


def step_rows(step: int, n_rows: int, per_step: int, seed: int) -> list[int]:
    """The packed-row indices of optimizer step ``step`` (``per_step`` = the global batch): a
    seeded permutation of all ``n_rows`` rows per epoch, read in order across epochs."""
    start = step * per_step
    out = []
    for position in range(start, start + per_step):
        epoch, offset = divmod(position, n_rows)
        out.append(int(_epoch_order(seed, epoch, n_rows)[offset]))
    return out


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


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, n_rows: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n_rows)
