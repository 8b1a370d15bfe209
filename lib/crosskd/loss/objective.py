"""The student's whole loss: ``ce_weight * CE + kd_scale * KD`` (spec sections 5 and 6), with
each teacher's KD term the one its algorithm names (``LossConfig.algorithm``): CSD, X-Token's
projected KL (:mod:`crosskd.loss.xtoken`), its gold loss or H-KL (:mod:`crosskd.loss.gold`) or
the ULD baseline (:mod:`crosskd.loss.uld`).

Two steps, so that everything that depends only on the data and the teacher signals happens
before the student's forward pass (in the collator or a data-loader worker):

1. :func:`plan_loss` (numpy, no gradients): the CE targets, and per teacher the events of every
   counted chunk (:func:`~crosskd.loss.events.build_events` for a cross-tokenizer teacher) or
   position (:func:`~crosskd.loss.tokens.build_token_events` for a same-tokenizer one, whose
   batch is first turned into one entry per student token by
   :func:`~crosskd.loss.tokens.token_positions`; every "chunk" below is then a position), after
   applying the teacher mode (``select`` narrows each teacher to the samples that chose it,
   ``average`` mixes the signals into one). :attr:`LossPlan.counts` are this micro-batch's CE
   tokens and counted chunks per teacher; sum them over the step's micro-batches (and over the
   data-parallel ranks: :func:`crosskd.loss.parallel.reduce_counts`) into the
   :class:`StepCounts` every micro-batch is normalised by.
2. :func:`compute_loss` (torch): CE and each teacher's KD from the student logits through one
   :class:`~crosskd.loss.logprobs.StudentLogProbs` per temperature (shared when ``tau = 1``),
   then ``kd_scale`` and the total. Summing the micro-batch losses' gradients gives the step's
   mean gradient.

``kd_scale`` is ``kd_weight`` (static) or, with ``dynamic_kd_scale``,
``kd_weight * min(|CE| / |KD|, max_kd_scale)`` of this micro-batch, detached, and 0 when
``|KD| < 1e-8``. ``KD = sum_t weight_t KD_t`` (``sum`` and ``select``) or the one KD against the
mixture (``average``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

from crosskd.data.collate import ChunkBatch
from crosskd.errors import ConfigError, DataError
from crosskd.loss.config import PROJECTED, LossConfig
from crosskd.loss.csd import kd_from_terms
from crosskd.loss.events import Events, build_events, to_numpy
from crosskd.loss.gold import GOLD_STATS, GoldParts, gold_parts, gold_term, partition
from crosskd.loss.kernels import BlockKernels
from crosskd.loss.logprobs import LocalLogProbs, StudentLogProbs
from crosskd.loss.metrics import add_sums, chunk_sums, sum_keys, summarize, term_sums
from crosskd.loss.teachers import mix_signals, predicted_bits, select_teachers
from crosskd.loss.tokens import build_token_events, token_positions
from crosskd.loss.uld import UldTerm, paired_positions, teacher_sorted_probs, uld_sum
from crosskd.loss.xtoken import chunk_teacher, xtoken_events
from crosskd.output_layer import OutputLayer
from crosskd.projection import Projection
from crosskd.tables import TablePair
from crosskd.teacher.signal import TeacherSignal
from crosskd.transfer import to_device

KD_FLOOR = 1e-8
"""``|KD|`` below this gives a dynamic ``kd_scale`` of 0."""


@dataclass(frozen=True)
class TeacherBatch:
    """One teacher's side of a micro-batch: its ``input_ids`` int64 ``[B, L_t]``, its chunks
    (from the collator; for a same-tokenizer teacher its positions, or chunks that
    :func:`plan_loss` turns into positions) and its signal for the rows ``[B, L_t]``."""

    input_ids: Tensor
    chunks: ChunkBatch
    signal: TeacherSignal


@dataclass(frozen=True)
class TeacherPlan:
    """One KD term of a micro-batch: its metrics ``name``, ``weight``, counted ``events``, and
    for every chunk of the batch (every position, for a ``same_tokenizer`` term) its shape and
    flags (numpy, for the skip reasons) and its first prediction row (flat
    ``b * L_s + max(s0 - 1, 0)``: which rank of a sequence-parallel layout evaluates it)."""

    name: str
    weight: float
    events: Events
    chunk_shape: np.ndarray
    chunk_flags: np.ndarray
    chunk_first_row: np.ndarray
    same_tokenizer: bool
    gold: GoldParts | None = None
    """``algorithm: gold`` or ``hkl``: the data side of the term (the events then serve the
    chunk metrics only)."""
    algorithm: str = "csd"
    """The term's algorithm."""

    @property
    def n_counted(self) -> int:
        """The chunks this term counts (the normaliser's share of this micro-batch)."""
        return self.events.n_chunks


