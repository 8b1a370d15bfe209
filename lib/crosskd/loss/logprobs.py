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
        normalizer, picked = row_pieces(self.logits, rows, ids, None, self.tau, self.block_rows)
        return picked - normalizer[rows]


def row_pieces(
    logits: Tensor, rows: Tensor, ids: Tensor, owned: Tensor | None, tau: float, block: int
) -> tuple[Tensor, Tensor]:
    """The two pieces every log probability is made of, as one fused autograd operation.

    ``logits`` ``[R, V]`` (any float dtype); ``rows`` / ``ids`` int64 ``[M]``; ``owned`` bool
    ``[M]`` or None (all): which ids lie in these logits (a vocabulary shard holds some).
    Returns ``logsumexp(logits / tau)`` of every row (float ``[R]``) and ``logits[rows, ids] /
    tau`` (float ``[M]``, 0 where not owned). The forward pass reads the logits in blocks of
    ``block`` rows; the backward pass writes ``softmax * g_normalizer / tau`` plus the picked
    gradients straight into the logits' gradient, block by block, so nothing of size ``R x V``
    is kept between the passes.
    """
    if owned is None:
        owned = torch.ones(rows.shape, dtype=torch.bool, device=rows.device)
    return _RowPieces.apply(logits, rows, ids, owned, tau, block)


def _scaled(values: Tensor, tau: float, dtype: torch.dtype) -> Tensor:
    """``values / tau`` in ``dtype`` (no copy of float32 values at tau = 1)."""
    values = values.to(dtype)
    return values if tau == 1 else values / tau


class _RowPieces(torch.autograd.Function):
    """See :func:`row_pieces`. Nothing here reads a value back to the host (no boolean
    indexing, no data-dependent slicing): ids a slice does not own are clamped into it for the
    gather and their values and gradients zeroed, and each block of the backward pass adds the
    picked gradients of every pair, zero outside the block."""

    @staticmethod
    def forward(ctx, logits, rows, ids, owned, tau: float, block: int):
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        normalizer = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        for start in range(0, logits.shape[0], block):
            chunk = _scaled(logits[start : start + block], tau, dtype)
            normalizer[start : start + block] = torch.logsumexp(chunk, dim=-1)
        ids = ids.clamp(0, max(logits.shape[1] - 1, 0))
        picked = _scaled(logits[rows, ids], tau, dtype) if len(rows) else normalizer.new_zeros(0)
        picked = torch.where(owned, picked, 0.0)
        ctx.save_for_backward(logits, normalizer, rows, ids, owned)
        ctx.tau, ctx.block = tau, block
        return normalizer, picked

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_normalizer, g_picked):
        logits, normalizer, rows, ids, owned = ctx.saved_tensors
        tau, block = ctx.tau, ctx.block
        dtype = normalizer.dtype
        # d normalizer[r] / d logits[r] = softmax(logits[r] / tau) / tau;
        # d picked / d logits[row, id] = 1 / tau.
        per_row = (
            torch.zeros_like(normalizer) if g_normalizer is None else g_normalizer.to(dtype) / tau
        )
        grad = (
            torch.zeros(len(rows), dtype=dtype, device=logits.device)
            if g_picked is None else torch.where(owned, g_picked.to(dtype) / tau, 0.0)
        )  # fmt: skip
        out = torch.empty_like(logits)
        for start in range(0, logits.shape[0], block):
            stop = min(start + block, logits.shape[0])
            chunk = _scaled(logits[start:stop], tau, dtype)
            chunk = torch.exp(chunk - normalizer[start:stop, None]).mul_(per_row[start:stop, None])
            inside = (rows >= start) & (rows < stop)
            local = (rows - start).clamp(0, stop - start - 1)
            chunk.index_put_((local, ids), torch.where(inside, grad, 0.0), accumulate=True)
            out[start:stop] = chunk
        return out, None, None, None, None, None


def segment_sum(values: Tensor, segments: Tensor, count: int) -> Tensor:
    """Sum of ``values`` ``[M]`` per segment id ``segments`` (int64 ``[M]``, in ``[0, count)``);
    ``[count]``, differentiable (a chunk's realized log prob is the sum over its tokens)."""
    out = values.new_zeros(count)
    return out.index_add(0, segments, values)
