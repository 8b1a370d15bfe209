"""The whole loss (``crosskd.loss.objective``): CE, the same-tokenizer KD, kd_scale, several
teachers and micro-batches, on hand-made batches with numbers worked out by hand."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from crosskd.data.collate import ChunkBatch
from crosskd.data.shards import FLAG_CORRECT, FLAG_KD, FLAG_PREDICTION
from crosskd.errors import ConfigError, DataError
from crosskd.loss import (
    LossConfig,
    StepCounts,
    TeacherBatch,
    TeacherLossConfig,
    compute_loss,
    kd_scale,
    plan_loss,
)
from crosskd.loss.teachers import mix_signals, predicted_bits, select_teachers
from crosskd.teacher import TeacherSignal, signal_from_logits

ALL = FLAG_CORRECT | FLAG_PREDICTION | FLAG_KD
LN = math.log


def token_chunks(lengths: list[int], flags: dict[tuple[int, int], int] | None = None) -> ChunkBatch:
    """Single-token chunks (the alignment of a tokenization with itself) of rows of the given
    lengths, one sample per row; position 0 has no prediction. ``flags``: (row, position) ->
    flags overriding the default."""
    rows, pos, flag = [], [], []
    for r, n in enumerate(lengths):
        for p in range(n):
            rows.append(r)
            pos.append(p)
            default = ALL if p else FLAG_CORRECT | FLAG_KD
            flag.append((flags or {}).get((r, p), default))
    pos_t = torch.tensor(pos, dtype=torch.int64)
    ranges = torch.stack([pos_t, pos_t + 1], dim=1)
    flags_t = torch.tensor(flag, dtype=torch.uint8)
    return ChunkBatch(
        row=torch.tensor(rows, dtype=torch.int64),
        student=ranges,
        teacher=ranges.clone(),
        shape=torch.zeros(len(rows), dtype=torch.uint8),
        region=torch.zeros(len(rows), dtype=torch.uint8),
        valid=(flags_t & ALL) == ALL,
        flags=flags_t,
        sample=torch.tensor(rows, dtype=torch.int64),
    )


# Student row 0 has p = (.1, .4, .2, .3) over V_S = 4. The teacher (V_T = 5, id 4 a padding row
# the student cannot price) has at row 0 the top 2 ids (1, 4) with probabilities (.5, .3).
STUDENT_ROW = [0.1, 0.4, 0.2, 0.3]


def worked_case(realized_id: int = 1, realized_p: float = 0.5):
    """One row, tokens [0, realized_id, 0]; only position 1 is a CE target and KD position."""
    ids = torch.tensor([[0, realized_id, 0]])
    logits = torch.log(torch.tensor([[STUDENT_ROW, [0.25] * 4, [0.25] * 4]], dtype=torch.float64))
    signal = TeacherSignal(
        ids=torch.tensor([[[1, 4], [0, 1], [0, 1]]]),
        log_probs=torch.log(torch.tensor([[[0.5, 0.3], [0.5, 0.5], [0.5, 0.5]]])),
        realized=torch.log(torch.tensor([[realized_p, 0.5]])),
        realized_t1=torch.log(torch.tensor([[realized_p, 0.5]])),
        tau=1.0,
        vocab_size=5,
        k=2,
    )
    chunks = token_chunks([3], {(0, 2): FLAG_CORRECT | FLAG_PREDICTION})  # position 2: no KD
    loss_mask = torch.tensor([[False, True, False]])
    return ids, logits, TeacherBatch(ids, chunks, signal), loss_mask


def run(config: LossConfig, case, counts=None):
    ids, logits, teacher, loss_mask = case
    logits = logits.clone().requires_grad_(True)
    plan = plan_loss(config, ids, loss_mask, [teacher], [None], student_vocab=4)
    return compute_loss(logits, plan, config, counts), logits, plan


def test_worked_same_tokenizer_kd_ce_and_static_scale():
    # E = {1} (id 4 is beyond V_S: left to REST). S = (.4 | .6), T = (.5 | .5).
    # KL(T||S) = .5 ln(.5/.4) + .5 ln(.5/.6) = .1115718 - .0911608 = .0204110.
    # CE = -ln .4 = .9162907 (one target). Static: loss = 1 * CE + 2 * KD.
    config = LossConfig(divergence="forward_kl", kd_weight=2.0, teachers=[TeacherLossConfig(k=2)])
    out, _, plan = run(config, worked_case())
    assert plan.counts == StepCounts(tokens=1, chunks=(1,))
    assert out.ce.item() == pytest.approx(0.9162907, abs=1e-7)
    assert out.kd.item() == pytest.approx(0.0204110, abs=1e-7)
    assert out.kd_scale == 2.0
    assert out.loss.item() == pytest.approx(0.9162907 + 2 * 0.0204110, abs=1e-6)
    metrics = out.metrics
    assert metrics["teacher0/token/valid"] == 1 and metrics["teacher0/token/chunks"] == 3
    assert metrics["teacher0/token/skipped_no_prediction"] == 1
    assert metrics["teacher0/token/skipped_masked"] == 1
    assert metrics["teacher0/token/mean_events"] == 1
    assert metrics["teacher0/token/mean_rest_student"] == pytest.approx(0.6)
    assert metrics["teacher0/token/mean_rest_teacher"] == pytest.approx(0.5)
    assert metrics["teacher0/token/top1_agreement"] == 1  # .5 > .3 and id 1 was realized
    assert metrics["teacher0/token/realized_in_topk_rate"] == 1
    assert metrics["teacher0/token/kd_share"] == 1


def test_worked_same_tokenizer_keep_realized_outside_the_top_k():
    # Realized id 2 (p_S = .2), teacher realized probability .1, not in the top 2.
    # Off: E = {1}, as above. On: E = {1, 2}: S = (.4, .2 | .4), T = (.5, .1 | .4):
    # KL(T||S) = .5 ln(.5/.4) + .1 ln(.1/.2) + .4 ln(1) = .1115718 - .0693147 = .0422571.
    case = worked_case(realized_id=2, realized_p=0.1)
    for keep, want in ((False, 0.0204110), (True, 0.0422571)):
        config = LossConfig(
            divergence="forward_kl", keep_realized=keep, teachers=[TeacherLossConfig(k=2)]
        )
        out, _, _ = run(config, case)
        assert out.kd.item() == pytest.approx(want, abs=1e-7)
        assert out.metrics["teacher0/token/realized_in_topk_rate"] == 0
        assert out.metrics["teacher0/token/top1_agreement"] == 0


def test_dynamic_kd_scale_is_the_detached_ratio_capped_and_zero_without_kd():
    base = {"divergence": "forward_kl", "teachers": [TeacherLossConfig(k=2)]}
    ratio = 0.9162907 / 0.0204110
    for cap, weight, want in ((1000.0, 1.0, ratio), (10.0, 0.5, 5.0)):
        config = LossConfig(dynamic_kd_scale=True, max_kd_scale=cap, kd_weight=weight, **base)
        out, logits, _ = run(config, worked_case())
        assert out.kd_scale == pytest.approx(want, rel=1e-5)
        # Detached: the gradient is d CE + scale * d KD, with the scale a constant.
        (grad,) = torch.autograd.grad(out.loss, logits, retain_graph=True)
        (g_ce,) = torch.autograd.grad(out.ce, logits, retain_graph=True)
        (g_kd,) = torch.autograd.grad(out.kd, logits)
        torch.testing.assert_close(grad, g_ce + out.kd_scale * g_kd)
    ids, logits, teacher, mask = worked_case()
    no_kd = {(0, 1): FLAG_CORRECT, (0, 2): FLAG_CORRECT}
    none = TeacherBatch(ids, token_chunks([3], no_kd), teacher.signal)
    config = LossConfig(dynamic_kd_scale=True, **base)
    out, _, _ = run(config, (ids, logits, none, mask))
    assert out.kd.item() == 0 and out.kd_scale == 0.0

    def scale(ce: float, kd: float) -> float:
        return kd_scale(
            torch.tensor(ce, dtype=torch.float64), torch.tensor(kd, dtype=torch.float64), config
        ).item()

    assert scale(2.0, 5e-9) == 0.0 and scale(2.0, -0.5) == 4.0 and scale(0.0, 0.0) == 0.0


def test_step_counts_normalise_every_micro_batch():
    # N = 4 and 3 CE tokens over the step: this micro-batch's terms are 1/4 and 1/3 of its sums.
    config = LossConfig(divergence="forward_kl", teachers=[TeacherLossConfig(k=2)])
    out, _, _ = run(config, worked_case(), StepCounts(tokens=3, chunks=(4,)))
    assert out.ce.item() == pytest.approx(0.9162907 / 3, abs=1e-7)
    assert out.kd.item() == pytest.approx(0.0204110 / 4, abs=1e-7)
    with pytest.raises(ValueError, match="different numbers of KD terms"):
        StepCounts(1, (1,)) + StepCounts(1, (1, 2))


def _random_same_tokenizer(seed: int, vocab: int = 11, lengths=(6, 4), tau: float = 1.5):
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), width), generator=gen)
    loss_mask = torch.zeros(ids.shape, dtype=torch.bool)
    for r, n in enumerate(lengths):
        ids[r, n:] = 0
        loss_mask[r, 1:n] = True
    student = torch.randn(len(lengths), width, vocab, generator=gen, dtype=torch.float64)
    teacher_logits = 2 * torch.randn(len(lengths), width, vocab, generator=gen)
    return ids, loss_mask, student, teacher_logits, token_chunks(list(lengths)), tau


@pytest.mark.parametrize("seed", range(3))
def test_dense_same_tokenizer_equals_the_full_vocabulary_kl(seed):
    """Parity with a direct computation: with a dense signal on one vocabulary, E is the whole
    vocabulary and REST holds ~0 on both sides, so KD = tau^2 * mean over positions of the
    full-vocabulary KL(T||S); a top-K signal with K = V gives the same."""
    ids, mask, student, teacher_logits, chunks, tau = _random_same_tokenizer(seed)
    log_t = torch.log_softmax(teacher_logits.double() / tau, -1)[:, :-1]
    log_s = torch.log_softmax(student / tau, -1)[:, :-1]
    per_row = (log_t.exp() * (log_t - log_s)).sum(-1)
    direct = tau**2 * per_row[mask[:, 1:]].mean()
    for k in (0, 11):
        config = LossConfig(divergence="forward_kl", tau=tau, teachers=[TeacherLossConfig(k=k)])
        signal = signal_from_logits(teacher_logits, ids, k=k, tau=tau)
        plan = plan_loss(
            config, ids, mask, [TeacherBatch(ids, chunks, signal)], [None], student_vocab=11
        )
        out = compute_loss(student, plan, config)
        assert out.kd.item() == pytest.approx(direct.item(), rel=1e-6)
        target = mask[:, 1:]
        ce = torch.nn.functional.cross_entropy(student[:, :-1][target], ids[:, 1:][target])
        assert out.ce.item() == pytest.approx(ce.item(), rel=1e-12)


def test_same_tokenizer_teacher_with_a_multi_token_chunk_is_refused():
    ids, _, teacher, mask = worked_case()
    chunks = teacher.chunks
    wide = ChunkBatch(
        chunks.row,
        torch.tensor([[0, 1], [1, 3], [2, 3]]),
        chunks.teacher,
        chunks.shape,
        chunks.region,
        chunks.valid,
        chunks.flags,
        chunks.sample,
    )
    config = LossConfig(teachers=[TeacherLossConfig(k=2)])
    with pytest.raises(ConfigError, match=r"does not tokenize like the student.*tables"):
        plan_loss(
            config, ids, mask, [TeacherBatch(ids, wide, teacher.signal)], [None], student_vocab=4
        )


def test_bad_inputs_are_refused_by_name():
    ids, logits, teacher, mask = worked_case()
    config = LossConfig(teachers=[TeacherLossConfig(k=2)])
    with pytest.raises(ConfigError, match=r"teachers lists 1 teacher\(s\) but the batch has 2"):
        plan_loss(config, ids, mask, [teacher, teacher], [None, None], student_vocab=4)
    with pytest.raises(ConfigError, match=r"teachers\[0\] has no tables in the config but a "):
        plan_loss(config, ids, mask, [teacher], [object()], student_vocab=4)
    with pytest.raises(Exception, match=r"k is 2, the config asks for 8"):
        plan_loss(
            LossConfig(teachers=[TeacherLossConfig(k=8)]),
            ids,
            mask,
            [teacher],
            [None],
            student_vocab=4,
        )
    with pytest.raises(Exception, match=r"tau is 1\.0, the config asks for 2\.0"):
        plan_loss(
            LossConfig(tau=2.0, teachers=[TeacherLossConfig(k=2)]),
            ids,
            mask,
            [teacher],
            [None],
            student_vocab=4,
        )
    with pytest.raises(DataError, match="loss_mask marks the first token"):
        plan_loss(config, ids, torch.ones_like(mask), [teacher], [None], student_vocab=4)
    select = LossConfig(teacher_mode="select", teachers=[TeacherLossConfig(k=2)])
    with pytest.raises(ConfigError, match="pass teacher_bytes"):
        plan_loss(select, ids, mask, [teacher], [None], student_vocab=4)
    plan = plan_loss(config, ids, mask, [teacher], [None], student_vocab=4)
    with pytest.raises(DataError, match=r"the plan was made for \[B, 3, V\]"):
        compute_loss(logits[:, :2], plan, config)


def test_no_target_and_no_valid_chunk_is_zero_loss_and_zero_gradient():
    ids, logits, teacher, _ = worked_case()
    empty = TeacherBatch(ids, token_chunks([3], {(0, 1): 0, (0, 2): 0}), teacher.signal)
    for dynamic in (False, True):
        config = LossConfig(dynamic_kd_scale=dynamic, teachers=[TeacherLossConfig(k=2)])
        out, logits_, _ = run(config, (ids, logits, empty, torch.zeros(1, 3, dtype=torch.bool)))
        out.loss.backward()
        assert out.loss.item() == 0 and torch.count_nonzero(logits_.grad) == 0


def test_bf16_and_peaked_logits_stay_finite():
    ids, mask, student, teacher_logits, chunks, tau = _random_same_tokenizer(7)
    peaked = student.clone()
    peaked[..., 3] += 80.0  # one id holds nearly all the student mass
    teacher_logits[..., 3] += 80.0
    for kind in ("jsd", "forward_kl", "reverse_kl"):
        config = LossConfig(divergence=kind, tau=tau, teachers=[TeacherLossConfig(k=4)])
        signal = signal_from_logits(teacher_logits, ids, k=4, tau=tau)
        plan = plan_loss(
            config, ids, mask, [TeacherBatch(ids, chunks, signal)], [None], student_vocab=11
        )
        for logits in (student.bfloat16(), peaked.float(), peaked.bfloat16()):
            logits = logits.clone().requires_grad_(True)
            out = compute_loss(logits, plan, config)
            assert out.loss.dtype == torch.float32
            out.loss.backward()
            assert math.isfinite(out.loss.item()) and torch.isfinite(logits.grad).all()


# --- several teachers ------------------------------------------------------------------------


def test_predicted_bits_worked_example():
    # Row 0, tokens at positions 1 and 2 predicted (realized_t1 = ln .5 and ln .25: 1 + 2 bits),
    # position 3 outside the KD mask. Token bytes: id 0 -> 1, 1 -> 2, 2 -> 3.
    ids = torch.tensor([[0, 1, 2, 2]])
    chunks = token_chunks([4], {(0, 3): FLAG_CORRECT | FLAG_PREDICTION})
    signal = signal_from_logits(torch.zeros(1, 4, 3), ids, k=1, tau=1.0)
    signal = TeacherSignal(
        signal.ids,
        signal.log_probs,
        signal.realized,
        torch.log(torch.tensor([[0.5, 0.25, 0.125]])),
        1.0,
        3,
        1,
    )
    bits, n_bytes = predicted_bits(signal, ids.numpy(), chunks, np.array([1, 2, 3]), 2)
    assert bits.tolist() == pytest.approx([3.0, 0.0])
    assert n_bytes.tolist() == [5, 0]


def test_select_teachers_lowest_bits_per_byte_ties_to_the_lower_index():
    bits = np.array([[3.0, 4.0, 2.0, 0.0], [3.0, 1.0, 1.0, 0.0]])
    n_bytes = np.array([[6, 4, 4, 0], [6, 4, 1, 0]])
    # bpb: sample 0 .5 vs .5 (tie -> 0); 1: 1 vs .25 -> 1; 2: .5 vs 1 -> 0; 3: no bytes -> -1.
    assert select_teachers(bits, n_bytes).tolist() == [0, 1, 0, -1]


def _two_teacher_batch():
    """Two rows (samples) of 4 tokens; teacher 0 is sure of the realized tokens of row 0 and
    unsure of row 1's, teacher 1 the other way round."""
    ids = torch.tensor([[0, 1, 2, 1], [2, 0, 1, 2]])
    mask = torch.tensor([[False, True, True, True]] * 2)
    chunks = token_chunks([4, 4])

    def teacher(good_row: int) -> TeacherSignal:
        logits = torch.zeros(2, 4, 3)
        for r in range(2):
            for p in range(3):
                logits[r, p, ids[r, p + 1]] = 6.0 if r == good_row else 0.5
        return signal_from_logits(logits, ids, k=2, tau=1.0)

    return ids, mask, chunks, [teacher(0), teacher(1)]