@dataclass(frozen=True)
class StepCounts:
    """The normalisers of an optimizer step: CE ``tokens`` and counted ``chunks`` per KD term.
    Add the counts of every micro-batch (``a + b``)."""

    tokens: int
    chunks: tuple[int, ...]

    def __add__(self, other: StepCounts) -> StepCounts:
        if len(self.chunks) != len(other.chunks):
            raise ValueError("StepCounts of plans with different numbers of KD terms")
        chunks = tuple(a + b for a, b in zip(self.chunks, other.chunks, strict=True))
        return StepCounts(self.tokens + other.tokens, chunks)


@dataclass(frozen=True)
class LossPlan:
    """Everything the loss of one micro-batch needs besides the student logits.

    ``width``: the student batch's ``L_s``; ``vocab``: ``V_S``; ``ce_rows`` / ``ce_ids`` int64
    ``[M]``: each CE target's flat row (``b * L_s + position - 1``) and token id; ``terms``:
    the KD terms, one per teacher (a :class:`TeacherPlan` for CSD and X-Token's three losses, a
    :class:`~crosskd.loss.uld.UldTerm` for ULD);
    ``sums``: metric sums known before the forward pass (teachers' bits and bytes, selections).
    """

    width: int
    vocab: int
    ce_rows: np.ndarray
    ce_ids: np.ndarray
    terms: list[TeacherPlan | UldTerm]
    sums: dict[str, float]

    @property
    def counts(self) -> StepCounts:
        """This micro-batch's CE tokens and counted chunks (ULD: pairs) per KD term."""
        return StepCounts(len(self.ce_rows), tuple(t.n_counted for t in self.terms))


@dataclass(frozen=True)
class ReportLayout:
    """Where each reported value of a :class:`LossOutput` lies in its ``reported`` vector:
    ``loss``, ``ce``, ``kd``, ``kd/{term}`` of each of ``terms``, ``kd_scale``, then the metric
    sums of ``keys`` (:func:`crosskd.loss.metrics.sum_keys`)."""

    terms: tuple[str, ...]
    keys: tuple[str, ...]

    def read(self, row: Sequence[float]) -> tuple[dict[str, float], float, dict[str, float]]:
        """``(totals, kd_scale, sums)`` of one reported vector read to the host (``row``);
        sums of 0 are left out."""
        n = len(self.terms)
        totals = {"loss": row[0], "ce": row[1], "kd": row[2]}
        totals |= {f"kd/{name}": row[3 + i] for i, name in enumerate(self.terms)}
        sums = {key: value for key, value in zip(self.keys, row[4 + n :], strict=True) if value}
        return totals, row[3 + n], sums


@dataclass(frozen=True)
class LossOutput:
    """One micro-batch's loss on this rank.

    ``loss`` (differentiable; call ``backward`` on it) = ``ce_weight * ce + kd_scale * kd``, and
    ``ce``, ``kd``, ``kd_terms`` (name -> value before weights), all differentiable, are **this
    rank's share**: in one process the whole micro-batch, under a parallel layout the CE targets
    and chunks this rank evaluates, so that the shares of all ranks sum to the micro-batch's
    terms. ``reported`` (float64, on the logits' device, laid out as ``layout`` says) holds the
    complete values: the totals (``loss``, ``ce``, ``kd``, ``kd/{name}``), ``kd_scale`` and the
    metric sums (:mod:`crosskd.loss.metrics`), summed over every rank, identical on every rank.
    Nothing of it is read back to the host while the loss is computed: a training step reads
    the vectors of all its micro-batches at once after their backward passes
    (:meth:`ReportLayout.read`); :attr:`kd_scale`, :attr:`totals`, :attr:`sums` and
    :attr:`metrics` read this one (a device synchronisation on GPU).
    """

    loss: Tensor
    ce: Tensor
    kd: Tensor
    kd_terms: dict[str, Tensor]
    reported: Tensor
    layout: ReportLayout

    @cached_property
    def _read(self) -> tuple[dict[str, float], float, dict[str, float]]:
        return self.layout.read(self.reported.tolist())

    @property
    def totals(self) -> dict[str, float]:
        """``loss``, ``ce``, ``kd``, ``kd/{name}`` of the micro-batch (complete)."""
        return self._read[0]

    @property
    def kd_scale(self) -> float:
        """The ``kd_scale`` the loss was computed with."""
        return self._read[1]

    @property
    def sums(self) -> dict[str, float]:
        """The metric sums (complete; those of 0 left out)."""
        return self._read[2]

    @property
    def metrics(self) -> dict[str, float]:
        """The reported metrics of this micro-batch: ``loss``, ``ce``, ``kd``, ``kd_scale``,
        ``kd/{teacher}`` and the per-teacher, per-shape statistics (complete values)."""
        return {**self.totals, "kd_scale": self.kd_scale} | summarize(self.sums)


