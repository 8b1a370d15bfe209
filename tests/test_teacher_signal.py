"""The teacher signal: exact tempered log probs, realized tokens priced by the row before,
deterministic top-K ties, and the signal's identity (tau, V, K)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from crosskd.teacher import SignalError, signal_from_logits, top_k_ids


def test_hand_worked_signal():
    # One sequence of 3 tokens over V = 4. Row 0 predicts token 1 (id 2), row 1 predicts
    # token 2 (id 3); row 2 has no next token.
    logits = torch.tensor(
        [[0.0, 0.0, math.log(2.0), 0.0], [math.log(3.0), 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    )
    ids = torch.tensor([1, 2, 3])
    signal = signal_from_logits(logits, ids, k=2, tau=1.0)
    # Row 0: exp(logits) = (1, 1, 2, 1), sum 5: p = (.2, .2, .4, .2). Top 2: id 2 (.4) and the
    # tie among ids 0, 1, 3 at .2 goes to the lowest id, 0. Stored in ascending id order.
    assert signal.ids[0].tolist() == [0, 2]
    assert torch.allclose(signal.log_probs[0], torch.log(torch.tensor([0.2, 0.4])))
    # Not renormalised over K: .2 + .4 < 1.
    assert math.isclose(float(signal.log_probs[0].exp().sum()), 0.6, rel_tol=1e-6)
    # Row 1: exp = (3, 1, 1, 1), sum 6: p = (.5, 1/6, 1/6, 1/6); top 2: ids 0 and 1.
    assert signal.ids[1].tolist() == [0, 1]
    # Realized: row 0 prices id 2 (p .4), row 1 prices id 3 (p 1/6, outside the top 2).
    assert torch.allclose(signal.realized, torch.log(torch.tensor([0.4, 1 / 6])))
    assert signal.realized.shape == (2,)


def test_realized_token_is_priced_by_the_row_before_it():
    """Only the correct row carries mass on the realized token: a shift would be caught."""
    vocab, ids = 6, torch.tensor([5, 1, 4, 2])
    logits = torch.full((4, vocab), -30.0)
    for row in range(3):
        logits[row, ids[row + 1]] = 30.0
    signal = signal_from_logits(logits, ids, k=1, tau=1.0)
    assert torch.all(signal.realized > -1e-6)
    assert signal.ids[:3, 0].tolist() == ids[1:].tolist()


def test_temperature_values_and_t1_realized():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    ids = torch.randint(0, 11, (2, 5))
    signal = signal_from_logits(logits, ids, k=3, tau=2.0)
    tempered = torch.log_softmax(logits / 2.0, dim=-1)
    assert torch.allclose(signal.log_probs, tempered.gather(-1, signal.ids))
    plain = torch.log_softmax(logits, dim=-1)
    expected_t1 = plain[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert torch.allclose(signal.realized_t1, expected_t1)
    assert not torch.allclose(signal.realized, signal.realized_t1)
    dense = signal_from_logits(logits, ids, k=0, tau=2.0)
    assert dense.ids is None and torch.allclose(dense.log_probs, tempered)
    assert torch.equal(dense.realized, signal.realized)


def test_bf16_logits_give_float32_signal():
    logits = torch.randn(3, 7, 50).to(torch.bfloat16)
    signal = signal_from_logits(logits, torch.randint(0, 50, (3, 7)), k=5, tau=1.5)
    assert signal.log_probs.dtype == torch.float32 and signal.realized.dtype == torch.float32
    assert torch.isfinite(signal.log_probs).all()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-3, 3), min_size=2, max_size=30), st.data())
def test_top_k_matches_a_stable_sort_reference(values, data):
    """Integer-valued rows have many ties: the chosen set is the stable-sort prefix."""
    k = data.draw(st.integers(1, len(values)))
    row = torch.tensor(values, dtype=torch.float32)
    expected = sorted(sorted(range(len(values)), key=lambda i: (-values[i], i))[:k])
    assert top_k_ids(row[None], k)[0].tolist() == expected


def test_signal_identity_is_enforced():
    signal = signal_from_logits(torch.randn(4, 9), torch.randint(0, 9, (4,)), k=3, tau=2.0)
    signal.require(tau=2.0, vocab_size=9, k=3, where="cache s3://b/x")
    with pytest.raises(SignalError, match=r"cache s3://b/x: tau is 2\.0, the config asks for 1\.0"):
        signal.require(tau=1.0, vocab_size=9, where="cache s3://b/x")
    with pytest.raises(SignalError, match="vocab_size is 9, the config asks for 10"):
        signal.require(tau=2.0, vocab_size=10, where="x")
    with pytest.raises(SignalError, match="k is 3, the config asks for 0"):
        signal.require(tau=2.0, vocab_size=9, k=0, where="x")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"k": 3, "tau": 0.0}, "tau is 0.0"),
        ({"k": 10, "tau": 1.0}, "k is 10"),
        ({"k": -1, "tau": 1.0}, "k is -1"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(SignalError, match=message):
        signal_from_logits(torch.randn(4, 9), torch.randint(0, 9, (4,)), **kwargs)
    with pytest.raises(SignalError, match="disagree on the sequence shape"):
        signal_from_logits(torch.randn(4, 9), torch.randint(0, 9, (5,)), k=1, tau=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "tau"), [(8, 1.0), (8, 2.0), (0, 1.0), (0, 0.7)])
def test_values_are_within_1e_5_nats_of_float64_when_one_logit_dominates(dtype, k, tau):
    """Rows where one logit dominates V = 151936 zeros: a float32 ``log_softmax`` loses the small
    entries' mass there. Measured with torch 2.13 on an x86 CPU (it depends on the vector width),
    float32 ``log_softmax`` vs float64: 5.4e-4 nats with a lead of 16.6, 3.9e-4 at 17, 3.2e-5 at
    14, 2.0e-5 at 20, 1.4e-8 at 30 (V = 50000: 1.8e-4 at 16.6), which the signal stored before the
    fix (5.4e-4 on this case, 5.6e-4 from bf16 logits). The stored top-K (or dense) values and
    realized log probs at tau and at 1 must be within 1e-5 nats of float64 ``log_softmax`` of the
    same logits (after the fix: 2.2e-6, dense at tau 0.7 4.8e-6)."""
    vocab = 151936
    logits = torch.zeros(1, 6, vocab)
    for row, top in enumerate((16.6, 17.0, 14.0, 20.0, 30.0)):
        logits[0, row, 3 * row] = tau * top  # dominates by `top` after tempering
    logits[0, 1, 7] = 2.0  # a second, smaller peak
    logits[0, 5] = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 3
    logits = logits.to(dtype)
    ids = torch.tensor([[5, 0, 7, 1, 12, 9]])  # realized: dominant (row 0 -> id 0), peak, tail
    signal = signal_from_logits(logits, ids, k=k, tau=tau)
    exact = torch.log_softmax(logits.double() / tau, dim=-1)
    exact_t1 = torch.log_softmax(logits.double(), dim=-1)
    expected = exact if k == 0 else exact.gather(-1, signal.ids)
    nxt = ids[:, 1:, None]
    assert signal.log_probs.dtype == torch.float32
    assert (signal.log_probs.double() - expected).abs().max().item() < 1e-5
    realized = exact[:, :-1].gather(-1, nxt)[..., 0]
    assert (signal.realized.double() - realized).abs().max().item() < 1e-5
    realized_t1 = exact_t1[:, :-1].gather(-1, nxt)[..., 0]
    assert (signal.realized_t1.double() - realized_t1).abs().max().item() < 1e-5
    # A realized value is the very value stored for its id in the row (dense: every id; top K:
    # row 0 realizes its dominant id 0, row 1 its second peak 7).
    if k:
        # The dominant id of each row is in its top K, and the top K is that of float64.
        assert signal.ids[0, 0].tolist()[0] == 0
        assert torch.equal(signal.ids, top_k_ids(exact, k))
        assert signal.realized[0, 0] == signal.log_probs[0, 0, 0]
        assert signal.realized[0, 1] == signal.log_probs[0, 1, signal.ids[0, 1].tolist().index(7)]
    else:
        assert torch.equal(signal.realized, signal.log_probs[:, :-1].gather(-1, nxt)[..., 0])
