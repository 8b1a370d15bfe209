"""Teacher scoring fused with the output head: :func:`signal_from_output_layer` gives the signal of
:func:`signal_from_logits` without the ``rows x V`` logits (blocks of rows and of the
vocabulary, ties, both temperatures, bias), and :func:`score_sequences` takes that path for a
teacher whose head is fusable and the logits path for one that soft-caps its logits (Gemma 2).

Tolerance: both signals are within a few float32 ulps of a float64 ``log_softmax`` of the same
logits (the signal module's contract, measured <= 2.5e-6 nats), and the blocked product may
differ from the whole one in the last bit of a logit: a value ``(logit - max) - log sum`` moves
by up to two ulps of the logits where a logit and its row's max are each one ulp off (logits
below 32: 3.8e-6 nats); 1e-5 nats bounds both with room. Where the logits are exact (small
dyadic operands: every product and partial sum is exact in float32, and in bfloat16), the ids
must be equal even with many ties at the K-th logit.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from test_model_families import SMALL as FAMILIES_SMALL

from crosskd.output_layer import OutputHead, OutputLayer
from crosskd.teacher.model import LoadedTeacher, load_teacher
from crosskd.teacher.scoring import score_sequences
from crosskd.teacher.signal import (
    SignalError,
    TeacherSignal,
    signal_from_logits,
    signal_from_output_layer,
)

TOLERANCE = 1e-5
SMALL = FAMILIES_SMALL | {"vocab_size": 300}
"""The tiny families' size with a vocabulary wide enough for several blocks of it."""


def dyadic_layer(
    shape: tuple[int, ...], vocab: int, hidden: int, *, bias: bool, seed: int, dtype=torch.float32
) -> OutputLayer:
    """An output layer whose logits are exact in float32 and bfloat16 whatever the order of the
    sums: hidden states in {-1, -1/2, 0, 1/2, 1}, weights in {-1/2, ..., 1/2} by 1/4, bias in
    {-1, ..., 1} by 1/4 (|logit| <= hidden / 2 + 1 in steps of 1/8), so many logits tie."""
    gen = torch.Generator().manual_seed(seed)
    states = torch.randint(-2, 3, (*shape, hidden), generator=gen) / 2
    weight = torch.randint(-2, 3, (vocab, hidden), generator=gen) / 4
    offsets = torch.randint(-4, 5, (vocab,), generator=gen) / 4 if bias else None
    return OutputLayer(
        states.to(dtype), weight.to(dtype), None if offsets is None else offsets.to(dtype)
    )


def assert_same_signal(got: TeacherSignal, want: TeacherSignal) -> None:
    """Same ids, tau, V and K; values and realized log probs within :data:`TOLERANCE`."""
    assert (got.tau, got.vocab_size, got.k) == (want.tau, want.vocab_size, want.k)
    if want.ids is None:
        assert got.ids is None
    else:
        assert got.ids.dtype == torch.int64 and torch.equal(got.ids, want.ids)
    for name in ("log_probs", "realized", "realized_t1"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        assert torch.all((a - b).abs() <= TOLERANCE), name


def head_logits(layer: OutputLayer) -> torch.Tensor:
    """The logits ``[..., V]`` the head computes, whole."""
    return F.linear(layer.hidden, layer.weight, layer.bias)


# --- signal_from_output_layer ---------------------------------------------------------------


@pytest.mark.parametrize("tau", [1.0, 2.0])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    ("k", "block_rows", "vocab_block"),
    [
        (5, 7, 13),  # row blocks do not divide R = 33, vocabulary blocks do not divide V = 300
        (8, 4, 3),  # vocabulary blocks smaller than K
        (1, 33, 64),  # K = 1, one row block
        (300, 5, 17),  # K = V
        (12, 1, 300),  # one row at a time, one vocabulary block
        (7, None, None),  # the defaults
    ],
)
def test_fused_signal_equals_the_logits_signal(tau, bias, k, block_rows, vocab_block):
    """Exact logits with many ties: the same ids, values within the tolerance."""
    layer = dyadic_layer((3, 11), 300, 16, bias=bias, seed=k + 7 * (block_rows or 0))
    ids = torch.randint(0, 300, (3, 11), generator=torch.Generator().manual_seed(k))
    want = signal_from_logits(head_logits(layer), ids, k=k, tau=tau)
    got = signal_from_output_layer(
        layer, ids, k=k, tau=tau, block_rows=block_rows, vocab_block=vocab_block
    )
    assert_same_signal(got, want)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 9),
    length=st.integers(1, 6),
    vocab=st.integers(1, 70),
    data=st.data(),
)
def test_fused_signal_matches_on_random_shapes_and_ties(rows, length, vocab, data):
    """Any shape, K, block sizes, temperature and bias, dyadic logits full of ties."""
    k = data.draw(st.integers(1, vocab), label="k")
    block_rows = data.draw(st.integers(1, rows * length + 2), label="block_rows")
    vocab_block = data.draw(st.integers(1, vocab + 2), label="vocab_block")
    tau = data.draw(st.sampled_from([1.0, 2.0, 0.7]), label="tau")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    layer = dyadic_layer((rows, length), vocab, 8, bias=data.draw(st.booleans()), seed=seed)
    ids = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))
    want = signal_from_logits(head_logits(layer), ids, k=k, tau=tau)
    got = signal_from_output_layer(
        layer, ids, k=k, tau=tau, block_rows=block_rows, vocab_block=vocab_block
    )
    assert_same_signal(got, want)


