"""Student log probabilities behind one small interface (spec sections 5 and 7).

The CSD loss only ever needs ``log p(id | row)`` for a set of (row, id) pairs: the realized
tokens of a chunk and its alternative events. :class:`StudentLogProbs` is that interface;
:class:`LocalLogProbs` implements it for logits held by one process. A vocabulary-parallel or
sequence-parallel version implements the same two methods (log-normaliser from all-reduced max
and sum of exponentials; ids gathered from the rank that owns them), so the chunk logic never
changes with the layout.

Rows index the flattened ``[B * L]`` positions of the student batch; ``log p`` is at
temperature ``tau``: ``logits[row] / tau - logsumexp(logits[row] / tau)``, over all ``V`` rows
of the output layer, in float32 whatever the logits' dtype (float64 stays float64). The full
``[rows, V]`` log-softmax is never materialised: the log-normaliser is computed in blocks of
rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor


class StudentLogProbs(Protocol):
    """``log p(id | row)`` at the loss temperature, for many (row, id) pairs at once."""

    def log_prob(self, rows: Tensor, ids: Tensor) -> Tensor:
        """Log probabilities of ``ids`` at ``rows`` (both int64 ``[M]``); float ``[M]``."""
        ...

    def log_normalizer(self, rows: Tensor) -> Tensor:
        """``logsumexp(logits[row] / tau)`` of ``rows`` (int64 ``[M]``); float ``[M]``."""
        ...


@dataclass
class LocalLogProbs:
    """:class:`StudentLogProbs` over logits ``[R, V]`` held by this process (flatten ``[B, L,
    V]`` first). ``block_rows``: rows per block of the log-normaliser (bounds the float32
    temporary to ``block_rows x V``)."""

    logits: Tensor
    tau: float = 1.0
    block_rows: int = 1024
    _normalizer: Tensor | None = field(default=None, init=False, repr=False)

    @property
    def dtype(self) -> torch.dtype:
        """The arithmetic dtype: float64 for float64 logits, else float32."""
        return torch.float64 if self.logits.dtype == torch.float64 else torch.float32

    def log_normalizer(self, rows: Tensor) -> Tensor:
        """``logsumexp(logits[row] / tau)`` for ``rows``; computed once for all rows."""
        if self._normalizer is None:
            blocks = [
                torch.logsumexp(block.to(self.dtype) / self.tau, dim=-1)
                for block in self.logits.split(self.block_rows)
            ]
            self._normalizer = torch.cat(blocks) if blocks else self.logits.new_zeros(0)
        return self._normalizer[rows]

    def log_prob(self, rows: Tensor, ids: Tensor) -> Tensor:
        """Log probabilities of ``ids`` at ``rows`` at temperature ``tau``."""
        picked = self.logits[rows, ids].to(self.dtype) / self.tau
        return picked - self.log_normalizer(rows)


def segment_sum(values: Tensor, segments: Tensor, count: int) -> Tensor:
    """Sum of ``values`` ``[M]`` per segment id ``segments`` (int64 ``[M]``, in ``[0, count)``);
    ``[count]``, differentiable (a chunk's realized log prob is the sum over its tokens)."""
    out = values.new_zeros(count)
    return out.index_add(0, segments, values)
