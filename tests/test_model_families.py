"""Tiny models of the real families (Mistral, Qwen2, Gemma 2/3, LFM2, Falcon-H1, Qwen3-Next),
not only Llama: packed rows exact for sliding-window attention, hybrids with state-carrying
mixers refused for packed rows and context parallelism, the flash-attention varlen bounds
computed once per micro-batch and handed to every layer."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from train_inputs import train_config

from crosskd.data.collate import collate
from crosskd.errors import ConfigError
from crosskd.parallel.attention import (
    layer_windows,
    packed_inputs,
    refuse_state_mixers,
    state_mixers,
    varlen_bounds,
)
from crosskd.parallel.context import enable_context_parallel
from crosskd.tokenization import load_tokenizer
from crosskd.train import Trainer

SMALL = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}
SLIDING = {
    # every layer slides (no layer_types): one banded mask
    "mistral": {"sliding_window": 4},
    # layer 0 full, layer 1 sliding: a mask per layer type
    "qwen2": {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
    "gemma2": {"sliding_window": 4, "query_pre_attn_scalar": 8},
    "gemma3_text": {
        "sliding_window": 4,
        "query_pre_attn_scalar": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    },
}
HYBRID = {
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    "falcon_h1": {
        "mamba_d_ssm": 32,
        "mamba_n_heads": 4,
        "mamba_d_head": 8,
        "mamba_d_state": 8,
        "mamba_chunk_size": 8,
    },
    "qwen3_next": {
        "layer_types": ["linear_attention", "full_attention"],
        "num_experts": 2,
        "num_experts_per_tok": 1,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
    },
}


def tiny(model_type: str, attention: str = "eager", **overrides) -> torch.nn.Module:
    """A random-init model of ``model_type`` (float32, eval mode)."""
    extra = SLIDING.get(model_type, {}) | HYBRID.get(model_type, {}) | overrides
    config = transformers.AutoConfig.for_model(model_type, **(SMALL | extra))
    config._attn_implementation = attention
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def two_packed_rows(vocab: int, lengths: list[list[int]]):
    """int64 ``[B, L]`` ids, segment ids and positions of rows packing samples of ``lengths``
    (padded with -1 segments at the end), and the samples' ids."""
    generator = torch.Generator().manual_seed(1)
    width = max(sum(row) for row in lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.int64)
    segments = torch.full_like(ids, -1)
    positions = torch.zeros_like(ids)
    samples = []
    for r, row in enumerate(lengths):
        start = 0
        for s, n in enumerate(row):
            sample = torch.randint(1, vocab, (n,), generator=generator)
            ids[r, start : start + n] = sample
            segments[r, start : start + n] = s
            positions[r, start : start + n] = torch.arange(n)
            samples.append((r, start, sample))
            start += n
    return ids, segments, positions, samples


def worst_gap(model, attention: str, windows) -> float:
    """Largest |logit difference| between each sample in its packed row and the sample alone
    (the packed logits reshaped to ``[B, L, V]``, as the trainer does)."""
    ids, segments, positions, samples = two_packed_rows(64, [[9, 7], [5, 8, 3]])
    device = next(model.parameters()).device
    with torch.no_grad():
        packed = model(
            use_cache=False,
            **packed_inputs(
                attention, ids, segments, positions, torch.float32, windows=windows, device=device
            ),
        ).logits.reshape(*ids.shape, -1)
        gap = 0.0
        for row, start, sample in samples:
            alone = model(input_ids=sample[None].to(device), use_cache=False).logits[0]
            gap = max(gap, (packed[row, start : start + len(sample)] - alone).abs().max().item())
    return gap


FLASH = pytest.mark.skipif(
    not (torch.cuda.is_available() and importlib.util.find_spec("flash_attn")),
    reason="flash-attention needs CUDA and the flash_attn package",
)