@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_fused_signal_of_bfloat16_operands(tau):
    """bfloat16 hidden states and weight: the head's logits are bfloat16 (exact here, with
    even more ties), the signal float32, the same as from the whole bfloat16 logits."""
    layer = dyadic_layer((2, 9), 200, 16, bias=False, seed=3, dtype=torch.bfloat16)
    ids = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(1))
    logits = head_logits(layer)
    assert logits.dtype == torch.bfloat16
    want = signal_from_logits(logits, ids, k=10, tau=tau)
    got = signal_from_output_layer(layer, ids, k=10, tau=tau, block_rows=4, vocab_block=32)
    assert_same_signal(got, want)


@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_fused_signal_of_random_float_logits_is_within_the_tolerance(tau):
    """Realistic float32 operands (logits of standard deviation 4, below 32; the blocked
    products may differ from the whole one in the last bit): values within the tolerance of the
    logits path and of float64, with the top K of the whole logits."""
    gen = torch.Generator().manual_seed(0)
    layer = OutputLayer(
        torch.randn(4, 25, 64, generator=gen) / 2,
        torch.randn(1000, 64, generator=gen),
        torch.randn(1000, generator=gen),
    )
    ids = torch.randint(0, 1000, (4, 25), generator=gen)
    logits = head_logits(layer)
    want = signal_from_logits(logits, ids, k=32, tau=tau)
    got = signal_from_output_layer(layer, ids, k=32, tau=tau, block_rows=9, vocab_block=96)
    assert_same_signal(got, want)
    assert logits.abs().max() < 32
    exact = torch.log_softmax(logits.double() / tau, dim=-1).gather(-1, got.ids)
    assert (got.log_probs.double() - exact).abs().max().item() <= TOLERANCE


