"""X-Token's projected KL (``algorithm: xtoken``): a chunk's teacher side worked out by hand, the
whole term against a slow reference written from the formulas (float64, chunk by chunk, values
and gradients) on real tokenizer pairs (Llama-3 packs the digits Qwen3 spells one by one), the
terms of several teachers of different algorithms adding up, and the refusals."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from loss_cases import DIVERGENCES, PAIR_IDS, PAIRS, TAU, make_case, reference_teacher_chunk

from crosskd.data.collate import ChunkBatch
from crosskd.errors import ConfigError
from crosskd.loss import LossConfig, TeacherBatch, TeacherLossConfig, compute_loss, plan_loss
from crosskd.loss.logprobs import LocalLogProbs
from crosskd.loss.objective import loss_from_logprobs
from crosskd.loss.xtoken import xtoken_events
from crosskd.projection import Projection, build_projection
from crosskd.projection.format import ProjectionMeta
from crosskd.teacher.signal import TeacherSignal

K = 8
TABLES = {"student_to_teacher": "s2t", "teacher_to_student": "t2s"}


def test_teacher_side_of_one_chunk_by_hand():
    """One chunk of two teacher rows, V_T = 4, K = 2. Row 1: ids 0, 1 at 0.5, 0.3 (tail 0.2,
    0.1 per id outside its top 2); row 2: ids 1, 2 at 0.6, 0.2 (tail 0.2). S_c = {0, 1, 2}:
    row 1 is (0.5, 0.3, 0.1) with REST 0.1, row 2 (0.1, 0.6, 0.2), REST 0.1; the normalised
    geometric mean is (sqrt .05, sqrt .18, sqrt .02, sqrt .01) / their sum."""
    probs = torch.tensor([[[0.5, 0.3], [0.6, 0.2], [1.0, 0.0]]]).clamp(min=1e-30)
    signal = TeacherSignal(
        ids=torch.tensor([[[0, 1], [1, 2], [0, 1]]]),
        log_probs=probs.log(),
        realized=torch.zeros(1, 2),
        realized_t1=torch.zeros(1, 2),
        tau=1.0,
        vocab_size=4,
        k=2,
    )
    chunks = ChunkBatch(
        row=torch.tensor([0]),
        student=torch.tensor([[1, 3]]),
        teacher=torch.tensor([[1, 3]]),
        shape=torch.tensor([3], dtype=torch.uint8),
        region=torch.zeros(1, dtype=torch.uint8),
        valid=torch.tensor([True]),
        flags=torch.tensor([7], dtype=torch.uint8),
        sample=torch.tensor([0]),
    )
    # W: student 0 -> teacher 0; 1 -> 1 (.75), 2 (.25); 2 -> 1. The chunk's two student rows
    # (before tokens 1 and 2) and each event's column of W make its terms.
    w = Projection(
        np.array([0, 1, 3, 4]),
        np.array([0, 1, 2, 1], dtype=np.int32),
        np.array([1.0, 0.75, 0.25, 1.0], dtype=np.float32),
        ProjectionMeta("S", "T", "fs", "ft", 3, 4, 4, 4),
    )
    events = xtoken_events(np.array([[5, 1, 2]]), signal, chunks, np.array([True]), 4, w)
    geo = np.sqrt([0.05, 0.18, 0.02, 0.01])
    np.testing.assert_allclose(np.exp(events.teacher_lp), geo[:3] / geo.sum(), rtol=1e-6)
    assert events.event_chunk.tolist() == [0, 0, 0]
    assert events.term_event.tolist() == [0, 0, 1, 1, 1, 1, 2, 2]
    assert events.term_row.tolist() == [0, 1, 0, 0, 1, 1, 0, 1]
    assert events.term_id.tolist() == [0, 0, 1, 2, 1, 2, 1, 1]
    np.testing.assert_allclose(
        np.exp(events.term_log_weight), [0.5, 0.5, 0.375, 0.5, 0.375, 0.5, 0.125, 0.125]
    )


def _reference(case, signal, projection, logits, kind: str, beta: float = 0.5):
    """The P-KL term from the formulas of :mod:`crosskd.loss.xtoken`, chunk by chunk."""
    probs = torch.softmax(logits / TAU, dim=-1)
    rows_of = probs.reshape(-1, probs.shape[-1]).unbind(0)  # one backward node for all rows
    width = probs.shape[1]
    columns: dict[int, list[tuple[int, float]]] = {}
    for s in range(projection.meta.student_vocab_size):
        for t, w in zip(*projection.row(s), strict=True):
            columns.setdefault(int(t), []).append((s, float(w)))
    total, n = logits.new_zeros(()), 0
    for c in torch.nonzero(case.chunks.valid).flatten().tolist():
        b = int(case.chunks.row[c])
        s0, s1 = case.chunks.student[c].tolist()
        t0, t1 = case.chunks.teacher[c].tolist()
        support, mean_log, rest = reference_teacher_chunk(signal, b, range(t0 - 1, t1 - 1))
        mean = np.append(mean_log, rest)
        teacher = torch.tensor(np.exp(mean) / np.exp(mean).sum(), dtype=torch.float64)
        projected = []
        for v in support:
            ids = torch.tensor([s for s, _ in columns.get(v, [])], dtype=torch.int64)
            weights = torch.tensor([w for _, w in columns.get(v, [])], dtype=torch.float64)
            per_row = [(rows_of[b * width + i - 1][ids] * weights).sum() for i in range(s0, s1)]
            projected.append(torch.stack(per_row).mean().clamp(min=1e-10))  # X-Token's floor
        q = torch.stack(projected)
        student = torch.cat([q, (1.0 - q.sum())[None]])
        if kind == "forward_kl":
            d = (teacher * (teacher.log() - student.log())).sum()
        elif kind == "reverse_kl":
            d = (student * (student.log() - teacher.log())).sum()
        else:
            m = beta * teacher + (1 - beta) * student
            d = beta * (teacher * (teacher / m).log()).sum()
            d = d + (1 - beta) * (student * (student / m).log()).sum()
        total, n = total + d, n + 1
    return TAU**2 * total / n


def _config(kind: str = "forward_kl", **teacher) -> LossConfig:
    entry = TeacherLossConfig(k=K, algorithm="xtoken", projection="w", **TABLES, **teacher)
    return LossConfig(tau=TAU, divergence=kind, teachers=[entry])


def _plan(case, signal, config, projection, pairs=None, batches=None):
    batch = TeacherBatch(case.teacher_ids, case.chunks, signal)
    return plan_loss(
        config,
        case.student_ids,
        case.loss_mask,
        batches or [batch],
        pairs or [case.pair],
        student_vocab=case.student_logits.shape[-1],
        projections=projection if isinstance(projection, list) else [projection],
    )


@pytest.fixture(scope="module", params=PAIRS, ids=PAIR_IDS)
def xcase(request, zoo, built_table):
    student, teacher, texts = request.param
    case = make_case(zoo, built_table, student, teacher, texts)
    return case, build_projection(case.pair)


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_matches_the_reference_values_and_gradients(xcase, kind):
    case, projection = xcase
    signal = case.signal(K)
    config = _config(kind)
    plan = _plan(case, signal, config, projection)
    logits = case.logits(torch.float64)
    out = compute_loss(logits, plan, config)
    (grad,) = torch.autograd.grad(out.kd, logits)
    ref_logits = case.logits(torch.float64)
    want = _reference(case, signal, projection, ref_logits, kind)
    (ref_grad,) = torch.autograd.grad(want, ref_logits)
    assert out.kd.item() == pytest.approx(want.item(), rel=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-12)
    assert plan.terms[0].n_counted == int(case.chunks.valid.sum())


def test_blocks_and_float32_agree(xcase):
    """The rows read in blocks of 3 or all at once, in float32: the same term."""
    case, projection = xcase
    signal = case.signal(K)
    config = _config()
    plan = _plan(case, signal, config, projection)
    values = []
    for block in (3, 4096):
        logits = case.logits(torch.float32)
        student = LocalLogProbs(logits.reshape(-1, logits.shape[-1]), block_rows=block)
        values.append(loss_from_logprobs(student, plan, config, plan.counts, device="cpu").kd)
    assert values[0].item() == pytest.approx(values[1].item(), rel=1e-6)


def test_terms_of_different_algorithms_add_up(xcase):
    """Teacher 0 by CSD, teacher 1 (the same signal) by X-Token at weight 3: the KD is the
    CSD term plus 3 times the X-Token term, each as computed alone."""
    case, projection = xcase
    signal = case.signal(K)
    csd = LossConfig(tau=TAU, divergence="forward_kl", teachers=[TeacherLossConfig(k=K, **TABLES)])
    xtoken = _config()
    both = LossConfig(
        tau=TAU,
        divergence="forward_kl",
        teachers=[csd.teachers[0], replace(xtoken.teachers[0], weight=3.0)],
    )
    batch = TeacherBatch(case.teacher_ids, case.chunks, signal)
    alone = [
        compute_loss(case.logits(), _plan(case, signal, csd, None), csd).kd.item(),
        compute_loss(case.logits(), _plan(case, signal, xtoken, projection), xtoken).kd.item(),
    ]
    plan = _plan(case, signal, both, [None, projection], [case.pair] * 2, [batch, batch])
    out = compute_loss(case.logits(), plan, both)
    assert out.kd.item() == pytest.approx(alone[0] + 3.0 * alone[1], rel=1e-9)
    assert out.totals["kd/teacher1"] == pytest.approx(alone[1], rel=1e-9)
    assert out.metrics["teacher1/1:n/valid"] > 0


def test_config_refusals():
    with pytest.raises(ConfigError, match=r"teachers\[0\].projection is not set"):
        LossConfig(teachers=[TeacherLossConfig(algorithm="xtoken", **TABLES)])
    with pytest.raises(ConfigError, match=r"xtoken with k 0 .* give teachers\[0\].k > 0"):
        LossConfig(teachers=[TeacherLossConfig(algorithm="xtoken", k=0, projection="w", **TABLES)])
    with pytest.raises(ConfigError, match=r"no tables, so it is a same-tokenizer teacher"):
        LossConfig(teachers=[TeacherLossConfig(algorithm="xtoken", projection="w")])
    with pytest.raises(ConfigError, match=r"projection is set but teachers\[0\] uses algorithm"):
        LossConfig(teachers=[TeacherLossConfig(projection="w", **TABLES)])
    with pytest.raises(ConfigError, match=r"teachers\[0\].algorithm is 'GOLD'; choose one of"):
        LossConfig(teachers=[TeacherLossConfig(algorithm="GOLD", **TABLES)])
    dense = {"k": 0, **TABLES}
    with pytest.raises(ConfigError, match=r"different algorithms \(uld, csd\)"):
        LossConfig(
            teacher_mode="average",
            teachers=[TeacherLossConfig(algorithm="uld", **dense), TeacherLossConfig(**dense)],
        )
    assert LossConfig(kd="xtoken", teachers=[TeacherLossConfig(projection="w", **TABLES)])


def test_a_missing_or_foreign_projection_is_refused(xcase):
    case, projection = xcase
    signal = case.signal(K)
    with pytest.raises(ConfigError, match=r"teachers\[0\] uses algorithm xtoken but no projection"):
        _plan(case, signal, _config(), None)
    meta = replace(projection.meta, teacher_name="other", teacher_fingerprint="f" * 64)
    foreign = Projection(projection.offsets, projection.columns, projection.weights, meta, "w2")
    with pytest.raises(ConfigError, match=r"the projection w2 maps \S+ -> other .* not this"):
        _plan(case, signal, _config(), foreign)


def test_the_fused_output_layer_gives_the_logits_numbers(xcase):
    """X-Token asks for (row, id) log probabilities like CSD, so the loss fused with the output
    layer gives the values and gradients of the same loss on the head's logits."""
    from crosskd.output_layer import OutputLayer

    case, projection = xcase
    plan = _plan(case, case.signal(K), _config(), projection)
    gen = torch.Generator().manual_seed(3)
    vocab = case.student_logits.shape[-1]
    hidden = torch.randn(*case.student_ids.shape, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, 8, generator=gen, dtype=torch.float64)
    grads = []
    for fused in (True, False):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        source = OutputLayer(h, w, None) if fused else h @ w.T
        out = compute_loss(source, plan, _config())
        out.loss.backward()
        grads.append((out.kd.item(), h.grad, w.grad))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-9)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(grads[0][2], grads[1][2], rtol=1e-7, atol=1e-12)
