"""The teacher signal: what a teacher provides per row (spec section 4).

Row ``r`` of a sequence's logits predicts token ``r + 1`` (a token is priced by the row before
it). For every row the signal holds the top-K token ids and their log probabilities at
temperature ``tau`` (``log_softmax(logits / tau)`` over **all** ``V`` rows of the output layer,
so the values are exact and not renormalised over K; padding rows' mass is left to REST), and
for every row that has a next token, the log probability of that realized token at ``tau``
(always, even outside the top K) and at temperature 1 (for bits per byte). ``K = 0`` means
dense: the whole log-probability row is kept.

Precision: values are float32 whatever the logits' dtype, computed as ``(logits / tau - max)
- log(sum(exp(logits / tau - max)))`` with the row's log-normaliser from an accurate float32
reduction (:func:`log_normaliser`) and the same float32 operations for the top-K, dense and
realized values (so a value is bit-identical wherever it is stored). Every stored value is then
within a few float32 ulps of a float64 ``log_softmax`` of the same logits, also when one logit
dominates its row: measured at most 2.3e-6 nats over V = 152k (a float32 ``log_softmax`` is
off by up to 5e-4 there). Nothing ``[..., V]`` is made in float64.

The top K is taken over the logits (the same order as the tempered log probs); ties at the
K-th logit are broken towards the lower id, and the top-K ids of a row are stored in ascending
id order, so the same logits always give the same signal. Top-K values cannot be
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

    ``k``: top-K size (0 = dense); ``tau``: temperature (> 0). The stored values are float32
    whatever the logits' dtype, within a few float32 ulps of a float64 ``log_softmax`` (module
    docstring); the top-K ids are those of the largest logits.
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
    scaled = logits if tau == 1 else logits / tau
    top, log_sum = log_normaliser(scaled)
    nxt = input_ids[..., 1:].long().unsqueeze(-1)
    realized = _log_probs(scaled[..., :-1, :].gather(-1, nxt), top[..., :-1], log_sum[..., :-1])
    if tau == 1:
        realized_t1 = realized
    else:
        top_t1, log_sum_t1 = log_normaliser(logits)
        realized_t1 = _log_probs(
            logits[..., :-1, :].gather(-1, nxt), top_t1[..., :-1], log_sum_t1[..., :-1]
        )
    realized, realized_t1 = realized.squeeze(-1), realized_t1.squeeze(-1)
    if k == 0:
        dense = _log_probs(scaled, top, log_sum)
        return TeacherSignal(None, dense, realized, realized_t1, float(tau), vocab, 0)
    ids = top_k_ids(logits, k)
    values = _log_probs(scaled.gather(-1, ids), top, log_sum)
    return TeacherSignal(ids, values, realized, realized_t1, float(tau), vocab, k)


def _log_probs(picked: torch.Tensor, row_max: torch.Tensor, log_sum: torch.Tensor) -> torch.Tensor:
    """``(picked - row_max) - log_sum`` in float32 for ``picked`` ``[..., n]`` of one row each
    (``row_max``, ``log_sum`` ``[...]``). The same float32 operations whatever ``n``, so a value
    is bit-identical in the dense signal, the top K and the realized log probs. Each is rounded
    twice (``x - max`` is exact near the max), plus the float32 rounding of the log-sum (at most
    half an ulp of ``log V``): about 1e-6 nats for log probs above -16, 6e-6 above -64."""
    shifted = picked - row_max.unsqueeze(-1)
    return shifted.sub_(log_sum.float().unsqueeze(-1))


_BLOCK = {"cpu": 1 << 21, "cuda": 1 << 26}
"""Entries of the exponentials' buffer of :func:`log_normaliser` by device type (CPU: 8 MB, so
it stays in cache; other devices: 256 MB, so few kernel launches)."""


def log_normaliser(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-normaliser of each row of float32 ``values`` ``[..., V]`` as ``(row max, log
    sum)``: ``logsumexp(row) = max + log(sum(exp(row - max)))``, the max float32 ``[...]``, the
    log of the sum float64 ``[...]``.

    The sum is torch's float32 ``sum`` (a pairwise/cascade reduction on CPU) of the
    exponentials of a block of rows at a time, in one reused buffer of at most ``_BLOCK``
    entries (no ``[..., V]`` temporary, no float64 copy): measured on CPU within 2.5e-6 nats of
    float64 over V = 152k, dominant logit or not. (``torch.log_softmax`` in float32 is not: its
    CPU kernel sums each vector lane sequentially, so the lane holding a dominant logit drops
    the small entries added to it, up to 5e-4 nats with one logit 16.6 above 152k zeros.) A row
    whose max is not finite uses 0 for it, as ``torch.logsumexp`` does.
    """
    vocab = values.shape[-1]
    flat = values.reshape(-1, vocab)
    row_max = flat.amax(dim=-1)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    total = torch.empty_like(row_max)
    block = max(1, _BLOCK.get(values.device.type, _BLOCK["cuda"]) // max(vocab, 1))
    buffer = flat.new_empty(min(block, len(flat)), vocab)
    for start in range(0, len(flat), block):
        stop = min(start + block, len(flat))
        exps = torch.sub(flat[start:stop], row_max[start:stop, None], out=buffer[: stop - start])
        total[start:stop] = exps.exp_().sum(dim=-1)
    return row_max.reshape(values.shape[:-1]), total.double().log().reshape(values.shape[:-1])


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
