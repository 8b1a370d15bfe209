"""Events of a same-tokenizer teacher (spec section 5, "Same tokenizer"), in numpy.

A teacher whose tokenizer is the student's needs no chunks: every valid position compares the
teacher's top K (plus the realized token under ``keep_realized`` when the top K misses it) and
REST, with the same divergences and normalisation as CSD (``N`` = the step's valid positions,
every position weighing 1). Top-K ids the student cannot price (padding rows at or beyond
``V_S``) are left to REST.

**Positions** come from the student's tokens, not from an alignment: a position ``p`` of a
sample (the token it predicts, priced from row ``p - 1``) is valid when it has a prediction
(it is not the first token of its sample or conversation), lies inside the KD mask (plain text:
every token; chat: the tokens the student's CE loss mask covers, as data preparation marks
them: :mod:`crosskd.data.prepare`) and the teacher's id there equals the student's. The collator
gives such a teacher a :class:`~crosskd.data.collate.ChunkBatch` of positions (one entry per
student token, ``same_tokenizer`` true); :func:`token_positions` turns any other batch of
chunks (hand-made, or prepared data of format version 1, which stored the alignment of the
student with itself: a multi-byte character is then one ``n:n`` chunk) into those positions,
so that :func:`build_token_events` only ever sees one entry per position.

The events are the same flat :class:`~crosskd.loss.events.Events` the CSD term uses, one
student term per event, so the loss code is shared; the metrics report positions under the
shape ``token``. A dense signal (``K = 0``) gives ``V`` events per position: fine for small
vocabularies and tests, too large for real ones (use a top-K signal there).
"""

from __future__ import annotations

import numpy as np
import torch

from crosskd.data.collate import ChunkBatch
from crosskd.data.shards import FLAG_CORRECT, FLAG_KD, FLAG_PREDICTION
from crosskd.errors import ConfigError
from crosskd.loss.events import (
    STATUS_COUNTED,
    STATUS_INVALID,
    STATUS_UNSUPPORTED,
    Events,
    to_numpy,
)
from crosskd.teacher.signal import TeacherSignal

SHAPE_TOKEN = 5
"""The metrics' shape code of a same-tokenizer position."""


