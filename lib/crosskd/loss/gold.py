"""X-Token's gold loss and H-KL: ``loss.teachers[i].algorithm: gold`` and ``hkl``.

Both split the two vocabularies into a **common** part, pairs ``(s, t)`` of a student and a
teacher token taken as the same event, and the **uncommon** rest, from the teacher's projection
``W`` (:mod:`crosskd.projection`), as NVIDIA NeMo RL's X-Token loss does (:func:`partition`):

* ``gold``: the exact rows of ``W`` (one teacher token of weight 1: the same bytes, or a
  special of the same role); a teacher token claimed by several student tokens goes to the
  lowest student id;
* ``hkl`` (X-Token's "H-KL", gold with a relaxed partition): every student token whose largest
  weight in ``W`` is at least :data:`RELAXED_WEIGHT` is matched to that top-ranked teacher
  token (a teacher token claimed by several goes to the largest weight, ties to the lowest
  student id): a Llama-3 ``123`` joins SmolLM2's ``1`` unless ``1``'s own exact twin claims it.

On the chunks of the character-offset alignment (the counted ones, as for CSD), at ``tau``,
with the chunk's student rows ``I_c`` and teacher rows ``J_c``, both sides are the mean log
probabilities of the chunk's rows, not renormalised (X-Token's chunk averages):
``log S_c(s) = 1/|I_c| sum_i log p_i(s)`` over the whole student vocabulary,
``log T_c(t) = 1/|J_c| sum_j log p_j(t)`` over ``S_c`` (the union of the rows' top-K ids; an id
outside one row's top K at that row's tail spread evenly, as in :mod:`crosskd.loss.xtoken`).
Per chunk,

* ``D_c``: ``divergence`` (forward KL, reverse KL or the generalised JSD) summed over the
  common pairs whose teacher token is in ``S_c``, elementwise and **not renormalised**
  (``sum T_c(t) (log T_c(t) - log S_c(s))`` for forward KL);
* ``L1_c``: the sorted L1 of the uncommon parts: the teacher's vector is ``T_c`` of the
  uncommon ids of ``S_c`` plus one entry for the rest (the mean log of each row's mass outside
  ``S_c``: what the top-K cache leaves of the teacher, the approximation ULD makes here too),
  sorted decreasing; the student's is ``S_c`` of every student token outside the partition,
  its largest entries against the teacher's and the remainder against the teacher's zeros
  (``sum_i |sort(S)_i - sort(T)_i| + (sum S - sum_{i<n} sort(S)_i)``);
* ``KD = tau^2 sum_c (D_c + L1_c) / N`` with ``N`` the step's counted chunks (X-Token: both
  parts weigh 1).

X-Token reads the teacher's whole logits: there every common pair counts in ``D_c`` and the
uncommon teacher vector is exact; from a top-K cache the common pairs outside ``S_c`` and the
teacher's tail are its rest entry. A dense signal (``k: 0``) is refused, as for ``xtoken``.

**Cost and layouts.** ``S_c`` is a whole row of ``V_S``, and the sorted L1 needs the largest
uncommon entries of it: the chunks are taken in blocks of :data:`BLOCK_CHUNKS`, each block's
rows' log-softmax averaged per chunk by a sparse product and recomputed in the backward pass.
It reads the student's logits, not the fused output layer (which never holds them), as this
process holds them (:class:`~crosskd.loss.logprobs.RowSlices`). Over a vocabulary split
between tensor-parallel ranks, every rank of the group computes each block on its slice: the
log-softmax with the all-reduced normaliser, its part of ``D_c`` (the pairs whose student id it
holds) and of the uncommon mass, and its ``n`` largest uncommon entries; one differentiable sum
per block carries ``C_b x (2 + tp * n)`` numbers, and the ``n`` largest of the ``tp * n``
candidates are those of the whole row. Over sequence windows, a chunk belongs to the window of
its first row; the few chunks whose rows lie in two windows (one per row and window boundary at
most) have their mean ``log S_c`` summed over the windows first, ``V / tp`` numbers each. So
every layout gives one process's values and gradients. X-Token's P-KL, which reads (row, id)
log probabilities as CSD does, needs none of this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from crosskd.loss.csd import KdTerm
from crosskd.loss.logprobs import RowSlices
from crosskd.loss.xtoken import ChunkTeacher
from crosskd.projection import Projection
from crosskd.ragged import offsets_from_lengths, positions
from crosskd.transfer import to_device

RELAXED_WEIGHT = 0.6
"""H-KL's threshold: a student token's largest weight in ``W`` that matches it to that teacher
token (X-Token's)."""
BLOCK_CHUNKS = 256
"""Chunks per block of the student side (a block holds ``BLOCK_CHUNKS x V_S`` floats)."""
GOLD_STATS = ("gold_common", "gold_uncommon")
"""Metric sums of a gold / H-KL term (``{teacher}/{stat}``): its ``D_c`` and ``L1_c``."""


def partition(projection: Projection, *, relaxed: bool) -> np.ndarray:
    """The common pairs of ``W`` (module docstring), int64 ``[n, 2]``: (student id, teacher
    id), one pair per teacher id, sorted by student id; ``relaxed``: H-KL's rule, else gold's."""
    lengths = projection.lengths
    rows = np.flatnonzero(lengths > 0)
    first = projection.offsets[rows]  # each row's largest weight comes first
    weight = projection.weights[first].astype(np.float64)
    teacher = projection.columns[first].astype(np.int64)
    keep = weight >= RELAXED_WEIGHT if relaxed else (lengths[rows] == 1) & (weight == 1.0)
    rows, teacher, weight = rows[keep], teacher[keep], weight[keep]
    order = np.lexsort((rows, -weight, teacher))  # per teacher id: the largest, then lowest s
    rows, teacher = rows[order], teacher[order]
    winner = np.ones(len(teacher), dtype=bool)
    winner[1:] = teacher[1:] != teacher[:-1]
    pairs = np.stack([rows[winner], teacher[winner]], axis=1)
    return pairs[np.argsort(pairs[:, 0], kind="stable")]


@dataclass(frozen=True)
class GoldParts:
    """The data side of one gold / H-KL term over its ``C`` counted chunks (numpy):
    ``row_offsets`` int64 ``[C + 1]`` and ``rows`` (the flat student rows ``b * L_s + s - 1``
    of each chunk, CSR); the common pairs of ``S_c`` as ``pair_chunk``, ``pair_student``
    (int64 ``[P]``) and ``pair_teacher_log`` (float64 ``[P]``: ``log T_c(t)``); the teacher's
    uncommon vectors ``teacher_uncommon`` (float64 ``[C, n]``, sorted decreasing, zero-padded);
    ``student_common`` bool ``[V_S]``: the student tokens of the partition."""

    row_offsets: np.ndarray
    rows: np.ndarray
    pair_chunk: np.ndarray
    pair_student: np.ndarray
    pair_teacher_log: np.ndarray
    teacher_uncommon: np.ndarray
    student_common: np.ndarray


def gold_parts(side: ChunkTeacher, pairs: np.ndarray, width: int, student_vocab: int) -> GoldParts:
    """The :class:`GoldParts` of a teacher's chunks (``side``, :func:`crosskd.loss.xtoken
    .chunk_teacher`) under the partition ``pairs`` (:func:`partition`), for a student batch
    ``width`` wide with ``student_vocab`` output rows."""
    n = len(side.cand)
    n_rows = side.s1 - side.s0
    offsets = offsets_from_lengths(n_rows)
    rows = np.repeat(side.b * width + side.s0 - 1, n_rows) + positions(n_rows)
    partner = np.full(int(side.event_id.max(initial=-1)) + 1, -1, dtype=np.int64)
    inside = pairs[:, 1] < len(partner)
    partner[pairs[inside, 1]] = pairs[inside, 0]
    student = partner[side.event_id]
    common = student >= 0
    uncommon = np.flatnonzero(~common)
    values = np.concatenate([np.exp(side.mean_log[uncommon]), np.exp(side.rest_mean)])
    owner = np.concatenate([side.event_chunk[uncommon], np.arange(n)])
    order = np.lexsort((-values, owner))
    values, owner = values[order], owner[order]
    counts = np.bincount(owner, minlength=n)
    grid = np.zeros((n, int(counts.max(initial=0))))
    grid[owner, positions(counts)] = values
    in_partition = np.zeros(student_vocab, dtype=bool)
    in_partition[pairs[:, 0]] = True
    return GoldParts(
        offsets,
        rows,
        side.event_chunk[common],
        student[common],
        side.mean_log[common],
        grid,
        in_partition,
    )


def gold_term(
    slices: RowSlices,
    parts: GoldParts,
    owned: np.ndarray,
    *,
    tau: float,
    kind: str,
    beta: float,
    n_total: int,
    after: Tensor | None = None,
) -> tuple[KdTerm, Tensor]:
    """``tau^2 sum_c (D_c + L1_c) / N`` (module docstring) over the chunks marked in ``owned``
    (bool ``[C]``: this process's share; ``N = n_total``), from the micro-batch's student
    logits as this process holds them (``slices``: its window of every row and its slice of
    the vocabulary, or everything; differentiable; float32 arithmetic, float64 kept). Every
    rank of a vocabulary-split group computes each chunk of its window with the others, and
    the rows of a chunk that crosses into another window are summed over the windows first
    (module docstring); each rank counts its own. ``after``: a scalar of the loss computed
    before this term whose graph holds the earlier sequence-parallel collectives: the
    exchange here is made to depend on it (plus zero), so that every rank runs the backward
    collectives in the one order. Returns the :class:`~crosskd.loss.csd.KdTerm` of the owned
    chunks (its ``divergence`` is ``D_c + L1_c``, its REST values the uncommon masses of both
    sides, its events the common pairs of each chunk) and the sums of their ``D_c`` and
    ``L1_c`` (float64 ``[2]``, detached)."""
    dtype = torch.float64 if slices.flat.dtype == torch.float64 else torch.float32
    device = slices.flat.device
    n = len(parts.row_offsets) - 1
    if n == 0 or n_total == 0:
        empty = slices.flat.new_zeros(0, dtype=dtype)
        term = KdTerm(slices.flat.sum() * 0.0, 0, empty, empty, empty, empty.long())
        return term, torch.zeros(2, dtype=torch.float64, device=device)
    stop = slices.vocab_start + slices.flat.shape[1]
    common = to_device(parts.student_common[slices.vocab_start : stop], device)
    lengths = np.diff(parts.row_offsets)
    chunk_of_row = np.repeat(np.arange(n), lengths)
    here_row, local_row = slices.local(parts.rows)
    window = parts.rows % slices.width // slices.window
    first = parts.row_offsets[:-1]
    crossing = np.bincount(chunk_of_row, window != window[first][chunk_of_row], n) > 0
    mine = here_row[first]  # the chunks of this window (the first row's)
    options = _Options(common, tau, kind, beta, dtype)
    inside = np.flatnonzero(mine & ~crossing)
    groups = [inside[b0 : b0 + BLOCK_CHUNKS] for b0 in range(0, len(inside), BLOCK_CHUNKS)]
    blocks = [_Block.of(parts, g, local_row, None, slices.vocab_start, device) for g in groups]
    across = np.flatnonzero(crossing)  # the same on every rank of the group (the shard's plan)
    if len(across):
        blocks.append(_Block.of(parts, across, local_row, here_row, slices.vocab_start, device))
    pieces, order = [], []
    for i, logits in enumerate(_gather(slices, blocks)):
        if i < len(groups):
            args = (slices, blocks[i], logits, options)
            if logits.requires_grad:
                pieces.append(checkpoint(_block_values, *args, use_reentrant=False))
            else:
                pieces.append(_block_values(*args))
            order.append(groups[i])
            continue
        partial = _log_means(blocks[i], logits, tau, dtype, slices)
        if after is not None:
            partial = partial + 0.0 * after
        log_s = slices.cp_sum(partial)
        keep = mine[across]
        pairs = _Block.of(parts, across[keep], local_row, None, slices.vocab_start, device)
        pieces.append(_chunk_values(slices, log_s[to_device(keep, device)], pairs, options))
        order.append(across[keep])
    if not pieces:  # no chunk in this window (nor on the other ranks of its group)
        empty = slices.flat.new_zeros(0, dtype=dtype)
        term = KdTerm(slices.flat.sum() * 0.0, 0, empty, empty, empty, empty.long())
        return term, torch.zeros(2, dtype=torch.float64, device=device)
    evaluated = np.concatenate(order)
    rank = np.empty(n, dtype=np.int64)
    rank[evaluated] = np.arange(len(evaluated))
    values = torch.cat(pieces)[to_device(rank[np.flatnonzero(owned)], device)]  # [C_owned, 4]
    per_chunk = values[:, 0] + values[:, 1]  # D_c, L1_c, student and teacher uncommon mass
    matched = np.bincount(parts.pair_chunk, minlength=n)[owned]
    term = KdTerm(
        tau**2 * per_chunk.sum() / n_total,
        len(matched),
        per_chunk.detach(),
        values[:, 2].detach().clamp(min=1e-30).log(),
        values[:, 3].detach().clamp(min=1e-30).log(),
        to_device(matched, device),
    )
    return term, values[:, :2].detach().double().sum(0)


@dataclass(frozen=True)
class _Block:
    """Some chunks of a term as tensors: the rows of ``flat`` they read, the sparse
    ``[C_b, R_b]`` mean over each chunk's rows (weight ``1 / |I_c|``), the common pairs (block
    chunk, student id counted from the slice's first, teacher log) and the teacher's uncommon
    vectors."""

    rows: Tensor
    mean: Tensor
    pair_chunk: Tensor
    pair_student: Tensor
    pair_teacher: Tensor
    teacher: Tensor

    @classmethod
    def of(
        cls,
        parts: GoldParts,
        chunks: np.ndarray,
        local_row: np.ndarray,
        here: np.ndarray | None,
        vocab_start: int,
        device: torch.device,
    ) -> _Block:
        """The chunks ``chunks`` (int64, ascending); ``local_row``: each row of ``parts`` in
        ``flat``; ``here``: only the rows of this window (bool per row of ``parts``), else
        every row of the chunks."""
        lengths = np.diff(parts.row_offsets)[chunks]
        index = np.repeat(parts.row_offsets[chunks], lengths) + positions(lengths)
        chunk = np.repeat(np.arange(len(chunks)), lengths)
        if here is not None:
            index, chunk = index[here[index]], chunk[here[index]]
        mean = torch.sparse_coo_tensor(
            to_device(np.stack([chunk, np.arange(len(index))]), device),
            to_device(1.0 / lengths[chunk], device),
            (len(chunks), len(index)),
            is_coalesced=True,
            check_invariants=False,
        )
        block = np.full(len(parts.row_offsets) - 1, -1, dtype=np.int64)
        block[chunks] = np.arange(len(chunks))
        pick = block[parts.pair_chunk] >= 0
        return cls(
            to_device(local_row[index], device),
            mean,
            to_device(block[parts.pair_chunk[pick]], device),
            to_device(parts.pair_student[pick] - vocab_start, device),
            to_device(parts.pair_teacher_log[pick], device),
            to_device(parts.teacher_uncommon[chunks], device),
        )


def _gather(slices: RowSlices, blocks: list[_Block]) -> list[Tensor]:
    """Each block's rows of ``slices.flat``, taken in one gather and split: the gradient is then
    one scatter into the logits, not one logits-sized buffer per block."""
    if not blocks:
        return []
    rows = torch.cat([block.rows for block in blocks])
    return list(slices.flat[rows].split([len(block.rows) for block in blocks]))


def _log_means(
    block: _Block, logits: Tensor, tau: float, dtype: torch.dtype, slices: RowSlices
) -> Tensor:
    """``[C_b, V_here]``: the block's mean over each chunk's rows of ``log p`` at ``tau``, from
    the block's rows of the logits (``logits`` ``[R_b, V_here]``)."""
    return torch.sparse.mm(block.mean.to(dtype), slices.log_softmax(logits, tau, dtype))


@dataclass(frozen=True)
class _Options:
    """What every block of a term shares: ``common`` (bool ``[V_here]``: the slice's student
    tokens of the partition), the temperature, divergence and JSD ``beta``, the float dtype of
    the arithmetic."""

    common: Tensor
    tau: float
    kind: str
    beta: float
    dtype: torch.dtype


def _block_values(slices: RowSlices, block: _Block, logits: Tensor, options: _Options) -> Tensor:
    """:func:`_chunk_values` of a block whose rows all lie in this window (``logits``: its
    rows)."""
    log_s = _log_means(block, logits, options.tau, options.dtype, slices)
    return _chunk_values(slices, log_s, block, options)


def _chunk_values(slices: RowSlices, log_s: Tensor, block: _Block, options: _Options) -> Tensor:
    """``[C_b, 4]``: per chunk of the block ``D_c``, ``L1_c`` and the uncommon mass of the
    student and of the teacher, from ``log_s`` (``[C_b, V_here]``: ``log S_c`` over this
    slice). Over a vocabulary slice: each slice's part of ``D_c`` and of the uncommon mass,
    and its largest uncommon entries, summed and merged over the slices in one collective of
    ``C_b x (2 + tp * n)`` numbers."""
    here = (block.pair_student >= 0) & (block.pair_student < log_s.shape[1])
    chunk = block.pair_chunk[here]
    s = log_s[chunk, block.pair_student[here]]
    t = block.pair_teacher[here].to(options.dtype)
    kind, beta = options.kind, options.beta
    if kind == "forward_kl":
        terms = t.exp() * (t - s)
    elif kind == "reverse_kl":
        terms = s.exp() * (s - t)
    else:
        m = torch.logaddexp(t + math.log(beta), s + math.log1p(-beta))
        terms = beta * t.exp() * (t - m) + (1.0 - beta) * s.exp() * (s - m)
    n = log_s.shape[0]
    divergence = log_s.new_zeros(n).index_add(0, chunk, terms)
    uncommon = log_s.exp().masked_fill(options.common[None, :], 0.0)
    teacher = block.teacher.to(options.dtype)
    width = teacher.shape[1]
    top = uncommon.topk(min(width, uncommon.shape[1]), dim=-1).values
    gathered = [top if r == slices.tp_rank else torch.zeros_like(top) for r in range(slices.tp)]
    local = torch.cat([divergence[:, None], uncommon.sum(-1)[:, None], *gathered], dim=1)
    total = slices.tp_sum(local)
    divergence, mass, candidates = total[:, 0], total[:, 1], total[:, 2:]
    top = candidates.topk(min(width, candidates.shape[1]), dim=-1).values
    top = torch.nn.functional.pad(top, (0, width - top.shape[1]))
    l1 = (top - teacher).abs().sum(-1) + (mass - top.sum(-1)).clamp(min=0.0)
    return torch.stack([divergence, l1, mass, teacher.sum(-1)], dim=1)
