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
* a teacher id of ``S_c`` that no student token maps to has ``Q_c(v) = 0``, taken as ``1e-10``
  (:data:`~crosskd.loss.events.LOG_MIXTURE_FLOOR`; X-Token adds the same ``1e-10``): a constant
  of no gradient.

With a chunk of one teacher row and its top K covering the teacher's mass, this is X-Token's
P-KL on that chunk. A dense signal (``k: 0``) is refused: ``S_c`` would be the whole teacher
vocabulary.

**How it is computed.** ``Q_c(v)`` is a weighted sum of student probabilities
``p_i(s)``, one per student row of the chunk and student token of ``v``'s column of ``W``
(:func:`xtoken_events`), so the loss asks for those ``(row, s)`` log probabilities like CSD's
chain terms (:class:`~crosskd.loss.logprobs.StudentLogProbs`: one pass over the logits with CE
and every teacher) and takes each event's ``log sum exp(lp + log weight)``. It therefore runs
wherever CSD runs: the fused output layer, and the vocabulary-, sequence- and data-parallel
loss. The cost is the pairs: a column of ``W`` can be long (SmolLM2's ``.`` gathers about
6,000 Llama-3 tokens whose spelling starts with it), so a chunk whose teacher rows rank ``.``
in their top K asks for that many pairs per row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from crosskd.data.collate import ChunkBatch
from crosskd.loss.events import (
    STATUS_COUNTED,
    STATUS_INVALID,
    Events,
    in_top,
    to_numpy,
    top1_ids,
)
from crosskd.projection import Projection
from crosskd.ragged import offsets_from_lengths, positions
from crosskd.teacher.signal import TeacherSignal

TINY_TAIL = 1e-30
"""The smallest tail mass a teacher row is taken to have (a top K that holds all of a row's
mass, in float32, leaves 0): keeps the estimates of ids outside the top K finite."""


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
        ``b * L_s + s - 1`` of a student batch ``width`` wide, ``term_id`` the event's teacher
        id); chunk weights 1."""
        n_srows = self.s1 - self.s0
        term_lengths = n_srows[self.event_chunk]
        term_event = np.repeat(np.arange(len(self.event_chunk)), term_lengths)
        term_s = np.repeat(self.s0[self.event_chunk], term_lengths) + positions(term_lengths)
        term_row = np.repeat(self.b[self.event_chunk], term_lengths) * width + term_s - 1
        return Events(
            event_chunk=self.event_chunk,
            teacher_lp=teacher_lp,
            term_event=term_event,
            term_row=term_row,
            term_id=self.event_id[term_event],
            weight=np.ones(len(self.cand)),
            chunk_index=self.cand,
            status=self.status,
            shape=shape[self.cand].astype(np.int64),
            top1=self.top1,
            in_topk=self.in_topk,
        )


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
    row_q = np.repeat(t0 - 1, n_rows) + positions(n_rows)
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
    pair_row = np.repeat(row_first[event_chunk], pair_lengths) + positions(pair_lengths)
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
    projection: Projection,
) -> Events:
    """The P-KL events of one teacher's chunks (module docstring), numpy.

    ``teacher_ids`` ``[B, L_t]``; ``signal``: top-K (``k > 0``) for those rows; ``valid`` bool
    ``[C]``: the candidate chunks; ``width``: the student batch's ``L_s``; ``projection``: ``W``.
    Returns the :class:`~crosskd.loss.events.Events` of the events ``(c, v)``, ``v`` in
    ``S_c``: ``teacher_lp`` ``log T_c(v)`` (REST left implied) and, for ``log Q_c(v)``, one
    term per student row ``i`` of the chunk and student token ``s`` of ``v``'s column of ``W``:
    ``term_row`` the flat row ``b * L_s + i - 1``, ``term_id`` ``s`` and ``term_log_weight``
    ``log W[s, v] - log |I_c|``; chunk weights 1.
    """
    side = chunk_teacher(teacher_ids, signal, chunks, valid)
    n = len(side.cand)
    both = np.concatenate([side.mean_log, side.rest_mean])
    owner = np.concatenate([side.event_chunk, np.arange(n)])
    peak = np.full(n, -np.inf)
    np.maximum.at(peak, owner, both)
    total = np.bincount(owner, np.exp(both - peak[owner]), n)
    teacher_lp = side.mean_log - (peak + np.log(total))[side.event_chunk]
    events = side.events(teacher_lp, to_numpy(chunks.shape), width)
    # Each (event, row) term spread over the student tokens of the event's column of W.
    offsets, students, weights = projection.by_teacher
    v = side.event_id[events.term_event]
    lengths = offsets[v + 1] - offsets[v]
    entry = np.repeat(offsets[v], lengths) + positions(lengths)
    n_rows = (side.s1 - side.s0)[side.event_chunk[events.term_event]]
    return replace(
        events,
        term_event=np.repeat(events.term_event, lengths),
        term_row=np.repeat(events.term_row, lengths),
        term_id=students[entry],
        term_log_weight=np.log(weights[entry]) - np.log(np.repeat(n_rows, lengths)),
    )
