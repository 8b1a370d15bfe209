"""The CSD knowledge-distillation term for one teacher (spec section 5), single process.

Events come from :func:`crosskd.loss.events.build_events` (numpy, once per batch); the loss
itself is gathers and segment sums in torch: each event's student log probability is the sum
of its terms' log probabilities (:class:`~crosskd.loss.logprobs.StudentLogProbs`, so the
sharded versions slot in), events are laid out as ``[C, E_max]`` per chunk, REST is added on
both sides, and ``KD = tau^2 * sum_c w_c D_c / N`` with ``N`` the number of counted chunks
(pass the step's global ``N`` as ``n_total`` when summing over micro-batches or ranks).
All arithmetic is float32 (float64 for float64 logits, for gradcheck).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from crosskd.data.collate import ChunkBatch
from crosskd.loss.divergence import divergence, with_rest
from crosskd.loss.events import LOG_MIXTURE_FLOOR, CsdOptions, Events, build_events, to_numpy
from crosskd.loss.logprobs import LocalLogProbs, StudentLogProbs, segment_logsumexp, segment_sum
from crosskd.tables import TablePair
from crosskd.teacher.signal import TeacherSignal
from crosskd.transfer import to_device


@dataclass(frozen=True)
class KdTerm:
    """A KD term and what the metrics need of it.

    ``value``: the differentiable scalar ``tau^2 * sum_c w_c D_c / N``; ``n_chunks``: chunks
    (or positions) counted here; per counted chunk, detached float ``[C]``: ``divergence`` (D,
    before weight and tau^2), ``log_rest_student`` / ``log_rest_teacher`` (log REST mass) and
    ``n_events`` (``|E|``, int64).
    """

    value: Tensor
    n_chunks: int
    divergence: Tensor
    log_rest_student: Tensor
    log_rest_teacher: Tensor
    n_events: Tensor


def kd_from_grids(
    student: Tensor,
    teacher: Tensor,
    mask: Tensor,
    weight: Tensor,
    *,
    tau: float,
    kind: str,
    beta: float,
    n: int,
) -> KdTerm:
    """KD of chunks laid out as grids: event log probs ``student`` (differentiable) and
    ``teacher`` ``[C, E]`` with ``mask`` bool ``[C, E]`` marking real events, chunk weights
    ``weight`` ``[C]``; ``N = n``."""
    full_mask = torch.nn.functional.pad(mask, (0, 1), value=True)
    log_s, log_t = with_rest(student, mask), with_rest(teacher, mask)
    per_chunk = divergence(log_s, log_t, full_mask, kind=kind, beta=beta)
    value = tau**2 * (weight.to(per_chunk.dtype) * per_chunk).sum() / max(n, 1)
    return KdTerm(
        value,
        int(mask.shape[0]),
        per_chunk.detach(),
        log_s[:, -1].detach(),
        log_t[:, -1].detach(),
        mask.sum(-1),
    )


def csd_kd(
    student_logits: Tensor,
    student_ids: Tensor,
    teacher_ids: Tensor,
    signal: TeacherSignal,
    chunks: ChunkBatch,
    pair: TablePair,
    *,
    tau: float,
    kind: str = "jsd",
    beta: float = 0.5,
    options: CsdOptions | None = None,
    n_total: int | None = None,
) -> KdTerm:
    """The KD term of a batch.

    ``student_logits`` ``[B, L_s, V_S]``; ``student_ids`` ``[B, L_s]``; ``teacher_ids``
    ``[B, L_t]``; ``signal`` for the teacher rows ``[B, L_t]``; ``chunks`` with ``row``,
    ``student``, ``teacher``, ``shape``, ``valid`` (a :class:`crosskd.data.collate.ChunkBatch`).
    """
    signal.require(
        tau=tau,
        vocab_size=pair.teacher_to_student.meta.src_vocab_size,
        where="passed to csd_kd (checked against the teacher V of the tables)",
    )
    events = build_events(
        to_numpy(student_ids),
        to_numpy(teacher_ids),
        signal,
        chunks,
        pair,
        options or CsdOptions(),
    )
    logprobs = LocalLogProbs(student_logits.reshape(-1, student_logits.shape[-1]), tau=tau)
    return kd_from_events(events, logprobs, tau=tau, kind=kind, beta=beta, n_total=n_total)


def kd_from_events(
    events: Events,
    logprobs: StudentLogProbs,
    *,
    tau: float,
    kind: str = "jsd",
    beta: float = 0.5,
    n_total: int | None = None,
) -> KdTerm:
    """``tau^2 * sum_c w_c D_c / N`` over the events' chunks (``N = n_total`` or the chunks
    here), on the device of the logits behind ``logprobs``; a zero that keeps the graph when
    nothing counts."""
    term_lp = logprobs.log_prob(events.term_row, events.term_id)
    return kd_from_terms(events, term_lp, tau=tau, kind=kind, beta=beta, n_total=n_total)


def kd_from_terms(
    events: Events,
    term_lp: Tensor,
    *,
    tau: float,
    kind: str = "jsd",
    beta: float = 0.5,
    n_total: int | None = None,
) -> KdTerm:
    """:func:`kd_from_events` from the student log probabilities of the events' terms
    (``term_lp`` float ``[M]``, differentiable, at ``tau``), for callers that gather the terms
    of several KD terms (and CE) in one pass over the logits. An event's value is the sum of
    its terms' log probabilities, or with ``events.term_log_weight`` the log of their weighted
    sum of probabilities."""
    n_events = len(events.teacher_lp)
    segments = to_device(events.term_event, term_lp.device)
    if events.term_log_weight is None:
        student = segment_sum(term_lp, segments, n_events)
    else:
        weighted = term_lp + to_device(events.term_log_weight, term_lp.device).to(term_lp.dtype)
        student = segment_logsumexp(weighted, segments, n_events).clamp(min=LOG_MIXTURE_FLOOR)
    return kd_from_event_values(events, student, tau=tau, kind=kind, beta=beta, n_total=n_total)


def kd_from_event_values(
    events: Events,
    student: Tensor,
    *,
    tau: float,
    kind: str = "jsd",
    beta: float = 0.5,
    n_total: int | None = None,
) -> KdTerm:
    """:func:`kd_from_terms` from the student log probability of each event (``student`` float
    ``[E]``, differentiable, at ``tau``), for terms whose event values are not sums of token
    log probabilities (X-Token's projected mixtures, :mod:`crosskd.loss.xtoken`)."""
    n = events.n_chunks if n_total is None else n_total
    device = student.device

    def tensor(array: np.ndarray) -> Tensor:
        return to_device(array, device)

    if events.n_chunks == 0 or n == 0:
        empty = student.new_zeros(0).detach()
        return KdTerm(
            student.sum() * 0.0,
            events.n_chunks,
            empty,
            empty,
            empty,
            torch.zeros(0, dtype=torch.int64, device=device),
        )
    dtype = student.dtype
    n_events = len(events.teacher_lp)
    teacher = tensor(events.teacher_lp).to(dtype)
    starts = np.searchsorted(events.event_chunk, np.arange(events.n_chunks))
    slots = np.arange(n_events) - starts[events.event_chunk]
    chunk, slot = tensor(events.event_chunk), tensor(slots)
    width = int(slots.max()) + 1
    mask = torch.zeros(events.n_chunks, width, dtype=torch.bool, device=device)
    mask[chunk, slot] = True
    s_grid = student.new_zeros(events.n_chunks, width).index_put((chunk, slot), student)
    t_grid = teacher.new_zeros(events.n_chunks, width).index_put((chunk, slot), teacher)
    return kd_from_grids(
        s_grid, t_grid, mask, tensor(events.weight), tau=tau, kind=kind, beta=beta, n=n
    )