def token_positions(
    chunks: ChunkBatch, student_ids: np.ndarray, teacher_ids: np.ndarray
) -> ChunkBatch:
    """The positions of a same-tokenizer teacher's batch: one entry per token, with
    ``student == teacher == [p, p + 1)`` (``same_tokenizer`` true).

    Each chunk ``[s0, s1) x [t0, t1)`` with ranges of equal length gives the positions
    ``s0 + j <-> t0 + j``, each with the chunk's row, sample, shape, region and flags, except:
    ``FLAG_PREDICTION`` is on for every token after the chunk's first (only a sequence's first
    token has no prediction; in an alignment of the student with itself it starts a chunk) and
    off at a packed row's first token; ``FLAG_CORRECT`` is off where the two ids differ (that
    position is not compared). A batch of positions (the collator's) comes back with the same
    two rules applied. ``student_ids`` ``[B, L_s]``, ``teacher_ids`` ``[B, L_t]``.

    Raises:
        ConfigError: a valid chunk has ranges of different lengths (the teacher does not
            tokenize like the student, so it needs tables).
    """
    row, student, teacher = (
        to_numpy(x).astype(np.int64) for x in (chunks.row, chunks.student, chunks.teacher)
    )
    student, teacher = student.reshape(-1, 2), teacher.reshape(-1, 2)
    flags = to_numpy(chunks.flags).astype(np.uint8)
    valid = to_numpy(chunks.valid).astype(bool)
    n_s, n_t = student[:, 1] - student[:, 0], teacher[:, 1] - teacher[:, 0]
    bad = np.flatnonzero(valid & (n_s != n_t))
    if bad.size:
        c = int(bad[0])
        (s0, s1), (t0, t1), b = student[c], teacher[c], row[c]
        raise ConfigError(
            f"a same-tokenizer teacher (no tables) was given a chunk of student tokens "
            f"{student_ids[b, s0:s1].tolist()} vs teacher tokens "
            f"{teacher_ids[b, t0:t1].tolist()} (packed row {b}); the teacher does not tokenize "
            f"like the student. Build tables for it (teachers[*].student_to_teacher / "
            f"teacher_to_student)."
        )
    owner = np.repeat(np.arange(len(row)), n_s)
    step = np.arange(len(owner)) - np.repeat(np.cumsum(n_s) - n_s, n_s)
    p = student[owner, 0] + step
    q = teacher[owner, 0] + np.minimum(step, np.maximum(n_t[owner] - 1, 0))
    b = row[owner]
    out_flags = flags[owner] | np.where(step > 0, FLAG_PREDICTION, 0).astype(np.uint8)
    out_flags = np.where((p == 0) | (q == 0), out_flags & (0xFF ^ FLAG_PREDICTION), out_flags)
    agree = (n_s == n_t)[owner]
    if len(owner):
        agree &= student_ids[b, p] == teacher_ids[b, q]
    out_flags = np.where(agree, out_flags, out_flags & (0xFF ^ FLAG_CORRECT)).astype(np.uint8)
    need = FLAG_CORRECT | FLAG_PREDICTION | FLAG_KD
    ranges = np.stack([p, p + 1], axis=1)

    def taken(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.asarray(to_numpy(x))[owner])

    return ChunkBatch(
        torch.from_numpy(b),
        torch.from_numpy(ranges),
        torch.from_numpy(np.stack([q, q + 1], axis=1)),
        taken(chunks.shape),
        taken(chunks.region),
        torch.from_numpy((out_flags & need) == need),
        torch.from_numpy(out_flags),
        taken(chunks.sample),
        same_tokenizer=True,
    )


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
    positions (:func:`token_positions`; one token per entry); ``valid``: bool ``[C]``
    candidates (default ``chunks.valid``); ``student_vocab``: ``V_S``. A candidate whose two ids
    differ, or that has no row before it, is not counted.

    Raises:
        ConfigError: a candidate spans more than one token (pass :func:`token_positions`).
    """
    width = student_ids.shape[1]
    chunk_row, chunk_student, chunk_teacher = (
        to_numpy(x) for x in (chunks.row, chunks.student, chunks.teacher)
    )
    chunk_valid = to_numpy(chunks.valid if valid is None else valid).astype(bool)
    cand = np.flatnonzero(chunk_valid)
    b = np.asarray(chunk_row, dtype=np.int64)[cand]
    s0, s1 = (np.asarray(chunk_student, dtype=np.int64).reshape(-1, 2)[cand, i] for i in (0, 1))
    t0, t1 = (np.asarray(chunk_teacher, dtype=np.int64).reshape(-1, 2)[cand, i] for i in (0, 1))
    single = (s1 - s0 == 1) & (t1 - t0 == 1)
    if not single.all():
        c = int(np.flatnonzero(~single)[0])
        raise ConfigError(
            f"a same-tokenizer teacher (no tables) was given a chunk of student tokens "
            f"{student_ids[b[c], s0[c] : s1[c]].tolist()} vs teacher tokens "
            f"{teacher_ids[b[c], t0[c] : t1[c]].tolist()} (packed row {b[c]}) where one position "
            f"was expected; turn chunks into positions first (crosskd.loss.tokens."
            f"token_positions), or, if the teacher does not tokenize like the student, build "
            f"tables for it (teachers[*].student_to_teacher / teacher_to_student)."
        )
    keep_cand = (s0 > 0) & (t0 > 0)
    keep_cand[keep_cand] = (
        student_ids[b[keep_cand], s0[keep_cand]] == teacher_ids[b[keep_cand], t0[keep_cand]]
    )
    cand, b, s0, t0 = cand[keep_cand], b[keep_cand], s0[keep_cand], t0[keep_cand]
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
        local[owner],
        lps[keep],
        np.arange(n_events),
        b[owner] * width + s0[owner] - 1,
        ids[keep],
        np.ones(len(chunk_index)),
        chunk_index,
        status,
        np.full(len(chunk_index), SHAPE_TOKEN, dtype=np.uint8),
        top1[counted],
        in_topk[counted],
    )
