"""The CSD KD term (spec section 5) on real tokenizer pairs: properties of the slow reference
(``tests/loss_reference.py``) and parity of the vectorised ``crosskd.loss.csd.csd_kd`` with it.

Batches: ``tests/loss_cases.py``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from loss_cases import (
    DIVERGENCES,
    PAIR_IDS,
    PAIRS,
    TAU,
    CsdCase,
    loss_config,
    make_case,
    plan_rows,
)
from loss_reference import (
    SHAPE_1_N,
    SHAPE_N_1,
    lookups,
    reference_chunks,
    reference_kd,
)

from crosskd.data.collate import ChunkBatch
from crosskd.loss import CsdOptions, csd_kd
from crosskd.teacher import signal_from_logits


@pytest.fixture(scope="module", params=PAIRS, ids=PAIR_IDS)
def case(request, zoo, built_table) -> CsdCase:
    student, teacher, texts = request.param
    return make_case(zoo, built_table, student, teacher, texts)


# --- the vectorised implementation, called like the reference -------------------------------


def implementation_kd(
    logits, case: CsdCase, signal, *, tau=TAU, divergence="jsd", beta=0.5, **options
):
    """``(KD, N)`` from ``crosskd.loss.csd.csd_kd``, called like the reference (with its
    default ``mismatch_weight`` 5, not the library's 1, so the weight is checked)."""
    options = {"mismatch_weight": 5.0, **options}
    term = csd_kd(
        logits,
        case.student_ids,
        case.teacher_ids,
        signal,
        case.chunks,
        case.pair,
        tau=tau,
        kind=divergence,
        beta=beta,
        options=CsdOptions(**options),
    )
    return term.value, term.n_chunks


def grad_of(kd: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(kd, logits, allow_unused=True)
    return torch.zeros_like(logits) if grad is None else grad


# --- the reference's own properties ---------------------------------------------------------


def test_reference_lookups_match_the_table_pair(case):
    look = lookups(case.pair)
    mine = sorted((i, j) for j, i in look.common_t2s.items())
    assert mine == [tuple(r) for r in case.pair.common.tolist()]


@pytest.mark.parametrize("k", [8, 64])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_reference_is_finite_nonnegative_with_finite_gradient(case, k, divergence):
    logits = case.logits()
    kd, n = reference_kd(
        logits,
        case.student_ids,
        case.teacher_ids,
        case.signal(k),
        case.chunks,
        case.pair,
        tau=TAU,
        divergence=divergence,
    )
    assert n > 0
    assert math.isfinite(kd.item()) and kd.item() >= 0
    grad = grad_of(kd, logits)
    assert torch.isfinite(grad).all()
    assert grad.abs().sum() > 0


def _prefix_free(paths: list[tuple[int, ...]]) -> bool:
    """No path equals or extends another: the events are disjoint sets of continuations.
    (In lexicographic order a path that is a prefix of another is a prefix of the next one.)"""
    ordered = sorted(paths)
    return all(b[: len(a)] != a for a, b in itertools.pairwise(ordered))


@pytest.mark.parametrize("k", [8, 64])
def test_events_are_disjoint_and_rest_completes_them(case, k):
    logits = case.logits()
    infos = reference_chunks(
        logits,
        case.student_ids,
        case.teacher_ids,
        case.signal(k),
        case.chunks,
        case.pair,
        tau=TAU,
        keep_realized=True,
    )
    with_alternatives = 0
    for info in infos:
        if not info.counts:
            continue
        assert _prefix_free([e.student_path for e in info.events])
        assert _prefix_free([e.teacher_path for e in info.events])
        assert sum(e.kind == "realized" for e in info.events) == 1
        teacher_mass = sum(math.exp(e.b) for e in info.events)
        student_mass = sum(math.exp(e.a) for e in info.events)
        assert teacher_mass <= 1 + 1e-6 and student_mass <= 1 + 1e-9
        assert teacher_mass + math.exp(info.log_rest_t) == pytest.approx(1, abs=1e-9)
        assert student_mass + math.exp(info.log_rest_s.item()) == pytest.approx(1, abs=1e-9)
        if info.shape in (SHAPE_1_N, SHAPE_N_1) and len(info.events) > 1:
            with_alternatives += 1
            assert all(e.kind == "prefix" for e in info.events if e.kind != "realized")
    assert with_alternatives > 0, "the batch must exercise 1:n / n:1 alternatives"


def test_mismatch_events_are_disjoint_with_a_dense_teacher(case):
    """Dense: every prefix alternative exists; the teacher mass of E still cannot exceed 1."""
    sub = _subset(case, 2, (SHAPE_1_N, SHAPE_N_1))
    infos = reference_chunks(
        sub.logits(),
        sub.student_ids,
        sub.teacher_ids,
        sub.signal(0),
        sub.chunks,
        sub.pair,
        tau=TAU,
    )
    counted = [info for info in infos if info.counts]
    assert counted
    for info in counted:
        assert _prefix_free([e.teacher_path for e in info.events])
        assert _prefix_free([e.student_path for e in info.events])
        assert sum(math.exp(e.b) for e in info.events) <= 1 + 1e-6
        assert sum(math.exp(e.a) for e in info.events) <= 1 + 1e-9


def test_positions_a_token_is_priced_by_the_row_before_it(case):
    """Spec 8.6: only the correct row carries mass, so every realized event has log prob ~0."""
    logits = torch.zeros_like(case.student_logits, dtype=torch.float64)
    teacher = torch.zeros_like(case.teacher_logits)
    for b in range(logits.shape[0]):
        for p in range(1, logits.shape[1]):
            logits[b, p - 1, case.student_ids[b, p]] = 60.0
        for t in range(1, teacher.shape[1]):
            teacher[b, t - 1, case.teacher_ids[b, t]] = 60.0
    signal = signal_from_logits(teacher, case.teacher_ids, k=8, tau=TAU)
    infos = reference_chunks(
        logits,
        case.student_ids,
        case.teacher_ids,
        signal,
        case.chunks,
        case.pair,
        tau=TAU,
    )
    realized = [e for info in infos for e in info.events if e.kind == "realized"]
    assert len(realized) == int(case.chunks.valid.sum())
    for event in realized:
        assert event.a > -1e-6 and event.b > -1e-6


def _subset(case: CsdCase, per_shape: int = 1, shapes=range(5)) -> CsdCase:
    """A few valid chunks of every shape (keeps the dense reference fast)."""
    keep = torch.zeros_like(case.chunks.valid)
    for shape in shapes:
        idx = torch.nonzero(case.chunks.valid & (case.chunks.shape == shape)).flatten()
        keep[idx[:per_shape]] = True
    return case.with_valid(keep)


def test_dense_equals_sparse_with_k_covering_the_vocabulary(case):
    """Spec 8.3: K = V and keep_realized off is the dense objective; keep_realized changes the
    objective of a top-K signal."""
    sub = _subset(case)
    vocab = sub.teacher_logits.shape[-1]
    args = (sub.student_ids, sub.teacher_ids)
    dense, n_dense = reference_kd(sub.logits(), *args, sub.signal(0), sub.chunks, sub.pair, tau=TAU)
    full, n_full = reference_kd(
        sub.logits(), *args, sub.signal(vocab), sub.chunks, sub.pair, tau=TAU
    )
    assert n_dense == n_full > 0
    assert dense.item() == pytest.approx(full.item(), rel=1e-12)

    differ = False
    for k in (8, 64):
        signal = case.signal(k)
        base = (case.logits(), *args, signal, case.chunks, case.pair)
        off, _ = reference_kd(*base, tau=TAU)
        on, _ = reference_kd(*base, tau=TAU, keep_realized=True)
        differ |= abs(on.item() - off.item()) > 1e-9 * abs(off.item())
    assert differ


def test_no_valid_chunk_gives_zero_and_zero_gradient(case):
    signal = case.signal(8)
    none_valid = case.with_valid(torch.zeros_like(case.chunks.valid))
    empty = replace(
        case,
        chunks=ChunkBatch(
            torch.zeros(0, dtype=torch.int64),
            torch.zeros(0, 2, dtype=torch.int64),
            torch.zeros(0, 2, dtype=torch.int64),
            torch.zeros(0, dtype=torch.uint8),
            torch.zeros(0, dtype=torch.uint8),
            torch.zeros(0, dtype=torch.bool),
            torch.zeros(0, dtype=torch.uint8),
            torch.zeros(0, dtype=torch.int64),
        ),
    )
    for sub in (none_valid, empty):
        logits = sub.logits()
        kd, n = reference_kd(
            logits, sub.student_ids, sub.teacher_ids, signal, sub.chunks, sub.pair, tau=TAU
        )
        assert n == 0 and kd.item() == 0
        assert torch.count_nonzero(grad_of(kd, logits)) == 0


# --- parity of the vectorised loss with the reference ---------------------------------------

OPTION_SETS = {
    "k8": (8, {}),
    "k64": (64, {}),
    "keep_realized": (8, {"keep_realized": True}),
    "realized_only_mismatch": (64, {"realized_only_mismatch": True}),
    "drop_unrealized_topk": (8, {"drop_unrealized_topk": True, "mismatch_weight": 2.5}),
    "min_support_10": (8, {"min_mismatch_support": 10}),
}


PARITY = [("jsd", name) for name in OPTION_SETS] + [
    (kind, name) for kind in ("forward_kl", "reverse_kl") for name in ("k8", "keep_realized")
]


@pytest.mark.parametrize(("divergence", "option_set"), PARITY)
def test_csd_kd_matches_the_reference(case, divergence, option_set):
    k, options = OPTION_SETS[option_set]
    signal = case.signal(k)
    ref_logits, impl_logits = case.logits(), case.logits()
    ref, n_ref = reference_kd(
        ref_logits,
        case.student_ids,
        case.teacher_ids,
        signal,
        case.chunks,
        case.pair,
        tau=TAU,
        divergence=divergence,
        beta=0.3 if divergence == "jsd" else 0.5,
        **options,
    )
    got, n_got = implementation_kd(
        impl_logits,
        case,
        signal,
        divergence=divergence,
        beta=0.3 if divergence == "jsd" else 0.5,
        **options,
    )
    assert n_got == n_ref > 0
    assert got.item() == pytest.approx(ref.item(), rel=1e-6)
    g_ref, g_got = grad_of(ref, ref_logits), grad_of(got, impl_logits)
    scale = g_ref.abs().max().item()
    torch.testing.assert_close(g_got.double(), g_ref, rtol=1e-5, atol=1e-5 * scale)


def test_csd_kd_matches_the_reference_dense(case):
    sub = _subset(case)
    signal = sub.signal(0)
    for keep in (False,):
        ref_logits, impl_logits = sub.logits(), sub.logits()
        ref, n_ref = reference_kd(
            ref_logits,
            sub.student_ids,
            sub.teacher_ids,
            signal,
            sub.chunks,
            sub.pair,
            tau=TAU,
            keep_realized=keep,
        )
        got, n_got = implementation_kd(impl_logits, sub, signal, keep_realized=keep)
        assert n_got == n_ref > 0
        assert got.item() == pytest.approx(ref.item(), rel=1e-6)
        g_ref, g_got = grad_of(ref, ref_logits), grad_of(got, impl_logits)
        torch.testing.assert_close(
            g_got.double(), g_ref, rtol=1e-5, atol=1e-5 * g_ref.abs().max().item()
        )


def test_csd_kd_float32_logits_close_to_the_reference(case):
    signal = case.signal(64)
    ref, _ = reference_kd(
        case.logits(), case.student_ids, case.teacher_ids, signal, case.chunks, case.pair, tau=TAU
    )
    got, _ = implementation_kd(case.logits(torch.float32), case, signal)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(ref.item(), rel=1e-4)


def test_csd_kd_no_valid_chunk_gives_zero_and_zero_gradient(case):
    sub = case.with_valid(torch.zeros_like(case.chunks.valid))
    logits = sub.logits()
    kd, n = implementation_kd(logits, sub, sub.signal(8))
    assert n == 0 and kd.item() == 0
    assert torch.count_nonzero(grad_of(kd, logits)) == 0


# --- the whole loss on real pairs: micro-batches, metrics, event mass -----------------------


def test_micro_batches_with_step_counts_sum_to_the_whole_batch(case):
    """Summing the micro-batch losses (each normalised by the step's counts) gives the loss and
    gradient of the whole batch."""
    from crosskd.loss import compute_loss

    config = loss_config(64)
    signal = case.signal(64)
    whole = plan_rows(case, signal, config)
    parts = [plan_rows(case, signal, config, slice(r, r + 1)) for r in (0, 1)]
    counts = parts[0].counts + parts[1].counts
    assert counts == whole.counts and counts.chunks[0] > 0
    logits = case.logits()
    full = compute_loss(logits, whole, config)
    (g_full,) = torch.autograd.grad(full.loss, logits)
    split_logits = case.logits()
    total = sum(
        compute_loss(split_logits[i : i + 1], part, config, counts).loss
        for i, part in enumerate(parts)
    )
    (g_split,) = torch.autograd.grad(total, split_logits)
    assert total.item() == pytest.approx(full.loss.item(), rel=1e-12)
    torch.testing.assert_close(g_split, g_full, rtol=1e-10, atol=1e-12)


def test_metrics_match_the_reference_per_shape(case):
    from crosskd.loss import compute_loss
    from crosskd.loss.metrics import SHAPES, SKIP_REASONS

    config = loss_config(8, drop_unrealized_topk=True, min_mismatch_support=3)
    signal = case.signal(8)
    out = compute_loss(case.logits(), plan_rows(case, signal, config), config)
    metrics = out.metrics
    infos = reference_chunks(
        case.logits(),
        case.student_ids,
        case.teacher_ids,
        signal,
        case.chunks,
        case.pair,
        tau=TAU,
        drop_unrealized_topk=True,
        min_mismatch_support=3,
    )
    reasons = {"dropped-unrealized": "dropped_unrealized", "unsupported": "unsupported"}
    shares = 0.0
    for code, name in enumerate(SHAPES[:5]):
        here = [i for i in infos if i.shape == code]
        counted = [i for i in here if i.counts]
        key = f"teacher0/{name}"
        assert metrics.get(f"{key}/chunks", 0) == len(here)
        assert metrics.get(f"{key}/valid", 0) == len(counted)
        skipped = sum(metrics.get(f"{key}/skipped_{r}", 0) for r in SKIP_REASONS)
        assert skipped + len(counted) == len(here)
        for ref_reason, reason in reasons.items():
            want = sum(i.reason == ref_reason for i in here)
            assert metrics.get(f"{key}/skipped_{reason}", 0) == want
        if not counted:
            continue
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        assert metrics[f"{key}/mean_divergence"] == pytest.approx(
            mean([i.d.item() for i in counted]), rel=1e-6
        )
        assert metrics[f"{key}/mean_events"] == mean([len(i.events) for i in counted])
        assert metrics[f"{key}/mean_rest_student"] == pytest.approx(
            mean([math.exp(i.log_rest_s.item()) for i in counted]), rel=1e-6, abs=1e-12
        )
        assert metrics[f"{key}/mean_rest_teacher"] == pytest.approx(
            mean([math.exp(i.log_rest_t) for i in counted]), rel=1e-6, abs=1e-12
        )
        shares += metrics[f"{key}/kd_share"]
    assert shares == pytest.approx(1.0)
    assert any(i.reason == "dropped-unrealized" for i in infos)
    assert any(i.reason == "unsupported" for i in infos)


def test_teacher_mass_of_mismatch_events_is_at_most_one(case):
    """For 1:n and n:1 the events are disjoint, so their teacher probabilities sum to at most 1
    (REST completes them), with a dense signal where every alternative exists."""
    from crosskd.loss import build_events

    sub = _subset(case, 2, (SHAPE_1_N, SHAPE_N_1))
    events = build_events(
        sub.student_ids.numpy(),
        sub.teacher_ids.numpy(),
        sub.signal(0),
        sub.chunks,
        sub.pair,
        CsdOptions(),
    )
    assert events.n_chunks > 0
    mass = np.bincount(events.event_chunk, weights=np.exp(events.teacher_lp))
    assert (mass <= 1 + 1e-6).all() and (mass > 0).all()


def test_a_signal_of_another_teacher_vocabulary_is_refused_naming_the_tables(case):
    from crosskd.errors import ConfigError
    from crosskd.loss import TeacherBatch, plan_loss

    ids = case.teacher_ids
    small = signal_from_logits(torch.zeros(*ids.shape, 1000), ids % 1000, k=8, tau=TAU)
    config = loss_config(8)
    with pytest.raises(
        ConfigError,
        match=r"teachers\[0\]: the teacher signal has V = 1000 rows, "
        r"its tables were built for V = 151936",
    ):
        plan_loss(
            config,
            case.student_ids,
            case.loss_mask,
            [TeacherBatch(ids, case.chunks, small)],
            [case.pair],
            student_vocab=case.student_logits.shape[-1],
        )