@pytest.mark.parametrize(
    ("model_type", "attention"),
    [
        *(
            (model_type, attention)
            for model_type in SLIDING
            for attention in ("eager", "sdpa")
            if (model_type, attention) != ("gemma2", "sdpa")
        ),  # Gemma 2's softcapping: eager only
        *(pytest.param(model_type, "flash_attention_2", marks=FLASH) for model_type in SLIDING),
    ],
)
def test_a_packed_row_of_a_sliding_window_model_is_each_sample_alone(model_type, attention):
    """Samples of 9, 7, 5, 8 and 3 tokens under a window of 4: with a mask per layer type the
    packed row gives each sample's logits alone; the plain causal mask (what transformers
    passes unchanged to a sliding layer) does not, past the window. Flash attention (on a GPU,
    in bfloat16) gets the samples' bounds and applies each layer's window itself."""
    model = tiny(model_type, attention)
    windows = layer_windows(model.config)
    assert 4 in windows.values()
    if attention == "flash_attention_2":
        model = model.to("cuda", torch.bfloat16)
        assert worst_gap(model, attention, windows) < 5e-2
        return
    assert worst_gap(model, attention, windows) < 1e-5
    assert worst_gap(model, attention, None) > 1e-3


def test_layer_windows_by_family():
    """Worked out from each family's config: one kind of layer without ``layer_types``."""
    assert layer_windows(tiny("mistral").config) == {"": 4}
    assert layer_windows(tiny("llama").config) == {"": None}
    assert layer_windows(tiny("qwen2").config) == {"full_attention": None, "sliding_attention": 4}
    assert layer_windows(tiny("qwen2", use_sliding_window=False).config) == {"full_attention": None}
    assert layer_windows(tiny("lfm2").config) == {"full_attention": None}
    config = tiny("llama").config
    config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(ConfigError, match=r"llama has layers of type chunked_attention.*pack=fal"):
        layer_windows(config)


def test_the_band_of_a_window_of_positions_is_its_rows_of_the_whole_band():
    """Context parallelism: the window [3, 7) of a sliding-window mask is the whole mask's rows
    of those queries; row 0 worked out by hand for a window of 2 over one 7-token sample."""
    ids = torch.arange(1, 8)[None]
    segments = torch.zeros_like(ids)
    positions = torch.arange(7)[None]
    whole = packed_inputs("sdpa", ids, segments, positions, torch.float32, windows={"": 2})[
        "attention_mask"
    ]
    part = packed_inputs("sdpa", ids, segments, positions, torch.float32, (3, 7), windows={"": 2})[
        "attention_mask"
    ]
    assert torch.equal(part, whole[:, :, 3:7])
    assert part[0, 0].int().tolist() == [
        [0, 0, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1, 1],
    ]


@pytest.mark.parametrize("model_type", list(HYBRID))
def test_hybrids_are_refused_for_packed_rows_and_context_parallelism(model_type):
    """Their convolution / state-space state ignores any mask: refused by name, with the way
    out, for packed rows and for parallel.cp (before any process group is touched)."""
    model = tiny(model_type)
    assert state_mixers(model)
    with pytest.raises(ConfigError, match=rf"^{model_type} .*packed rows.*pack=false"):
        refuse_state_mixers(model, "the samples of packed rows", "prepare with pack=false")
    with pytest.raises(ConfigError, match=rf"^{model_type} .*parallel.cp=1"):
        enable_context_parallel(model, list(model.model.layers), group=None)
    with pytest.raises(ConfigError) as error:
        refuse_state_mixers(model, "a", "b")
    assert "\n" not in str(error.value)


def test_attention_only_families_have_no_state_mixers():
    for model_type in ("llama", *SLIDING):
        assert state_mixers(tiny(model_type)) == []


def test_the_state_of_a_hybrid_leaks_into_the_next_packed_sample():
    """Why the refusal: LFM2's short convolution carries the first sample into the second one's
    logits even under the exact attention mask."""
    model = tiny("lfm2", initializer_range=0.5)
    assert worst_gap(model, "eager", layer_windows(model.config)) > 1e-3


