"""Events of a same-tokenizer teacher (spec section 5, "Same tokenizer"), in numpy.

A teacher whose tokenizer is the student's needs no chunks: every valid position compares the
teacher's top K (plus the realized token under ``keep_realized`` when the top K misses it) and
REST, with the same divergences and normalisation as CSD (``N`` = the step's valid positions,
every position weighing 1). Top-K ids the student cannot price (padding rows at or beyond
``V_S``) are left to REST.

The positions come from the prepared chunks: the alignment of a tokenization with itself has a
single-token chunk per token, so "valid position" means exactly what "valid chunk" means for a
cross-tokenizer teacher (correct, has a prediction, inside the KD mask). The events are the same
flat :class:`~crosskd.loss.events.Events` the CSD term uses, one student term per event, so the
loss code is shared. A dense signal (``K = 0``) gives ``V`` events per position: fine for small
vocabularies and tests, too large for real ones (use a top-K signal there).
"""

from __future__ import annotations

import numpy as np

from crosskd.data.collate import ChunkBatch
from crosskd.errors import ConfigError
from crosskd.loss.events import (
    STATUS_COUNTED,
    STATUS_INVALID,
    STATUS_UNSUPPORTED,
    Events,
    to_numpy,
)
from crosskd.teacher import TeacherSignal

SHAPE_TOKEN = 5
"""The metrics' shape code of a same-tokenizer position."""


def build_token_events(
    student_ids: np.ndarray,
    teacher_ids: np.ndarray,
    signal: TeacherSignal,
    chunks: ChunkBatch,
    valid: np.ndarray | None = None,
    *,
    student_vocab: int,
    keep_realized: bool,
) -> Events:
    """Events of every valid position of a batch for a same-tokenizer teacher.

    ``student_ids`` ``[B, L_s]``, ``teacher_ids`` ``[B, L_t]``; ``chunks``: the teacher's
    :class:`~crosskd.data.collate.ChunkBatch`; ``valid``: bool ``[C]`` candidates (default
    ``chunks.valid``); ``student_vocab``: ``V_S``.

    Raises:
        ConfigError: a valid chunk spans more than one token or the two ids differ (the teacher
            does not tokenize like the student, so it needs tables).
    """
    width = student_ids.shape[1]
    chunk_row, chunk_student, chunk_teacher = (
        to_numpy(x) for x in (chunks.row, chunks.student, chunks.teacher)
    )
    chunk_valid = to_numpy(chunks.valid if valid is None else valid).astype(bool)
    cand = np.flatnonzero(chunk_valid)
    b = np.asarray(chunk_row, dtype=np.int64)[cand]
    s0, s1 = (np.asarray(chunk_student, dtype=np.int64)[cand, i] for i in (0, 1))
    t0, t1 = (np.asarray(chunk_teacher, dtype=np.int64)[cand, i] for i in (0, 1))
    single = (s1 - s0 == 1) & (t1 - t0 == 1)
    same = single & (student_ids[b, s0] == teacher_ids[b, t0])
    if not same.all():
        c = int(np.flatnonzero(~same)[0])
        raise ConfigError(
            f"a same-tokenizer teacher (no tables) was given a chunk of student tokens "
            f"{student_ids[b[c], s0[c]:s1[c]].tolist()} vs teacher tokens "
            f"{teacher_ids[b[c], t0[c]:t1[c]].tolist()} (packed row {b[c]}); the teacher does "
            f"not tokenize like the student. Build tables for it (teachers[*].student_to_teacher"
            f" / teacher_to_student)."
        )
    q = t0 - 1
    realized_id = teacher_ids[b, t0]
    if signal.ids is None:
        ids = np.broadcast_to(np.arange(signal.vocab_size), (len(cand), signal.vocab_size))
    else:
        ids = signal.ids.cpu().numpy()[b, q]
    lps = signal.log_probs.detach().cpu().double().numpy()[b, q]
    hit = ids == realized_id[:, None]
    in_topk = hit.any(axis=1)
    top1 = ids[np.arange(len(cand)), lps.argmax(axis=1)] == realized_id
    keep = ids < student_vocab
    extra = np.zeros((len(cand), 1), dtype=bool)
    if keep_realized:
        extra[:, 0] = ~in_topk
    realized = signal.realized.detach().cpu().double().numpy()[b, q]
    ids = np.concatenate([ids, realized_id[:, None]], axis=1)
    lps = np.concatenate([lps, realized[:, None]], axis=1)
    keep = np.concatenate([keep, extra], axis=1)
    counted = keep.any(axis=1)
    keep &= counted[:, None]
    owner, _ = np.nonzero(keep)
    status = np.full(len(chunk_valid), STATUS_INVALID, dtype=np.int8)
    status[cand] = np.where(counted, STATUS_COUNTED, STATUS_UNSUPPORTED)
    chunk_index = cand[counted]
    local = np.cumsum(counted) - 1
    n_events = len(owner)
    return Events(
        local[owner], lps[keep], np.arange(n_events), b[owner] * width + s0[owner] - 1,
        ids[keep], np.ones(len(chunk_index)), chunk_index, status,
        np.full(len(chunk_index), SHAPE_TOKEN, dtype=np.uint8), top1[counted], in_topk[counted],
    )  # fmt: skip
