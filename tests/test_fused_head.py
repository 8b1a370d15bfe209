"""The loss fused with the output layer (:class:`crosskd.output_layer.OutputLayer` in place of
the logits) against the same loss on the logits the layer computes: values, reported metrics
and the gradients of the hidden states, the weight and the bias, in float32, on real tokenizer
pairs (every chunk shape), every divergence, both temperature paths, dynamic ``kd_scale``,
several teachers, a same-tokenizer teacher; row blocks that do not divide the rows; autocast;
the head swap and the probe that decides whether fusing is exact; the trainer fused and on the
logits (the multi-process layouts train fused by default: tests/test_train_parallel.py)."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from loss_cases import DIVERGENCES, PAIR_IDS, PAIRS, loss_config, make_case, plan_rows
from test_loss_objective import token_chunks
from test_model_families import _family_student
from train_inputs import train_config
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, Qwen2Config

from crosskd.errors import ConfigError
from crosskd.loss import (
    LossConfig,
    TeacherBatch,
    TeacherLossConfig,
    compute_loss,
    logprobs,
    plan_loss,
)
from crosskd.loss.logprobs import LocalLogProbs
from crosskd.output_layer import (
    OutputHead,
    OutputLayer,
    head_output_unchanged,
    use_output_head,
)
from crosskd.teacher import signal_from_logits
from crosskd.train import Trainer

HIDDEN = 24


@pytest.fixture(scope="module")
def cases(zoo, built_table):
    return {
        pair_id: make_case(zoo, built_table, student, teacher, texts)
        for pair_id, (student, teacher, texts) in zip(PAIR_IDS, PAIRS, strict=True)
    }


def _head(shape: tuple[int, int], vocab: int, seed: int, bias: bool = True):
    """Hidden states ``[B, L, H]``, weight ``[V, H]`` and bias whose logits spread over a few
    nats, as a trained head's do (float32 leaves)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, HIDDEN, generator=gen)
    weight = torch.randn(vocab, HIDDEN, generator=gen) * (3 / HIDDEN**0.5)
    b = torch.randn(vocab, generator=gen) if bias else None
    return [t.requires_grad_(True) for t in (hidden, weight, b) if t is not None]


@pytest.fixture
def blocks(monkeypatch):
    """Fused blocks of ``rows`` rows whatever the vocabulary (so that a small batch spans
    several blocks, the last one short)."""

    def set_rows(rows: int, vocab: int) -> None:
        monkeypatch.setattr(logprobs, "HEAD_BLOCK_ENTRIES", {"cpu": rows * vocab})

    return set_rows


def _both(plan, config, params):
    """(output, gradients) of the loss on the logits and fused, from the same parameters."""
    results = []
    for fused in (False, True):
        leaves = [p.detach().clone().requires_grad_(True) for p in params]
        hidden, weight, *bias = leaves
        bias = bias[0] if bias else None
        source = OutputLayer(hidden, weight, bias) if fused else F.linear(hidden, weight, bias)
        out = compute_loss(source, plan, config)
        out.loss.backward()
        results.append((out, [p.grad for p in leaves]))
    return results


def _same(results, rtol: float = 1e-5) -> None:
    (want, want_grads), (got, got_grads) = results
    assert got.loss.item() == pytest.approx(want.loss.item(), rel=rtol)
    assert got.metrics.keys() == want.metrics.keys()
    for key, value in want.metrics.items():
        assert got.metrics[key] == pytest.approx(value, rel=rtol, abs=1e-6), key
    for name, g, w in zip(("hidden", "weight", "bias"), got_grads, want_grads, strict=False):
        torch.testing.assert_close(g, w, rtol=rtol, atol=rtol * w.abs().max().item(), msg=name)


