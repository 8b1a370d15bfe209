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

A chunk counts when it has at least 1 event (``1:1``, ``n:m``, special, realized-only) or at
least ``min_mismatch_support`` (``1:n``, ``n:1``; 1 with ``keep_realized``);
``drop_unrealized_topk`` also drops chunks (other than special pairs) whose last realized
teacher token is outside the top K. Every source token is in E at most once.

The result is flat index arrays: each event's teacher log probability, and the student
"terms" (flat student row, id) whose log probabilities sum to the event's student value, so the
loss is gathers and segment sums with no Python loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from crosskd.tables import TablePair
from crosskd.teacher import TeacherSignal

SHAPE_1_1, SHAPE_1_N, SHAPE_N_1, SHAPE_N_M, SHAPE_SPECIAL = range(5)
_MISMATCH = (SHAPE_1_N, SHAPE_N_1, SHAPE_N_M)


@dataclass(frozen=True)
class CsdOptions:
    """What counts as an event and how chunks are weighted (spec section 5).

    Top-K (``K > 0``) and dense (``K = 0``) signals are different objectives, and
    ``keep_realized`` changes the objective even when K covers the vocabulary.
    """

    keep_realized: bool = False
    min_mismatch_support: int = 2
    mismatch_weight: float = 5.0
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
    """

    event_chunk: np.ndarray
    teacher_lp: np.ndarray
    term_event: np.ndarray
    term_row: np.ndarray
    term_id: np.ndarray
    weight: np.ndarray
    chunk_index: np.ndarray

    @property
    def n_chunks(self) -> int:
        """Counted chunks (the N of this batch)."""
        return len(self.weight)


def build_events(
    student_ids: np.ndarray,
    teacher_ids: np.ndarray,
    signal: TeacherSignal,
    chunk_row: np.ndarray,
    chunk_student: np.ndarray,
    chunk_teacher: np.ndarray,
    chunk_shape: np.ndarray,
    chunk_valid: np.ndarray,
    pair: TablePair,
    options: CsdOptions,
) -> Events:
    """Events of every chunk of a batch (see the module docstring).

    ``student_ids`` ``[B, L_s]`` and ``teacher_ids`` ``[B, L_t]`` (int); chunks as in
    :class:`crosskd.data.collate.ChunkBatch` (``row`` ``[C]``, ranges ``[C, 2]``, ``shape``,
    ``valid``) as numpy arrays.
    """
    width = student_ids.shape[1]
    realized = signal.realized.detach().cpu().double().numpy()
    top_ids = None if signal.ids is None else signal.ids.cpu().numpy()
    top_lps = signal.log_probs.detach().cpu().double().numpy()
    common = np.full(signal.vocab_size, -1, dtype=np.int64)
    common[pair.common[:, 1]] = pair.common[:, 0]
    out = _Collector()
    for c in np.flatnonzero(chunk_valid).tolist():
        b = int(chunk_row[c])
        s0, s1 = (int(x) for x in chunk_student[c])
        t0, t1 = (int(x) for x in chunk_teacher[c])
        shape = int(chunk_shape[c])
        s_tok, t_tok = student_ids[b, s0:s1], teacher_ids[b, t0:t1]
        s_rows = b * width + np.arange(s0, s1) - 1
        t_real = realized[b, t0 - 1 : t1 - 1]

        def teacher_lp(q: int, ids: np.ndarray, b: int = b) -> np.ndarray:
            """Teacher log probs of ``ids`` at teacher row ``q``; NaN where not in the top K."""
            if top_ids is None:
                return top_lps[b, q, ids]
            at = np.searchsorted(top_ids[b, q], ids).clip(max=top_ids.shape[-1] - 1)
            found = top_ids[b, q, at] == ids
            return np.where(found, top_lps[b, q, at], np.nan)

        in_topk = not np.isnan(teacher_lp(t1 - 2, t_tok[-1:]))[0]
        if options.drop_unrealized_topk and shape != SHAPE_SPECIAL and not in_topk:
            continue
        events: list[tuple[float, np.ndarray, np.ndarray]] = []
        if shape == SHAPE_SPECIAL or in_topk or options.keep_realized:
            events.append((float(t_real.sum()), s_rows, s_tok))
        effective = shape
        if options.realized_only_mismatch and shape in (SHAPE_1_N, SHAPE_N_1):
            effective = SHAPE_N_M
        if effective == SHAPE_1_1:
            ids = np.arange(signal.vocab_size) if top_ids is None else top_ids[b, t0 - 1]
            students = common[ids]
            keep = (students >= 0) & (ids != t_tok[0]) & (students != s_tok[0])
            for i, lp in zip(students[keep], teacher_lp(t0 - 1, ids[keep]), strict=True):
                events.append((float(lp), s_rows[:1], np.array([i])))
        elif effective == SHAPE_1_N:
            for k in range(len(t_tok)):
                rows = pair.prefix_s2t.get(tuple(t_tok[:k].tolist()))
                if rows is None:
                    continue
                lps = teacher_lp(t0 - 1 + k, rows[:, 1])
                keep = ~np.isnan(lps) & (rows[:, 1] != t_tok[k]) & (rows[:, 0] != s_tok[0])
                for (i, _), lp in zip(rows[keep], lps[keep], strict=True):
                    events.append((float(t_real[:k].sum() + lp), s_rows[:1], np.array([i])))
        elif effective == SHAPE_N_1:
            for k in range(len(s_tok)):
                rows = pair.prefix_t2s.get(tuple(s_tok[:k].tolist()))
                if rows is None:
                    continue
                lps = teacher_lp(t0 - 1, rows[:, 0])
                keep = ~np.isnan(lps) & (rows[:, 0] != t_tok[0]) & (rows[:, 1] != s_tok[k])
                for (_, last), lp in zip(rows[keep], lps[keep], strict=True):
                    ids = np.append(s_tok[:k], last)
                    events.append((float(lp), s_rows[: k + 1], ids))
        need = 1
        if effective in (SHAPE_1_N, SHAPE_N_1) and not options.keep_realized:
            need = options.min_mismatch_support
        if len(events) >= need:
            weight = options.mismatch_weight if shape in _MISMATCH else 1.0
            out.add(c, weight, events)
    return out.result()


class _Collector:
    """Accumulates counted chunks and their events into flat arrays."""

    def __init__(self) -> None:
        self.chunks: list[int] = []
        self.weights: list[float] = []
        self.event_chunk: list[int] = []
        self.teacher_lp: list[float] = []
        self.terms: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def add(self, chunk: int, weight: float, events: list) -> None:
        index = len(self.chunks)
        self.chunks.append(chunk)
        self.weights.append(weight)
        for lp, rows, ids in events:
            event = len(self.teacher_lp)
            self.event_chunk.append(index)
            self.teacher_lp.append(lp)
            self.terms.append((np.full(len(rows), event), rows, ids))

    def result(self) -> Events:
        def cat(k: int) -> np.ndarray:
            parts = [t[k].astype(np.int64) for t in self.terms]
            return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

        return Events(
            np.asarray(self.event_chunk, dtype=np.int64),
            np.asarray(self.teacher_lp, dtype=np.float64),
            cat(0), cat(1), cat(2),
            np.asarray(self.weights, dtype=np.float64),
            np.asarray(self.chunks, dtype=np.int64),
        )  # fmt: skip
