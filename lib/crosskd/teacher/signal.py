"""The teacher signal: what a teacher provides per row (spec section 4).

Row ``r`` of a sequence's logits predicts token ``r + 1`` (a token is priced by the row before
it). For every row the signal holds the top-K token ids and their log probabilities at
temperature ``tau`` (``log_softmax(logits / tau)`` over **all** ``V`` rows of the output layer,
so the values are exact and not renormalised over K; padding rows' mass is left to REST), and
for every row that has a next token, the log probability of that realized token at ``tau``
(always, even outside the top K) and at temperature 1 (for bits per byte). ``K = 0`` means
dense: the whole log-probability row is kept.

Ties at the K-th value are broken towards the lower id, and the top-K ids of a row are stored in
ascending id order, so the same logits always give the same signal. Top-K values cannot be
re-tempered: the signal records ``tau``, ``V`` and ``K``, and :meth:`TeacherSignal.require`
refuses a signal made with other values, naming the field and both values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from crosskd.errors import CrosskdError


class SignalError(CrosskdError):
    """A teacher signal does not match what the loss or the config expects."""


@dataclass(frozen=True)
class TeacherSignal:
    """One batch of teacher rows; shapes over leading dims ``[..., L]`` of the sequences.

    ``ids`` int64 ``[..., L, K]`` (ascending per row) and ``log_probs`` float32 ``[..., L, K]``
    at ``tau``; dense (``k == 0``): ``ids`` is None and ``log_probs`` is ``[..., L, V]``.
    ``realized`` / ``realized_t1`` float32 ``[..., L - 1]``: log probability of token ``r + 1``
    from row ``r``, at ``tau`` and at temperature 1.
    """

    ids: torch.Tensor | None
    log_probs: torch.Tensor
    realized: torch.Tensor
    realized_t1: torch.Tensor
    tau: float
    vocab_size: int
    k: int

    def require(
        self, *, tau: float, vocab_size: int | None, k: int | None = None, where: str
    ) -> None:
        """Refuse a signal made at another temperature, vocabulary size or K (``where`` names
        the signal in the message, e.g. its cache URI); None: not checked."""
        expected = {"tau": tau, "vocab_size": vocab_size, "k": k}
        for field, want in expected.items():
            have = getattr(self, field)
            if want is not None and have != want:
                raise SignalError(
                    f"teacher signal {where}: {field} is {have}, the config asks for {want}; "
                    f"top-K log probabilities cannot be converted, so score the teacher again "
                    f"with {field}={want} (or set the config's {field} to {have})."
                )


def signal_from_logits(
    logits: torch.Tensor, input_ids: torch.Tensor, *, k: int, tau: float
) -> TeacherSignal:
    """The signal of teacher ``logits`` ``[..., L, V]`` for the tokens ``input_ids`` ``[..., L]``.

    ``k``: top-K size (0 = dense); ``tau``: temperature (> 0). Arithmetic in float32 whatever
    the logits' dtype.
    """
    if tau <= 0:
        raise SignalError(f"tau is {tau}; it must be > 0.")
    vocab = logits.shape[-1]
    if not 0 <= k <= vocab:
        raise SignalError(f"k is {k}; it must be 0 (dense) or between 1 and V = {vocab}.")
    if logits.shape[:-1] != input_ids.shape:
        raise SignalError(
            f"logits {tuple(logits.shape)} and input_ids {tuple(input_ids.shape)} disagree on the "
            f"sequence shape; pass the logits of exactly these tokens."
        )
    logits = logits.float()
    tempered = torch.log_softmax(logits if tau == 1 else logits / tau, dim=-1)
    plain = tempered if tau == 1 else torch.log_softmax(logits, dim=-1)
    nxt = input_ids[..., 1:].long().unsqueeze(-1)
    realized = tempered[..., :-1, :].gather(-1, nxt).squeeze(-1)
    realized_t1 = plain[..., :-1, :].gather(-1, nxt).squeeze(-1)
    if k == 0:
        return TeacherSignal(None, tempered, realized, realized_t1, float(tau), vocab, 0)
    ids = top_k_ids(tempered, k)
    return TeacherSignal(
        ids, tempered.gather(-1, ids), realized, realized_t1, float(tau), vocab, k
    )


def top_k_ids(values: torch.Tensor, k: int) -> torch.Tensor:
    """Ids of the ``k`` largest entries of each row of ``values`` ``[..., V]``, ties at the k-th
    value broken towards the lower id, in ascending id order; int64 ``[..., k]``."""
    vocab = values.shape[-1]
    top, ids = torch.topk(values, min(k + 1, vocab), dim=-1)
    # A value outside the top k equal to the k-th one makes the choice ambiguous; it exists
    # exactly when the (k+1)-th largest value equals the k-th.
    if k < vocab:
        ambiguous = top[..., k] == top[..., k - 1]
        ids = ids[..., :k]
    else:
        ambiguous = torch.zeros(values.shape[:-1], dtype=torch.bool, device=values.device)
    if ambiguous.any():
        order = torch.sort(values[ambiguous], dim=-1, descending=True, stable=True).indices
        ids[ambiguous] = order[..., :k]
    return torch.sort(ids, dim=-1).values