@pytest.mark.parametrize(
    ("model_type", "attention"),
    [
        ("lfm2", "eager"),
        ("falcon_h1", "eager"),
        ("qwen3_next", "sdpa"),
        ("mistral", "sdpa"),
        ("gemma2", "eager"),
        ("lfm3", "sdpa"),
    ],
)
def test_rows_of_one_sample_are_exact_for_every_family(model_type, attention):
    """Data prepared with ``pack=false``: each right-padded row gets the 2D padding mask and
    the model builds its own masks per layer type, so a row's logits are its sample's alone,
    for hybrids too (LFM3 mixes convolutions with sliding and full attention, which no mask
    of ours covers)."""
    if model_type not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    extra = (
        {
            "layer_types": ["conv", "sliding_attention", "conv", "full_attention"],
            "num_hidden_layers": 4,
            "sliding_window": 4,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }
        if model_type == "lfm3"
        else {}
    )
    model = tiny(model_type, attention, initializer_range=0.5, **extra)
    ids, segments, positions, samples = two_packed_rows(64, [[9], [5], [12]])
    with torch.no_grad():
        rows = model(
            use_cache=False,
            **packed_inputs(attention, ids, segments, positions, torch.float32, packed=False),
        ).logits
        for row, _, sample in samples:
            alone = model(input_ids=sample[None], use_cache=False).logits[0]
            torch.testing.assert_close(rows[row, : len(sample)], alone, rtol=0, atol=1e-5)


def _family_student(folder, tokenizer: str, model_type: str, vocab: int) -> str:
    """A tiny ``model_type`` student saved with the tokenizer of the folder ``tokenizer``."""
    tiny(model_type, vocab_size=vocab).save_pretrained(str(folder), safe_serialization=True)
    load_tokenizer(tokenizer).hf.save_pretrained(str(folder))
    return str(folder)


def test_the_trainer_packs_a_mistral_student_exactly_and_refuses_an_lfm2_one(
    train_inputs, tmp_path
):
    """The trainer's own forward on packed rows of a sliding-window student (window 4, rows of
    up to 48 tokens) equals the model's forward of each sample alone (its own sliding mask);
    an LFM2 student on packed data is refused at setup with one line naming the model type,
    the data and ``pack=false``."""
    tokenizer = train_inputs["student"]
    vocab = transformers.AutoConfig.from_pretrained(tokenizer).vocab_size
    student = _family_student(tmp_path / "mistral", tokenizer, "mistral", vocab)
    trainer = Trainer(
        train_config(train_inputs, tmp_path / "run", student=student, attn_implementation="sdpa"),
        progress=False,
    )
    trainer.setup()
    every, _ = trainer.read_rows(list(range(trainer.shard_order.rows)))
    rows = sorted(every, key=lambda row: -sum(len(s["student_ids"]) for s in row))[:2]
    assert max(len(s["student_ids"]) for row in rows for s in row) > 4
    batch = collate(rows, n_teachers=1).models["student"]
    with torch.no_grad():
        logits = trainer._forward(batch).whole_logits()  # the fused head's, whole
        for r, row in enumerate(rows):
            start = 0
            for sample in row:
                ids = torch.tensor(sample["student_ids"])[None]
                alone = trainer.model(input_ids=ids, use_cache=False).logits[0]
                n = len(sample["student_ids"])
                assert (logits[r, start : start + n] - alone).abs().max() < 1e-5
                start += n
    trainer.close()
    hybrid = _family_student(tmp_path / "lfm2", tokenizer, "lfm2", vocab)
    refused = Trainer(
        train_config(train_inputs, tmp_path / "run-lfm2", student=hybrid), progress=False
    )
    with pytest.raises(ConfigError, match=r"^lfm2 .*packed rows of .*pack=false") as error:
        refused.setup()
    assert "\n" not in str(error.value)
    refused.close()


