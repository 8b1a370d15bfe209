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
rows, and the gradient is written block by block.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    V]`` first). ``block_rows``: rows per block of the row-wise passes (bounds the float32
    temporary to ``block_rows x V``).

    :meth:`log_prob` is one fused autograd operation: the forward pass computes the
    log-normaliser of every row in blocks and gathers the requested logits; the backward pass
    writes ``(onehot - softmax) / tau`` weighted by the incoming gradients straight into the
    logits' gradient, block by block. Nothing of size ``R x V`` is saved for the backward pass
    and the gradient is the only ``R x V`` allocation, so CE and KD through one call cost about
    what a plain cross entropy does. Ask for every (row, id) pair of a temperature in one call:
    each call is a pass over the logits.
    """

    logits: Tensor
    tau: float = 1.0
    block_rows: int = 1024

    @property
    def dtype(self) -> torch.dtype:
        """The arithmetic dtype: float64 for float64 logits, else float32."""
        return torch.float64 if self.logits.dtype == torch.float64 else torch.float32

    def log_normalizer(self, rows: Tensor) -> Tensor:
        """``logsumexp(logits[row] / tau)`` for ``rows`` (differentiable)."""
        return torch.logsumexp(_scaled(self.logits[rows], self.tau, self.dtype), dim=-1)

    def log_prob(self, rows: Tensor, ids: Tensor) -> Tensor:
        """Log probabilities of ``ids`` at ``rows`` at temperature ``tau``."""
        return _PairLogProbs.apply(self.logits, rows, ids, self.tau, self.block_rows)


def _scaled(values: Tensor, tau: float, dtype: torch.dtype) -> Tensor:
    """``values / tau`` in ``dtype`` (no copy of float32 values at tau = 1)."""
    values = values.to(dtype)
    return values if tau == 1 else values / tau


class _PairLogProbs(torch.autograd.Function):
    """``log_softmax(logits / tau)[rows, ids]`` without an ``R x V`` intermediate."""

    @staticmethod
    def forward(ctx, logits: Tensor, rows: Tensor, ids: Tensor, tau: float, block: int) -> Tensor:
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        normalizer = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        for start in range(0, logits.shape[0], block):
            chunk = _scaled(logits[start : start + block], tau, dtype)
            normalizer[start : start + block] = torch.logsumexp(chunk, dim=-1)
        ctx.save_for_backward(logits, normalizer, rows, ids)
        ctx.tau, ctx.block = tau, block
        return _scaled(logits[rows, ids], tau, dtype) - normalizer[rows]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        logits, normalizer, rows, ids = ctx.saved_tensors
        tau, block = ctx.tau, ctx.block
        grad = grad.to(normalizer.dtype) / tau
        # d log p(id | r) / d logits[r] = (onehot(id) - softmax(logits[r] / tau)) / tau.
        per_row = torch.zeros_like(normalizer).index_add_(0, rows, grad)
        order = torch.argsort(rows)
        rows, ids, grad = rows[order], ids[order], grad[order]
        out = torch.empty_like(logits)
        for start in range(0, logits.shape[0], block):
            stop = min(start + block, logits.shape[0])
            chunk = _scaled(logits[start:stop], tau, normalizer.dtype)
            chunk = torch.exp(chunk - normalizer[start:stop, None]).mul_(-per_row[start:stop, None])
            lo, hi = torch.searchsorted(rows, torch.tensor([start, stop], device=rows.device))
            chunk.index_put_((rows[lo:hi] - start, ids[lo:hi]), grad[lo:hi], accumulate=True)
            out[start:stop] = chunk
        return out, None, None, None, None


def segment_sum(values: Tensor, segments: Tensor, count: int) -> Tensor:
    """Sum of ``values`` ``[M]`` per segment id ``segments`` (int64 ``[M]``, in ``[0, count)``);
    ``[count]``, differentiable (a chunk's realized log prob is the sum over its tokens)."""
    out = values.new_zeros(count)
    return out.index_add(0, segments, values)
