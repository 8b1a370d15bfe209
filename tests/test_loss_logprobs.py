"""The student log-prob interface against a plain log_softmax, with gradients."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from crosskd.loss.logprobs import LocalLogProbs, segment_sum


@settings(max_examples=50, deadline=None)
@given(
    rows=st.integers(1, 40),
    vocab=st.integers(2, 30),
    tau=st.sampled_from([0.5, 1.0, 2.0]),
    block=st.integers(1, 7),
    seed=st.integers(0, 2**16),
)
def test_log_prob_equals_log_softmax_gather(rows, vocab, tau, block, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 5
    pick_rows = torch.randint(0, rows, (17,), generator=gen)
    pick_ids = torch.randint(0, vocab, (17,), generator=gen)
    got = LocalLogProbs(logits, tau=tau, block_rows=block).log_prob(
        pick_rows.numpy(), pick_ids.numpy()
    )
    expected = torch.log_softmax(logits / tau, dim=-1)[pick_rows, pick_ids]
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 30),
    vocab=st.integers(2, 25),
    tau=st.sampled_from([0.5, 1.0, 3.0]),
    block=st.integers(1, 9),
    pairs=st.integers(0, 40),
    seed=st.integers(0, 2**16),
)
def test_fused_gradient_equals_autograd_of_log_softmax(rows, vocab, tau, block, pairs, seed):
    """The hand-written backward (block by block, repeated and unsorted pairs) against autograd
    of the plain log_softmax + gather."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 4).requires_grad_()
    pick_rows = torch.randint(0, rows, (pairs,), generator=gen)
    pick_ids = torch.randint(0, vocab, (pairs,), generator=gen)
    weights = torch.randn(pairs, generator=gen, dtype=torch.float64)
    got_lp = LocalLogProbs(logits, tau=tau, block_rows=block).log_prob(
        pick_rows.numpy(), pick_ids.numpy()
    )
    (got,) = torch.autograd.grad((got_lp * weights).sum(), logits, allow_unused=True)
    plain = torch.log_softmax(logits / tau, dim=-1)[pick_rows, pick_ids]
    (want,) = torch.autograd.grad((plain * weights).sum(), logits, allow_unused=True)
    want = torch.zeros_like(logits) if want is None else want
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_bf16_gradient_has_the_logits_dtype_and_is_close():
    logits = (torch.randn(4, 200) * 6).to(torch.bfloat16).requires_grad_()
    rows, ids = torch.tensor([0, 1, 1, 3]), torch.tensor([5, 7, 199, 0])
    lp = LocalLogProbs(logits, tau=2.0, block_rows=3).log_prob(rows.numpy(), ids.numpy())
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    ref = logits.detach().float().requires_grad_()
    torch.log_softmax(ref / 2.0, dim=-1)[rows, ids].sum().backward()
    torch.testing.assert_close(logits.grad.float(), ref.grad, rtol=1e-2, atol=1e-3)


def test_gradients_match_autograd_of_the_plain_form():
    logits = torch.randn(6, 9, dtype=torch.float64, requires_grad=True)
    rows, ids = torch.tensor([0, 2, 2, 5, 1]), torch.tensor([3, 0, 8, 4, 4])
    weights = torch.tensor([1.0, -2.0, 0.5, 3.0, 1.5], dtype=torch.float64)
    pairs = rows.numpy(), ids.numpy()
    (LocalLogProbs(logits, tau=1.7, block_rows=4).log_prob(*pairs) * weights).sum().backward()
    got = logits.grad.clone()
    logits.grad = None
    (torch.log_softmax(logits / 1.7, dim=-1)[rows, ids] * weights).sum().backward()
    torch.testing.assert_close(got, logits.grad)
    assert torch.autograd.gradcheck(
        lambda x: LocalLogProbs(x, tau=0.7, block_rows=2).log_prob(*pairs),
        (logits.detach().requires_grad_(),),
    )


def test_bf16_logits_are_computed_in_float32():
    logits = (torch.randn(5, 300) * 8).to(torch.bfloat16)
    got = LocalLogProbs(logits, tau=2.0).log_prob(np.arange(5), np.arange(5))
    assert got.dtype == torch.float32
    expected = torch.log_softmax(logits.float() / 2.0, dim=-1)[torch.arange(5), torch.arange(5)]
    torch.testing.assert_close(got, expected)


def test_segment_sum_and_its_gradient():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    out = segment_sum(values, torch.tensor([2, 0, 2, 2]), 4)
    assert out.tolist() == [2.0, 0.0, 8.0, 0.0]
    (out * torch.tensor([10.0, 20.0, 30.0, 40.0])).sum().backward()
    assert values.grad.tolist() == [30.0, 10.0, 30.0, 30.0]


def test_log_normalizer_of_rows():
    logits = torch.log(torch.tensor([[1.0, 3.0], [2.0, 2.0], [0.5, 0.5]], dtype=torch.float64))
    got = LocalLogProbs(2 * logits, tau=2.0).log_normalizer(np.array([2, 0]))
    # logits / tau = log of the rows: logsumexp = log(row sum) = log 1 and log 4.
    torch.testing.assert_close(got, torch.log(torch.tensor([1.0, 4.0], dtype=torch.float64)))
