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

Given an :class:`~crosskd.output_layer.OutputLayer` (the last hidden states and the head's
weight and bias) in place of logits, the same operation runs fused with the output layer: each
block's logits are computed from its hidden states, used and dropped, and computed again in the
backward pass, which writes the gradients of the hidden states, the weight and the bias. The
``rows x V`` logits never exist; the values and gradients are those of the head's logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from crosskd.output_layer import OutputLayer
from crosskd.transfer import to_device

HEAD_BLOCK_ENTRIES = {"cpu": 1 << 22, "cuda": 1 << 25}
"""Logits per block of the fused output layer by device type (``block x V`` floats: 16 MiB on
the CPU, 128 MiB on a GPU, where larger products run closer to peak; other devices as CUDA): a
block has ``min(block_rows, entries // V)`` rows (at least 16)."""


class StudentLogProbs(Protocol):
    """``log p(id | row)`` at the loss temperature, for many (row, id) pairs at once. The pairs
    are data the host knows before the forward pass (the loss plan's numpy arrays), so they are
    passed as numpy: an implementation splits them by block of rows there and moves them to the
    logits' device itself, and never reads the device back."""

    def log_prob(self, rows: np.ndarray, ids: np.ndarray) -> Tensor:
        """Log probabilities of ``ids`` at ``rows`` (both int64 ``[M]``, numpy); float ``[M]`` on
        the logits' device."""
        ...

    def log_normalizer(self, rows: np.ndarray) -> Tensor:
        """``logsumexp(logits[row] / tau)`` of ``rows`` (int64 ``[M]``, numpy); float ``[M]`` on
        the logits' device."""
        ...


@dataclass
class LocalLogProbs:
    """:class:`StudentLogProbs` over logits ``[R, V]`` held by this process (flatten ``[B, L,
    V]`` first), or over an :class:`~crosskd.output_layer.OutputLayer` ``[R, H]`` (fused: the
    logits are computed a block at a time). ``block_rows``: rows per block of the row-wise
    passes (bounds the float32 temporary to ``block_rows x V``).

    :meth:`log_prob` is one fused autograd operation: the forward pass computes the
    log-normaliser of every row in blocks and gathers the requested logits; the backward pass
    writes ``(onehot - softmax) / tau`` weighted by the incoming gradients straight into the
    logits' gradient, block by block. Nothing of size ``R x V`` is saved for the backward pass
    and the gradient is the only ``R x V`` allocation, so CE and KD through one call cost about
    what a plain cross entropy does. Ask for every (row, id) pair of a temperature in one call:
    each call is a pass over the logits.
    """

    logits: Tensor | OutputLayer
    tau: float = 1.0
    block_rows: int = 1024

    def log_normalizer(self, rows: np.ndarray) -> Tensor:
        """``logsumexp(logits[row] / tau)`` for ``rows`` (int64 ``[M]``, numpy;
        differentiable)."""
        if isinstance(self.logits, OutputLayer):
            empty = np.zeros(0, dtype=np.int64)
            normalizer, _ = row_pieces(self.logits, empty, empty, None, self.tau, self.block_rows)
            return normalizer[to_device(rows, self.logits.device)]
        rows = to_device(rows, self.logits.device)
        return torch.logsumexp(_scaled(self.logits[rows], self.tau, _arith(self.logits)), dim=-1)

    def log_prob(self, rows: np.ndarray, ids: np.ndarray) -> Tensor:
        """Log probabilities of ``ids`` at ``rows`` (int64 ``[M]``, numpy) at temperature
        ``tau``; float ``[M]`` on the logits' device."""
        normalizer, picked = row_pieces(self.logits, rows, ids, None, self.tau, self.block_rows)
        return picked - normalizer[to_device(rows, self.logits.device)]


