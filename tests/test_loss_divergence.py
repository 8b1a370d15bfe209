"""Divergences over events + REST (spec section 5, "Divergence"; issue 4, item 2)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from crosskd.loss import divergence, with_rest
from crosskd.loss.divergence import DIVERGENCES, LOG_REST_FLOOR

KINDS = list(DIVERGENCES)


def _full_mask(event_mask: torch.Tensor) -> torch.Tensor:
    """Event mask ``[C, E]`` -> ``[C, E + 1]`` with the (always real) REST column."""
    return torch.nn.functional.pad(event_mask, (0, 1), value=True)


def _chunk(probs: list[float], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """One chunk's event log probs ``[1, E]``."""
    return torch.tensor([probs], dtype=dtype).log()


# ---------------------------------------------------------------- worked examples
# Two events. S = (0.5, 0.3) so REST_S = 0.2; T = (0.6, 0.2) so REST_T = 0.2.
#
# forward KL = KL(T||S) = sum T ln(T/S)
#   = 0.6 ln(0.6/0.5) + 0.2 ln(0.2/0.3) + 0.2 ln(0.2/0.2)
#   = 0.6 * 0.1823215568 + 0.2 * (-0.4054651081) + 0
#   = 0.1093929341 - 0.0810930216 = 0.0282999125
# reverse KL = KL(S||T)
#   = 0.5 ln(0.5/0.6) + 0.3 ln(0.3/0.2) + 0.2 ln(1)
#   = 0.5 * (-0.1823215568) + 0.3 * 0.4054651081 = -0.0911607784 + 0.1216395324 = 0.0304787540
# JSD beta = 0.5: M = 0.5 T + 0.5 S = (0.55, 0.25, 0.2)
#   KL(T||M) = 0.6 ln(0.6/0.55) + 0.2 ln(0.2/0.25) = 0.6 * 0.0870113770 - 0.2 * 0.2231435513
#            = 0.0522068262 - 0.0446287103 = 0.0075781159
#   KL(S||M) = 0.5 ln(0.5/0.55) + 0.3 ln(0.3/0.25) = -0.5 * 0.0953101798 + 0.3 * 0.1823215568
#            = -0.0476550899 + 0.0546964670 = 0.0070413771
#   D = 0.5 * 0.0075781159 + 0.5 * 0.0070413771 = 0.0073097465
# JSD beta = 0.9: M = 0.9 T + 0.1 S = (0.54 + 0.05, 0.18 + 0.03, 0.18 + 0.02) = (0.59, 0.21, 0.2)
#   KL(T||M) = 0.6 ln(0.6/0.59) + 0.2 ln(0.2/0.21) = 0.6 * 0.0168071183 - 0.2 * 0.0487901642
#            = 0.0100842710 - 0.0097580328 = 0.0003262382
#   KL(S||M) = 0.5 ln(0.5/0.59) + 0.3 ln(0.3/0.21) = -0.5 * 0.1655144385 + 0.3 * 0.3566749439
#            = -0.0827572193 + 0.1070024832 = 0.0242452639
#   D = 0.9 * 0.0003262382 + 0.1 * 0.0242452639 = 0.0002936144 + 0.0024245264 = 0.0027181408
WORKED = [
    ("forward_kl", 0.5, 0.0282999125),
    ("reverse_kl", 0.5, 0.0304787540),
    ("jsd", 0.5, 0.0073097465),
    ("jsd", 0.9, 0.0027181408),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("kind", "beta", "expected"), WORKED)
def test_worked_example(kind: str, beta: float, expected: float, dtype: torch.dtype) -> None:
    events = torch.ones(1, 2, dtype=torch.bool)
    s = with_rest(_chunk([0.5, 0.3], dtype), events)
    t = with_rest(_chunk([0.6, 0.2], dtype), events)
    # REST = 1 - 0.5 - 0.3 = 0.2 and 1 - 0.6 - 0.2 = 0.2.
    assert s[0, 2].item() == pytest.approx(math.log(0.2), rel=1e-6)
    assert t[0, 2].item() == pytest.approx(math.log(0.2), rel=1e-6)
    d = divergence(s, t, _full_mask(events), kind=kind, beta=beta)
    assert d.shape == (1,)
    assert d.dtype == dtype
    assert d.item() == pytest.approx(expected, rel=1e-6 if dtype == torch.float64 else 1e-4)


