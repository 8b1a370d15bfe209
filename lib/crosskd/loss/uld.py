"""Universal Logit Distillation (ULD; Boizard et al. 2024), the usual cross-tokenizer baseline:
``loss.kd: uld``.

Per pair of positions, each model's next-token probability vector at temperature ``tau`` is
sorted in decreasing order, the shorter one padded with zeros, and the two compared by their
L1 distance (the closed form of the Wasserstein-1 distance between the two sorted vectors that
the paper uses): ``ULD_pair = sum_i |sort(p_S)_i - sort(p_T)_i|``. A teacher's term is the sum
over its pairs divided by its number of pairs in the whole optimizer step (counted before the
forward pass and all-reduced, like CSD's ``N``); ``KD = sum_t weight_t ULD_t``, and the total is
``ce_weight * CE + kd_scale * KD`` as for CSD (the paper's ``lambda`` is ``kd_weight``; it
used 1.5). There is no ``tau^2`` factor.

**Pairing (the paper's).** Positions are paired by index, per sample: the ``i``-th position the
student predicts inside the KD region with the ``i``-th the teacher predicts, both in text
order; the longer side's tail is dropped (the original code truncates each sample to
``min(student_size, teacher_size)``; TRL's ``use_extended_uld=False`` does the same). The
positions are the tokens of the sample's chunks in the KD mask (``FLAG_KD``): on the student's
side those in its loss mask (a CE target is never a sample's first token), on the teacher's
side all but the first token of a chunk without a prediction (one that starts a sequence on
either side; where only the student's side starts there, e.g. a teacher with a BOS the student
lacks, this drops one predictable teacher token per sample). Unpaired special tokens are in no
chunk and take no part. The counts of positions left unpaired on each
side are reported (``{teacher}/uld_unpaired_student``, ``.../uld_unpaired_teacher``). Unlike
CSD, chunk correctness plays no part: ULD never looks at what the tokens are.

**Top-K signals.** With a top-K cache the teacher's vector is its K stored probabilities plus
the tail ``1 - sum`` as **one entry**, sorted together: an approximation (the true tail is
spread over ``V_T - K`` entries, each at most the K-th probability), which overstates one entry
and zeroes the others; it is exact with a dense signal (``k: 0``). The student side is exact:
``sum_i |q_i - t_i|`` over the first ``n`` sorted entries (``n`` = the teacher vector's length)
plus the student's remaining mass ``1 - sum_{i<=n} q_i`` (where the teacher's padded vector is
0), so only the student's top ``n`` probabilities are needed (``torch.topk``).

**Cost and layouts.** Each paired row's whole distribution is needed (a full softmax and a
top-``n``), in blocks of ``block_rows`` rows recomputed in the backward pass (activation
checkpointing), so memory stays at one block of ``block_rows x V_S`` floats; not the fused
output layer. Over a vocabulary split between tensor-parallel ranks each rank takes its slice's
``n`` largest probabilities (normalised over the whole vocabulary) and one sum per block merges
them, ``P x tp * n`` numbers; a pair belongs to the sequence window of its row. Every layout
gives one process's values and gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from crosskd.data.collate import ChunkBatch
from crosskd.data.shards import FLAG_KD, FLAG_PREDICTION
from crosskd.loss.events import to_numpy
from crosskd.loss.logprobs import RowSlices
from crosskd.teacher.signal import TeacherSignal
from crosskd.transfer import to_device

ULD_STATS = ("uld_pairs", "uld_unpaired_student", "uld_unpaired_teacher", "uld_sum_l1")
"""Metric sums of a ULD term, per teacher (``{teacher}/{stat}``)."""


@dataclass(frozen=True)
class UldTerm:
    """One teacher's ULD term of a micro-batch: its metrics ``name`` and ``weight``, the paired
    positions' flat student prediction rows (int64 ``[P]``, ``b * L_s + s - 1``), the teacher's
    sorted probability vectors there (float64 ``[P, n]``, each row decreasing, summing to 1),
    and the KD positions left unpaired on each side."""

    name: str
    weight: float
    student_rows: np.ndarray
    teacher_probs: Tensor
    unpaired_student: int
    unpaired_teacher: int

    @property
    def n_counted(self) -> int:
        """The pairs this term counts (the normaliser's share of this micro-batch)."""
        return len(self.student_rows)

    @property
    def chunk_first_row(self) -> np.ndarray:
        """Each pair's row (which sequence window owns it)."""
        return self.student_rows


def paired_positions(
    chunks: ChunkBatch,
    loss_mask: np.ndarray,
    keep: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """The paper's pairing over one teacher's chunks (module docstring): per sample, the
    ``i``-th predicted KD position of the student with the ``i``-th of the teacher.
    ``loss_mask`` bool ``[B, L_s]``: the student's CE targets; ``keep`` bool ``[C]``: chunks
    that may take part (e.g. the samples that chose this teacher).
    Returns ``(rows, student, teacher, unpaired_student, unpaired_teacher)``: int64 ``[P]``
    packed rows and token positions of each pair (the predicted tokens; their prediction rows
    are one before), in sample and text order."""
    flags = to_numpy(chunks.flags).astype(np.uint8)
    use = (flags & FLAG_KD) > 0
    if keep is not None:
        use &= keep
    index = np.flatnonzero(use)
    s_range, t_range = to_numpy(chunks.student)[index], to_numpy(chunks.teacher)[index]
    sample, row = to_numpy(chunks.sample)[index], to_numpy(chunks.row)[index]
    skip_first = ((flags[index] & FLAG_PREDICTION) == 0).astype(np.int64)
    order = np.lexsort((s_range[:, 0], sample))
    rows, students, teachers = [], [], []
    unpaired = [0, 0]
    for value in np.unique(sample):
        picked = order[sample[order] == value]
        s_pos = np.concatenate([np.arange(s_range[c, 0], s_range[c, 1]) for c in picked])
        s_pos = s_pos[loss_mask[row[picked[0]], s_pos]]
        t_pos = np.concatenate(
            [np.arange(t_range[c, 0] + skip_first[c], t_range[c, 1]) for c in picked]
        )
        n = min(len(s_pos), len(t_pos))
        unpaired[0] += len(s_pos) - n
        unpaired[1] += len(t_pos) - n
        rows.append(np.full(n, row[picked[0]], dtype=np.int64))
        students.append(s_pos[:n].astype(np.int64))
        teachers.append(t_pos[:n].astype(np.int64))
    empty = np.zeros(0, dtype=np.int64)
    return (
        np.concatenate(rows) if rows else empty,
        np.concatenate(students) if rows else empty,
        np.concatenate(teachers) if rows else empty,
        *unpaired,
    )


def teacher_sorted_probs(signal: TeacherSignal, rows: np.ndarray, positions: np.ndarray) -> Tensor:
    """The teacher's probability vectors predicting the tokens at ``positions`` of the packed
    ``rows`` (from rows ``position - 1``), sorted in decreasing order: float64 ``[P, K + 1]``
    for a top-K signal (the tail mass as one entry, exact to float64 rounding rather than
    float32's), ``[P, V_T]`` for a dense one."""
    log_probs = signal.log_probs[torch.from_numpy(rows), torch.from_numpy(positions - 1)]
    probs = log_probs.to(torch.float64).exp()
    if signal.k > 0:
        tail = (1.0 - probs.sum(-1, keepdim=True)).clamp(min=0.0)
        probs = torch.cat([probs, tail], dim=-1)
    return probs.sort(dim=-1, descending=True).values


def uld_distance(student_logits: Tensor, teacher_probs: Tensor, tau: float) -> Tensor:
    """``sum_i |sort(softmax(logits / tau))_i - t_i|`` per row, the shorter vector padded with
    zeros: ``student_logits`` ``[P, V_S]`` (differentiable; float32 arithmetic, float64 kept),
    ``teacher_probs`` ``[P, n]`` sorted decreasing. Returns ``[P]``."""
    whole = RowSlices(student_logits, len(student_logits), len(student_logits))
    return _distances(whole, student_logits, teacher_probs, tau)


def _distances(slices: RowSlices, logits: Tensor, teacher_probs: Tensor, tau: float) -> Tensor:
    """:func:`uld_distance` of ``logits`` (rows of ``slices.flat``, ``[P, V_here]``); over a
    vocabulary slice, each slice's ``n`` largest probabilities are merged over the slices (one
    collective of ``P x tp * n`` numbers) into the row's."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    probs = slices.log_softmax(logits, tau, dtype).exp()
    teacher = teacher_probs.to(device=probs.device, dtype=dtype)
    m = min(teacher.shape[-1], probs.shape[-1] * slices.tp)
    top = probs.topk(min(m, probs.shape[-1]), dim=-1).values
    gathered = [top if r == slices.tp_rank else torch.zeros_like(top) for r in range(slices.tp)]
    top = slices.tp_sum(torch.cat(gathered, dim=1)).topk(m, dim=-1).values
    matched = (top - teacher[:, :m]).abs().sum(-1)
    teacher_beyond = teacher[:, m:].sum(-1)  # entries the student's vector pads with zeros
    student_rest = (1.0 - top.sum(-1)).clamp(min=0.0)  # where the teacher's vector is 0
    return matched + teacher_beyond + student_rest


def uld_sum(
    slices: RowSlices, term: UldTerm, owned: np.ndarray, tau: float, block_rows: int = 1024
) -> Tensor:
    """The sum of :func:`uld_distance` over the term's pairs marked in ``owned`` (bool
    ``[P]``: this process's share), from the micro-batch's student logits as this process
    holds them (``slices``: its window of every row and its slice of the vocabulary, or
    everything): every rank of a vocabulary-split group computes each pair of its window with
    the others, in blocks of ``block_rows`` rows recomputed in the backward pass (so only one
    block's ``block_rows x V_here`` probabilities are held)."""
    here, local = slices.local(term.student_rows)
    pick = np.flatnonzero(here)
    device = slices.flat.device
    dtype = torch.float64 if slices.flat.dtype == torch.float64 else torch.float32
    teachers = to_device(term.teacher_probs, device)[to_device(pick, device)]
    weights = to_device(owned[pick], device).to(dtype)
    total = slices.flat.new_zeros((), dtype=dtype)
    # One gather, split by block: the gradient is one scatter, not a logits-sized buffer a block.
    logits = slices.flat[to_device(local[pick], device)].split(block_rows)
    for b, start in enumerate(range(0, len(pick), block_rows)):
        block = slice(start, start + block_rows)
        args = (slices, logits[b], teachers[block], weights[block], tau)
        if slices.flat.requires_grad:
            part = checkpoint(_block_sum, *args, use_reentrant=False)
        else:
            part = _block_sum(*args)
        total = total + part
    return total


def _block_sum(
    slices: RowSlices, logits: Tensor, teacher: Tensor, weights: Tensor, tau: float
) -> Tensor:
    return (_distances(slices, logits, teacher, tau) * weights).sum()