@dataclass(frozen=True)
class Ownership:
    """The part of a micro-batch one rank evaluates, so that every CE target and every chunk is
    evaluated by exactly one rank: ``ce`` bool ``[M]`` over the plan's CE targets, ``chunks``
    per KD term bool over all of its batch chunks (the metric sums of a chunk go with it),
    ``leader``: whether this rank adds the plan's own sums (one rank per data-parallel shard),
    and ``reduce``: sums a float64 vector over every rank (returns the complete vector)."""

    ce: np.ndarray
    chunks: list[np.ndarray]
    leader: bool
    reduce: Callable[[Tensor], Tensor]

    @classmethod
    def everything(cls, plan: LossPlan) -> Ownership:
        """One process: everything is evaluated here; nothing to reduce."""
        return cls(
            np.ones(len(plan.ce_rows), dtype=bool),
            [
                np.ones(
                    len(t.chunk_shape) if isinstance(t, TeacherPlan) else t.n_counted, dtype=bool
                )
                for t in plan.terms
            ],
            True,
            lambda x: x,
        )


def plan_loss(
    config: LossConfig,
    student_ids: Tensor,
    loss_mask: Tensor,
    teachers: Sequence[TeacherBatch],
    pairs: Sequence[TablePair | None],
    *,
    student_vocab: int,
    teacher_bytes: Sequence[np.ndarray] | None = None,
    projections: Sequence[Projection | None] | None = None,
) -> LossPlan:
    """The data side of one micro-batch's loss.

    Args:
        config: the loss config (``config.teachers[i]`` describes ``teachers[i]``).
        student_ids: int64 ``[B, L_s]``; ``loss_mask``: bool ``[B, L_s]`` (CE targets; never
            the first token of a sample).
        teachers: one :class:`TeacherBatch` per teacher.
        pairs: per teacher its :class:`TablePair`, or None for a same-tokenizer teacher (its
            valid positions: a prediction, inside the KD mask, equal ids; see
            :mod:`crosskd.loss.tokens`).
        student_vocab: ``V_S`` (the student's output rows).
        teacher_bytes: per teacher the UTF-8 length of each token id (int ``[V_T]``, e.g.
            ``LoadedTokenizer.bytes.lengths``); needed by ``select``, and when given the
            teachers' bits and predicted bytes are added to the metric sums.
        projections: per teacher its projection ``W`` (its algorithm reads one: ``xtoken``,
            ``gold``, ``hkl``) or None.
    """
    projections = list(projections) if projections is not None else [None] * len(teachers)
    _check_inputs(config, teachers, pairs, teacher_bytes, projections)
    ids = student_ids.cpu().numpy()
    teachers = [
        t
        if pair is not None
        else replace(t, chunks=token_positions(t.chunks, ids, to_numpy(t.input_ids)))
        for t, pair in zip(teachers, pairs, strict=True)
    ]
    mask = loss_mask.cpu().numpy().astype(bool)
    width = ids.shape[1]
    b, p = np.nonzero(mask)
    if (p == 0).any():
        raise DataError(
            "loss_mask marks the first token of a row as a CE target; nothing predicts it. The "
            "collator's loss mask never does: pass batch.loss_mask."
        )
    sums: dict[str, float] = {}
    valid = [to_numpy(t.chunks.valid).astype(bool) for t in teachers]
    chosen_by = [None] * len(teachers)  # under select: the chunks of samples that chose it
    if teacher_bytes is not None:
        n_samples = 1 + max(int(to_numpy(t.chunks.sample).max(initial=-1)) for t in teachers)
        bits = np.zeros((len(teachers), n_samples))
        n_bytes = np.zeros((len(teachers), n_samples), dtype=np.int64)
        for i, (teacher, lengths) in enumerate(zip(teachers, teacher_bytes, strict=True)):
            bits[i], n_bytes[i] = predicted_bits(
                teacher.signal,
                to_numpy(teacher.input_ids),
                teacher.chunks,
                np.asarray(lengths),
                n_samples,
            )
            sums[f"teacher{i}/bits"] = float(bits[i].sum())
            sums[f"teacher{i}/bytes"] = float(n_bytes[i].sum())
        if config.teacher_mode == "select":
            chosen = select_teachers(bits, n_bytes)
            for i, teacher in enumerate(teachers):
                chosen_by[i] = chosen[to_numpy(teacher.chunks.sample)] == i
                valid[i] &= chosen_by[i]
                sums[f"teacher{i}/selected_samples"] = float((chosen == i).sum())
    options = config.csd_options()
    plans: list[TeacherPlan | UldTerm] = []
    names = term_names(config, len(teachers))
    if config.teacher_mode == "average":
        signal = mix_signals([t.signal for t in teachers], [e.weight for e in config.teachers])
        teachers = [TeacherBatch(teachers[0].input_ids, teachers[0].chunks, signal)]
        pairs = pairs[:1]
    for i, (teacher, pair, name) in enumerate(zip(teachers, pairs, names, strict=True)):
        weight = 1.0 if config.teacher_mode == "average" else config.teachers[i].weight
        algorithm = config.algorithm(i)
        if algorithm == "uld":
            plans.append(_uld_term(name, weight, teacher, mask, chosen_by[i], width, sums))
            continue
        ch = teacher.chunks
        t_ids = to_numpy(teacher.input_ids)
        gold = None
        if algorithm == "xtoken":
            events = xtoken_events(t_ids, teacher.signal, ch, valid[i], width, projections[i])
        elif algorithm in ("gold", "hkl"):
            side = chunk_teacher(t_ids, teacher.signal, ch, valid[i])
            common = partition(projections[i], relaxed=algorithm == "hkl")
            gold = gold_parts(side, common, width, student_vocab)
            events = side.events(side.mean_log, to_numpy(ch.shape), width)
        elif pair is None:
            events = build_token_events(
                ids,
                t_ids,
                teacher.signal,
                ch,
                valid[i],
                student_vocab=student_vocab,
                keep_realized=config.keep_realized,
            )
        else:
            events = build_events(ids, t_ids, teacher.signal, ch, pair, options, valid[i])
        first_row = to_numpy(ch.row) * width + np.maximum(to_numpy(ch.student)[:, 0] - 1, 0)
        plans.append(
            TeacherPlan(
                name,
                weight,
                events,
                to_numpy(ch.shape),
                to_numpy(ch.flags),
                first_row,
                pair is None and algorithm == "csd",
                gold,
                algorithm,
            )
        )
    return LossPlan(width, student_vocab, b * width + p - 1, ids[b, p], plans, sums)


