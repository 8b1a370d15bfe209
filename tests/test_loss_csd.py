"""The CSD KD term (spec section 5) on real tokenizer pairs: properties of the slow reference
(``tests/loss_reference.py``) and parity of the vectorised ``crosskd.loss.csd.csd_kd`` with it.

Batches are real texts aligned by the real tokenizers (real ids, chunks and tables) with random
logits over the full vocabularies, biased so that realized tokens and candidate alternatives
(common tokens, chain prefixes) land in the teacher's top K.
"""

from __future__ import annotations

import inspect
import itertools
import math
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from loss_reference import (
    SHAPE_1_1,
    SHAPE_1_N,
    SHAPE_N_1,
    SHAPE_N_M,
    SHAPE_SPECIAL,
    lookups,
    reference_chunks,
    reference_kd,
)

from crosskd.alignment import align_text
from crosskd.data.collate import ChunkBatch
from crosskd.tables import TablePair
from crosskd.teacher import signal_from_logits

TEXTS = [
    "In 2024, 東京 had 13,960,000 people 🎉 and 3.14159 pies.",
    "Hello world!\n\nNaïve café: 42 ñandúes 😀 über 7x7=49 ★",
    "The 1234th emoji 👩\u200d💻 wrote: 数据 + données = 99%",
]
# (student, teacher, texts): two rows each, at most 32 student tokens per row.
PAIRS = [("llama3", "qwen3", (0, 2)), ("smollm2", "qwen3", (1, 2))]
PAIR_IDS = [f"{s}-{t}" for s, t, _ in PAIRS]
TAU = 2.0
BIAS = 20.0  # added to teacher logits of realized tokens and candidate alternatives
DIVERGENCES = ("jsd", "forward_kl", "reverse_kl")


@dataclass
class CsdCase:
    """One batch: ids, chunks, tables and raw (biased) logits of both sides."""

    name: str
    student_ids: torch.Tensor  # [B, Ls]
    teacher_ids: torch.Tensor  # [B, Lt]
    chunks: ChunkBatch
    pair: TablePair
    student_logits: torch.Tensor  # float32 [B, Ls, V_S]
    teacher_logits: torch.Tensor  # float32 [B, Lt, V_T]

    def signal(self, k: int, tau: float = TAU):
        return signal_from_logits(self.teacher_logits, self.teacher_ids, k=k, tau=tau)

    def logits(self, dtype=torch.float64) -> torch.Tensor:
        return self.student_logits.to(dtype).clone().requires_grad_(True)

    def with_valid(self, valid: torch.Tensor) -> CsdCase:
        return replace(self, chunks=replace(self.chunks, valid=valid))


def _pad(rows: list[np.ndarray]) -> torch.Tensor:
    out = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.int64)
    for b, r in enumerate(rows):
        out[b, : len(r)] = torch.from_numpy(np.asarray(r, dtype=np.int64))
    return out


