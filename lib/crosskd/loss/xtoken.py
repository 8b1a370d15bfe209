"""X-Token's projected KL (P-KL): ``loss.teachers[i].algorithm: xtoken``.

The student and the teacher are compared in the teacher's vocabulary, the student's
distribution projected there through the sparse matrix ``W`` of :mod:`crosskd.projection`
(``q = p_S @ W``), on the chunks of the character-offset alignment (the same chunks CSD uses).
For each counted chunk ``c`` (correct, with a prediction, in the KD mask: ``chunks.valid``),
with student prediction rows ``I_c`` (the rows before its student tokens) and teacher rows
``J_c`` (before its teacher tokens), all at temperature ``tau``:

* **student**: the mean over ``I_c`` of the projected distributions,
  ``Q_c(v) = 1/|I_c| sum_{i in I_c} sum_s p_i(s) W[s, v]`` (X-Token averages the projected
  probabilities of a chunk's rows);
* **teacher**: the normalised geometric mean over ``J_c`` of the teacher's distributions,
  ``T_c(v) ~ exp(1/|J_c| sum_{j in J_c} log p_j(v))`` (X-Token averages the log
  probabilities of a chunk's rows; for a chunk of one teacher row ``T_c = p_j``);
* ``D_c``: the divergence of ``loss.divergence`` between ``T_c`` and ``Q_c`` (X-Token's
  default is forward KL, ``KL(T_c || Q_c)``); ``KD = tau^2 sum_c D_c / N``, every chunk
  weighing 1, with ``N`` the step's counted chunks, as for CSD.

**What the top-K cache changes against X-Token's dense original.** X-Token reads the
teacher's whole logits and compares the two on one subset of 8192 teacher ids per micro-batch,
both sides renormalised inside it. crosskd reads the cached top-K of each teacher row plus its
tail mass and compares the two on ``S_c``, the union of the top-K ids of the chunk's teacher
rows, plus a **REST** event (every other teacher id) on both sides, so both are distributions
and nothing is renormalised away:

* where ``v`` is outside row ``j``'s top K but in ``S_c`` (another row of the chunk has it),
  ``p_j(v)`` is the row's tail spread evenly, ``tail_j / (V_T - K)`` (the only value the cache
  determines); row ``j``'s REST is then ``tail_j (V_T - |S_c|) / (V_T - K)``;
* the student's REST is ``1 - sum_{v in S_c} Q_c(v)``: its mass on teacher ids outside
  ``S_c`` and on student tokens whose row of ``W`` is empty (they project nowhere: X-Token
  renormalises that mass away; here it counts against the student);
* a teacher id of ``S_c`` that no student token maps to has ``Q_c(v) = 0``, taken as
  :data:`PROJECTED_FLOOR` (X-Token adds the same ``1e-10``): a constant of no gradient.

With a chunk of one teacher row and its top K covering the teacher's mass, this is X-Token's
P-KL on that chunk. A dense signal (``k: 0``) is refused: ``S_c`` would be the whole teacher
vocabulary.

**Cost and layouts.** ``Q_c`` needs each student row's whole distribution (one teacher id of
``W`` gathers the mass of thousands of student tokens: ``.`` of SmolLM2 that of about 6,000
Llama-3 tokens), so the rows are read in blocks of ``block_rows``: the softmax of a block
times the columns of ``W`` the batch's events name, recomputed in the backward pass
(activation checkpointing), so memory stays at one block of ``block_rows x V_S``. Like ULD it
needs the student's logits held whole by this process: the fused output layer and the
vocabulary- and sequence-parallel loss refuse it; data parallelism works.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

from crosskd.data.collate import ChunkBatch
from crosskd.loss.events import (
    STATUS_COUNTED,
    STATUS_INVALID,
    Events,
    in_top,
    to_numpy,
    top1_ids,
)
from crosskd.loss.logprobs import segment_sum
from crosskd.projection import Projection
from crosskd.ragged import offsets_from_lengths
from crosskd.teacher.signal import TeacherSignal
from crosskd.transfer import to_device

PROJECTED_FLOOR = 1e-10
"""The least projected probability ``Q_c(v)`` is given (X-Token's ``log(Q + 1e-10)``): a teacher
id that no student token maps to (a Qwen3 word whose Llama-3 pieces are all exact rows of
``W``) has ``Q_c(v) = 0``; floored, its share of KL(T || Q) is a constant of no gradient
instead of infinite."""
TINY_TAIL = 1e-30
"""The smallest tail mass a teacher row is taken to have (a top K that holds all of a row's
mass, in float32, leaves 0): keeps the estimates of ids outside the top K finite."""


class ProjectionColumns:
    """The columns of ``W`` a batch needs, as a torch sparse matrix ``[U, V_S]`` (``W``
    transposed, restricted to the teacher ids ``columns``, int64 ``[U]``), built on the
    host."""

    def __init__(self, projection: Projection, columns: np.ndarray) -> None:
        offsets, students, weights = projection.by_teacher
        lengths = offsets[columns + 1] - offsets[columns]
        start = np.repeat(offsets[columns], lengths)
        place = np.arange(int(lengths.sum())) - np.repeat(
            offsets_from_lengths(lengths)[:-1], lengths
        )
        self.columns = columns
        self.index = np.stack(
            [np.repeat(np.arange(len(columns)), lengths), students[start + place]]
        )
        self.values = weights[start + place]
        self.student_vocab = projection.meta.student_vocab_size

    @cached_property
    def entries(self) -> int:
        """Non-zero entries."""
        return len(self.values)

    def matrix(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        """The sparse ``[U, V_S]`` matrix on ``device`` in ``dtype``."""
        return torch.sparse_coo_tensor(
            to_device(self.index, device),
            to_device(self.values, device).to(dtype),
            (len(self.columns), self.student_vocab),
            is_coalesced=True,
            check_invariants=False,
        )


@dataclass(frozen=True)
class ChunkTeacher:
    """The teacher side of one teacher's counted chunks, over ``S_c`` (the union of the top-K
    ids of each chunk's teacher rows): ``cand`` int64 ``[C]`` the counted chunks' indices in
    the batch and their ``b``, ``s0``, ``s1``, ``t0``, ``t1`` (int64 ``[C]``); per event
    ``(c, v)``, chunk by chunk in ascending ``v``: ``event_chunk``, ``event_id`` (int64
    ``[E]``) and ``mean_log`` (float64 ``[E]``: ``1/|J_c| sum_j log p_j(v)``, an id outside
    row ``j``'s top K at the row's tail spread evenly); per chunk ``rest_mean`` (the same mean
    of each row's mass outside ``S_c``); ``status`` over every chunk of the batch, ``top1``
    and ``in_topk`` per counted chunk (the metrics of :class:`~crosskd.loss.events.Events`)."""

    cand: np.ndarray
    b: np.ndarray
    s0: np.ndarray
    s1: np.ndarray
    t0: np.ndarray
    t1: np.ndarray
    event_chunk: np.ndarray
    event_id: np.ndarray
    mean_log: np.ndarray
    rest_mean: np.ndarray
    status: np.ndarray
    top1: np.ndarray
    in_topk: np.ndarray

    def events(self, teacher_lp: np.ndarray, shape: np.ndarray, width: int) -> Events:
        """:class:`~crosskd.loss.events.Events` of these chunks with per-event ``teacher_lp``
        and one term per event and student row of its chunk (``term_row`` the flat row
        ``b * L_s + s - 1`` of a student batch ``width`` wide, ``term_id`` the event's index in
        ``columns``); chunk weights 1."""
        n_srows = self.s1 - self.s0
        term_lengths = n_srows[self.event_chunk]
        term_event = np.repeat(np.arange(len(self.event_chunk)), term_lengths)
        term_s = np.repeat(self.s0[self.event_chunk], term_lengths) + _places(term_lengths)
        term_row = np.repeat(self.b[self.event_chunk], term_lengths) * width + term_s - 1
        _, column_of = np.unique(self.event_id, return_inverse=True)
        return Events(
            event_chunk=self.event_chunk,
            teacher_lp=teacher_lp,
            term_event=term_event,
            term_row=term_row,
            term_id=column_of[term_event],
            weight=np.ones(len(self.cand)),
            chunk_index=self.cand,
            status=self.status,
            shape=shape[self.cand].astype(np.int64),
            top1=self.top1,
            in_topk=self.in_topk,
        )

    @property
    def columns(self) -> np.ndarray:
        """The teacher ids the events name, int64 ``[U]`` sorted."""
        return np.unique(self.event_id)


def chunk_teacher(
    teacher_ids: np.ndarray, signal: TeacherSignal, chunks: ChunkBatch, valid: np.ndarray
) -> ChunkTeacher:
    """The :class:`ChunkTeacher` of one teacher's chunks (``valid`` bool ``[C]``: the counted
    ones), numpy; ``teacher_ids`` ``[B, L_t]``, ``signal`` top-K (``k > 0``) for those rows."""
    if signal.ids is None:
        raise ValueError("chunk_teacher needs a top-K signal (k > 0), not a dense one")
    k, vocab = signal.k, signal.vocab_size
    row, student, teacher = (to_numpy(x) for x in (chunks.row, chunks.student, chunks.teacher))
    status = np.full(len(row), STATUS_INVALID, dtype=np.int8)
    cand = np.flatnonzero(np.asarray(valid, dtype=bool))
    status[cand] = STATUS_COUNTED
    b = row[cand].astype(np.int64)
    s0, s1 = student[cand, 0].astype(np.int64), student[cand, 1].astype(np.int64)
    t0, t1 = teacher[cand, 0].astype(np.int64), teacher[cand, 1].astype(np.int64)
    top_ids = signal.ids.cpu().numpy()
    top_lps = signal.log_probs.detach().cpu().double().numpy()

    # Every (chunk, teacher row) and its top-K entries.
    n_rows = t1 - t0
    row_chunk = np.repeat(np.arange(len(cand)), n_rows)
    row_q = np.repeat(t0 - 1, n_rows) + _places(n_rows)
    row_b = b[row_chunk]
    row_lps = top_lps[row_b, row_q]  # [R, K]
    tail = np.maximum(1.0 - np.exp(row_lps).sum(axis=1), TINY_TAIL)
    spread = np.log(tail) - np.log(max(vocab - k, 1))  # log p_j(v) for v outside row j's top K
    entry_chunk = np.repeat(row_chunk, k)
    entry_id = top_ids[row_b, row_q].reshape(-1).astype(np.int64)

    # The events: the distinct (chunk, id) pairs, chunk by chunk in ascending id.
    keys, entry_event = np.unique(entry_chunk * np.int64(vocab) + entry_id, return_inverse=True)
    event_chunk, event_id = keys // vocab, keys % vocab
    n_events = np.bincount(event_chunk, minlength=len(cand))

    # log p_j(v) for every event of a chunk and every teacher row of that chunk: the spread
    # estimate, overwritten where the row's top K has v.
    pair_lengths = n_rows[event_chunk]
    pair_start = offsets_from_lengths(pair_lengths)
    row_first = offsets_from_lengths(n_rows)
    pair_row = np.repeat(row_first[event_chunk], pair_lengths) + _places(pair_lengths)
    values = spread[pair_row]
    entry_row = np.repeat(np.arange(len(row_chunk)), k)
    values[pair_start[entry_event] + entry_row - row_first[entry_chunk]] = row_lps.reshape(-1)
    pair_event = np.repeat(np.arange(len(keys)), pair_lengths)
    mean_log = np.bincount(pair_event, values, len(keys)) / pair_lengths
    log_rest = np.log(tail) + np.log(np.maximum(vocab - n_events[row_chunk], 0) / max(vocab - k, 1))
    with np.errstate(divide="ignore"):
        rest_mean = np.bincount(row_chunk, log_rest, len(cand)) / np.maximum(n_rows, 1)
    return ChunkTeacher(
        cand,
        b,
        s0,
        s1,
        t0,
        t1,
        event_chunk,
        event_id,
        mean_log,
        rest_mean,
        status,
        top1_ids(top_ids, top_lps, b, t0 - 1) == teacher_ids[b, t0],
        in_top(top_ids, b, t1 - 2, teacher_ids[b, t1 - 1]),
    )


def xtoken_events(
    teacher_ids: np.ndarray,
    signal: TeacherSignal,
    chunks: ChunkBatch,
    valid: np.ndarray,
    width: int,
) -> tuple[Events, np.ndarray]:
    """The P-KL events of one teacher's chunks (module docstring), numpy.

    ``teacher_ids`` ``[B, L_t]``; ``signal``: top-K (``k > 0``) for those rows; ``valid`` bool
    ``[C]``: the candidate chunks; ``width``: the student batch's ``L_s``.
    Returns the :class:`~crosskd.loss.events.Events` (``teacher_lp``: ``log T_c(v)`` of each
    event ``(c, v)``, ``v`` in ``S_c``, REST left implied; one term per event and student row
    of its chunk: ``term_row`` the flat row ``b * L_s + s - 1``, ``term_id`` the index of ``v``
    in the returned columns; chunk weights 1) and the teacher ids the events name, int64
    ``[U]`` sorted.
    """
    side = chunk_teacher(teacher_ids, signal, chunks, valid)
    n = len(side.cand)
    both = np.concatenate([side.mean_log, side.rest_mean])
    owner = np.concatenate([side.event_chunk, np.arange(n)])
    peak = np.full(n, -np.inf)
    np.maximum.at(peak, owner, both)
    total = np.bincount(owner, np.exp(both - peak[owner]), n)
    log_z = peak + np.log(total)
    teacher_lp = side.mean_log - log_z[side.event_chunk]
    return side.events(teacher_lp, to_numpy(chunks.shape), width), side.columns


def _places(lengths: np.ndarray) -> np.ndarray:
    """``0 .. n - 1`` for each ``n`` of ``lengths``, concatenated (int64)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(
        offsets_from_lengths(lengths)[:-1], lengths
    )


def projected_event_log_probs(
    flat_logits: Tensor,
    events: Events,
    columns: ProjectionColumns,
    tau: float,
    block_rows: int = 1024,
) -> Tensor:
    """``log Q_c(v)`` of every event, from the micro-batch's flat student logits
    ``[B * L_s, V_S]`` (differentiable; float32 arithmetic, float64 kept): each needed row's
    softmax at ``tau`` times the needed columns of ``W``, in blocks of ``block_rows`` rows
    recomputed in the backward pass (:class:`_Projected`); ``[E]``. A projected probability below
    :data:`PROJECTED_FLOOR` is taken as that floor."""
    dtype = torch.float64 if flat_logits.dtype == torch.float64 else torch.float32
    device = flat_logits.device
    if len(events.term_row) == 0:
        return flat_logits.new_zeros(0, dtype=dtype)
    rows, slot = np.unique(events.term_row, return_inverse=True)
    matrix = columns.matrix(device, dtype)
    projected = _Projected.apply(
        flat_logits, to_device(rows, device), matrix, matrix.t().coalesce(), tau, dtype, block_rows
    )  # [rows, U]
    picked = projected[to_device(slot, device), to_device(events.term_id, device)]
    n_events = len(events.teacher_lp)
    term_event = to_device(events.term_event, device)
    total = segment_sum(picked, term_event, n_events)
    counts = segment_sum(torch.ones_like(picked), term_event, n_events)
    return torch.log((total / counts).clamp(min=PROJECTED_FLOOR))


class _Projected(torch.autograd.Function):
    """``softmax(logits[rows] / tau) @ W_U`` (``[R, U]``) as one autograd operation, a block of
    rows at a time: the forward pass keeps each row's log-normaliser only, the backward pass
    recomputes a block's probabilities and writes ``p * (g W_U^T - <p, g W_U^T>) / tau``
    straight into the logits' gradient. The sparse products take the dense side contiguous
    (about 30x faster on the CPU than a transposed view)."""

    @staticmethod
    def forward(ctx, logits, rows, matrix, matrix_t, tau, dtype, block):
        outs, normalizers = [], []
        for start in range(0, len(rows), block):
            x = logits[rows[start : start + block]].to(dtype) / tau
            normalizer = torch.logsumexp(x, dim=-1, keepdim=True)
            probs = (x - normalizer).exp_()
            outs.append(torch.sparse.mm(matrix, probs.T.contiguous()).T)
            normalizers.append(normalizer)
        ctx.save_for_backward(logits, rows, torch.cat(normalizers))
        ctx.matrix_t, ctx.tau, ctx.dtype, ctx.block = matrix_t, tau, dtype, block
        return torch.cat(outs)

    @staticmethod
    def backward(ctx, grad):
        logits, rows, normalizers = ctx.saved_tensors
        tau, dtype, block = ctx.tau, ctx.dtype, ctx.block
        out = torch.zeros_like(logits)
        for start in range(0, len(rows), block):
            here = rows[start : start + block]
            probs = (logits[here].to(dtype) / tau - normalizers[start : start + block]).exp_()
            g = grad[start : start + block].to(dtype)
            g_probs = torch.sparse.mm(ctx.matrix_t, g.T.contiguous()).T  # [R, V_S]
            inner = (probs * g_probs).sum(-1, keepdim=True)
            out.index_add_(0, here, (probs * (g_probs - inner) / tau).to(out.dtype))
        return out, None, None, None, None, None, None