def term_names(config: LossConfig, n_teachers: int) -> list[str]:
    """The KD terms' names (the ``teacher`` label of their metrics): ``teacher0``,
    ``teacher1``, ... one per teacher, or the one ``average`` term of that mode."""
    if config.teacher_mode == "average" and n_teachers:
        return ["average"]
    return [f"teacher{i}" for i in range(n_teachers)]


def _uld_term(
    name: str,
    weight: float,
    teacher: TeacherBatch,
    loss_mask: np.ndarray,
    chosen_by: np.ndarray | None,
    width: int,
    sums: dict[str, float],
) -> UldTerm:
    """One teacher's :class:`UldTerm` (the paper's pairing over the student's ``loss_mask``
    ``[B, L_s]``; ``chosen_by``: its chunks that may take part, under ``select``); adds its
    pair counts to ``sums``."""
    rows, s_pos, t_pos, unpaired_s, unpaired_t = paired_positions(
        teacher.chunks, loss_mask, chosen_by
    )
    sums[f"{name}/uld_pairs"] = float(len(rows))
    sums[f"{name}/uld_unpaired_student"] = float(unpaired_s)
    sums[f"{name}/uld_unpaired_teacher"] = float(unpaired_t)
    return UldTerm(
        name,
        weight,
        rows * width + s_pos - 1,
        teacher_sorted_probs(teacher.signal, rows, t_pos),
        unpaired_s,
        unpaired_t,
    )


