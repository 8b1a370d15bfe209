"""Per-chunk divergences over a chunk's events plus one REST bucket (spec section 5).

Contract
--------
A chunk ``c`` has up to ``E`` events, padded to a common width; ``mask[c, e]`` marks the real
ones. Every quantity is a **natural-log probability** (nats); results are in **nats**.

* :func:`with_rest` turns event log probabilities ``[C, E]`` into a complete distribution
  ``[C, E + 1]``: padded events become ``-inf`` and a last column holds
  ``log REST = log1mexp(logsumexp(real events)) = log(1 - sum_e p_e)``, floored at
  ``log(1e-12)`` (:data:`LOG_REST_FLOOR`). The floor applies when the events hold all the mass or,
  by rounding, more than all of it; there the REST entry is flat (zero gradient). Callers append
  ``True`` to the mask for the REST column (it is always real).
* :func:`divergence` compares ``S = exp(student)`` and ``T = exp(teacher)``, both ``[C, E + 1]``
  from :func:`with_rest`, and returns one value per chunk, ``[C]``, in TRL's generalised-JSD
  convention: ``jsd`` (``M = beta*T + (1-beta)*S``, ``D = beta*KL(T||M) + (1-beta)*KL(S||M)``),
  ``forward_kl`` = ``KL(T||S)``, ``reverse_kl`` = ``KL(S||T)``. Entries outside ``mask``, and
  entries with zero probability on the side that weighs them, contribute exactly 0 (no NaN from
  ``0 * log 0`` or ``-inf - -inf``, in values or gradients). Gradients reach ``student`` only
  through differentiable operations; the teacher is taken as given (pass it without grad; it is
  not detached here).

Precision: all arithmetic is float32, whatever the input dtype (bf16/fp16 are upcast first);
float64 inputs stay float64 (for ``gradcheck``). Nothing here holds state.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from crosskd.errors import CrosskdError

__all__ = ["DIVERGENCES", "LOG_REST_FLOOR", "divergence", "with_rest"]

DIVERGENCES: tuple[str, ...] = ("jsd", "forward_kl", "reverse_kl")
"""The divergence kinds :func:`divergence` accepts."""

REST_FLOOR: float = 1e-12
"""The least probability the REST bucket is given."""

LOG_REST_FLOOR: float = math.log(REST_FLOOR)
"""``log(1e-12)``: the floor of ``log REST`` (nats)."""

_LN2 = math.log(2.0)
# Largest event log-mass whose REST is still above the floor: log(1 - 1e-12) (about -1e-12).
_LSE_CAP = math.log1p(-REST_FLOOR)


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (the loss's arithmetic precision)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``, stable at both ends (Mächler 2012).

    Both branches see clamped inputs so the branch ``torch.where`` drops never produces an
    inf/NaN that would leak into the gradient.
    """
    near_zero = x > -_LN2
    a = torch.log(-torch.expm1(x.clamp(min=-_LN2)))
    b = torch.log1p(-torch.exp(x.clamp(max=-_LN2)))
    return torch.where(near_zero, a, b)