def test_an_lfm2_student_trains_on_rows_of_one_sample(train_inputs, tmp_path):
    """The way out the refusal names: data prepared with ``pack=false`` (and its teacher
    cache); the trainer's forward of a batch of such rows gives each sample's logits alone (the
    model's own masks from the padding mask), and a step trains."""
    from crosskd.data.prepare import PrepareConfig, prepare
    from crosskd.teacher.scoring import ScoreConfig
    from crosskd.teacher.sharded import score

    tokenizer = train_inputs["student"]
    vocab = transformers.AutoConfig.from_pretrained(tokenizer).vocab_size
    student = _family_student(tmp_path / "lfm2", tokenizer, "lfm2", vocab)
    data, cache = str(tmp_path / "unpacked"), str(tmp_path / "cache")
    source = str(Path(train_inputs["data"]).parent / "data.jsonl")
    prepare(
        PrepareConfig(
            data=source,
            student_tokenizer=tokenizer,
            max_length=48,
            pack=False,
            teacher_tokenizers=[train_inputs["teacher"]],
            output=data,
        ),
        progress=False,
    )
    score(
        ScoreConfig(data=data, teacher=train_inputs["teacher"], output=cache, k=16), progress=False
    )
    trainer = Trainer(
        train_config(
            train_inputs, tmp_path / "run", student=student, data=data, teachers=[cache], steps=1
        ),
        progress=False,
    )
    trainer.setup()
    assert trainer.packed is False and trainer.windows is None
    rows, _ = trainer.read_rows([0, 1, 2])
    assert all(len(row) == 1 for row in rows)
    batch = collate(rows, n_teachers=1).models["student"]
    with torch.no_grad():
        logits = trainer._forward(batch).whole_logits()  # the fused head's, whole
        for r, (sample,) in enumerate(rows):
            ids = torch.tensor(sample["student_ids"])[None]
            alone = trainer.model(input_ids=ids, use_cache=False).logits[0]
            assert (logits[r, : ids.shape[1]] - alone).abs().max() < 1e-5
    (metrics,) = trainer.train()
    assert math.isfinite(metrics["loss"])
    trainer.close()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=4), min_size=1, max_size=3))
def test_varlen_bounds_match_what_transformers_finds_in_every_layer(lengths):
    """The bounds computed once on the host equal transformers' own from the flattened
    positions (what it would recompute, with a device synchronisation, in every layer)."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    _, _, positions, _ = two_packed_rows(64, lengths)
    ours = varlen_bounds(positions)
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(positions.reshape(1, -1))
    assert ours["cu_seq_lens_q"].dtype == torch.int32
    assert torch.equal(ours["cu_seq_lens_q"], cu_q) and torch.equal(ours["cu_seq_lens_k"], cu_k)
    assert ours["max_length_q"] == int(max_q) == ours["max_length_k"] == int(max_k)
    assert isinstance(ours["max_length_q"], int)
    assert np.diff(ours["cu_seq_lens_q"].numpy()).min() > 0


def test_every_layer_gets_the_varlen_bounds_of_the_micro_batch():
    """A stand-in flash implementation registered in transformers' attention registry (no GPU
    here) records what each layer of a tiny Mistral receives: the micro-batch's bounds, the
    same tensors in every layer, and each layer's own sliding window."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        seen.append(kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("crosskd_test_varlen", recording)
    model = tiny("mistral", "crosskd_test_varlen")
    ids, segments, positions, _ = two_packed_rows(64, [[9, 5], [5, 8, 3]])
    inputs = packed_inputs("flash_attention_2", ids, segments, positions, torch.float32)
    with torch.no_grad():
        model(use_cache=False, **inputs)
    assert len(seen) == model.config.num_hidden_layers
    for kwargs in seen:
        assert kwargs["cu_seq_lens_q"] is inputs["cu_seq_lens_q"]
        assert kwargs["cu_seq_lens_q"].tolist() == [0, 9, 14, 15, 16, 21, 29, 32]
        assert kwargs["max_length_q"] == kwargs["max_length_k"] == 9
        assert kwargs["sliding_window"] == 4