def test_worked_examples_batched_with_padding() -> None:
    """The worked chunk next to a one-event chunk (padded): each row keeps its own value.

    Second chunk: one event, S = (0.25) REST 0.75, T = (0.5) REST 0.5;
    KL(T||S) = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 * 0.6931471806 - 0.5 * 0.4054651081
             = 0.3465735903 - 0.2027325541 = 0.1438410362.
    """
    events = torch.tensor([[True, True], [True, False]])
    s = with_rest(torch.tensor([[0.5, 0.3], [0.25, 0.9]], dtype=torch.float64).log(), events)
    t = with_rest(torch.tensor([[0.6, 0.2], [0.5, 0.1]], dtype=torch.float64).log(), events)
    d = divergence(s, t, _full_mask(events), kind="forward_kl")
    assert d.tolist() == pytest.approx([0.0282999125, 0.1438410362], rel=1e-8)


# ---------------------------------------------------------------- with_rest
def test_with_rest_pads_with_minus_inf_and_ignores_padded_values() -> None:
    lp = torch.tensor([[math.log(0.5), float("nan"), math.log(0.25)]])
    mask = torch.tensor([[True, False, True]])
    out = with_rest(lp, mask)
    assert out.shape == (1, 4)
    assert out[0, 1].item() == -math.inf
    assert out[0, 3].item() == pytest.approx(math.log(0.25), rel=1e-6)  # 1 - 0.5 - 0.25


def test_with_rest_chunk_without_events_has_all_mass_in_rest() -> None:
    out = with_rest(torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.bool))
    assert out[0, :2].tolist() == [-math.inf, -math.inf]
    assert out[0, 2].item() == 0.0


@pytest.mark.parametrize("probs", [[0.7, 0.3], [0.7, 0.30001], [1.0]])
def test_rest_floor_when_events_hold_all_mass(probs: list[float]) -> None:
    """Events summing to 1 (or above, by rounding) give log REST = log(1e-12), finite grads."""
    logits = torch.tensor([probs], dtype=torch.float32).log().requires_grad_(True)
    mask = torch.ones_like(logits, dtype=torch.bool)
    assert pytest.approx(math.log(1e-12)) == LOG_REST_FLOOR
    assert with_rest(logits, mask)[0, -1].item() == pytest.approx(LOG_REST_FLOOR, rel=1e-6)
    # Teacher: each event 1/(E+1), REST 1/(E+1).
    teacher = with_rest(torch.full((1, len(probs)), -math.log(len(probs) + 1)), mask)
    for kind in KINDS:
        d = divergence(with_rest(logits, mask), teacher, _full_mask(mask), kind=kind)
        (grad,) = torch.autograd.grad(d.sum(), logits)
        assert torch.isfinite(d).all(), kind
        assert torch.isfinite(grad).all(), kind


def test_log1mexp_stable_when_events_hold_nearly_all_mass() -> None:
    """lse = -1e-6 in float32: REST = -expm1(-1e-6) = 9.999995e-7. The naive
    log1p(-exp(x)) loses ~6% of it here (exp(-1e-6) rounds in float32)."""
    one = torch.ones(1, 1, dtype=torch.bool)
    out = with_rest(torch.tensor([[-1e-6]], dtype=torch.float32), one)
    assert out[0, 1].item() == pytest.approx(math.log(-math.expm1(-1e-6)), abs=1e-5)


def test_log1mexp_stable_when_events_hold_almost_no_mass() -> None:
    """lse = -40 in float64: log REST = log1p(-e^-40) ~ -4.2484e-18, which the naive
    log(-expm1(x)) rounds to 0."""
    one = torch.ones(1, 1, dtype=torch.bool)
    out = with_rest(torch.tensor([[-40.0]], dtype=torch.float64), one)
    assert out[0, 1].item() == pytest.approx(-math.exp(-40.0), rel=1e-9)