def test_select_mode_uses_per_sample_the_teacher_with_the_lowest_bits_per_byte():
    ids, mask, chunks, signals = _two_teacher_batch()
    teachers = [TeacherLossConfig(k=2), TeacherLossConfig(k=2, weight=3.0)]
    config = LossConfig(teacher_mode="select", teachers=teachers)
    batches = [TeacherBatch(ids, chunks, s) for s in signals]
    lengths = np.array([1, 1, 1])
    plan = plan_loss(
        config, ids, mask, batches, [None, None], student_vocab=3, teacher_bytes=[lengths, lengths]
    )
    # Teacher 0 counts only row 0's three positions, teacher 1 only row 1's.
    assert plan.counts.chunks == (3, 3)
    rows = [np.unique(t.events.chunk_index // 4).tolist() for t in plan.terms]
    assert rows == [[0], [1]]
    assert plan.sums["teacher0/selected_samples"] == 1 == plan.sums["teacher1/selected_samples"]
    student = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    out = compute_loss(student, plan, config)
    kd0, kd1 = out.kd_terms["teacher0"], out.kd_terms["teacher1"]
    assert out.kd.item() == pytest.approx(kd0.item() + 3.0 * kd1.item())
    assert out.metrics["teacher1/token/skipped_not_selected"] == 3
    # Sum mode: both teachers everywhere.
    both = plan_loss(
        LossConfig(teachers=config.teachers), ids, mask, batches, [None, None], student_vocab=3
    )
    assert both.counts.chunks == (6, 6)


def test_mix_signals_worked_example():
    # p1 = (.5, .5), p2 = (.9, .1), weights 1 and 3 -> .25 p1 + .75 p2 = (.8, .2).
    def dense(p: list[float], realized: float) -> TeacherSignal:
        lp = torch.log(torch.tensor([[p, p]]))
        r = torch.log(torch.tensor([[realized]]))
        return TeacherSignal(None, lp, r, r, 1.0, 2, 0)

    mixed = mix_signals([dense([0.5, 0.5], 0.5), dense([0.9, 0.1], 0.1)], [1.0, 3.0])
    assert mixed.log_probs.exp()[0, 0].tolist() == pytest.approx([0.8, 0.2])
    assert mixed.realized.exp().item() == pytest.approx(0.25 * 0.5 + 0.75 * 0.1)
    with pytest.raises(ConfigError, match=r"teachers\[1\]'s signal has K = 2"):
        top = signal_from_logits(
            torch.zeros(1, 2, 2), torch.zeros(1, 2, dtype=torch.long), k=2, tau=1.0
        )
        mix_signals([dense([0.5, 0.5], 0.5), top], [1.0, 1.0])


def test_average_mode_is_one_kd_against_the_mixture():
    ids, mask, chunks, _ = _two_teacher_batch()
    gen = torch.Generator().manual_seed(3)
    t_logits = [torch.randn(2, 4, 3, generator=gen) for _ in range(2)]
    signals = [signal_from_logits(t, ids, k=0, tau=1.0) for t in t_logits]
    teachers = [TeacherLossConfig(k=0, weight=1.0), TeacherLossConfig(k=0, weight=3.0)]
    config = LossConfig(teacher_mode="average", divergence="forward_kl", teachers=teachers)
    plan = plan_loss(
        config,
        ids,
        mask,
        [TeacherBatch(ids, chunks, s) for s in signals],
        [None, None],
        student_vocab=3,
    )
    assert [t.name for t in plan.terms] == ["average"]
    student = torch.randn(2, 4, 3, dtype=torch.float64, generator=gen)
    out = compute_loss(student, plan, config)
    # The mixture of the stored (float32) signals, in float64: the teacher's own float32
    # rounding is no part of what is compared.
    p_mix = 0.25 * signals[0].log_probs.double().exp() + 0.75 * signals[1].log_probs.double().exp()
    log_s = torch.log_softmax(student, -1)
    kl = (p_mix * (p_mix.log() - log_s)).sum(-1)[:, :-1]
    assert out.kd.item() == pytest.approx(kl[mask[:, 1:]].mean().item(), rel=1e-6)  # float32 mix


def test_uld_under_select_pairs_each_sample_with_its_chosen_teacher_only():
    """``kd: uld`` with ``select``: teacher 0 pairs only row 0's three predicted positions,
    teacher 1 only row 1's; in ``sum`` mode both pair all six; KD = sum_t weight_t ULD_t."""
    ids, mask, chunks, signals = _two_teacher_batch()
    teachers = [TeacherLossConfig(k=2), TeacherLossConfig(k=2, weight=3.0)]
    config = LossConfig(kd="uld", teacher_mode="select", teachers=teachers)
    batches = [TeacherBatch(ids, chunks, s) for s in signals]
    lengths = np.array([1, 1, 1])
    plan = plan_loss(
        config, ids, mask, batches, [None, None], student_vocab=3, teacher_bytes=[lengths, lengths]
    )
    assert plan.counts.chunks == (3, 3)
    assert [sorted(set(t.student_rows // 4)) for t in plan.terms] == [[0], [1]]
    student = torch.randn(
        2, 4, 3, dtype=torch.float64, requires_grad=True, generator=torch.Generator().manual_seed(5)
    )
    out = compute_loss(student, plan, config)
    assert out.kd.item() == pytest.approx(
        out.kd_terms["teacher0"].item() + 3.0 * out.kd_terms["teacher1"].item()
    )
    both = plan_loss(
        replace(config, teacher_mode="sum"), ids, mask, batches, [None, None], student_vocab=3
    )
    assert both.counts.chunks == (6, 6)
