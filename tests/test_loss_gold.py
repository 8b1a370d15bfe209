"""X-Token's gold loss and H-KL (``algorithm: gold`` / ``hkl``): the two partitions worked out
by hand (on a real pair: ``tests/test_projection.py``), the whole term against a
slow reference written from the formulas (float64, chunk by chunk, values and gradients) on real
tokenizer pairs, blocks of chunks, and the refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from loss_cases import DIVERGENCES, PAIR_IDS, PAIRS, TAU, make_case, reference_teacher_chunk

from crosskd.errors import ConfigError
from crosskd.loss import LossConfig, TeacherBatch, TeacherLossConfig, compute_loss, plan_loss
from crosskd.loss import gold as gold_module
from crosskd.loss.gold import partition
from crosskd.projection import build_projection
from crosskd.projection.format import Projection, ProjectionMeta

K = 8
TABLES = {"student_to_teacher": "s2t", "teacher_to_student": "t2s"}


def _projection(rows: list[dict[int, float]], v_t: int) -> Projection:
    lengths = [len(r) for r in rows]
    meta = ProjectionMeta("S", "T", "fs", "ft", len(rows), v_t, 4, 4)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ordered = [sorted(r.items(), key=lambda e: (-e[1], e[0])) for r in rows]
    columns = np.array([t for r in ordered for t, _ in r], dtype=np.int32)
    weights = np.array([w for r in ordered for _, w in r], dtype=np.float32)
    return Projection(offsets, columns, weights, meta)


def test_partitions_by_hand():
    """s0 -> t0 .7, t1 .3; s1 -> t0 .8, t2 .2; s2 -> t1 1; s3 -> t0 .8, t1 .2. Gold: the one
    exact row, s2 - t1. H-KL: t0 is claimed by s0 (.7), s1 and s3 (.8 each): s1 wins (the
    largest, then the lowest id); t1 by s2 alone (1.0)."""
    w = _projection([{0: 0.7, 1: 0.3}, {0: 0.8, 2: 0.2}, {1: 1.0}, {0: 0.8, 1: 0.2}], 3)
    assert partition(w, relaxed=False).tolist() == [[2, 1]]
    assert partition(w, relaxed=True).tolist() == [[1, 0], [2, 1]]


def _reference(case, signal, projection, logits, algorithm, kind, beta=0.5):
    pairs = partition(projection, relaxed=algorithm == "hkl")
    student_of = {t: s for s, t in pairs.tolist()}
    common = torch.zeros(logits.shape[-1], dtype=torch.bool)
    common[torch.from_numpy(pairs[:, 0])] = True
    log_p = torch.log_softmax(logits / TAU, dim=-1)
    total, n = logits.new_zeros(()), 0
    for c in torch.nonzero(case.chunks.valid).flatten().tolist():
        b = int(case.chunks.row[c])
        s0, s1 = case.chunks.student[c].tolist()
        t0, t1 = case.chunks.teacher[c].tolist()
        support, mean_log, rest = reference_teacher_chunk(signal, b, range(t0 - 1, t1 - 1))
        log_s = log_p[b, s0 - 1 : s1 - 1].mean(0)
        d = logits.new_zeros(())
        for v, t in zip(support, mean_log.tolist(), strict=True):
            if v not in student_of:
                continue
            s = log_s[student_of[v]]
            if kind == "forward_kl":
                d = d + math.exp(t) * (t - s)
            elif kind == "reverse_kl":
                d = d + s.exp() * (s - t)
            else:
                m = torch.logaddexp(torch.tensor(t + math.log(beta)), s + math.log(1 - beta))
                d = d + beta * math.exp(t) * (t - m) + (1 - beta) * s.exp() * (s - m)
        uncommon_t = [math.exp(x) for v, x in zip(support, mean_log, strict=True)]
        uncommon_t = [x for v, x in zip(support, uncommon_t, strict=True) if v not in student_of]
        teacher = torch.tensor(sorted([*uncommon_t, math.exp(rest)], reverse=True))
        student = log_s.exp()[~common]
        top = student.sort(descending=True).values[: len(teacher)]
        l1 = (top - teacher).abs().sum() + (student.sum() - top.sum())
        total, n = total + d + l1, n + 1
    return TAU**2 * total / n


def _config(algorithm: str, kind: str = "forward_kl") -> LossConfig:
    entry = TeacherLossConfig(k=K, algorithm=algorithm, projection="w", **TABLES)
    return LossConfig(tau=TAU, divergence=kind, teachers=[entry])


def _plan(case, signal, config, projection):
    return plan_loss(
        config,
        case.student_ids,
        case.loss_mask,
        [TeacherBatch(case.teacher_ids, case.chunks, signal)],
        [case.pair],
        student_vocab=case.student_logits.shape[-1],
        projections=[projection],
    )


@pytest.fixture(scope="module", params=PAIRS, ids=PAIR_IDS)
def gcase(request, zoo, built_table):
    student, teacher, texts = request.param
    case = make_case(zoo, built_table, student, teacher, texts)
    return case, build_projection(case.pair)


@pytest.mark.parametrize(
    ("algorithm", "kind"), [*(("gold", kind) for kind in DIVERGENCES), ("hkl", "forward_kl")]
)
def test_matches_the_reference_values_and_gradients(gcase, algorithm, kind):
    case, projection = gcase
    signal = case.signal(K)
    config = _config(algorithm, kind)
    plan = _plan(case, signal, config, projection)
    logits = case.logits(torch.float64)
    out = compute_loss(logits, plan, config)
    (grad,) = torch.autograd.grad(out.kd, logits)
    ref_logits = case.logits(torch.float64)
    want = _reference(case, signal, projection, ref_logits, algorithm, kind)
    (ref_grad,) = torch.autograd.grad(want, ref_logits)
    assert out.kd.item() == pytest.approx(want.item(), rel=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-12)
    sums = out.sums
    total = sums["teacher0/gold_common"] + sums["teacher0/gold_uncommon"]
    assert TAU**2 * total / plan.counts.chunks[0] == pytest.approx(out.kd.item(), rel=1e-9)


def test_blocks_of_chunks_agree(gcase, monkeypatch):
    case, projection = gcase
    signal = case.signal(K)
    config = _config("hkl")
    plan = _plan(case, signal, config, projection)
    whole = compute_loss(case.logits(torch.float32), plan, config).kd.item()
    monkeypatch.setattr(gold_module, "BLOCK_CHUNKS", 3)
    assert compute_loss(case.logits(torch.float32), plan, config).kd.item() == pytest.approx(
        whole, rel=1e-6
    )


def test_refusals():
    with pytest.raises(ConfigError, match=r"teachers\[0\] uses algorithm gold, which reads a"):
        LossConfig(teachers=[TeacherLossConfig(algorithm="gold", **TABLES)])
    with pytest.raises(ConfigError, match=r"algorithm hkl with k 0"):
        LossConfig(teachers=[TeacherLossConfig(algorithm="hkl", k=0, projection="w", **TABLES)])
    config = LossConfig(kd="gold", teachers=[TeacherLossConfig(projection="w", **TABLES)])
    assert config.whole_rows() == "teachers[0] (gold)"


def test_a_missing_projection_is_refused_when_the_loss_is_planned(gcase):
    case, _ = gcase
    with pytest.raises(ConfigError, match=r"teachers\[0\] uses algorithm hkl but no projection"):
        _plan(case, case.signal(K), _config("hkl"), None)