def test_with_rest_dtypes() -> None:
    mask = torch.ones(2, 3, dtype=torch.bool)
    lp = torch.full((2, 3), -2.0)
    assert with_rest(lp.bfloat16(), mask).dtype == torch.float32
    assert with_rest(lp.half(), mask).dtype == torch.float32
    assert with_rest(lp, mask).dtype == torch.float32
    assert with_rest(lp.double(), mask).dtype == torch.float64


def test_with_rest_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="mask"):
        with_rest(torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bool))


# ---------------------------------------------------------------- masking
@pytest.mark.parametrize("kind", KINDS)
def test_masked_event_changes_nothing(kind: str) -> None:
    """Chunk (0.5, 0.3) vs (0.6, 0.2), then the same with a third, masked event whose slot
    holds garbage: same value; the masked slot gets zero gradient."""
    base_mask = torch.ones(1, 2, dtype=torch.bool)
    s0 = with_rest(_chunk([0.5, 0.3]), base_mask)
    t0 = with_rest(_chunk([0.6, 0.2]), base_mask)
    expected = divergence(s0, t0, _full_mask(base_mask), kind=kind, beta=0.7)

    pad_mask = torch.tensor([[True, False, True]])
    student_lp = torch.tensor([[math.log(0.5), -0.01, math.log(0.3)]], dtype=torch.float64)
    student_lp.requires_grad_(True)
    s1 = with_rest(student_lp, pad_mask)
    t1 = with_rest(
        torch.tensor([[math.log(0.6), -0.02, math.log(0.2)]], dtype=torch.float64), pad_mask
    )
    got = divergence(s1, t1, _full_mask(pad_mask), kind=kind, beta=0.7)
    assert got.item() == pytest.approx(expected.item(), rel=1e-12)
    (grad,) = torch.autograd.grad(got.sum(), student_lp)
    assert grad[0, 1].item() == 0.0
    assert torch.isfinite(grad).all()

    # Finite garbage at a masked position of the [C, E+1] inputs is ignored too.
    s2, t2 = s1.detach().clone(), t1.clone()
    s2[0, 1], t2[0, 1] = 3.0, -7.0
    again = divergence(s2, t2, _full_mask(pad_mask), kind=kind, beta=0.7)
    assert again.item() == pytest.approx(expected.item(), rel=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_all_padding_chunk_is_zero_without_nan(kind: str) -> None:
    """A fully padded row (even its REST masked off) contributes 0 and a zero gradient."""
    lp = torch.full((2, 3), -1.5, requires_grad=True)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    s = with_rest(lp, mask[:, :3])
    t = with_rest(torch.full((2, 3), -2.0), mask[:, :3])
    d = divergence(s, t, mask, kind=kind)
    d.sum().backward()
    assert d.tolist() == [0.0, 0.0]
    assert lp.grad is not None and (lp.grad == 0).all()


@pytest.mark.parametrize("kind", KINDS)
def test_zero_probability_entries_marked_real_contribute_nothing(kind: str) -> None:
    """An entry inside the mask with probability 0 on both sides (log p = -inf, e.g. a caller
    that marks padded events real) adds 0 and yields no NaN gradient."""
    events = torch.ones(1, 2, dtype=torch.bool)
    expected = divergence(
        with_rest(_chunk([0.5, 0.3]), events),
        with_rest(_chunk([0.6, 0.2]), events),
        _full_mask(events),
        kind=kind,
    )
    inf = -math.inf
    student = torch.tensor(
        [[math.log(0.5), inf, math.log(0.3), math.log(0.2)]],
        dtype=torch.float64,
        requires_grad=True,
    )
    teacher = torch.tensor(
        [[math.log(0.6), inf, math.log(0.2), math.log(0.2)]], dtype=torch.float64
    )
    got = divergence(student, teacher, torch.ones(1, 4, dtype=torch.bool), kind=kind)
    (grad,) = torch.autograd.grad(got.sum(), student)
    assert got.item() == pytest.approx(expected.item(), rel=1e-12)
    assert torch.isfinite(grad).all(), grad


# ---------------------------------------------------------------- gradients
def _random_chunks(
    generator: torch.Generator,
    chunks: int = 4,
    events: int = 3,
    vocab: int = 8,
    dtype: torch.dtype = torch.float64,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Free student logits ``[C, V]``, event ids ``[C, E]``, event mask and teacher ``[C, E+1]``.

    Event ids are distinct within a chunk; row ``c`` keeps ``E - (c % E)`` real events.
    """
    logits = torch.randn(chunks, vocab, generator=generator, dtype=dtype) * scale
    ids = torch.stack([torch.randperm(vocab, generator=generator)[:events] for _ in range(chunks)])
    mask = torch.arange(events).unsqueeze(0) < (events - torch.arange(chunks) % events).unsqueeze(1)
    teacher_logits = torch.randn(chunks, vocab, generator=generator, dtype=dtype) * scale
    teacher = with_rest(torch.log_softmax(teacher_logits, -1).gather(1, ids), mask)
    return logits, ids, mask, teacher


def _student(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return with_rest(torch.log_softmax(logits, -1).gather(1, ids), mask)


@pytest.mark.parametrize(
    ("kind", "beta"), [("jsd", 0.5), ("jsd", 0.2), ("forward_kl", 0.5), ("reverse_kl", 0.5)]
)
def test_gradcheck(kind: str, beta: float) -> None:
    g = torch.Generator().manual_seed(0)
    logits, ids, mask, teacher = _random_chunks(g)
    logits.requires_grad_(True)
    full = _full_mask(mask)

    def f(x: torch.Tensor) -> torch.Tensor:
        return divergence(_student(x, ids, mask), teacher, full, kind=kind, beta=beta)

    assert torch.autograd.gradcheck(f, (logits,), eps=1e-6, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- precision
@pytest.mark.parametrize("kind", KINDS)
def test_bf16_input_is_computed_in_float32(kind: str) -> None:
    g = torch.Generator().manual_seed(1)
    logits, ids, mask, teacher = _random_chunks(
        g, chunks=16, events=4, vocab=32, dtype=torch.float32
    )
    lp = torch.log_softmax(logits, -1).gather(1, ids)
    full = _full_mask(mask)
    ref = divergence(with_rest(lp, mask), teacher, full, kind=kind)

    lp16 = lp.bfloat16()
    s16 = with_rest(lp16, mask)
    got = divergence(s16, teacher.bfloat16(), full, kind=kind)
    assert s16.dtype == torch.float32
    assert got.dtype == torch.float32
    # Exactly the float32 computation on the bf16-rounded inputs (upcast before arithmetic) ...
    upcast = divergence(with_rest(lp16.float(), mask), teacher.bfloat16().float(), full, kind=kind)
    torch.testing.assert_close(got, upcast, rtol=0, atol=0)
    # ... and close to the full-precision one (bf16 keeps ~3 significant digits of log p).
    torch.testing.assert_close(got, ref, rtol=5e-2, atol=5e-3)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_divergence_upcasts_low_precision_inputs(kind: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    logits, ids, mask, teacher = _random_chunks(
        g, chunks=8, events=3, vocab=16, dtype=torch.float32
    )
    student = _student(logits, ids, mask)
    full = _full_mask(mask)
    got = divergence(student.to(dtype), teacher.to(dtype), full, kind=kind)
    assert got.dtype == torch.float32
    expected = divergence(student.to(dtype).float(), teacher.to(dtype).float(), full, kind=kind)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tau", [0.05, 0.5, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peaked_tempered_inputs_stay_finite(kind: str, tau: float, dtype: torch.dtype) -> None:
    """Very peaked logits divided by tau: the events hold (nearly) all mass or almost none."""
    g = torch.Generator().manual_seed(2)
    vocab, events = 64, 4
    logits = torch.randn(6, vocab, generator=g) * 30.0
    logits[:, 0] += 200.0  # token 0 dominates
    teacher_logits = torch.randn(6, vocab, generator=g) * 30.0
    teacher_logits[:, 1] += 200.0
    ids = torch.tensor(
        [[0, 1, 2, 3], [0, 5, 6, 7], [4, 5, 6, 7], [1, 8, 9, 10], [0, 1, 2, 3], [9, 10, 11, 12]]
    )
    mask = torch.ones(6, events, dtype=torch.bool)
    mask[4, 2:] = False
    x = (logits / tau).to(dtype).requires_grad_(True)
    s = with_rest(torch.log_softmax(x, -1).gather(1, ids), mask)
    t = with_rest(torch.log_softmax((teacher_logits / tau).to(dtype), -1).gather(1, ids), mask)
    d = divergence(s, t, _full_mask(mask), kind=kind)
    d.sum().backward()
    assert d.dtype == torch.float32
    assert torch.isfinite(d).all()
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()


# ---------------------------------------------------------------- properties
@st.composite
def _distribution_pairs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    chunks = draw(st.integers(1, 4))
    events = draw(st.integers(1, 5))
    scale = draw(st.floats(0.1, 15.0))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    vocab = events + draw(st.integers(0, 4))  # vocab == events: REST floored
    ids = torch.stack([torch.randperm(vocab, generator=g)[:events] for _ in range(chunks)])
    mask = torch.rand(chunks, events, generator=g) < 0.8
    s = torch.log_softmax(torch.randn(chunks, vocab, generator=g) * scale, -1).gather(1, ids)
    t = torch.log_softmax(torch.randn(chunks, vocab, generator=g) * scale, -1).gather(1, ids)
    return with_rest(s, mask), with_rest(t, mask), _full_mask(mask)


@settings(max_examples=60, deadline=None)
@given(pair=_distribution_pairs(), beta=st.floats(0.01, 0.99))
def test_divergences_nonnegative_and_zero_on_equal(pair, beta: float) -> None:
    s, t, full = pair
    for kind in KINDS:
        d = divergence(s, t, full, kind=kind, beta=beta)
        assert torch.isfinite(d).all(), kind
        assert (d >= -1e-6).all(), (kind, d)
        same = divergence(s, s, full, kind=kind, beta=beta)
        assert same.abs().max().item() <= 1e-6, (kind, same)


@settings(max_examples=40, deadline=None)
@given(pair=_distribution_pairs())
def test_jsd_symmetric_at_half(pair) -> None:
    s, t, full = pair
    torch.testing.assert_close(
        divergence(s, t, full, kind="jsd", beta=0.5),
        divergence(t, s, full, kind="jsd", beta=0.5),
        rtol=1e-5,
        atol=1e-7,
    )


def test_jsd_not_symmetric_away_from_half() -> None:
    """Guards the symmetry test: with beta = 0.9 swapping S and T changes the worked value."""
    events = torch.ones(1, 2, dtype=torch.bool)
    s = with_rest(_chunk([0.5, 0.3]), events)
    t = with_rest(_chunk([0.6, 0.2]), events)
    full = _full_mask(events)
    assert divergence(s, t, full, beta=0.9).item() != pytest.approx(
        divergence(t, s, full, beta=0.9).item(), rel=1e-3
    )


# ---------------------------------------------------------------- argument errors
@pytest.mark.parametrize("kind", ["kl", "JSD", ""])
def test_invalid_kind(kind: str) -> None:
    x = with_rest(torch.zeros(1, 1) - 1.0, torch.ones(1, 1, dtype=torch.bool))
    allowed = r"kind=.*allowed values: 'jsd', 'forward_kl', 'reverse_kl'"
    with pytest.raises(ValueError, match=allowed):
        divergence(x, x, torch.ones(1, 2, dtype=torch.bool), kind=kind)


@pytest.mark.parametrize("beta", [0.0, 1.0, -0.1, 1.5, float("nan")])
@pytest.mark.parametrize("kind", KINDS)
def test_invalid_beta(beta: float, kind: str) -> None:
    x = with_rest(torch.zeros(1, 1) - 1.0, torch.ones(1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"beta=.*allowed values: .*\(0, 1\)"):
        divergence(x, x, torch.ones(1, 2, dtype=torch.bool), kind=kind, beta=beta)


def test_shape_mismatch_is_refused() -> None:
    x = with_rest(torch.zeros(1, 1) - 1.0, torch.ones(1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask"):
        divergence(x, x, torch.ones(1, 3, dtype=torch.bool))