def make_case(zoo, built_table, student: str, teacher: str, texts, seed: int = 0) -> CsdCase:
    s_tok, t_tok = zoo(student), zoo(teacher)
    pair = TablePair(built_table(student, teacher), built_table(teacher, student))
    samples = [align_text(s_tok, t_tok, TEXTS[i]) for i in texts]
    student_ids = _pad([a.student.tokens.ids for a in samples])
    teacher_ids = _pad([a.teacher.tokens.ids for a in samples])
    parts = {k: [] for k in ("row", "s", "t", "shape", "valid")}
    for b, a in enumerate(samples):
        ch = a.chunks
        parts["row"].append(np.full(len(ch), b, dtype=np.int64))
        parts["s"].append(ch.student)
        parts["t"].append(ch.teacher)
        parts["shape"].append(ch.shape)
        parts["valid"].append(ch.is_correct & ch.has_prediction & a.kd_mask)
    cat = {k: torch.from_numpy(np.concatenate(v)) for k, v in parts.items()}
    shape = cat["shape"].to(torch.uint8).clone()
    valid = cat["valid"].to(torch.bool)
    # The plain-text zoo batches have no role pair; relabel one valid 1:1 chunk as a special
    # pair so the special path (realized only, always in E) is exercised too.
    one_to_one = torch.nonzero(valid & (shape == SHAPE_1_1)).flatten()
    shape[one_to_one[len(one_to_one) // 2]] = SHAPE_SPECIAL
    chunks = ChunkBatch(
        row=cat["row"].long(), student=cat["s"].long(), teacher=cat["t"].long(), shape=shape,
        region=torch.zeros(len(shape), dtype=torch.uint8), valid=valid,
    )  # fmt: skip

    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    n_b, l_s = student_ids.shape
    l_t = teacher_ids.shape[1]
    student_logits = 2.0 * torch.randn(n_b, l_s, s_tok.vocab_size, generator=gen)
    teacher_logits = torch.randn(n_b, l_t, t_tok.vocab_size, generator=gen)
    # Realized next tokens in the top K, except at the last row of every fourth chunk, every
    # other n:m chunk and the special pair (so keep_realized, drop_unrealized_topk and the
    # "no event" case all occur).
    for b in range(n_b):
        for r in range(l_t - 1):
            teacher_logits[b, r, teacher_ids[b, r + 1]] += BIAS
        for r in range(l_s - 1):
            student_logits[b, r, student_ids[b, r + 1]] += 4.0
    n_m_seen = 0
    for v, c in enumerate(torch.nonzero(valid).flatten().tolist()):
        b, t1 = int(chunks.row[c]), int(chunks.teacher[c, 1])
        n_m = int(shape[c]) == SHAPE_N_M
        n_m_seen += n_m
        if v % 4 == 3 or (n_m and n_m_seen % 2 == 1) or int(shape[c]) == SHAPE_SPECIAL:
            teacher_logits[b, t1 - 2, teacher_ids[b, t1 - 1]] -= BIAS

    def boost(b: int, row: int, candidates: np.ndarray, n: int) -> None:
        if len(candidates):
            pick = rng.choice(candidates, size=min(n, len(candidates)), replace=False)
            teacher_logits[b, row, torch.from_numpy(pick)] += BIAS * rng.uniform(0.8, 1.0)

    common_t = pair.common[:, 1]
    s_list, t_list = student_ids.tolist(), teacher_ids.tolist()
    for c in torch.nonzero(valid).flatten().tolist():
        b = int(chunks.row[c])
        s0, s1 = chunks.student[c].tolist()
        t0, t1 = chunks.teacher[c].tolist()
        s_path, t_path = s_list[b][s0:s1], t_list[b][t0:t1]
        if int(shape[c]) == SHAPE_1_1:
            boost(b, t0 - 1, common_t, 4)
        elif int(shape[c]) == SHAPE_1_N:
            for k in range(1, len(t_path) + 1):
                rows = pair.prefix_s2t.get(tuple(t_path[: k - 1]))
                if rows is not None:
                    boost(b, t0 + k - 2, rows[rows[:, 1] != t_path[k - 1], 1], 3)
        elif int(shape[c]) == SHAPE_N_1:
            for k in range(1, len(s_path) + 1):
                rows = pair.prefix_t2s.get(tuple(s_path[: k - 1]))
                if rows is not None:
                    boost(b, t0 - 1, rows[rows[:, 1] != s_path[k - 1], 0], 2)
    return CsdCase(
        f"{student}-{teacher}", student_ids, teacher_ids, chunks, pair, student_logits,
        teacher_logits,
    )  # fmt: skip


@pytest.fixture(scope="module", params=PAIRS, ids=PAIR_IDS)
def case(request, zoo, built_table) -> CsdCase:
    student, teacher, texts = request.param
    return make_case(zoo, built_table, student, teacher, texts)


# --- the vectorised implementation, called like the reference -------------------------------


def implementation_kd(logits, case: CsdCase, signal, *, tau=TAU, divergence="jsd", beta=0.5,
                      **options):  # fmt: skip
    """``(KD, N)`` from ``crosskd.loss.csd.csd_kd`` (skips the test until it exists)."""
    csd = pytest.importorskip("crosskd.loss.csd")
    params = inspect.signature(csd.csd_kd).parameters
    kwargs = {"tau": tau, "beta": beta}
    kwargs["kind" if "kind" in params else "divergence"] = divergence
    if "options" in params:
        from crosskd.loss.events import CsdOptions

        kwargs["options"] = CsdOptions(**options)
    else:
        kwargs.update(options)
    result = csd.csd_kd(
        logits, case.student_ids, case.teacher_ids, signal, case.chunks, case.pair, **kwargs
    )
    kd, n = result if isinstance(result, tuple) else (result.kd, result.n_valid)
    return kd, int(n)


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
        logits, case.student_ids, case.teacher_ids, case.signal(k), case.chunks, case.pair,
        tau=TAU, divergence=divergence,
    )  # fmt: skip
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
        logits, case.student_ids, case.teacher_ids, case.signal(k), case.chunks, case.pair,
        tau=TAU, keep_realized=True,
    )  # fmt: skip
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
        sub.logits(), sub.student_ids, sub.teacher_ids, sub.signal(0), sub.chunks, sub.pair,
        tau=TAU,
    )  # fmt: skip
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
        logits, case.student_ids, case.teacher_ids, signal, case.chunks, case.pair, tau=TAU,
    )  # fmt: skip
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
    dense, n_dense = reference_kd(sub.logits(), *args, sub.signal(0), sub.chunks, sub.pair,
                                  tau=TAU)  # fmt: skip
    full, n_full = reference_kd(sub.logits(), *args, sub.signal(vocab), sub.chunks, sub.pair,
                                tau=TAU)  # fmt: skip
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
    empty = replace(case, chunks=ChunkBatch(
        torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2, dtype=torch.int64),
        torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, dtype=torch.uint8),
        torch.zeros(0, dtype=torch.uint8), torch.zeros(0, dtype=torch.bool),
    ))  # fmt: skip
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
    pytest.importorskip("crosskd.loss.csd")
    k, options = OPTION_SETS[option_set]
    signal = case.signal(k)
    ref_logits, impl_logits = case.logits(), case.logits()
    ref, n_ref = reference_kd(
        ref_logits, case.student_ids, case.teacher_ids, signal, case.chunks, case.pair,
        tau=TAU, divergence=divergence, beta=0.3 if divergence == "jsd" else 0.5, **options,
    )  # fmt: skip
    got, n_got = implementation_kd(
        impl_logits, case, signal, divergence=divergence,
        beta=0.3 if divergence == "jsd" else 0.5, **options,
    )  # fmt: skip
    assert n_got == n_ref > 0
    assert got.item() == pytest.approx(ref.item(), rel=1e-6)
    g_ref, g_got = grad_of(ref, ref_logits), grad_of(got, impl_logits)
    scale = g_ref.abs().max().item()
    torch.testing.assert_close(g_got.double(), g_ref, rtol=1e-5, atol=1e-5 * scale)