def test_a_dominant_logit_keeps_float64_precision():
    """One logit 16.6 above 20,000 others split over many vocabulary blocks (where a float32
    ``log_softmax`` loses the small entries' mass): the running sum keeps it."""
    vocab = 20_000
    weight = torch.zeros(vocab, 2)
    weight[:, 1] = 1.0
    weight[15_000, 0] = 16.6
    # rows 0 and 1: every logit 1 but id 15,000's, 17.6 (in the 16th vocabulary block, after
    # the running sums of 15 blocks); row 2: every logit 1
    layer = OutputLayer(torch.tensor([[[1.0, 1.0], [1.0, 1.0], [0.0, 1.0]]]), weight)
    ids = torch.tensor([[0, 15_000, 7]])
    got = signal_from_output_layer(layer, ids, k=4, tau=1.0, block_rows=2, vocab_block=999)
    exact = torch.log_softmax(head_logits(layer).double(), dim=-1)
    assert got.ids[0, 0].tolist() == [0, 1, 2, 15_000]  # ties at 1 towards the lower ids
    assert got.ids[0, 2].tolist() == [0, 1, 2, 3]
    assert (got.log_probs.double() - exact.gather(-1, got.ids)).abs().max().item() < 3e-6
    realized = exact[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    assert (got.realized.double() - realized).abs().max().item() < 3e-6


def test_dense_signal_comes_from_the_whole_logits():
    layer = dyadic_layer((2, 5), 40, 8, bias=True, seed=1)
    ids = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(2))
    got = signal_from_output_layer(layer, ids, k=0, tau=2.0, block_rows=3, vocab_block=7)
    want = signal_from_logits(head_logits(layer), ids, k=0, tau=2.0)
    assert got.log_probs.shape == (2, 5, 40)
    assert_same_signal(got, want)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"k": 3, "tau": 0.0}, "tau is 0.0"),
        ({"k": 41, "tau": 1.0}, "k is 41"),
        ({"k": -1, "tau": 1.0}, "k is -1"),
        ({"k": 3, "tau": 1.0, "block_rows": 0}, "block_rows is 0"),
        ({"k": 3, "tau": 1.0, "vocab_block": -2}, "vocab_block is -2"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    layer = dyadic_layer((2, 5), 40, 8, bias=False, seed=0)
    with pytest.raises(SignalError, match=message):
        signal_from_output_layer(layer, torch.zeros(2, 5, dtype=torch.long), **kwargs)


def test_bad_shapes_and_token_ids_are_refused():
    layer = dyadic_layer((2, 5), 40, 8, bias=False, seed=0)
    with pytest.raises(SignalError, match="disagree on the sequence shape"):
        signal_from_output_layer(layer, torch.zeros(2, 6, dtype=torch.long), k=3, tau=1.0)
    too_large = torch.zeros(2, 5, dtype=torch.long)
    too_large[1, 3] = 40
    with pytest.raises(SignalError, match=r"from 0 to 40; .* V = 40 .* 0 \.\. 39"):
        signal_from_output_layer(layer, too_large, k=3, tau=1.0)
    negative = torch.zeros(2, 5, dtype=torch.long)
    negative[0, 1] = -1
    with pytest.raises(SignalError, match="from -1 to 0"):
        signal_from_output_layer(layer, negative, k=3, tau=1.0)


# --- scoring with a real (tiny) teacher ------------------------------------------------------


def save_tiny(folder: Path, model_type: str, **overrides) -> Path:
    """A random-init model of ``model_type`` (seed 0) saved as safetensors in ``folder``; a head
    with a bias gets a random one (``from_config`` makes it 0)."""
    config = transformers.AutoConfig.for_model(model_type, **(SMALL | overrides))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    bias = model.get_output_embeddings().bias
    if bias is not None:
        with torch.no_grad():
            bias.normal_()
    model.save_pretrained(folder)
    return folder


SEQUENCES = [
    torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(n)).numpy()
    for n in (17, 5, 1, 12)
]


def score_both_ways(teacher: LoadedTeacher, *, k: int, tau: float):
    """The samples' signals scored fused (the teacher as loaded) and from the logits, and the
    width of the logits the head returned in each."""
    widths: list[int] = []
    hook = teacher.head.register_forward_hook(lambda _m, _a, out: widths.append(out.shape[-1]))
    try:
        fused = score_sequences(teacher, SEQUENCES, k=k, tau=tau)
        plain = score_sequences(dataclasses.replace(teacher, head=None), SEQUENCES, k=k, tau=tau)
    finally:
        hook.remove()
    return fused, plain, widths


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [("llama", {}), ("qwen2", {"tie_word_embeddings": True}), ("phi", {})],
)
def test_a_fusable_teacher_is_scored_fused_as_from_its_logits(
    tmp_path, caplog, model_type, overrides
):
    """Llama, Qwen2 with tied embeddings and Phi (a head with a bias) return their head's
    logits unchanged: loaded, the head is an OutputHead holding the same parameters, the model's
    logits are unchanged outside a capture, scoring runs fused (the head returns no logits), and
    the fused scores equal the logits path's."""
    folder = save_tiny(tmp_path / model_type, model_type, **overrides)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with caplog.at_level(logging.INFO, logger="crosskd.teacher.model"):
        teacher = load_teacher(str(folder), device="cpu", dtype="float32")
    assert "scored from its logits" not in caplog.text
    assert isinstance(teacher.head, OutputHead)
    assert teacher.model.get_output_embeddings() is teacher.head
    assert (teacher.head.bias is not None) == (model_type == "phi")
    if overrides.get("tie_word_embeddings"):
        assert teacher.head.weight is teacher.model.get_input_embeddings().weight
    ids = torch.as_tensor(SEQUENCES[0])[None]
    with torch.no_grad():
        assert torch.equal(teacher.model(input_ids=ids).logits, reference(input_ids=ids).logits)
    if model_type == "phi":
        assert teacher.head.bias.abs().min() > 0
    for k, tau in ((8, 1.0), (3, 2.0)):
        fused, plain, widths = score_both_ways(teacher, k=k, tau=tau)
        assert widths == [0, 300]  # fused: the head handed over its input, no logits
        for got, want in zip(fused, plain, strict=True):
            assert got.ids.shape == (got.length, k)
            assert (got.ids == want.ids).all()
            for name in ("log_probs", "realized", "realized_t1"):
                gap = abs(getattr(got, name) - getattr(want, name))
                assert gap.max(initial=0.0) <= TOLERANCE, name