def row_pieces(
    logits: Tensor | OutputLayer,
    rows: np.ndarray,
    ids: np.ndarray,
    owned: np.ndarray | None,
    tau: float,
    block: int,
) -> tuple[Tensor, Tensor]:
    """The two pieces every log probability is made of, as one fused autograd operation.

    ``logits`` ``[R, V]`` (any float dtype), or an :class:`~crosskd.output_layer.OutputLayer`
    ``[R, H]`` whose logits are computed a block at a time (fused; see the module docstring;
    its blocks have at most ``HEAD_BLOCK_ENTRIES[device] // V`` rows); ``rows`` / ``ids`` int64
    ``[M]`` and ``owned`` bool ``[M]`` or None (all), numpy: which pairs these logits hold (a
    shard holds some rows and some ids; ``rows`` must lie in ``[0, R)`` and ``ids`` in
    ``[0, V)`` where owned).
    Returns ``logsumexp(logits / tau)`` of every row (float ``[R]``) and ``logits[rows, ids] /
    tau`` (float ``[M]``, 0 where not owned), on the logits' device. The forward pass reads the
    logits in blocks of ``block`` rows; the backward pass writes ``softmax * g_normalizer /
    tau`` plus the picked gradients straight into the logits' gradient, block by block, so
    nothing of size ``R x V`` is kept between the passes. Which owned pairs fall in each block
    is counted here on the host (``O(M)``), so neither pass reads the device back: the
    backward pass adds each block's own pairs only, from a stable sort of the pairs by row made
    on the device.
    """
    n_rows = logits.shape[0]
    kept = None if owned is None else np.flatnonzero(owned)
    kept_rows = rows if kept is None else rows[kept]
    per_block = np.bincount(kept_rows // block, minlength=-(-n_rows // block))
    bounds = (0, *np.cumsum(per_block).tolist())
    device = logits.device
    if isinstance(logits, OutputLayer):
        block = _head_block(block, logits.shape[-1], device)
        per_block = np.bincount(kept_rows // block, minlength=-(-n_rows // block))
        return _HeadPieces.apply(
            logits.hidden,
            logits.weight,
            logits.bias,
            logits.compute_dtype,
            to_device(kept_rows, device),
            to_device(ids if kept is None else ids[kept], device),
            None if kept is None else to_device(kept, device),
            len(rows),
            (0, *np.cumsum(per_block).tolist()),
            tau,
            block,
        )
    return _RowPieces.apply(
        logits,
        to_device(kept_rows, device),
        to_device(ids if kept is None else ids[kept], device),
        None if kept is None else to_device(kept, device),
        len(rows),
        bounds,
        tau,
        block,
    )


def _head_block(block: int, vocab: int, device: torch.device) -> int:
    """Rows per block of the fused output layer over ``vocab`` logits per row on ``device``."""
    entries = HEAD_BLOCK_ENTRIES.get(device.type) or HEAD_BLOCK_ENTRIES["cuda"]
    return max(16, min(block, entries // max(vocab, 1)))


def _arith(logits: Tensor) -> torch.dtype:
    """The arithmetic dtype of ``logits``: float64 for float64, else float32."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _scaled(values: Tensor, tau: float, dtype: torch.dtype) -> Tensor:
    """``values / tau`` in ``dtype`` (no copy of float32 values at tau = 1)."""
    values = values.to(dtype)
    return values if tau == 1 else values / tau


class _RowPieces(torch.autograd.Function):
    """See :func:`row_pieces`: ``rows`` / ``ids`` (int64, on the device) are the owned pairs,
    ``kept`` their places among all ``size`` pairs (None: all pairs are owned), ``bounds``
    (host ints) where each block's pairs start and end once sorted by row."""

    @staticmethod
    def forward(
        ctx, logits, rows, ids, kept, size: int, bounds: tuple[int, ...], tau: float, block: int
    ):
        dtype = _arith(logits)
        normalizer = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        for start in range(0, logits.shape[0], block):
            chunk = _scaled(logits[start : start + block], tau, dtype)
            normalizer[start : start + block] = torch.logsumexp(chunk, dim=-1)
        values = _scaled(logits[rows, ids], tau, dtype)
        picked = values if kept is None else values.new_zeros(size).index_copy_(0, kept, values)
        order = torch.argsort(rows, stable=True)
        place = order if kept is None else kept[order]
        ctx.save_for_backward(logits, normalizer, rows[order], ids[order], place)
        ctx.bounds, ctx.tau, ctx.block = bounds, tau, block
        return normalizer, picked

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_normalizer, g_picked):
        logits, normalizer, rows, ids, place = ctx.saved_tensors
        bounds, tau, block = ctx.bounds, ctx.tau, ctx.block
        dtype = normalizer.dtype
        # d normalizer[r] / d logits[r] = softmax(logits[r] / tau) / tau;
        # d picked / d logits[row, id] = 1 / tau.
        per_row = (
            torch.zeros_like(normalizer) if g_normalizer is None else g_normalizer.to(dtype) / tau
        )
        grad = (
            torch.zeros(len(rows), dtype=dtype, device=logits.device)
            if g_picked is None
            else g_picked.to(dtype)[place] / tau
        )
        out = torch.empty_like(logits)
        for i, start in enumerate(range(0, logits.shape[0], block)):
            stop = min(start + block, logits.shape[0])
            chunk = _scaled(logits[start:stop], tau, dtype)
            chunk = torch.exp(chunk - normalizer[start:stop, None]).mul_(per_row[start:stop, None])
            lo, hi = bounds[i], bounds[i + 1]
            chunk.index_put_((rows[lo:hi] - start, ids[lo:hi]), grad[lo:hi], accumulate=True)
            out[start:stop] = chunk
        return out, None, None, None, None, None, None, None


class _HeadPieces(torch.autograd.Function):
    """:func:`row_pieces` fused with the output layer ``logits = hidden @ weight.T + bias``
    (``hidden`` ``[R, H]``, ``weight`` ``[V, H]``, ``bias`` ``[V]`` or None; the product in
    ``compute_dtype``, else the operands' dtype): the forward pass computes each block's
    logits, its log-normalisers and its pairs' logits; the backward pass computes the block's
    logits again and from the logits' gradient (as :class:`_RowPieces` writes it) adds the
    block's share of the three gradients. ``rows`` / ``ids`` / ``kept`` / ``size`` / ``bounds``
    as in :class:`_RowPieces`; the pairs are sorted by row here."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        compute_dtype,
        rows,
        ids,
        kept,
        size: int,
        bounds: tuple[int, ...],
        tau: float,
        block: int,
    ):
        layer = OutputLayer(hidden, weight, bias, compute_dtype)
        w, b = layer.operands()
        dtype = _arith(w)
        normalizer = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)
        order = torch.argsort(rows, stable=True)
        rows, ids = rows[order], ids[order]
        place = order if kept is None else kept[order]
        picked = torch.zeros(size, dtype=dtype, device=hidden.device)
        for i, start in enumerate(range(0, hidden.shape[0], block)):
            chunk = _scaled(F.linear(hidden[start : start + block].to(w.dtype), w, b), tau, dtype)
            normalizer[start : start + block] = torch.logsumexp(chunk, dim=-1)
            lo, hi = bounds[i], bounds[i + 1]
            picked[place[lo:hi]] = chunk[rows[lo:hi] - start, ids[lo:hi]]
        ctx.save_for_backward(hidden, weight, bias, normalizer, rows, ids, place)
        ctx.compute_dtype, ctx.bounds, ctx.tau, ctx.block = compute_dtype, bounds, tau, block
        return normalizer, picked

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_normalizer, g_picked):
        hidden, weight, bias, normalizer, rows, ids, place = ctx.saved_tensors
        bounds, tau, block = ctx.bounds, ctx.tau, ctx.block
        w, b = OutputLayer(hidden, weight, bias, ctx.compute_dtype).operands()
        dtype = normalizer.dtype
        per_row = (
            torch.zeros_like(normalizer) if g_normalizer is None else g_normalizer.to(dtype) / tau
        )
        grad = (
            torch.zeros(len(rows), dtype=dtype, device=hidden.device)
            if g_picked is None
            else g_picked.to(dtype)[place] / tau
        )
        g_hidden = torch.empty(hidden.shape, dtype=w.dtype, device=hidden.device)
        g_weight = torch.zeros(weight.shape, dtype=dtype, device=hidden.device)
        g_bias = None if bias is None else torch.zeros(bias.shape, dtype=dtype, device=bias.device)
        for i, start in enumerate(range(0, hidden.shape[0], block)):
            stop = min(start + block, hidden.shape[0])
            h = hidden[start:stop].to(w.dtype)
            # the block's logits are this function's own: the gradient is written over them
            chunk = _scaled(F.linear(h, w, b), tau, dtype).to(dtype)
            chunk.sub_(normalizer[start:stop, None]).exp_().mul_(per_row[start:stop, None])
            lo, hi = bounds[i], bounds[i + 1]
            chunk.index_put_((rows[lo:hi] - start, ids[lo:hi]), grad[lo:hi], accumulate=True)
            g_logits = chunk.to(w.dtype)
            g_hidden[start:stop] = g_logits @ w
            if g_logits.dtype == dtype:
                g_weight.addmm_(g_logits.T, h)  # no V x H temporary
            else:  # a bf16 product, summed over the blocks in float32
                g_weight += g_logits.T @ h
            if g_bias is not None:
                g_bias += chunk.sum(0)
        return (
            g_hidden.to(hidden.dtype),
            g_weight.to(weight.dtype),
            None if g_bias is None else g_bias.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def segment_sum(values: Tensor, segments: Tensor, count: int) -> Tensor:
    """Sum of ``values`` ``[M]`` per segment id ``segments`` (int64 ``[M]``, in ``[0, count)``);
    ``[count]``, differentiable (a chunk's realized log prob is the sum over its tokens)."""
    out = values.new_zeros(count)
    return out.index_add(0, segments, values)