def test_csd_kd_matches_the_reference_dense(case):
    pytest.importorskip("crosskd.loss.csd")
    sub = _subset(case)
    signal = sub.signal(0)
    for keep in (False,):
        ref_logits, impl_logits = sub.logits(), sub.logits()
        ref, n_ref = reference_kd(
            ref_logits, sub.student_ids, sub.teacher_ids, signal, sub.chunks, sub.pair,
            tau=TAU, keep_realized=keep,
        )  # fmt: skip
        got, n_got = implementation_kd(impl_logits, sub, signal, keep_realized=keep)
        assert n_got == n_ref > 0
        assert got.item() == pytest.approx(ref.item(), rel=1e-6)
        g_ref, g_got = grad_of(ref, ref_logits), grad_of(got, impl_logits)
        torch.testing.assert_close(
            g_got.double(), g_ref, rtol=1e-5, atol=1e-5 * g_ref.abs().max().item()
        )


def test_csd_kd_float32_logits_close_to_the_reference(case):
    pytest.importorskip("crosskd.loss.csd")
    signal = case.signal(64)
    ref, _ = reference_kd(
        case.logits(), case.student_ids, case.teacher_ids, signal, case.chunks, case.pair, tau=TAU
    )
    got, _ = implementation_kd(case.logits(torch.float32), case, signal)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(ref.item(), rel=1e-4)


def test_csd_kd_no_valid_chunk_gives_zero_and_zero_gradient(case):
    pytest.importorskip("crosskd.loss.csd")
    sub = case.with_valid(torch.zeros_like(case.chunks.valid))
    logits = sub.logits()
    kd, n = implementation_kd(logits, sub, sub.signal(8))
    assert n == 0 and kd.item() == 0
    assert torch.count_nonzero(grad_of(kd, logits)) == 0