def compute_loss(
    student_logits: Tensor | OutputLayer,
    plan: LossPlan,
    config: LossConfig,
    counts: StepCounts | None = None,
    reduce: Callable[[Tensor], Tensor] | None = None,
) -> LossOutput:
    """The loss of one micro-batch from the student's logits ``[B, L_s, V_S]`` (any float dtype;
    arithmetic in float32), or from its :class:`~crosskd.output_layer.OutputLayer` (hidden
    states ``[B, L_s, H]`` and the head: fused, the logits are computed a block of rows at a
    time and never exist whole; the same values and gradients). ``counts``: the step's
    totals (default: this micro-batch's own).
    ``reduce``: under data parallelism, sums a float64 vector over the ranks (so ``kd_scale``
    and the reported values are complete); each rank then holds its share of the loss."""
    shape = tuple(student_logits.shape)
    if len(shape) != 3 or shape[1] != plan.width:
        raise DataError(
            f"student logits have shape {shape}; the plan was made for [B, {plan.width}, V]. "
            f"Pass the logits of the batch the plan was made from."
        )
    counts = plan.counts if counts is None else counts
    flat = (
        student_logits.flatten()
        if isinstance(student_logits, OutputLayer)
        else student_logits.reshape(-1, shape[-1])
    )
    ownership = None
    if reduce is not None:
        ownership = replace(Ownership.everything(plan), reduce=reduce)
    student = LocalLogProbs(flat, kernels=BlockKernels.named(config.kernels))
    return loss_from_logprobs(
        student, plan, config, counts, device=flat.device, ownership=ownership
    )


def loss_from_logprobs(
    student: StudentLogProbs,
    plan: LossPlan,
    config: LossConfig,
    counts: StepCounts,
    *,
    device: torch.device | str,
    ownership: Ownership | None = None,
) -> LossOutput:
    """:func:`compute_loss` over any :class:`StudentLogProbs` (CE at temperature 1, KD at
    ``config.tau``): the entry point of the sharded versions, which pass their
    :class:`Ownership`. Every (row, id) pair of CE and the CSD terms is asked for in one call at
    its temperature (one pass over the logits; the same call on every rank of a parallel
    layout, as the log-prob interface may communicate); then only the owned CE targets and
    chunks are evaluated. ULD, gold and H-KL terms read whole rows of the logits as this process
    holds them (``row_slices``: its window and vocabulary slice; not the fused output layer,
    :func:`_whole_rows`). ``kd_scale`` and the reported values come from the complete
    (reduced) terms."""
    own = Ownership.everything(plan) if ownership is None else ownership

    def tensor(array: np.ndarray) -> Tensor:
        return to_device(array, device)

    for term in plan.terms:
        if not _by_requests(term):
            _whole_rows(student, term)
    by_requests = [t for t in plan.terms if _by_requests(t)]
    kd_requests = [(t.events.term_row, t.events.term_id, config.tau) for t in by_requests]
    ce_lp, *kd_lps = student.log_probs_at([(plan.ce_rows, plan.ce_ids, 1.0), *kd_requests])
    requested = dict(zip((id(t) for t in by_requests), kd_lps, strict=True))
    ce = -ce_lp[tensor(np.flatnonzero(own.ce))].sum() / max(counts.tokens, 1)
    kd = ce.new_zeros(())
    kd_terms: dict[str, Tensor] = {}
    sums = dict(plan.sums) if own.leader else {}
    on_device: list[tuple[list[str], Tensor | None]] = []
    parts = zip(plan.terms, counts.chunks, own.chunks, strict=True)
    for term_plan, n_total, owned in parts:
        if isinstance(term_plan, UldTerm):
            slices = student.row_slices(plan.width)
            total = uld_sum(slices, term_plan, owned, config.tau, student.block_rows)
            kd_terms[term_plan.name] = total / max(n_total, 1)
            kd = kd + term_plan.weight * kd_terms[term_plan.name]
            on_device.append(([f"{term_plan.name}/uld_sum_l1"], total.detach().double()[None]))
            continue
        events, kept = term_plan.events.subset(owned)
        options = {"tau": config.tau, "kind": config.divergence, "beta": config.beta}
        if term_plan.gold is not None:
            slices = student.row_slices(plan.width)
            mine = owned[term_plan.events.chunk_index]
            term, parts = gold_term(
                slices, term_plan.gold, mine, **options, n_total=n_total, after=ce + kd
            )
            keys = [f"{term_plan.name}/{stat}" for stat in GOLD_STATS]
            on_device.append((keys, parts))
        else:
            term_lp = requested[id(term_plan)][tensor(kept)]
            term = kd_from_terms(events, term_lp, **options, n_total=n_total)
        kd_terms[term_plan.name] = term.value
        kd = kd + term_plan.weight * term.value
        sums = add_sums(
            sums,
            chunk_sums(
                term_plan.name,
                events,
                term_plan.chunk_shape[owned],
                term_plan.chunk_flags[owned],
                same_tokenizer=term_plan.same_tokenizer,
            ),
        )
        on_device.append(
            term_sums(
                term_plan.name,
                events,
                term,
                term_plan.chunk_shape[owned],
                same_tokenizer=term_plan.same_tokenizer,
            )
        )
    return _complete(ce, kd, kd_terms, sums, on_device, plan, config, own, device)


