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

import numpy as np
import torch
from torch import Tensor

from crosskd.loss.divergence import divergence, with_rest
from crosskd.loss.events import CsdOptions, Events, build_events
from crosskd.loss.logprobs import LocalLogProbs, StudentLogProbs, segment_sum
from crosskd.tables import TablePair
from crosskd.teacher import TeacherSignal


def csd_kd(
    student_logits: Tensor,
    student_ids: Tensor,
    teacher_ids: Tensor,
    signal: TeacherSignal,
    chunks: object,
    pair: TablePair,
    *,
    tau: float,
    kind: str = "jsd",
    beta: float = 0.5,
    options: CsdOptions | None = None,
    n_total: int | None = None,
) -> tuple[Tensor, int]:
    """KD term and the number of counted chunks of a batch.

    ``student_logits`` ``[B, L_s, V_S]``; ``student_ids`` ``[B, L_s]``; ``teacher_ids``
    ``[B, L_t]``; ``signal`` for the teacher rows ``[B, L_t]``; ``chunks`` with ``row``,
    ``student``, ``teacher``, ``shape``, ``valid`` (a :class:`crosskd.data.collate.ChunkBatch`).
    """
    signal.require(
        tau=tau, vocab_size=pair.teacher_to_student.meta.src_vocab_size,
        where="passed to csd_kd (checked against the teacher V of the tables)",
    )  # fmt: skip
    events = build_events(
        student_ids.cpu().numpy(), teacher_ids.cpu().numpy(), signal,
        _np(chunks.row), _np(chunks.student), _np(chunks.teacher), _np(chunks.shape),
        _np(chunks.valid), pair, options or CsdOptions(),
    )  # fmt: skip
    logprobs = LocalLogProbs(student_logits.reshape(-1, student_logits.shape[-1]), tau=tau)
    return kd_from_events(
        events, logprobs, tau=tau, kind=kind, beta=beta, n_total=n_total,
        device=student_logits.device,
    )  # fmt: skip


def kd_from_events(
    events: Events,
    logprobs: StudentLogProbs,
    *,
    tau: float,
    kind: str = "jsd",
    beta: float = 0.5,
    n_total: int | None = None,
    device: torch.device | str = "cpu",
) -> tuple[Tensor, int]:
    """``tau^2 * sum_c w_c D_c / N`` over the events' chunks (``N = n_total`` or the chunks
    here); a zero that keeps the graph when nothing counts. Index tensors go to ``device``."""
    n = events.n_chunks if n_total is None else n_total

    def tensor(array: np.ndarray) -> Tensor:
        return torch.from_numpy(array).to(device)

    term_lp = logprobs.log_prob(tensor(events.term_row), tensor(events.term_id))
    if events.n_chunks == 0 or n == 0:
        return term_lp.sum() * 0.0, events.n_chunks
    dtype = term_lp.dtype
    n_events = len(events.teacher_lp)
    student = segment_sum(term_lp, tensor(events.term_event), n_events)
    teacher = tensor(events.teacher_lp).to(dtype)
    starts = np.searchsorted(events.event_chunk, np.arange(events.n_chunks))
    slots = np.arange(n_events) - starts[events.event_chunk]
    chunk, slot = tensor(events.event_chunk), tensor(slots)
    width = int(slots.max()) + 1
    mask = torch.zeros(events.n_chunks, width, dtype=torch.bool, device=term_lp.device)
    mask[chunk, slot] = True
    s_grid = student.new_zeros(events.n_chunks, width).index_put((chunk, slot), student)
    t_grid = teacher.new_zeros(events.n_chunks, width).index_put((chunk, slot), teacher)
    full_mask = torch.nn.functional.pad(mask, (0, 1), value=True)
    per_chunk = divergence(
        with_rest(s_grid, mask), with_rest(t_grid, mask), full_mask, kind=kind, beta=beta
    )
    weights = tensor(events.weight).to(per_chunk.dtype)
    return tau**2 * (weights * per_chunk).sum() / n, events.n_chunks


def _np(value: Tensor | np.ndarray) -> np.ndarray:
    return value.cpu().numpy() if isinstance(value, Tensor) else np.asarray(value)