def test_a_soft_capping_teacher_stays_on_the_logits_path(tmp_path, caplog):
    """Gemma 2 soft-caps its logits after the head: the fused path would not be exact, so the
    head stays (None on the teacher), an INFO line says why, and the scores are those of the
    model's (capped) logits."""
    folder = save_tiny(
        tmp_path / "gemma2",
        "gemma2",
        sliding_window=4,
        query_pre_attn_scalar=8,
        final_logit_softcapping=2.0,
    )
    with caplog.at_level(logging.INFO, logger="crosskd.teacher.model"):
        teacher = load_teacher(str(folder), device="cpu", dtype="float32")
    assert teacher.head is None
    assert type(teacher.model.get_output_embeddings()) is torch.nn.Linear
    assert "scored from its logits, not fused" in caplog.text
    assert "final_logit_softcapping" in caplog.text
    scored = score_sequences(teacher, SEQUENCES, k=6, tau=2.0)
    for seq, got in zip(SEQUENCES, scored, strict=True):
        ids = torch.as_tensor(seq)[None]
        with torch.no_grad():
            logits = teacher.model(input_ids=ids).logits
        assert logits.abs().max() <= 2.0  # capped
        want = signal_from_logits(logits, ids, k=6, tau=2.0)
        assert (got.ids == want.ids[0].numpy()).all()
        assert abs(got.log_probs - want.log_probs[0].numpy()).max() <= TOLERANCE
        assert abs(got.realized - want.realized[0].numpy()).max(initial=0.0) <= TOLERANCE
        assert abs(got.realized_t1 - want.realized_t1[0].numpy()).max(initial=0.0) <= TOLERANCE


def test_an_output_layer_of_another_width_is_refused_on_both_paths(tmp_path):
    teacher = load_teacher(str(save_tiny(tmp_path / "llama", "llama")), device="cpu")
    wrong = dataclasses.replace(teacher, vocab_size=301)
    for head in (teacher.head, None):
        with pytest.raises(SignalError, match="returned 300 logits per row, its output layer has"):
            score_sequences(dataclasses.replace(wrong, head=head), SEQUENCES, k=4, tau=1.0)


def test_threads_sharing_a_teacher_take_turns(tmp_path):
    """A trainer's input thread and its on-policy rollouts score with one teacher: each forward
    pass and its signal hold the teacher's lock, so passes never overlap (a fused head cannot
    capture two at once) and both threads get the signal one thread alone gets."""
    import threading
    import time

    teacher = load_teacher(str(save_tiny(tmp_path / "llama", "llama")), device="cpu")
    alone = score_sequences(teacher, SEQUENCES, k=4, tau=1.0)
    inside, most = [0], [0]
    forward = teacher.model.forward

    def slow_forward(*args, **kwargs):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.2)
        try:
            return forward(*args, **kwargs)
        finally:
            inside[0] -= 1

    teacher.model.forward = slow_forward
    results, errors = [None, None], []

    def score(i: int) -> None:
        try:
            results[i] = score_sequences(teacher, SEQUENCES, k=4, tau=1.0)
        except Exception as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=score, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and most[0] == 1
    for got in results:
        for g, w in zip(got, alone, strict=True):
            assert (g.ids == w.ids).all() and (g.log_probs == w.log_probs).all()
