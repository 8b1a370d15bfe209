"""Student log probabilities behind one small interface (spec sections 5 and 7).

The CSD loss only ever needs ``log p(id | row)`` for a set of (row, id) pairs: the realized
tokens of a chunk and its alternative events. :class:`StudentLogProbs` is that interface;
:class:`LocalLogProbs` implements it for logits held by one process. A vocabulary-parallel or
sequence-parallel version implements the same methods (log-normaliser from all-reduced max
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
backward pass (there a block of vocabulary ids over every row at a time, so that each slice of
the weight's gradient is written once), which writes the gradients of the hidden states, the
weight and the bias. The ``rows x V`` logits never exist; the values and gradients are those of
the head's logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from crosskd.loss.kernels import EAGER, BlockKernels
from crosskd.output_layer import OutputLayer
from crosskd.transfer import to_device

HEAD_BLOCK_ENTRIES = {"cpu": 1 << 22, "cuda": 1 << 25}
"""Logits per block of the fused output layer by device type (``block x V`` floats: 16 MiB on
the CPU, 128 MiB on a GPU, where larger products run closer to peak; other devices as CUDA): a
block has ``min(block_rows, entries // V)`` rows (at least 16)."""


Request = tuple[np.ndarray, np.ndarray, float]
"""Pairs ``(rows, ids)`` (int64 ``[M]`` each, numpy) and the temperature to price them at."""


class StudentLogProbs(Protocol):
    """``log p(id | row)`` at the loss temperature, for many (row, id) pairs at once. The pairs
    are data the host knows before the forward pass (the loss plan's numpy arrays), so they are
    passed as numpy: an implementation splits them by block of rows there and moves them to the
    logits' device itself, and never reads the device back."""

    logits: Tensor | OutputLayer
    """The student's logits as this process holds them (or the fused output layer)."""
    block_rows: int
    """Rows per block of the row-wise passes."""

    def row_slices(self, width: int) -> RowSlices:
        """The logits as :class:`RowSlices` for the terms that read whole rows (rows ``width``
        long); the fused output layer has none (a ValueError)."""
        ...

    def log_prob(self, rows: np.ndarray, ids: np.ndarray) -> Tensor:
        """Log probabilities of ``ids`` at ``rows`` (both int64 ``[M]``, numpy); float ``[M]`` on
        the logits' device."""
        ...

    def log_probs_at(
        self, requests: Sequence[tuple[np.ndarray, np.ndarray, float]]
    ) -> list[Tensor]:
        """Log probabilities of each request ``(rows, ids, tau)`` at its own temperature, all in
        one pass over the logits (CE at 1 and KD at the loss temperature); float ``[M_i]``
        each, on the logits' device."""
        ...

    def log_normalizer(self, rows: np.ndarray) -> Tensor:
        """``logsumexp(logits[row] / tau)`` of ``rows`` (int64 ``[M]``, numpy); float ``[M]`` on
        the logits' device."""
        ...


@dataclass(frozen=True)
class Requests:
    """Several requests ``(rows, ids, tau)`` as one set of pairs (numpy): ``rows`` / ``ids``
    int64 ``[M]`` concatenated, ``taus`` the distinct temperatures (in order of first use),
    ``which`` int64 ``[M]`` each pair's index into ``taus``, ``sizes`` each request's pairs."""

    rows: np.ndarray
    ids: np.ndarray
    taus: tuple[float, ...]
    which: np.ndarray
    sizes: list[int]

    @classmethod
    def of(cls, requests: Sequence[Request]) -> Requests:
        """The pairs of ``requests``."""
        taus = tuple(dict.fromkeys(float(tau) for *_, tau in requests))
        empty = np.zeros(0, dtype=np.int64)
        return cls(
            np.concatenate([empty, *(np.asarray(r, dtype=np.int64) for r, _, _ in requests)]),
            np.concatenate([empty, *(np.asarray(i, dtype=np.int64) for _, i, _ in requests)]),
            taus,
            np.concatenate(
                [empty, *(np.full(len(r), taus.index(float(t))) for r, _, t in requests)]
            ),
            [len(r) for r, _, _ in requests],
        )


def _same(tensor: Tensor) -> Tensor:
    """A collective over a group of one process: the tensor itself."""
    return tensor


@dataclass(frozen=True)
class RowSlices:
    """The student's logits as this process holds them, for the terms that read whole rows of
    the distribution (gold, H-KL): ``flat`` ``[B * window, V_here]``, the positions of its
    sequence window (number ``cp_rank``, ``window`` positions of rows ``width`` long) of every
    row and the vocabulary ids ``[vocab_start, vocab_start + V_here)``, one of ``tp`` slices
    (number ``tp_rank``); and the collectives over the slices of one window (``tp_sum``,
    differentiable; ``tp_max``, in place, not differentiated) and over the windows of one slice
    (``cp_sum``, differentiable). One process: one window, one slice, no collectives."""

    flat: Tensor | OutputLayer
    """(An :class:`~crosskd.output_layer.OutputLayer` where the logits are fused: only
    :meth:`local` and :meth:`normalizer` then.)"""
    width: int
    window: int
    vocab_start: int = 0
    cp_rank: int = 0
    tp: int = 1
    tp_rank: int = 0
    tp_sum: Callable[[Tensor], Tensor] = _same
    tp_max: Callable[[Tensor], Tensor] = _same
    cp_sum: Callable[[Tensor], Tensor] = _same

    @property
    def cp(self) -> int:
        """The number of sequence windows."""
        return self.width // self.window

    def local(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Which of the flat rows ``rows`` (``b * width + position``, int64, numpy) lie in this
        window (bool), and each one's row of ``flat`` there (a valid row for every one; used
        where it lies here)."""
        b, position = rows // self.width, rows % self.width
        return position // self.window == self.cp_rank, b * self.window + position % self.window

    def normalizer(self, local: Tensor) -> Tensor:
        """The log-normaliser over the whole vocabulary (any shape) from this slice's
        ``local`` one (differentiable)."""
        if self.tp == 1:
            return local
        peak = self.tp_max(local.detach().clone())
        return peak + torch.log(self.tp_sum(torch.exp(local - peak)))

    def log_softmax(self, logits: Tensor, tau: float, dtype: torch.dtype) -> Tensor:
        """``log p`` at ``tau`` of ``logits`` (rows of ``flat``, ``[R, V_here]``) over this
        slice's ids, normalised over the whole vocabulary: ``[R, V_here]`` in ``dtype``."""
        x = logits.to(dtype)
        if tau != 1.0:
            x = x / tau
        if self.tp == 1:
            return torch.log_softmax(x, dim=-1)
        return x - self.normalizer(torch.logsumexp(x, dim=-1))[:, None]


@dataclass
class LocalLogProbs:
    """:class:`StudentLogProbs` over logits ``[R, V]`` held by this process (flatten ``[B, L,
    V]`` first), or over an :class:`~crosskd.output_layer.OutputLayer` ``[R, H]`` (fused: the
    logits are computed a block at a time). ``tau``: the temperature of :meth:`log_prob` and
    :meth:`log_normalizer`; ``block_rows``: rows per block of the row-wise passes (bounds the
    float32 temporary to ``block_rows x V``); ``kernels``: how each block's elementwise work
    runs (eager or compiled, :mod:`crosskd.loss.kernels`).

    :meth:`log_probs_at` is one fused autograd operation: the forward pass computes the
    log-normaliser of every row at every temperature asked for in blocks and gathers the
    requested logits; the backward pass writes ``(onehot - softmax) / tau`` weighted by the
    incoming gradients straight into the logits' gradient, block by block. Nothing of size
    ``R x V`` is saved for the backward pass and the gradient is the only ``R x V``
    allocation, so CE and KD through one call cost about what a plain cross entropy does. Ask
    for every (row, id) pair in one call: each call is a pass over the logits.
    """

    logits: Tensor | OutputLayer
    tau: float = 1.0
    block_rows: int = 1024
    kernels: BlockKernels = EAGER

    def row_slices(self, width: int) -> RowSlices:
        """The logits as :class:`RowSlices` (one window of rows ``width`` long, the whole
        vocabulary); the fused output layer has none (a ValueError)."""
        if isinstance(self.logits, OutputLayer):
            raise ValueError("the fused output layer holds no logits")
        return RowSlices(self.logits, width, width)

    def log_normalizer(self, rows: np.ndarray) -> Tensor:
        """``logsumexp(logits[row] / tau)`` for ``rows`` (int64 ``[M]``, numpy;
        differentiable)."""
        if isinstance(self.logits, OutputLayer):
            pairs = Requests.of([(np.zeros(0, dtype=np.int64),) * 2 + (self.tau,)])
            normalizer, _ = row_pieces(self.logits, pairs, None, self.block_rows, self.kernels)
            return normalizer[0, to_device(rows, self.logits.device)]
        rows = to_device(rows, self.logits.device)
        return self.kernels.normalizers(self.logits[rows], (self.tau,), _arith(self.logits))[0]

    def log_prob(self, rows: np.ndarray, ids: np.ndarray) -> Tensor:
        """Log probabilities of ``ids`` at ``rows`` (int64 ``[M]``, numpy) at temperature
        ``tau``; float ``[M]`` on the logits' device."""
        return self.log_probs_at([(rows, ids, self.tau)])[0]

    def log_probs_at(
        self, requests: Sequence[tuple[np.ndarray, np.ndarray, float]]
    ) -> list[Tensor]:
        """Log probabilities of each request ``(rows, ids, tau)`` at its temperature, in one
        pass; float ``[M_i]`` each."""
        pairs = Requests.of(requests)
        normalizer, picked = row_pieces(self.logits, pairs, None, self.block_rows, self.kernels)
        device = self.logits.device
        values = picked - normalizer[to_device(pairs.which, device), to_device(pairs.rows, device)]
        return list(values.split(pairs.sizes))


def row_pieces(
    logits: Tensor | OutputLayer,
    pairs: Requests,
    owned: np.ndarray | None,
    block: int,
    kernels: BlockKernels = EAGER,
) -> tuple[Tensor, Tensor]:
    """The two pieces every log probability is made of, as one fused autograd operation.

    ``logits`` ``[R, V]`` (any float dtype), or an :class:`~crosskd.output_layer.OutputLayer`
    ``[R, H]`` whose logits are computed a block at a time (fused; see the module docstring;
    its blocks have at most ``HEAD_BLOCK_ENTRIES[device] // V`` rows); ``pairs``: the (row, id)
    pairs and each one's temperature; ``owned`` bool ``[M]`` or None (all), numpy: which pairs
    these logits hold (a shard holds some rows and some ids; ``rows`` must lie in ``[0, R)``
    and ``ids`` in ``[0, V)`` where owned).
    Returns ``logsumexp(logits / tau)`` of every row at every temperature ``pairs.taus`` (float
    ``[T, R]``) and ``logits[rows, ids] / tau`` at each pair's temperature (float ``[M]``, 0
    where not owned), on the logits' device. The forward pass reads the logits in blocks of
    ``block`` rows (one product with the head per block, fused); the backward pass writes
    ``sum over tau of softmax_tau * g_normalizer_tau / tau`` plus the picked gradients straight
    into the logits' gradient, block by block, so nothing of size ``R x V`` is kept between the
    passes. Which owned pairs fall in each block is counted here on the host (``O(M)``), so
    neither pass reads the device back: the backward pass adds each block's own pairs only,
    from a stable sort of the pairs by row made on the device.
    """
    n_rows = logits.shape[0]
    kept = None if owned is None else np.flatnonzero(owned)
    rows, ids, which = (
        (pairs.rows, pairs.ids, pairs.which)
        if kept is None
        else (pairs.rows[kept], pairs.ids[kept], pairs.which[kept])
    )
    device = logits.device
    if isinstance(logits, OutputLayer):
        block = _head_block(block, logits.shape[-1], device)
    per_block = np.bincount(rows // block, minlength=-(-n_rows // block))
    common = (
        to_device(rows, device),
        to_device(ids, device),
        to_device(which, device),
        None if kept is None else to_device(kept, device),
        len(pairs.rows),
        (0, *np.cumsum(per_block).tolist()),
        pairs.taus,
        block,
        kernels,
    )
    if isinstance(logits, OutputLayer):
        vocab = logits.shape[-1]
        width = _head_vocab_block(n_rows, vocab, device)
        per_id_block = np.bincount(ids // width, minlength=-(-vocab // width))
        return _HeadPieces.apply(
            logits.hidden,
            logits.weight,
            logits.bias,
            logits.compute_dtype,
            *common,
            width,
            (0, *np.cumsum(per_id_block).tolist()),
        )
    return _RowPieces.apply(logits, *common)


def _head_block(block: int, vocab: int, device: torch.device) -> int:
    """Rows per block of the fused output layer over ``vocab`` logits per row on ``device``."""
    entries = HEAD_BLOCK_ENTRIES.get(device.type) or HEAD_BLOCK_ENTRIES["cuda"]
    return max(16, min(block, entries // max(vocab, 1)))


def _head_vocab_block(rows: int, vocab: int, device: torch.device) -> int:
    """Vocabulary ids per block of the fused backward pass, which takes every one of ``rows``
    rows at once: ``HEAD_BLOCK_ENTRIES[device] // rows``, at least 64, at most ``vocab``."""
    entries = HEAD_BLOCK_ENTRIES.get(device.type) or HEAD_BLOCK_ENTRIES["cuda"]
    return max(1, min(vocab, max(64, entries // max(rows, 1))))


def _arith(logits: Tensor) -> torch.dtype:
    """The arithmetic dtype of ``logits``: float64 for float64, else float32."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _pair_setup(taus, rows, ids, which, kept, size, dtype, device):
    """The pairs sorted by row (stable), where each lands among all ``size`` pairs, and each
    one's temperature (``[T]`` on the device)."""
    order = torch.argsort(rows, stable=True)
    place = order if kept is None else kept[order]
    return (
        rows[order],
        ids[order],
        which[order],
        place,
        to_device(np.array(taus), device).to(dtype),
    )


def _backward_setup(g_normalizer, g_picked, normalizer, place, which, scale):
    """Per-row gradients ``[T, R]`` and per-pair gradients (sorted) of the logits, both already
    divided by their temperature."""
    dtype = normalizer.dtype
    per_row = (
        torch.zeros_like(normalizer)
        if g_normalizer is None
        else g_normalizer.to(dtype) / scale[:, None]
    )
    grad = (
        torch.zeros(len(place), dtype=dtype, device=normalizer.device)
        if g_picked is None
        else g_picked.to(dtype)[place] / scale[which]
    )
    return per_row, grad


class _RowPieces(torch.autograd.Function):
    """See :func:`row_pieces`: ``rows`` / ``ids`` / ``which`` (int64, on the device) are the
    owned pairs and their temperatures' indices, ``kept`` their places among all ``size``
    pairs (None: all pairs are owned), ``bounds`` (host ints) where each block's pairs start
    and end once sorted by row."""

    @staticmethod
    def forward(
        ctx,
        logits,
        rows,
        ids,
        which,
        kept,
        size: int,
        bounds: tuple[int, ...],
        taus: tuple[float, ...],
        block: int,
        kernels: BlockKernels,
    ):
        dtype = _arith(logits)
        normalizer = torch.empty(len(taus), logits.shape[0], dtype=dtype, device=logits.device)
        for start in range(0, logits.shape[0], block):
            raw = logits[start : start + block]
            normalizer[:, start : start + block] = kernels.normalizers(raw, taus, dtype)
        rows, ids, which, place, scale = _pair_setup(
            taus, rows, ids, which, kept, size, dtype, logits.device
        )
        values = logits[rows, ids].to(dtype) / scale[which]
        picked = values.new_zeros(size).index_copy_(0, place, values)
        ctx.save_for_backward(logits, normalizer, rows, ids, which, place, scale)
        ctx.bounds, ctx.taus, ctx.block, ctx.kernels = bounds, taus, block, kernels
        return normalizer, picked

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_normalizer, g_picked):
        logits, normalizer, rows, ids, which, place, scale = ctx.saved_tensors
        bounds, taus, block = ctx.bounds, ctx.taus, ctx.block
        # d normalizer_tau[r] / d logits[r] = softmax(logits[r] / tau) / tau;
        # d picked / d logits[row, id] = 1 / tau.
        per_row, grad = _backward_setup(g_normalizer, g_picked, normalizer, place, which, scale)
        out = torch.empty_like(logits)
        for i, start in enumerate(range(0, logits.shape[0], block)):
            stop = min(start + block, logits.shape[0])
            chunk = ctx.kernels.gradient(
                logits[start:stop],
                normalizer[:, start:stop],
                per_row[:, start:stop],
                taus,
                logits.dtype,
            )
            lo, hi = bounds[i], bounds[i + 1]
            where = (rows[lo:hi] - start, ids[lo:hi])
            chunk.index_put_(where, grad[lo:hi].to(chunk.dtype), accumulate=True)
            out[start:stop] = chunk
        return out, *(None,) * 9


class _HeadPieces(torch.autograd.Function):
    """:func:`row_pieces` fused with the output layer ``logits = hidden @ weight.T + bias``
    (``hidden`` ``[R, H]``, ``weight`` ``[V, H]``, ``bias`` ``[V]`` or None; the product in
    ``compute_dtype``, else the operands' dtype): the forward pass computes each block of
    rows' logits (one product for every temperature), its log-normalisers and its pairs'
    logits; the backward pass computes the logits again a block of ``vocab_block`` ids (over
    every row) at a time, turns them into the logits' gradient (as :class:`_RowPieces` writes
    it, its pairs from ``vocab_bounds``: where each block's pairs start and end once sorted by
    id) and writes that block's slice of the weight's and bias's gradients and adds its share
    of the hidden states'. The other arguments as in :class:`_RowPieces`."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        compute_dtype,
        rows,
        ids,
        which,
        kept,
        size: int,
        bounds: tuple[int, ...],
        taus: tuple[float, ...],
        block: int,
        kernels: BlockKernels,
        vocab_block: int,
        vocab_bounds: tuple[int, ...],
    ):
        w, b = OutputLayer(hidden, weight, bias, compute_dtype).operands()
        dtype = _arith(w)
        normalizer = torch.empty(len(taus), hidden.shape[0], dtype=dtype, device=hidden.device)
        rows, ids, which, place, scale = _pair_setup(
            taus, rows, ids, which, kept, size, dtype, hidden.device
        )
        picked = torch.zeros(size, dtype=dtype, device=hidden.device)
        for i, start in enumerate(range(0, hidden.shape[0], block)):
            raw = F.linear(hidden[start : start + block].to(w.dtype), w, b)
            normalizer[:, start : start + block] = kernels.normalizers(raw, taus, dtype)
            lo, hi = bounds[i], bounds[i + 1]
            values = raw[rows[lo:hi] - start, ids[lo:hi]].to(dtype) / scale[which[lo:hi]]
            picked[place[lo:hi]] = values
        ctx.save_for_backward(hidden, weight, bias, normalizer, rows, ids, which, place, scale)
        ctx.compute_dtype, ctx.taus, ctx.kernels = compute_dtype, taus, kernels
        ctx.vocab_block, ctx.vocab_bounds = vocab_block, vocab_bounds
        return normalizer, picked

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_normalizer, g_picked):
        hidden, weight, bias, normalizer, rows, ids, which, place, scale = ctx.saved_tensors
        taus = ctx.taus
        w, b = OutputLayer(hidden, weight, bias, ctx.compute_dtype).operands()
        dtype = normalizer.dtype
        per_row, grad = _backward_setup(g_normalizer, g_picked, normalizer, place, which, scale)
        # Vocabulary-major: each block of ids over every row, so each slice of the weight's
        # gradient is written once (a row-major loop would read and write all of it per block
        # of rows) and only the hidden states' gradient, R x H, is accumulated.
        h = hidden.to(w.dtype)
        g_hidden = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
        # a frozen head (trainable without it) needs no product for its gradient
        g_weight = (
            torch.empty(weight.shape, dtype=dtype, device=hidden.device)
            if ctx.needs_input_grad[1]
            else None
        )
        g_bias = (
            torch.empty(bias.shape, dtype=dtype, device=bias.device)
            if bias is not None and ctx.needs_input_grad[2]
            else None
        )
        by_id = torch.argsort(ids, stable=True)
        rows, ids, grad = rows[by_id], ids[by_id], grad[by_id]
        width = ctx.vocab_block
        for i, first in enumerate(range(0, weight.shape[0], width)):
            last = min(first + width, weight.shape[0])
            # the block's logits are this function's own: the gradient is written over them
            g_logits = ctx.kernels.gradient(
                F.linear(h, w[first:last], None if b is None else b[first:last]),
                normalizer,
                per_row,
                taus,
                w.dtype,
                own=True,
            )
            lo, hi = ctx.vocab_bounds[i], ctx.vocab_bounds[i + 1]
            where = (rows[lo:hi], ids[lo:hi] - first)
            g_logits.index_put_(where, grad[lo:hi].to(w.dtype), accumulate=True)
            if g_logits.dtype == dtype:  # float32 (float64): no temporaries
                g_hidden.addmm_(g_logits, w[first:last])
                if g_weight is not None:
                    torch.mm(g_logits.T, h, out=g_weight[first:last])
            else:  # bf16 products, summed in float32
                g_hidden += g_logits @ w[first:last]
                if g_weight is not None:
                    g_weight[first:last] = g_logits.T @ h
            if g_bias is not None:
                g_bias[first:last] = g_logits.sum(0, dtype=dtype)
        return (
            g_hidden.to(hidden.dtype),
            None if g_weight is None else g_weight.to(weight.dtype),
            None if g_bias is None else g_bias.to(bias.dtype),
            *(None,) * 12,
        )


def segment_sum(values: Tensor, segments: Tensor, count: int) -> Tensor:
    """Sum of ``values`` ``[M]`` per segment id ``segments`` (int64 ``[M]``, in ``[0, count)``);
    ``[count]``, differentiable (a chunk's realized log prob is the sum over its tokens)."""
    out = values.new_zeros(count)
    return out.index_add(0, segments, values)


def segment_logsumexp(values: Tensor, segments: Tensor, count: int) -> Tensor:
    """``log sum exp`` of ``values`` ``[M]`` per segment id ``segments`` (int64 ``[M]``, in
    ``[0, count)``); ``[count]``, differentiable, ``-inf`` for an empty segment (an event's
    mixture of weighted probabilities)."""
    peak = values.new_full((count,), -math.inf).scatter_reduce(
        0, segments, values.detach(), reduce="amax"
    )
    safe = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    total = values.new_zeros(count).index_add(0, segments, (values - safe[segments]).exp())
    return total.log() + safe