def _by_requests(term: TeacherPlan | UldTerm) -> bool:
    """Whether a term's student values are (row, id) log probabilities (CSD, X-Token's P-KL),
    not whole rows (ULD, gold, H-KL)."""
    return isinstance(term, TeacherPlan) and term.gold is None


def _whole_rows(student: StudentLogProbs, term: TeacherPlan | UldTerm) -> None:
    """Refuse the fused output layer, which holds no logits, for a term that reads whole rows
    (ULD, gold, H-KL)."""
    what = "uld" if isinstance(term, UldTerm) else term.algorithm
    if isinstance(student.logits, OutputLayer):
        raise ConfigError(
            f"{term.name} uses algorithm {what}, which reads whole rows of the student's "
            f"distribution and so needs the student's logits, not the fused output layer; pass "
            f"the logits (the trainer does so when a teacher uses uld, gold or hkl)."
        )


def _complete(
    ce: Tensor,
    kd: Tensor,
    kd_terms: dict[str, Tensor],
    sums: dict[str, float],
    on_device: list[tuple[list[str], Tensor | None]],
    plan: LossPlan,
    config: LossConfig,
    own: Ownership,
    device: torch.device | str,
) -> LossOutput:
    """The :class:`LossOutput` of this rank's terms: the host ``sums`` and the device ones
    (``on_device``: keys and values) and the terms packed into one float64 vector on
    ``device`` and all-reduced, ``kd_scale`` from the complete terms, the total; nothing is
    read back to the host."""
    names = [t.name for t in plan.terms]
    keys = sum_keys(names, len(config.teachers))
    place = {key: i for i, key in enumerate(keys)}
    summed = to_device(np.array([sums.get(key, 0.0) for key in keys], dtype=np.float64), device)
    for term_keys, values in on_device:
        if term_keys:
            index = to_device(np.array([place[key] for key in term_keys]), device)
            summed = summed.index_add(0, index, values)
    terms = torch.stack([ce.detach(), kd.detach(), *(v.detach() for v in kd_terms.values())])
    complete = own.reduce(torch.cat([terms.double(), summed]))
    ce_total, kd_total = complete[0], complete[1]
    scale = kd_scale(ce_total, kd_total, config)
    loss = config.ce_weight * ce + scale.to(kd.dtype) * kd
    reported = torch.cat(
        [
            (config.ce_weight * ce_total + scale * kd_total)[None],
            complete[: 2 + len(names)],
            scale[None],
            complete[2 + len(names) :],
        ]
    )
    return LossOutput(loss, ce, kd, kd_terms, reported, ReportLayout(tuple(names), tuple(keys)))