@pytest.mark.parametrize("pair_id", PAIR_IDS)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_fused_csd_loss_equals_the_loss_on_the_logits(cases, blocks, pair_id, divergence):
    """Cross-tokenizer CSD over every chunk shape of real pairs in blocks of 24 rows: tau = 2
    (CE and KD at two temperatures in one pass) with a dynamic kd_scale for JSD, tau = 1
    otherwise."""
    case = cases[pair_id]
    blocks(24, case.student_logits.shape[-1])
    tau = 2.0 if divergence == "jsd" else 1.0
    config = loss_config(64, divergence=divergence, dynamic_kd_scale=True, max_kd_scale=50.0)
    config = replace(config, tau=tau)
    plan = plan_rows(case, case.signal(64, tau=tau), config)
    assert set(plan.terms[0].chunk_shape.tolist()) >= {0, 1, 2}  # 1:1, 1:N, N:1 at least
    params = _head(case.student_ids.shape, case.student_logits.shape[-1], seed=1)
    results = _both(plan, config, params)
    assert results[0][0].kd.item() > 0
    _same(results)


def test_fused_loss_with_two_teachers_and_without_bias(cases, blocks):
    """Two teachers summed with weights, then mixed (``average``); a head without bias."""
    case = cases["llama3-qwen3"]
    blocks(40, case.student_logits.shape[-1])
    gen = torch.Generator().manual_seed(5)
    other = case.teacher_logits + torch.randn(case.teacher_logits.shape, generator=gen)
    tables = {"student_to_teacher": "s2t", "teacher_to_student": "t2s"}
    params = _head(case.student_ids.shape, case.student_logits.shape[-1], seed=2, bias=False)
    for mode, k in (("sum", 32), ("average", 0)):  # average mixes dense signals
        teachers = [
            TeacherLossConfig(k=k, weight=0.7, **tables),
            TeacherLossConfig(k=k, weight=0.3, **tables),
        ]
        config = LossConfig(tau=1.0, teacher_mode=mode, teachers=teachers)
        batches = [
            TeacherBatch(
                case.teacher_ids,
                case.chunks,
                signal_from_logits(t, case.teacher_ids, k=k, tau=1.0),
            )
            for t in (case.teacher_logits, other)
        ]
        plan = plan_loss(
            config,
            case.student_ids,
            case.loss_mask,
            batches,
            [case.pair, case.pair],
            student_vocab=case.student_logits.shape[-1],
        )
        _same(_both(plan, config, params))


def test_fused_same_tokenizer_loss_in_blocks_that_do_not_divide_the_rows(blocks):
    """A same-tokenizer teacher (top K over the student's own vocabulary) on 3 x 23 rows,
    fused in blocks of 16 rows (69 = 4 * 16 + 5)."""
    gen = torch.Generator().manual_seed(3)
    vocab, lengths = 300, [23, 17, 20]
    ids = torch.randint(0, vocab, (3, 23), generator=gen)
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    for r, n in enumerate(lengths):
        ids[r, n:] = 0
        mask[r, 1:n] = True
    signal = signal_from_logits(2 * torch.randn(3, 23, vocab, generator=gen), ids, k=8, tau=1.5)
    config = LossConfig(tau=1.5, divergence="forward_kl", teachers=[TeacherLossConfig(k=8)])
    batch = TeacherBatch(ids, token_chunks(lengths), signal)
    plan = plan_loss(config, ids, mask, [batch], [None], student_vocab=vocab)
    params = _head((3, 23), vocab, seed=4)
    blocks(16, vocab)
    _same(_both(plan, config, params))
    hidden, weight, bias = params
    layer = OutputLayer(hidden.reshape(-1, HIDDEN), weight, bias)
    rows, ids_ = np.arange(69), ids.reshape(-1).numpy()
    fused = LocalLogProbs(layer, tau=1.5, block_rows=16).log_prob(rows, ids_)
    logits = F.linear(hidden.reshape(-1, HIDDEN), weight, bias)
    torch.testing.assert_close(fused, LocalLogProbs(logits, tau=1.5).log_prob(rows, ids_))


