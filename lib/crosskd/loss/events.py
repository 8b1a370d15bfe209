"""Building the events of every chunk of a batch (spec section 5), once per batch, in numpy.

For each candidate chunk (correct, has a prediction, in the KD mask) the events E are:

* the **realized event** (the chunk's realized text: student terms = its tokens at the rows
  before them, teacher value = the sum of the stored realized log probs), in E when the
  teacher's last realized token is in its row's top K (always when dense) or ``keep_realized``;
* ``1:1``: common tokens ``(i, j)``, ``i != s``, ``j != t``, ``j`` in the teacher's top K;
* ``1:n``: student tokens ``i != s`` whose S->T chain is ``[t_1..t_{k-1}, c]``, ``c`` in the top
  K at the k-th teacher row and ``c != t_k`` (teacher value: realized prefix + ``lp_T(c)``);
* ``n:1``: teacher tokens ``j != t`` in the top K whose T->S chain is ``[s_1..s_{k-1}, c]``,
  ``c != s_k`` (student terms: the realized prefix and ``c`` at the k-th student row);
* ``n:m`` and special pairs: the realized event only (``realized_only_mismatch`` treats ``1:n``
  and ``n:1`` the same way).

The ``1:n`` / ``n:1`` alternatives come from the table pair's prefix indexes, which hold one id
per whole chain, the lowest (spec: when two ids of one vocabulary share their bytes, the
chain-to-id lookups use the lowest id): each path that leaves the realized one is at most one
event, a higher duplicate's mass stays in REST, and an ``n:1`` path whose lowest teacher id is
outside the top K has no event even when a higher duplicate is inside it.

A chunk counts when it has at least 1 event (``1:1``, ``n:m``, special, realized-only) or at
least ``min_mismatch_support`` (``1:n``, ``n:1``; 1 with ``keep_realized``);
``drop_unrealized_topk`` also drops chunks (other than special pairs) whose last realized
teacher token is outside the top K. A chunk that is both short of events and unrealized is
reported as unsupported (the first reason in the spec's order). Every source token is in E at
most once.

The realized events and the ``1:1`` alternatives (most of a batch) are built with whole-array
operations; ``1:n`` / ``n:1`` chunks walk their chains one chunk at a time. The result is flat
index arrays: each event's teacher log probability, and the student "terms" (flat student row,
id) whose log probabilities sum to the event's student value, so the loss is gathers and
segment sums with no Python loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from crosskd.data.collate import ChunkBatch
from crosskd.ragged import offsets_from_lengths
from crosskd.tables import TablePair
from crosskd.teacher.signal import TeacherSignal

SHAPE_1_1, SHAPE_1_N, SHAPE_N_1, SHAPE_N_M, SHAPE_SPECIAL = range(5)
SHAPE_NAMES = ("1:1", "1:n", "n:1", "n:m", "special")
_MISMATCH = (SHAPE_1_N, SHAPE_N_1, SHAPE_N_M)
STATUS_COUNTED, STATUS_INVALID, STATUS_UNSUPPORTED, STATUS_DROPPED = range(4)
LOG_MIXTURE_FLOOR = math.log(1e-10)
"""The least log probability a mixture event is given (X-Token's ``log(Q + 1e-10)``): a teacher
id that no student token maps to has an empty mixture; floored, its share of the divergence is
a constant of no gradient instead of infinite."""


@dataclass(frozen=True)
class CsdOptions:
    """What counts as an event and how chunks are weighted (spec section 5).

    Top-K (``K > 0``) and dense (``K = 0``) signals are different objectives, and
    ``keep_realized`` changes the objective even when K covers the vocabulary.
    """

    keep_realized: bool = False
    min_mismatch_support: int = 2
    mismatch_weight: float = 1.0
    realized_only_mismatch: bool = False
    drop_unrealized_topk: bool = False


@dataclass(frozen=True)
class Events:
    """Events of the counted chunks of a batch, flat.

    ``event_chunk`` int64 ``[E]`` (counted chunk of each event, events of a chunk contiguous),
    ``teacher_lp`` float64 ``[E]``, ``term_event`` / ``term_row`` / ``term_id`` int64 ``[M]``
    (student log prob of ``term_id`` at flat row ``term_row`` = ``b * L_s + position - 1``,
    summed into event ``term_event``), ``weight`` float64 ``[C]`` and ``chunk_index`` int64
    ``[C]`` (index of each counted chunk in the batch's chunk list).

    For the metrics: ``status`` int8 over **all** chunks of the batch (``STATUS_COUNTED``,
    ``STATUS_INVALID`` = not a candidate, ``STATUS_UNSUPPORTED``, ``STATUS_DROPPED``), and per
    counted chunk its ``shape``, ``top1`` (the teacher's most likely token at the chunk's first
    teacher row is the realized one) and ``in_topk`` (its last realized teacher token is in the
    top K at its row). Default-constructed metric arrays are empty.
    """

    event_chunk: np.ndarray
    teacher_lp: np.ndarray
    term_event: np.ndarray
    term_row: np.ndarray
    term_id: np.ndarray
    weight: np.ndarray
    chunk_index: np.ndarray
    status: np.ndarray | None = None
    shape: np.ndarray | None = None
    top1: np.ndarray | None = None
    in_topk: np.ndarray | None = None
    term_log_weight: np.ndarray | None = None
    """None: an event's student log probability is the **sum** of its terms' (a chain of tokens).
    Set (float64 ``[M]``): it is the log of the **weighted sum** of its terms' probabilities,
    ``log sum_m exp(lp_m + term_log_weight_m)`` (X-Token's projected mixtures,
    :mod:`crosskd.loss.xtoken`), floored at :data:`LOG_MIXTURE_FLOOR`."""

    @property
    def n_chunks(self) -> int:
        """Counted chunks (the N of this batch)."""
        return len(self.weight)

    def subset(self, keep: np.ndarray) -> tuple[Events, np.ndarray]:
        """The events of the chunks marked in ``keep`` (bool over **all** chunks of the batch),
        renumbered as if the batch held only those chunks, and the indices (int64) of the kept
        terms in this object's term arrays."""
        keep_chunk = keep[self.chunk_index]
        keep_event = keep_chunk[self.event_chunk]
        keep_term = keep_event[self.term_event]
        chunk_new = np.cumsum(keep_chunk) - 1
        event_new = np.cumsum(keep_event) - 1
        position = np.cumsum(keep) - 1
        kept = Events(
            chunk_new[self.event_chunk[keep_event]],
            self.teacher_lp[keep_event],
            event_new[self.term_event[keep_term]],
            self.term_row[keep_term],
            self.term_id[keep_term],
            self.weight[keep_chunk],
            position[self.chunk_index[keep_chunk]],
            None if self.status is None else self.status[keep],
            None if self.shape is None else self.shape[keep_chunk],
            None if self.top1 is None else self.top1[keep_chunk],
            None if self.in_topk is None else self.in_topk[keep_chunk],
            None if self.term_log_weight is None else self.term_log_weight[keep_term],
        )
        return kept, np.flatnonzero(keep_term)


@dataclass
class _Flat:
    """Events under construction, keyed by batch chunk index: per event its chunk and teacher
    log prob, per term its event (index into this list of events), row and id."""

    chunk: list[np.ndarray]
    teacher_lp: list[np.ndarray]
    term_event: list[np.ndarray]
    term_row: list[np.ndarray]
    term_id: list[np.ndarray]
    count: int = 0

    def add(self, chunk, teacher_lp, term_event, term_row, term_id) -> None:
        """Add events (``term_event`` local to this call: 0 = its first event)."""
        self.chunk.append(np.asarray(chunk, dtype=np.int64))
        self.teacher_lp.append(np.asarray(teacher_lp, dtype=np.float64))
        self.term_event.append(np.asarray(term_event, dtype=np.int64) + self.count)
        self.term_row.append(np.asarray(term_row, dtype=np.int64))
        self.term_id.append(np.asarray(term_id, dtype=np.int64))
        self.count += len(self.chunk[-1])

    def arrays(self) -> tuple[np.ndarray, ...]:
        def cat(parts: list[np.ndarray], dtype) -> np.ndarray:
            return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

        return (
            cat(self.chunk, np.int64),
            cat(self.teacher_lp, np.float64),
            cat(self.term_event, np.int64),
            cat(self.term_row, np.int64),
            cat(self.term_id, np.int64),
        )


def build_events(
    student_ids: np.ndarray,
    teacher_ids: np.ndarray,
    signal: TeacherSignal,
    chunks: ChunkBatch,
    pair: TablePair,
    options: CsdOptions,
    valid: np.ndarray | None = None,
) -> Events:
    """Events of every chunk of a batch (see the module docstring).

    ``student_ids`` ``[B, L_s]`` and ``teacher_ids`` ``[B, L_t]`` (int); ``chunks``: the
    teacher's :class:`~crosskd.data.collate.ChunkBatch` (tensors or numpy arrays); ``valid``:
    bool ``[C]`` candidates (default ``chunks.valid``).
    """
    width = student_ids.shape[1]
    chunk_row, chunk_student, chunk_teacher, chunk_shape = (
        to_numpy(x) for x in (chunks.row, chunks.student, chunks.teacher, chunks.shape)
    )
    chunk_valid = to_numpy(chunks.valid if valid is None else valid).astype(bool)
    realized = signal.realized.detach().cpu().double().numpy()
    top_ids = None if signal.ids is None else signal.ids.cpu().numpy()
    top_lps = signal.log_probs.detach().cpu().double().numpy()
    shape_all = np.asarray(chunk_shape, dtype=np.int64)
    status = np.full(len(shape_all), STATUS_INVALID, dtype=np.int8)
    cand = np.flatnonzero(chunk_valid)
    b = np.asarray(chunk_row, dtype=np.int64)[cand]
    s0, s1 = (np.asarray(chunk_student, dtype=np.int64)[cand, i] for i in (0, 1))
    t0, t1 = (np.asarray(chunk_teacher, dtype=np.int64)[cand, i] for i in (0, 1))
    shape = shape_all[cand]
    effective = shape.copy()
    if options.realized_only_mismatch:
        effective[(shape == SHAPE_1_N) | (shape == SHAPE_N_1)] = SHAPE_N_M

    t_last = teacher_ids[b, t1 - 1]
    in_topk = in_top(top_ids, b, t1 - 2, t_last)
    top1 = top1_ids(top_ids, top_lps, b, t0 - 1) == teacher_ids[b, t0]
    flat = _Flat([], [], [], [], [])

    # The realized events, all at once: student terms are the chunk's tokens at the rows before
    # them; the teacher value is the sum of the stored realized log probs.
    has_real = (shape == SHAPE_SPECIAL) | in_topk | options.keep_realized
    real = np.flatnonzero(has_real)
    csum = np.concatenate([np.zeros((len(realized), 1)), np.cumsum(realized, axis=1)], axis=1)
    n_terms = s1[real] - s0[real]
    offsets = offsets_from_lengths(n_terms)
    term_pos = np.arange(offsets[-1]) - np.repeat(offsets[:-1] - s0[real], n_terms)
    term_b = np.repeat(b[real], n_terms)
    flat.add(
        cand[real],
        csum[b[real], t1[real] - 1] - csum[b[real], t0[real] - 1],
        np.repeat(np.arange(len(real)), n_terms),
        term_b * width + term_pos - 1,
        student_ids[term_b, term_pos],
    )

    # 1:1 alternatives, all at once: common tokens (i, j) with j in the teacher's top K.
    one = np.flatnonzero(effective == SHAPE_1_1)
    if len(one):
        q = t0[one] - 1
        if top_ids is None:
            ids = np.broadcast_to(pair.common[:, 1], (len(one), len(pair.common)))
            students = np.broadcast_to(pair.common[:, 0], ids.shape)
            lps = top_lps[b[one][:, None], q[:, None], ids]
        else:
            common = np.full(signal.vocab_size, -1, dtype=np.int64)
            common[pair.common[:, 1]] = pair.common[:, 0]
            ids = top_ids[b[one], q]
            students = common[ids]
            lps = top_lps[b[one], q]
        keep = (
            (students >= 0)
            & (ids != teacher_ids[b[one], t0[one]][:, None])
            & (students != student_ids[b[one], s0[one]][:, None])
        )
        owner, _ = np.nonzero(keep)
        flat.add(
            cand[one[owner]],
            lps[keep],
            np.arange(len(owner)),
            b[one[owner]] * width + s0[one[owner]] - 1,
            students[keep],
        )

    for c in np.flatnonzero((effective == SHAPE_1_N) | (effective == SHAPE_N_1)).tolist():
        _mismatch_events(
            flat,
            int(cand[c]),
            int(effective[c]),
            int(b[c]),
            int(s0[c]),
            int(s1[c]),
            int(t0[c]),
            int(t1[c]),
            student_ids,
            teacher_ids,
            realized,
            top_ids,
            top_lps,
            pair,
            width,
        )

    event_chunk, teacher_lp, term_event, term_row, term_id = flat.arrays()
    n_events = np.bincount(np.searchsorted(cand, event_chunk), minlength=len(cand))
    need = np.ones(len(cand), dtype=np.int64)
    if not options.keep_realized:
        need[(effective == SHAPE_1_N) | (effective == SHAPE_N_1)] = options.min_mismatch_support
    unsupported = n_events < need
    dropped = ~unsupported & options.drop_unrealized_topk & (shape != SHAPE_SPECIAL) & ~in_topk
    counted = ~unsupported & ~dropped
    status[cand] = np.select(
        [unsupported, dropped], [STATUS_UNSUPPORTED, STATUS_DROPPED], STATUS_COUNTED
    )

    # Keep the events of counted chunks, grouped by chunk (stable, so order within a chunk is
    # the order of construction), and renumber the terms' events.
    chunk_index = cand[counted]
    keep = np.flatnonzero(status[event_chunk] == STATUS_COUNTED)
    order = keep[np.argsort(event_chunk[keep], kind="stable")]
    new_event = np.full(len(event_chunk), -1, dtype=np.int64)
    new_event[order] = np.arange(len(order))
    term_event = new_event[term_event]
    term_keep = term_event >= 0
    weight = np.where(np.isin(shape[counted], _MISMATCH), options.mismatch_weight, 1.0)
    return Events(
        np.searchsorted(chunk_index, event_chunk[order]),
        teacher_lp[order],
        term_event[term_keep],
        term_row[term_keep],
        term_id[term_keep],
        weight.astype(np.float64),
        chunk_index,
        status,
        shape[counted].astype(np.uint8),
        top1[counted],
        in_topk[counted],
    )


def to_numpy(value: Tensor | np.ndarray) -> np.ndarray:
    """A tensor (on any device) or array as a numpy array."""
    return value.cpu().numpy() if isinstance(value, Tensor) else np.asarray(value)


def in_top(top_ids: np.ndarray | None, b: np.ndarray, q: np.ndarray, ids: np.ndarray):
    """Whether ``ids[c]`` is in the top K at teacher row ``(b[c], q[c])``; bool ``[C]``."""
    if top_ids is None:
        return np.ones(len(ids), dtype=bool)
    return (top_ids[b, q] == ids[:, None]).any(axis=1)


def top1_ids(top_ids: np.ndarray | None, top_lps: np.ndarray, b: np.ndarray, q: np.ndarray):
    """The teacher's most likely id at rows ``(b[c], q[c])`` (lowest id on ties); ``[C]``."""
    best = top_lps[b, q].argmax(axis=1)
    return best if top_ids is None else top_ids[b, q, best]


def _mismatch_events(
    flat: _Flat,
    chunk: int,
    shape: int,
    b: int,
    s0: int,
    s1: int,
    t0: int,
    t1: int,
    student_ids: np.ndarray,
    teacher_ids: np.ndarray,
    realized: np.ndarray,
    top_ids: np.ndarray | None,
    top_lps: np.ndarray,
    pair: TablePair,
    width: int,
) -> None:
    """The prefix alternatives of one ``1:n`` or ``n:1`` chunk."""
    s_tok, t_tok = student_ids[b, s0:s1], teacher_ids[b, t0:t1]

    def teacher_lp(q: int, ids: np.ndarray) -> np.ndarray:
        """Teacher log probs of ``ids`` at teacher row ``q``; NaN where not in the top K."""
        if top_ids is None:
            return top_lps[b, q, ids]
        at = np.searchsorted(top_ids[b, q], ids).clip(max=top_ids.shape[-1] - 1)
        found = top_ids[b, q, at] == ids
        return np.where(found, top_lps[b, q, at], np.nan)

    if shape == SHAPE_1_N:
        t_real = realized[b, t0 - 1 : t1 - 1]
        for k in range(len(t_tok)):
            rows = pair.prefix_s2t.get(tuple(t_tok[:k].tolist()))
            if rows is None:
                continue
            lps = teacher_lp(t0 - 1 + k, rows[:, 1])
            keep = ~np.isnan(lps) & (rows[:, 1] != t_tok[k]) & (rows[:, 0] != s_tok[0])
            n = int(keep.sum())
            flat.add(
                np.full(n, chunk),
                t_real[:k].sum() + lps[keep],
                np.arange(n),
                np.full(n, b * width + s0 - 1),
                rows[keep, 0],
            )
        return
    for k in range(len(s_tok)):
        rows = pair.prefix_t2s.get(tuple(s_tok[:k].tolist()))
        if rows is None:
            continue
        lps = teacher_lp(t0 - 1, rows[:, 0])
        keep = ~np.isnan(lps) & (rows[:, 0] != t_tok[0]) & (rows[:, 1] != s_tok[k])
        n = int(keep.sum())
        # Student terms per event: s_1..s_k-1 at their rows, then the event's last id.
        ids = np.concatenate([np.tile(s_tok[:k], (n, 1)), rows[keep, 1:2]], axis=1)
        flat.add(
            np.full(n, chunk),
            lps[keep],
            np.repeat(np.arange(n), k + 1),
            np.tile(b * width + np.arange(s0, s0 + k + 1) - 1, n),
            ids.reshape(-1),
        )
