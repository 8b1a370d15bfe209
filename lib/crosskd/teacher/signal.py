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

Fused with the output layer (:func:`signal_from_output_layer`): given the teacher's last hidden
states and its head's weight and bias (an :class:`~crosskd.output_layer.OutputLayer`) instead
of logits, the same signal is computed a block of rows and a block of the vocabulary at a time,
so the ``rows x V`` logits never exist: an online max and sum of exponentials per row (each
block's float32 sum as :func:`log_normaliser` takes it, the blocks combined in float64), the
top K merged across vocabulary blocks with the same ties, and the realized token's logit
picked from the block that holds it, for both temperatures in one pass over the weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from crosskd.errors import CrosskdError
from crosskd.output_layer import OutputLayer


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
    vocab = logits.shape[-1]
    _check_k_tau(k, tau, vocab)
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


def _check_k_tau(k: int, tau: float, vocab: int) -> None:
    """Refuse a temperature that is not > 0 and a K outside ``0 .. vocab``."""
    if tau <= 0:
        raise SignalError(f"tau is {tau}; it must be > 0.")
    if not 0 <= k <= vocab:
        raise SignalError(f"k is {k}; it must be 0 (dense) or between 1 and V = {vocab}.")


FUSED_BLOCK = {"cpu": 1 << 22, "cuda": 1 << 24}
"""Logits per block (``block_rows x vocab_block``) of :func:`signal_from_output_layer` by
device type: 16 MiB of float32 on CPU (1,024 rows of 4,096: a block and its temporaries stay in
a server's last-level cache, and the product of 1,024 rows runs as fast per entry as the whole
one), 64 MiB on other devices (few, large kernel launches)."""

VOCAB_BLOCK = {"cpu": 4096, "cuda": 32768}
"""Vocabulary entries per block of :func:`signal_from_output_layer` by device type (at most
``V``)."""


@torch.no_grad()
def signal_from_output_layer(
    layer: OutputLayer,
    input_ids: torch.Tensor,
    *,
    k: int,
    tau: float,
    block_rows: int | None = None,
    vocab_block: int | None = None,
) -> TeacherSignal:
    """The signal of the logits of ``layer`` (hidden states ``[..., L, H]``, weight ``[V, H]``,
    bias ``[V]`` or None: the logits ``[..., L, V]`` the head computes) for the tokens
    ``input_ids`` ``[..., L]``, without making those logits: the :class:`TeacherSignal` of
    ``signal_from_logits(head logits, input_ids, k=k, tau=tau)`` (log probs in nats, float32,
    within a few float32 ulps of float64 as there: module docstring). A block's product may
    differ from the whole one in the last bit of a logit (as matrix products of other shapes
    do); where it does not, the top-K ids are the same, ties at the K-th logit included.

    How: the ``R`` rows (the flattened ``[..., L]``) are taken ``block_rows`` at a time and,
    within a block of rows, the vocabulary ``vocab_block`` ids at a time. Each block's logits
    ``[block_rows, vocab_block]`` are computed into a reused buffer (the operations of
    :meth:`OutputLayer.logits`: in the layer's compute dtype, then float32), and folded into
    each row's running state: its max and sum of exponentials at ``tau`` and, for ``tau`` != 1,
    at 1 (the block's exponentials relative to the running max, summed in float32; the running
    sum float64); its top-K candidates (logits that can still be among the top K: those above
    the K-th candidate so far, few once the top K fills up; cut back to K when they pass 4 K;
    see ``_FusedRows._merge_top_k``); and the logit of its realized token, picked from the
    block that holds it. Temporaries: a few buffers of a block (defaults: :data:`FUSED_BLOCK`
    entries, :data:`VOCAB_BLOCK` wide, by device type) and the candidates (at most
    ``block_rows x (4 K + vocab_block)``), besides the outputs (``R x K``); nothing ``R x V``.
    On a GPU each block reads back the number of its candidates (a host sync). ``k`` = 0
    (dense) stores ``R x V`` log probs by definition: it is computed from the whole logits
    (:func:`signal_from_logits`). Runs without autograd.

    Raises :class:`SignalError` for ``tau`` <= 0, ``k`` outside ``0 .. V``, hidden states and
    ``input_ids`` of other sequence shapes, a block size < 1, and a realized token id (any of
    ``input_ids[..., 1:]``) outside ``0 .. V - 1``.
    """
    vocab = layer.weight.shape[0]
    _check_k_tau(k, tau, vocab)
    if layer.hidden.shape[:-1] != input_ids.shape:
        raise SignalError(
            f"hidden states {tuple(layer.hidden.shape)} and input_ids {tuple(input_ids.shape)} "
            f"disagree on the sequence shape; pass the output layer of exactly these tokens."
        )
    for name, size in (("block_rows", block_rows), ("vocab_block", vocab_block)):
        if size is not None and size < 1:
            raise SignalError(f"{name} is {size}; it must be >= 1 (or None: the default).")
    if input_ids[..., 1:].numel():
        low, high = torch.stack(torch.aminmax(input_ids[..., 1:])).tolist()
        if low < 0 or high >= vocab:
            raise SignalError(
                f"input_ids hold token ids from {low} to {high}; the output layer has V = "
                f"{vocab} rows, so every id must be in 0 .. {vocab - 1}."
            )
    flat = layer.flatten()
    rows = flat.hidden.shape[0]
    if k == 0:
        logits = flat.logits(0, rows).reshape(layer.shape)
        return signal_from_logits(logits, input_ids, k=0, tau=tau)
    device = flat.hidden.device
    width = min(vocab, vocab_block or VOCAB_BLOCK.get(device.type, VOCAB_BLOCK["cuda"]))
    height = block_rows or max(1, FUSED_BLOCK.get(device.type, FUSED_BLOCK["cuda"]) // width)
    # the realized token of each flat row (the next one in its sequence; 0 after the last)
    targets = F.pad(input_ids.long(), (0, 1))[..., 1:].reshape(-1)
    weight, bias = flat.operands()
    ids = torch.empty(rows, k, dtype=torch.long, device=device)
    values = torch.empty(rows, k, dtype=torch.float32, device=device)
    realized = torch.empty(rows, dtype=torch.float32, device=device)
    realized_t1 = torch.empty_like(realized)
    scratch = _Scratch(min(height, rows) * width, weight.dtype, tau, device)
    for start in range(0, rows, height):
        stop = min(start + height, rows)
        block = _FusedRows(stop - start, k, tau, device)
        hidden = flat.hidden[start:stop].to(weight.dtype)
        target = targets[start:stop]
        for first in range(0, vocab, width):
            last = min(first + width, vocab)
            bias_part = None if bias is None else bias[first:last]
            logits = scratch.logits(hidden, weight[first:last], bias_part)
            block.add(logits, first, target, scratch)
        (
            ids[start:stop],
            values[start:stop],
            realized[start:stop],
            realized_t1[start:stop],
        ) = block.result()
    lead = input_ids.shape
    realized = realized.reshape(lead)[..., :-1]
    realized_t1 = realized_t1.reshape(lead)[..., :-1]
    return TeacherSignal(
        ids.reshape(*lead, k),
        values.reshape(*lead, k),
        realized,
        realized_t1,
        float(tau),
        vocab,
        k,
    )


class _Scratch:
    """The reused buffers of :func:`signal_from_output_layer`, ``entries`` each: a block's
    product in the compute dtype (when that is not float32), its float32 logits, and (for
    ``tau`` != 1) the tempered logits. Reused, so no block allocates memory."""

    def __init__(self, entries: int, dtype: torch.dtype, tau: float, device: torch.device) -> None:
        self.product = None
        if dtype != torch.float32:
            self.product = torch.empty(entries, dtype=dtype, device=device)
        self.float = torch.empty(entries, dtype=torch.float32, device=device)
        self.tempered = None if tau == 1 else torch.empty_like(self.float)

    def logits(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """The float32 logits ``[n, w]`` of ``hidden`` ``[n, H]`` through ``weight`` ``[w, H]``
        and ``bias`` ``[w]`` or None (the operations of ``F.linear`` on a matrix: ``addmm``,
        else ``mm``), in the float32 buffer (valid until the next call)."""
        shape = (hidden.shape[0], weight.shape[0])
        out = self.float if self.product is None else self.product
        product = out[: shape[0] * shape[1]].view(shape)
        if bias is None:
            torch.mm(hidden, weight.t(), out=product)
        else:
            torch.addmm(bias, hidden, weight.t(), out=product)
        if self.product is None:
            return product
        return self.float[: product.numel()].view(shape).copy_(product)

    def scaled(self, logits: torch.Tensor, tau: float) -> torch.Tensor:
        """``logits / tau`` in the tempered buffer (``logits`` itself at ``tau`` = 1)."""
        if self.tempered is None:
            return logits
        return torch.div(logits, tau, out=self.tempered[: logits.numel()].view(logits.shape))


class _FusedRows:
    """The running state of one block of ``n`` rows in :func:`signal_from_output_layer`: fed
    the float32 logits of one vocabulary block after another (:meth:`add`), it gives the rows'
    signal (:meth:`result`)."""

    def __init__(self, n: int, k: int, tau: float, device: torch.device) -> None:
        self.k, self.tau = k, tau
        self.tempered = _OnlineNormaliser(n, device)
        self.plain = self.tempered if tau == 1 else _OnlineNormaliser(n, device)
        self.top = torch.empty(n, 0, dtype=torch.float32, device=device)
        self.top_ids = torch.empty(n, 0, dtype=torch.long, device=device)
        self.threshold = torch.full((n,), -torch.inf, dtype=torch.float32, device=device)
        self.picked = torch.zeros(n, dtype=torch.float32, device=device)

    def add(
        self, logits: torch.Tensor, first: int, target: torch.Tensor, scratch: _Scratch
    ) -> None:
        """Fold in the logits ``[n, w]`` of vocabulary ids ``first .. first + w - 1`` (they are
        overwritten); ``target`` int64 ``[n]``: each row's realized token id."""
        width = logits.shape[1]
        inside = (target >= first) & (target < first + width)
        local = (target - first).clamp_(0, width - 1)
        picked = logits.gather(1, local[:, None])[:, 0]
        self.picked = torch.where(inside, picked, self.picked)
        self._merge_top_k(logits, first)
        self.tempered.add_(scratch.scaled(logits, self.tau))
        if self.plain is not self.tempered:
            self.plain.add_(logits)

    def _merge_top_k(self, logits: torch.Tensor, first: int) -> None:
        """Add the block's candidates for the top K to the running ones.

        The candidates are kept in ascending id order (the running ones, all below ``first``,
        then the block's, ascending), so :func:`top_k_ids` over them, whose ties go to the lower
        position, breaks ties towards the lower id as over the whole row. Once there are K,
        only the block's logits above ``threshold`` (the K-th largest candidate when they were
        last cut to K) can be among the top K: one equal to it has a higher id than the K
        candidates at or above it. Before that, a block at least K wide adds its logits at or
        above the K-th largest of the maxima of (up to 4 K) disjoint groups of its columns (K
        of its logits are at or above that, so none below it can be among the top K), and a
        narrower one all its logits. Either way only a few logits of a block are added once the
        top K is good; the candidates are cut back to the top K when there are K for the first
        time and when they pass 4 K.
        """
        k = self.k
        n, width = logits.shape
        short = self.top.shape[1] < k
        if not short:
            self._add_above(logits, first, self.threshold, inclusive=False)
        elif width >= k:
            groups = min(width, 4 * k)
            size = width // groups
            maxima = logits[:, : groups * size].view(n, groups, size).amax(dim=-1)
            floor = maxima.topk(k, dim=-1, sorted=False).values.amin(dim=-1)
            self._add_above(logits, first, floor, inclusive=True)
        else:
            ids = torch.arange(first, first + width, device=logits.device)
            self._append(logits, ids.expand(n, width))
        if (short and self.top.shape[1] >= k) or self.top.shape[1] > 4 * k:
            self._cut()

    def _add_above(
        self, logits: torch.Tensor, first: int, bound: torch.Tensor, *, inclusive: bool
    ) -> None:
        """Add the logits ``[n, w]`` of each row above its ``bound`` ``[n]`` (``inclusive``:
        at or above) as candidates, with their ids (``first`` + column)."""
        n, width = logits.shape
        above = logits >= bound[:, None] if inclusive else logits > bound[:, None]
        flat = torch.nonzero(above.view(-1))[:, 0]
        if len(flat) == 0:
            return
        rows = flat.div(width, rounding_mode="floor")
        # each row's candidates left-aligned in a [n, most] matrix padded with -inf (never
        # chosen: K candidates of the row that are at least as large come before them)
        counts = torch.bincount(rows, minlength=n)
        place = torch.arange(len(rows), device=rows.device) - (counts.cumsum(0) - counts)[rows]
        shape = (n, int(counts.max()))
        picked = logits.view(-1).take(flat)
        values = logits.new_full(shape, -torch.inf).index_put_((rows, place), picked)
        ids = rows.new_zeros(shape).index_put_((rows, place), flat - rows * width + first)
        self._append(values, ids)

    def _append(self, values: torch.Tensor, ids: torch.Tensor) -> None:
        """Add candidate ``values`` ``[n, m]`` and their ``ids`` after the running ones."""
        self.top = torch.cat([self.top, values], dim=1)
        self.top_ids = torch.cat([self.top_ids, ids], dim=1)

    def _cut(self) -> None:
        """Keep the top K candidates (in ascending id order) and their K-th largest value as
        the threshold."""
        if self.top.shape[1] > self.k:
            keep = top_k_ids(self.top, self.k)
            self.top, self.top_ids = self.top.gather(1, keep), self.top_ids.gather(1, keep)
        self.threshold = self.top.amin(dim=1)

    def result(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids, values, realized, realized_t1)``: top-K ids int64 ``[n, K]`` (ascending) and
        their log probs at ``tau``, the realized token's log probs at ``tau`` and at 1 (float32
        ``[n]``; meaningless on a sequence's last row), as :func:`signal_from_logits` makes
        them."""
        self._cut()
        tau = self.tau
        row_max, log_sum = self.tempered.result()
        scaled = self.top if tau == 1 else self.top / tau
        values = _log_probs(scaled, row_max, log_sum)
        picked = self.picked[:, None]
        realized = _log_probs(picked if tau == 1 else picked / tau, row_max, log_sum)[:, 0]
        if self.plain is self.tempered:
            return self.top_ids, values, realized, realized
        row_max_t1, log_sum_t1 = self.plain.result()
        return self.top_ids, values, realized, _log_probs(picked, row_max_t1, log_sum_t1)[:, 0]


class _OnlineNormaliser:
    """The log-normaliser of ``n`` rows fed a block of columns at a time, as
    :func:`log_normaliser` gives it for the whole rows: the running max (float32) and the
    running sum of exponentials relative to it (float64). Each block's exponentials are taken
    relative to the running max including the block (so each is <= 1 and the row's largest is
    exactly 1, as over the whole row) and summed by torch's float32 reduction; the sums of
    earlier blocks are rescaled to the new max in float64. A row whose max is not finite uses
    0 for it, as :func:`log_normaliser` does."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.row_max = torch.full((n,), -torch.inf, dtype=torch.float32, device=device)
        self.total = torch.zeros(n, dtype=torch.float64, device=device)

    def add_(self, values: torch.Tensor) -> None:
        """Fold in float32 ``values`` ``[n, w]`` (overwritten with their exponentials)."""
        row_max = torch.maximum(self.row_max, values.amax(dim=-1))
        old, new = _finite_or_zero(self.row_max), _finite_or_zero(row_max)
        block_sum = values.sub_(new[:, None]).exp_().sum(dim=-1)
        # old <= new wherever both are finite; where the old max was -inf the old sum is 0
        rescale = (old.double() - new.double()).clamp_(max=0).exp_()
        self.total = self.total.mul_(rescale).add_(block_sum.double())
        self.row_max = row_max

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(row max, log sum)`` as :func:`log_normaliser` returns them: float32 and float64
        ``[n]``."""
        return _finite_or_zero(self.row_max), self.total.log()


def _finite_or_zero(values: torch.Tensor) -> torch.Tensor:
    """``values`` with every entry that is not finite replaced by 0."""
    return torch.where(torch.isfinite(values), values, torch.zeros_like(values))


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
    row_max = _finite_or_zero(flat.amax(dim=-1))
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