def with_rest(log_probs: Tensor, mask: Tensor) -> Tensor:
    """Append the REST bucket to per-chunk event log probabilities.

    Args:
        log_probs: ``[C, E]`` log probabilities (nats) of each chunk's events, padded; values at
            padded positions are ignored (may be anything, even NaN).
        mask: bool ``[C, E]``, ``True`` for real events.

    Returns:
        ``[C, E + 1]`` log probabilities in float32 (float64 for float64 input): the real events
        as given, ``-inf`` at padded events, and last ``log REST = log(1 - sum_e exp(a_e))``
        floored at :data:`LOG_REST_FLOOR`. A chunk with no real event has ``log REST = 0``.

    Raises:
        ValueError: if the shapes differ or are not 2-D, or ``mask`` is not bool.
    """
    if log_probs.dim() != 2 or mask.shape != log_probs.shape:
        raise ValueError(
            f"with_rest: log_probs must be [C, E] and mask the same shape; got log_probs "
            f"{tuple(log_probs.shape)} and mask {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        raise ValueError(f"with_rest: mask must be torch.bool, got {mask.dtype}")
    dtype = _compute_dtype(log_probs)
    events = log_probs.to(dtype).masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(events, dim=-1)
    # The cap makes log REST >= log(1e-12) up to rounding; the final clamp removes that rounding.
    log_rest = _log1mexp(lse.clamp(max=_LSE_CAP)).clamp(min=LOG_REST_FLOOR)
    return torch.cat([events, log_rest.unsqueeze(-1)], dim=-1)


def _kl_terms(log_p: Tensor, log_q: Tensor, weighs: Tensor) -> Tensor:
    """Elementwise ``p * (log p - log q)``, exactly 0 where ``weighs`` is off or ``p == 0``."""
    live = weighs & (log_p > -math.inf)
    # log_p is zeroed where not live so the discarded branch stays finite (exp(-inf) * inf
    # would be NaN, and NaN leaks through torch.where's gradient); there the discarded
    # branch's gradient is exp(0) * 0 = 0 whatever log_q holds.
    lp = torch.where(live, log_p, torch.zeros_like(log_p))
    return torch.where(live, lp.exp() * (lp - log_q), torch.zeros_like(lp))


def _check_kind_beta(kind: str, beta: float) -> None:
    if kind not in DIVERGENCES:
        raise CrosskdError(
            f"divergence: kind={kind!r} is not supported; allowed values: "
            + ", ".join(repr(k) for k in DIVERGENCES)
        )
    if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not 0.0 < beta < 1.0:
        raise CrosskdError(
            f"divergence: beta={beta!r} is out of range; allowed values: a number strictly "
            "between 0 and 1 (open interval (0, 1))"
        )


def divergence(
    student: Tensor,
    teacher: Tensor,
    mask: Tensor,
    *,
    kind: str = "jsd",
    beta: float = 0.5,
) -> Tensor:
    """Per-chunk divergence between ``S = exp(student)`` and ``T = exp(teacher)``.

    Args:
        student: ``[C, E + 1]`` student log probabilities (events + REST, from
            :func:`with_rest`); differentiable.
        teacher: ``[C, E + 1]`` teacher log probabilities, same layout; taken as constant by
            the caller (pass it without grad).
        mask: bool ``[C, E + 1]``, ``True`` for real entries (the REST column is always real).
        kind: ``"jsd"`` (generalised JSD with ``beta``), ``"forward_kl"`` (``KL(T||S)``) or
            ``"reverse_kl"`` (``KL(S||T)``).
        beta: JSD mixing weight of the teacher, in the open interval (0, 1); checked for every
            kind (an out-of-range value is a configuration error even where it is unused).

    Returns:
        ``[C]`` divergences in nats, float32 (float64 if an input is float64).

    Raises:
        ValueError (:class:`~crosskd.errors.CrosskdError`): ``kind`` or ``beta`` invalid (the
            message names the argument, its value and the allowed values), or shapes disagree.
    """
    _check_kind_beta(kind, beta)
    if student.dim() != 2 or teacher.shape != student.shape or mask.shape != student.shape:
        raise ValueError(
            "divergence: student, teacher and mask must all be [C, E + 1]; got student "
            f"{tuple(student.shape)}, teacher {tuple(teacher.shape)}, mask {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        raise ValueError(f"divergence: mask must be torch.bool, got {mask.dtype}")
    dtype = _compute_dtype(student, teacher)
    s = student.to(dtype)
    t = teacher.to(dtype)

    if kind == "forward_kl":
        terms = _kl_terms(t, s, mask)
    elif kind == "reverse_kl":
        terms = _kl_terms(s, t, mask)
    else:
        # log M = logaddexp(log(beta) + t, log(1 - beta) + s). Entries that are masked, or have
        # zero mass on both sides, are replaced by 0 first so that no -inf/-inf pair reaches
        # logaddexp (its gradient there is NaN); they contribute 0 either way.
        live = mask & ((s > -math.inf) | (t > -math.inf))
        zero = torch.zeros_like(s)
        s_in = torch.where(live, s, zero)
        t_in = torch.where(live, t, zero)
        log_m = torch.logaddexp(t_in + math.log(beta), s_in + math.log1p(-beta))
        terms = beta * _kl_terms(t_in, log_m, live) + (1.0 - beta) * _kl_terms(s_in, log_m, live)
    return terms.sum(dim=-1)
