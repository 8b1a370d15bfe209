"""What held-out bits per byte count: every token after the first of a text sample, the content
of the assistant turns of a chat sample (reasoning and answer, no template text, no end of turn),
the same bytes for every tokenizer; and the bits of exactly those tokens, against a direct
float64 computation."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from crosskd.data.collate import load_prepared
from crosskd.data.prepare import PrepareConfig, prepare
from crosskd.evaluate import (
    nll_bits_and_bytes,
    prepared_sequences,
    prepared_targets,
    sequence_bits_and_bytes,
)

ROWS = [
    {"id": "t1", "text": "Hello world. crosskd aligns tokens."},
    {
        "id": "c1",
        "messages": [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "<think>Pick one.</think>Blue, like the sky."},
        ],
    },
    {
        "id": "c2",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello there!"},
            {"role": "user", "content": "Count to 3"},
            {"role": "assistant", "content": "1, 2, 3 😀"},
        ],
    },
]
# The content bytes of the assistant turns, by hand: "Pick one." (9) + "Blue, like the sky." (19);
# "Hello there!" (12) + "1, 2, 3 " (8) + the emoji (4).
CONTENT_BYTES = {"c1": 28, "c2": 24}
MODELS = {"student": "llama3", "teacher0": "qwen3", "teacher1": "smollm2", "teacher2": "llama3"}


def _prepared(folder, rows: list[dict], teachers: list[str], zoo_cache):
    """``rows`` prepared under ``folder`` for the Llama-3 student and ``teachers``."""
    (folder / "rows.jsonl").write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CROSSKD_CACHE_DIR", str(zoo_cache))
        prepare(
            PrepareConfig(
                data=str(folder / "rows.jsonl"),
                student_tokenizer="zoo:llama3",
                teacher_tokenizers=teachers,
                output=str(folder / "out"),
                max_length=96,
            ),
            progress=False,
        )
    return load_prepared(str(folder / "out"))


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory, zoo_cache):
    teachers = ["zoo:qwen3", "zoo:smollm2", "zoo:llama3"]  # the last: the student's own
    return _prepared(tmp_path_factory.mktemp("chat-eval"), ROWS, teachers, zoo_cache)


@pytest.mark.parametrize("name", list(MODELS))
def test_every_tokenizer_counts_the_same_content_bytes(chat_data, zoo, name):
    tok = zoo(MODELS[name])
    ids = [s["sample_id"] for row in chat_data.packed_rows() for s in row]
    sequences = prepared_sequences(chat_data, name)
    targets = prepared_targets(chat_data, name, tok)
    counted = {
        i: int(tok.bytes.lengths[q[t]].sum())
        for i, q, t in zip(ids, sequences, targets, strict=True)
    }
    assert {i: counted[i] for i in CONTENT_BYTES} == CONTENT_BYTES
    for i, q, t in zip(ids, sequences, targets, strict=True):
        assert not t[0]
        if i == "t1":  # text: every token after the first
            assert t[1:].all()
        else:
            text = tok.hf.decode(q[t])
            assert text == (
                "Pick one.Blue, like the sky." if i == "c1" else "Hello there!1, 2, 3 😀"
            )
            assert not np.isin(q[t], tok.special_ids).any()


def test_bits_are_those_of_the_target_tokens(chat_data, zoo, tmp_path):
    from crosskd.zoo.models import init_llama

    tok = zoo("llama3")
    folder = init_llama(
        tmp_path / "m",
        tok.name,
        {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1},
        seed=3,
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    sequences = prepared_sequences(chat_data, "student")
    targets = prepared_targets(chat_data, "student", tok)
    bits, n_bytes = nll_bits_and_bytes(
        model, sequences, tok.bytes.lengths, targets=targets, token_budget=64
    )
    expected = []
    with torch.no_grad():
        for q, t in zip(sequences, targets, strict=True):
            logits = model(input_ids=torch.as_tensor(q)[None]).logits[0].double()
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.as_tensor(q[1:])[:, None])
            expected.append(-lp[torch.as_tensor(t[1:])].sum().item() / math.log(2))
    assert n_bytes == 35 + sum(CONTENT_BYTES.values())  # the text sample's 35 bytes after BOS
    assert bits == pytest.approx(sum(expected), rel=1e-5)
    # Each sample's own terms, in the data's order (the paired comparison's inputs).
    per_bits, per_bytes = sequence_bits_and_bytes(
        model, sequences, tok.bytes.lengths, targets=targets, token_budget=64
    )
    ids = [s["sample_id"] for row in chat_data.packed_rows() for s in row]
    assert per_bits == pytest.approx(expected, rel=1e-5)
    assert {i: int(b) for i, b in zip(ids, per_bytes, strict=True) if i in CONTENT_BYTES} == (
        CONTENT_BYTES
    )
    assert per_bits.sum() == pytest.approx(bits, rel=1e-12) and per_bytes.sum() == n_bytes
    # Without targets: every token after the first of every sample, templates included.
    all_bits, all_bytes = nll_bits_and_bytes(model, sequences, tok.bytes.lengths)
    assert all_bytes > n_bytes and all_bits > bits


NUMBERS = "In 1984, 2048 bytes cost 3.50; call 555-0123 by 12:45."
# Its digits by hand: 1984 2048 3 50 555 0123 12 45: 4+4+1+2+3+4+2+2 = 22 bytes, in that order.
NUMBER_DIGITS = "1984204835055501231245"


@pytest.fixture(scope="module")
def number_data(tmp_path_factory, zoo_cache):
    rows = [{"id": "n1", "text": NUMBERS}, {"id": "t1", "text": "No numbers here."}]
    teachers = ["zoo:qwen3", "zoo:smollm2"]
    return _prepared(tmp_path_factory.mktemp("number-eval"), rows, teachers, zoo_cache)


@pytest.mark.parametrize("name", ["student", "teacher0", "teacher1"])
def test_digit_targets_are_the_numbers_digits_whatever_the_packing(number_data, zoo, name):
    tok = zoo(MODELS[name])
    ids = [s["sample_id"] for row in number_data.packed_rows() for s in row]
    sequences = prepared_sequences(number_data, name)
    everything = prepared_targets(number_data, name, tok)
    digits = prepared_targets(number_data, name, tok, digits=True)
    by_id = dict(zip(ids, zip(sequences, everything, digits, strict=True), strict=True))
    q, every, t = by_id["n1"]
    assert tok.hf.decode(q[t]) == NUMBER_DIGITS
    assert int(tok.bytes.lengths[q[t]].sum()) == len(NUMBER_DIGITS)
    assert not (t & ~every).any()  # a subset of the targets
    assert not by_id["t1"][2].any()
    if name == "student":  # Llama-3 packs up to three digits in a token, SmolLM2 and Qwen3 one
        assert [tok.hf.decode([i]) for i in q[t]][:3] == ["198", "4", "204"]
    else:
        assert (tok.bytes.lengths[q[t]] == 1).all()


@pytest.mark.parametrize("model", ["llama3", "smollm2", "qwen3"])
def test_digit_ids_are_those_spelled_by_ascii_digits_alone(zoo, model):
    vocab = zoo(model).bytes
    expected = np.array(
        [
            bool(b) and all(48 <= c <= 57 for c in b)
            for b in (vocab.token_bytes(i) for i in range(len(vocab)))
        ]
    )
    assert (vocab.digits == expected).all()
    assert 10 <= expected.sum() <= 1110  # 0-9 at least; Llama-3: every number below 1000


def test_an_unknown_token_choice_is_refused_by_name():
    from crosskd.errors import ConfigError
    from crosskd.evaluate import EvaluateConfig

    with pytest.raises(ConfigError, match=r"tokens is 'numbers'; write one of all, digits"):
        EvaluateConfig(data="d", models=["m"], tokens="numbers")


def test_a_digits_evaluation_counts_the_digits_and_is_not_the_earlier_one(
    number_data, zoo, tmp_path
):
    from crosskd.steps.evaluate import evaluate_models
    from crosskd.zoo.models import init_llama

    shape = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
    model = init_llama(tmp_path / "m", zoo("llama3").name, shape, seed=3)
    output = str(tmp_path / "evaluation.json")
    every = evaluate_models(number_data.uri, {"m": str(model)}, output)["evaluation"]
    digits = evaluate_models(number_data.uri, {"m": str(model)}, output, tokens="digits")
    written = json.loads((tmp_path / "evaluation.json").read_text())
    assert written["tokens"] == "digits"
    ids = [s["sample_id"] for row in number_data.packed_rows() for s in row]
    assert dict(zip(ids, written["models"]["m"]["sequence_bytes"], strict=True)) == {
        "n1": len(NUMBER_DIGITS),
        "t1": 0,
    }
    assert 0 < written["models"]["m"]["bits"] < every["models"]["m"]["bits"]
    assert digits["bits_per_byte"]["m"] == written["models"]["m"]["bits_per_byte"]
