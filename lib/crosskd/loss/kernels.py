"""The per-block elementwise work of the student's log probabilities, eager or compiled.

:func:`crosskd.loss.logprobs.row_pieces` goes over the logits (or the output layer's blocks of
logits) a block at a time. Besides the products with the head, each block costs two pieces of
elementwise work over its ``rows x V`` values:

* forward: the log-normaliser ``logsumexp(raw / tau)`` of each row at each temperature;
* backward: the logits' gradient ``sum over tau of softmax(raw / tau) * per_row[tau]``, in the
  dtype of the product that consumes it (bfloat16 under autocast).

Eager, each is a handful of torch operations, and each of them reads and writes the whole
block (casts, scaling, subtraction, exponential, product, sum): where the products are fast (a
GPU in bfloat16) those passes and their launches are most of the loss's time. Compiled
(``torch.compile``, inductor), each piece is one or two generated kernels that read the block
once and write only the result. The compiled functions take dynamic shapes (the number of
rows changes from batch to batch) and are compiled once per set of temperatures and dtypes,
on first use (tens of seconds on a CPU). Compiling needs a C compiler where the loss runs
(inductor's C++ kernels on a CPU; Triton's launcher, and the Python headers, on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor

KERNELS = ("eager", "compiled")
"""Values of ``loss.kernels``."""


def _scaled(values: Tensor, tau: float, dtype: torch.dtype) -> Tensor:
    """``values / tau`` in ``dtype`` (no copy of values already in ``dtype`` at tau = 1)."""
    values = values.to(dtype)
    return values if tau == 1 else values / tau


def block_normalizers(raw: Tensor, taus: tuple[float, ...], dtype: torch.dtype) -> Tensor:
    """The log-normalisers ``[T, rows]`` in ``dtype`` of a block of logits ``raw`` ``[rows,
    V]`` (any float dtype) at each temperature of ``taus``."""
    return torch.stack([torch.logsumexp(_scaled(raw, tau, dtype), dim=-1) for tau in taus])


def block_gradient(
    raw: Tensor,
    normalizer: Tensor,
    per_row: Tensor,
    taus: tuple[float, ...],
    out_dtype: torch.dtype,
    own: bool = False,
) -> Tensor:
    """``sum over tau of exp(raw / tau - normalizer[tau]) * per_row[tau]`` ``[rows, V]`` in
    ``out_dtype``, computed in the dtype of ``normalizer`` (float32, float64 for float64):
    the logits' gradient of a block ``raw`` ``[rows, V]`` with its log-normalisers ``[T,
    rows]`` and per-row gradients ``per_row`` ``[T, rows]`` (already divided by tau).
    ``own``: ``raw`` is the caller's temporary, which the result may be written over."""
    dtype = normalizer.dtype
    out = None
    for t, tau in enumerate(taus):
        scaled = _scaled(raw, tau, dtype)
        # a fresh copy, or raw itself at its last use when it is the caller's own
        writable = scaled is not raw or (own and t == len(taus) - 1)
        term = scaled.sub_(normalizer[t, :, None]) if writable else scaled - normalizer[t, :, None]
        term = term.exp_().mul_(per_row[t, :, None])
        out = term if out is None else out.add_(term)
    return out.to(out_dtype)


def _fused_gradient(
    raw: Tensor,
    normalizer: Tensor,
    per_row: Tensor,
    taus: tuple[float, ...],
    out_dtype: torch.dtype,
) -> Tensor:
    """:func:`block_gradient` without in-place operations, for the compiler to fuse."""
    dtype = normalizer.dtype
    out = sum(
        torch.exp(_scaled(raw, tau, dtype) - normalizer[t, :, None]) * per_row[t, :, None]
        for t, tau in enumerate(taus)
    )
    return out.to(out_dtype)


@cache
def _compiled(name: str):
    """``torch.compile`` of :func:`block_normalizers` or of the fused gradient, made on first
    use (importing the compiler costs a second or two that eager runs need not pay)."""
    function = {"normalizers": block_normalizers, "gradient": _fused_gradient}[name]
    return torch.compile(function, dynamic=True, fullgraph=True)


@dataclass(frozen=True)
class BlockKernels:
    """The two pieces of per-block work, eager (``compiled`` false) or through
    ``torch.compile``; the values agree to float rounding."""

    compiled: bool = False

    @classmethod
    def named(cls, kernels: str) -> BlockKernels:
        """The kernels ``loss.kernels`` (one of :data:`KERNELS`) names."""
        return cls(compiled=kernels == "compiled")

    def normalizers(self, raw: Tensor, taus: tuple[float, ...], dtype: torch.dtype) -> Tensor:
        """See :func:`block_normalizers`."""
        if self.compiled:
            return _compiled("normalizers")(raw, taus, dtype)
        return block_normalizers(raw, taus, dtype)

    def gradient(
        self,
        raw: Tensor,
        normalizer: Tensor,
        per_row: Tensor,
        taus: tuple[float, ...],
        out_dtype: torch.dtype,
        own: bool = False,
    ) -> Tensor:
        """See :func:`block_gradient`."""
        if self.compiled:
            return _compiled("gradient")(raw, normalizer, per_row, taus, out_dtype)
        return block_gradient(raw, normalizer, per_row, taus, out_dtype, own)


EAGER = BlockKernels()
"""The eager kernels (the default where no ``loss.kernels`` was chosen)."""