def kd_scale(ce: Tensor, kd: Tensor, config: LossConfig) -> Tensor:
    """``kd_weight``, or with ``dynamic_kd_scale`` ``kd_weight * min(|ce| / |kd|,
    max_kd_scale)`` (0 when ``|kd| < 1e-8``), a float64 scalar on ``kd``'s device; ``ce`` and
    ``kd`` are this micro-batch's complete (all-reduced) terms, float64 scalars."""
    if not config.dynamic_kd_scale:
        return torch.full((), config.kd_weight, dtype=torch.float64, device=kd.device)
    ratio = torch.clamp(ce.abs() / kd.abs(), max=config.max_kd_scale)
    return torch.where(kd.abs() < KD_FLOOR, 0.0, config.kd_weight * ratio)


def _check_inputs(
    config: LossConfig,
    teachers: Sequence[TeacherBatch],
    pairs: Sequence[TablePair | None],
    teacher_bytes: Sequence[np.ndarray] | None,
    projections: Sequence[Projection | None],
) -> None:
    if not len(teachers) == len(pairs) == len(projections) == len(config.teachers):
        raise ConfigError(
            f"teachers lists {len(config.teachers)} teacher(s) but the batch has "
            f"{len(teachers)}, and {len(pairs)} table pair(s) and {len(projections)} "
            f"projection(s) were given; give one teachers[] entry, one signal, one pair (None: "
            f"same tokenizer) and one projection (None unless its algorithm reads one) per teacher."
        )
    for i, (entry, teacher, pair) in enumerate(zip(config.teachers, teachers, pairs, strict=True)):
        if entry.same_tokenizer != (pair is None):
            what = "has no tables" if entry.same_tokenizer else "has tables"
            got = "a table pair was given" if pair is not None else "no table pair was given"
            raise ConfigError(
                f"teachers[{i}] {what} in the config but {got}; load the pair from "
                f"teachers[{i}].student_to_teacher / teacher_to_student (None for a "
                f"same-tokenizer teacher)."
            )
        if pair is not None and teacher.chunks.same_tokenizer:
            raise ConfigError(
                f"teachers[{i}] has tables in the config, but the data was prepared with it as a "
                f"same-tokenizer teacher (its tokenizer fingerprint equals the student's, so it "
                f"has positions, not chunks); remove teachers[{i}].student_to_teacher and "
                f"teacher_to_student to compare it token by token."
            )
        if pair is not None:
            vocab = pair.teacher_to_student.meta.src_vocab_size
            if teacher.signal.vocab_size != vocab:
                raise ConfigError(
                    f"teachers[{i}]: the teacher signal has V = {teacher.signal.vocab_size} "
                    f"rows, its tables were built for V = {vocab} (teacher_to_student "
                    f"{pair.teacher_to_student.source}); use the tables of this teacher, or score "
                    f"it with the model the tables were built for."
                )
        teacher.signal.require(
            tau=config.tau, vocab_size=None, k=entry.k, where=f"of teachers[{i}]"
        )
        _check_projection(config, i, teacher, pair, projections[i])
    if config.teacher_mode == "select" and teacher_bytes is None:
        raise ConfigError(
            "teacher_mode is 'select', which picks teachers by bits per byte; pass "
            "teacher_bytes (each teacher tokenizer's bytes.lengths)."
        )


def _check_projection(
    config: LossConfig,
    index: int,
    teacher: TeacherBatch,
    pair: TablePair | None,
    projection: Projection | None,
) -> None:
    """A teacher whose algorithm reads a projection (``xtoken``, ``gold``, ``hkl``) needs one,
    built for its tables' two tokenizers."""
    key = f"teachers[{index}]"
    algorithm = config.algorithm(index)
    if algorithm not in PROJECTED:
        return
    if projection is None:
        raise ConfigError(
            f"{key} uses algorithm {algorithm} but no projection was given; load "
            f"{key}.projection (`crosskd projection build` makes one)."
        )
    meta, tables = projection.meta, pair.student_to_teacher.meta
    if (meta.student_fingerprint, meta.teacher_fingerprint) != (
        tables.src_fingerprint,
        tables.dst_fingerprint,
    ) or meta.teacher_vocab_size != teacher.signal.vocab_size:
        raise ConfigError(
            f"{key}: the projection {projection.source} maps {meta.student_name} -> "
            f"{meta.teacher_name} (V_T = {meta.teacher_vocab_size}), not this student and "
            f"teacher (tables {pair.student_to_teacher.source}, signal V = "
            f"{teacher.signal.vocab_size}); build the projection from this teacher's tables."
        )
