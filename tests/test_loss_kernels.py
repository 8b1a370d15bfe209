"""The per-block elementwise work (:mod:`crosskd.loss.kernels`), eager and compiled by
``torch.compile`` on this CPU (inductor's C++ kernels): each piece against a direct formula,
then the whole CSD loss with ``kernels: compiled`` against the eager loss on the logits, fused
and not, values and gradients (1e-5 relative in float32), and under bfloat16 autocast. The
compiled functions are made once per process and dtype (tens of seconds here), so the cases
share two temperature sets and two dtypes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from loss_cases import loss_config, make_case, plan_rows
from test_fused_head import _both, _head, _same

from crosskd.errors import ConfigError
from crosskd.loss import LossConfig, compute_loss
from crosskd.loss.kernels import EAGER, BlockKernels
from crosskd.output_layer import OutputLayer

COMPILED = BlockKernels(compiled=True)
TAUS = (1.0, 2.0)


def _block(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A block of logits ``[rows, vocab]`` spread over a few nats, its log-normalisers at
    TAUS (by ``torch.logsumexp``) and per-row gradients ``[2, rows]``."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randn(rows, vocab, generator=gen) * 3
    normalizer = torch.stack([torch.logsumexp(raw / tau, dim=-1) for tau in TAUS])
    per_row = torch.randn(len(TAUS), rows, generator=gen)
    return raw, normalizer, per_row


@pytest.mark.parametrize("kernels", [EAGER, COMPILED], ids=["eager", "compiled"])
def test_each_piece_equals_its_formula_at_every_block_height(kernels):
    """Normalisers are ``logsumexp(raw / tau)``; the gradient is ``sum over tau of
    softmax(raw / tau) * per_row[tau]`` (``torch.softmax``), also in bfloat16 out of float32
    arithmetic. Three heights: the compiled functions take dynamic shapes."""
    for rows in (7, 32, 5):
        raw, normalizer, per_row = _block(rows, 300, seed=rows)
        got = kernels.normalizers(raw, TAUS, torch.float32)
        torch.testing.assert_close(got, normalizer, rtol=1e-6, atol=1e-5)
        want = sum(torch.softmax(raw / tau, -1) * per_row[t, :, None] for t, tau in enumerate(TAUS))
        got = kernels.gradient(raw.clone(), normalizer, per_row, TAUS, torch.float32, own=True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        rounded = raw.bfloat16()
        lows = torch.stack([torch.logsumexp(rounded.float() / tau, dim=-1) for tau in TAUS])
        low = kernels.gradient(rounded, lows, per_row, TAUS, torch.bfloat16)
        assert low.dtype == torch.bfloat16
        want_low = sum(
            torch.softmax(rounded.float() / tau, -1) * per_row[t, :, None]
            for t, tau in enumerate(TAUS)
        )
        torch.testing.assert_close(low, want_low.bfloat16(), rtol=1e-2, atol=1e-4)


def test_the_eager_gradient_leaves_a_block_it_does_not_own_alone():
    """At tau = 1 a float32 block needs no copy; unless it is the caller's own it must come
    back unchanged."""
    raw, normalizer, per_row = _block(6, 50, seed=3)
    before = raw.clone()
    EAGER.gradient(raw, normalizer[:1], per_row[:1], (1.0,), torch.float32)
    assert torch.equal(raw, before)


def test_the_config_names_the_kernels_and_a_bad_name_is_refused_by_key():
    assert BlockKernels.named(LossConfig().kernels) == EAGER
    assert BlockKernels.named(LossConfig(kernels="compiled").kernels) == COMPILED
    with pytest.raises(ConfigError, match=r"kernels is 'triton'; choose one of eager, compiled"):
        LossConfig(kernels="triton")


@pytest.fixture(scope="module")
def case(zoo, built_table):
    """SmolLM2 student, Llama-3 teacher (1:1, 1:n and n:1 chunks)."""
    return make_case(zoo, built_table, "smollm2", "llama3", [0, 1])


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
def test_the_compiled_loss_equals_the_eager_one(case, fused):
    """CSD (JSD, tau = 2: CE and KD at two temperatures in one pass) with ``kernels:
    compiled`` against ``eager`` on the same head: loss, metrics and the gradients of the
    hidden states, weight and bias."""
    config = replace(loss_config(64, dynamic_kd_scale=True), tau=2.0)
    plan = plan_rows(case, case.signal(64, tau=2.0), config)
    params = _head(case.student_ids.shape, case.student_logits.shape[-1], seed=4)
    results = []
    for kernels in ("eager", "compiled"):
        config = replace(config, kernels=kernels)
        if fused:
            results.append(_both(plan, config, params)[1])
            continue
        leaves = [p.detach().clone().requires_grad_(True) for p in params]
        out = compute_loss(torch.nn.functional.linear(*leaves), plan, config)
        out.loss.backward()
        results.append((out, [p.grad for p in leaves]))
    assert results[0][0].kd.item() > 0
    _same(results)


def test_the_compiled_loss_under_autocast_is_the_eager_one_to_bfloat16(case):
    """The fused loss under bfloat16 autocast (the product and the logits' gradient in
    bfloat16): compiled and eager agree to bfloat16's precision."""
    config = replace(loss_config(64), tau=2.0)
    plan = plan_rows(case, case.signal(64, tau=2.0), config)
    params = _head(case.student_ids.shape, case.student_logits.shape[-1], seed=5)
    results = []
    for kernels in ("eager", "compiled"):
        leaves = [p.detach().clone().requires_grad_(True) for p in params]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = compute_loss(OutputLayer(*leaves), plan, replace(config, kernels=kernels))
        out.loss.backward()
        results.append((out.loss.item(), [p.grad for p in leaves]))
    (want, want_grads), (got, got_grads) = results
    assert got == pytest.approx(want, rel=1e-3)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2 * w.abs().max().item())