def test_fused_gradients_pass_gradcheck_in_float64():
    """The custom backward pass against finite differences (hidden, weight and bias), with
    repeated (row, id) pairs and rows asked for by no pair."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(11, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, generator=gen, requires_grad=True)
    rows, ids = np.array([0, 39, 17, 17, 3, 0]), np.array([1, 10, 3, 3, 0, 1])

    def log_probs(h, w, b):
        return LocalLogProbs(OutputLayer(h, w, b), tau=1.5, block_rows=16).log_prob(rows, ids)

    assert torch.autograd.gradcheck(log_probs, (hidden, weight, bias))


def test_a_frozen_head_gets_no_gradient_and_the_hidden_states_the_same_one():
    """A head that does not need a gradient (trained without it): the hidden states' gradient
    is unchanged and the weight and bias get none."""
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(40, 3, generator=gen, requires_grad=True)
    weight, bias = torch.randn(11, 3, generator=gen), torch.randn(11, generator=gen)
    rows, ids = np.array([0, 39, 17, 17, 3]), np.array([1, 10, 3, 4, 0])
    grads = []
    for frozen in (True, False):
        w, b = (t.clone().requires_grad_(not frozen) for t in (weight, bias))
        LocalLogProbs(OutputLayer(hidden, w, b)).log_prob(rows, ids).sum().backward()
        grads.append(hidden.grad.clone())
        hidden.grad = None
        assert (w.grad is None, b.grad is None) == (frozen, frozen)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_under_autocast_the_fused_loss_computes_in_the_autocast_dtype(cases):
    """Under bf16 autocast the head hands over its input with bf16 as the compute dtype, and
    the fused loss equals the loss on the head's bf16 logits (to bf16's rounding of the
    product, which the blocks reproduce) with gradients in the parameters' dtype."""
    case = cases["smollm2-qwen3"]
    config = loss_config(32)
    plan = plan_rows(case, case.signal(32), config)
    hidden, weight, bias = _head(case.student_ids.shape, case.student_logits.shape[-1], seed=6)
    head = OutputHead(torch.nn.Parameter(weight.detach()), torch.nn.Parameter(bias.detach()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = head(hidden)
        with head.capture() as captured:
            empty = head(hidden)
    assert logits.dtype == torch.bfloat16 and empty.shape == (*hidden.shape[:-1], 0)
    (layer,) = captured
    assert layer.compute_dtype == torch.bfloat16 and layer.weight is head.weight
    want = compute_loss(logits, plan, config)
    got = compute_loss(layer, plan, config)
    assert got.loss.item() == pytest.approx(want.loss.item(), rel=1e-5)
    got.loss.backward()
    assert head.weight.grad.dtype == torch.float32 and hidden.grad.dtype == torch.float32


def test_uld_refuses_the_fused_layer(cases):
    case = cases["llama3-qwen3"]
    tables = {"student_to_teacher": "s2t", "teacher_to_student": "t2s"}
    config = LossConfig(kd="uld", tau=1.0, teachers=[TeacherLossConfig(k=32, **tables)])
    batch = TeacherBatch(case.teacher_ids, case.chunks, case.signal(32, tau=1.0))
    plan = plan_loss(
        config,
        case.student_ids,
        case.loss_mask,
        [batch],
        [case.pair],
        student_vocab=case.student_logits.shape[-1],
    )
    params = _head(case.student_ids.shape, case.student_logits.shape[-1], seed=7)
    with pytest.raises(ConfigError, match="needs the student's logits"):
        compute_loss(OutputLayer(*params), plan, config)


def _tiny(config_class, **extra):
    config = config_class(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        **extra,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def test_the_head_swap_keeps_names_tied_weights_and_logits():
    """``use_output_head`` keeps the state dict's names and values, a tied head tied, and the
    model's logits; inside ``capture`` the model returns zero-width logits and the head's input
    is handed over."""
    model = _tiny(Qwen2Config, tie_word_embeddings=True)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    want = model(input_ids=ids).logits
    names = sorted(model.state_dict())
    head = use_output_head(model)
    assert use_output_head(model) is head  # kept when it already is one
    assert sorted(model.state_dict()) == names
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=0, atol=0)
    with head.capture() as captured:
        assert model(input_ids=ids).logits.shape == (1, 5, 0)
    (layer,) = captured
    assert layer.shape == (1, 5, 64)
    torch.testing.assert_close(layer.flatten().logits(0, 5)[None], want, rtol=0, atol=0)
    torch.testing.assert_close(layer.whole_logits(), want, rtol=0, atol=0)
    assert head._captured is None  # and a later call computes logits again
    assert model(input_ids=ids).logits.shape == (1, 5, 64)


def test_the_probe_finds_models_that_change_their_logits():
    """Llama and Qwen2 return the head's output; Gemma 2 soft-caps it, so fusing would not be
    exact; the probe draws nothing from the random generator and keeps the training mode."""
    for config_class in (LlamaConfig, Qwen2Config):
        model = _tiny(config_class).train()
        state = torch.random.get_rng_state()
        assert head_output_unchanged(model) is None
        assert model.training and torch.equal(torch.random.get_rng_state(), state)
    gemma = _tiny(Gemma2Config, final_logit_softcapping=0.5)
    assert "soft-cap" in head_output_unchanged(gemma)
    other = _tiny(LlamaConfig)
    other.set_output_embeddings(torch.nn.Identity())
    assert "not a plain linear layer" in head_output_unchanged(other)
    with pytest.raises(TypeError, match=r"not an nn\.Linear"):
        use_output_head(other)


def _train(config) -> tuple[list[dict], Trainer]:
    trainer = Trainer(config, progress=False)
    trainer.setup()
    history = trainer.train()
    trainer.close()
    return history, trainer


def test_training_fused_equals_training_on_the_logits(train_inputs, tmp_path, caplog):
    """Three steps of a tiny Mistral student (sliding window, packed rows): fused (the default)
    and on the logits give the same curve and weights; a Gemma 2 student (soft-capped logits)
    and a ULD run take the logits, each saying why."""
    tokenizer = train_inputs["student"]
    vocab = transformers.AutoConfig.from_pretrained(tokenizer).vocab_size
    mistral = _family_student(tmp_path / "mistral", tokenizer, "mistral", vocab)
    curves, weights = [], []
    for fused in (True, False):
        config = train_config(
            train_inputs, tmp_path / f"run-{fused}", student=mistral, steps=3, fused_head=fused
        )
        history, trainer = _train(config)
        assert (trainer.head is not None) == fused
        curves.append(history)
        weights.append({k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
    for got, want in zip(*curves, strict=True):
        for key in ("loss", "ce", "kd", "kd_scale", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), key
    for key, value in weights[1].items():
        torch.testing.assert_close(weights[0][key], value, rtol=1e-4, atol=1e-6, msg=key)
    gemma = _family_student(tmp_path / "gemma2", tokenizer, "gemma2", vocab)
    tables = {"student_to_teacher": train_inputs["s2t"], "teacher_to_student": train_inputs["t2s"]}
    uld = LossConfig(kd="uld", teachers=[TeacherLossConfig(k=16, **tables)])
    runs = {
        "soft-cap": {"student": gemma, "attn_implementation": "eager"},
        "needs whole logits": {"loss": uld},
    }
    for why, keys in runs.items():
        config = train_config(train_inputs, tmp_path / why, steps=1, **keys)
        with caplog.at_level(logging.INFO, logger="crosskd.train.trainer"):
            _, trainer = _train(config)
        assert trainer.head is None
        assert any(why in r.getMessage() and "fused" in r.getMessage() for r in caplog.records)
