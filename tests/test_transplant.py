"""``crosskd transplant``: a model moved onto another tokenizer, its new embedding rows made
from the old ones through the ``new -> old`` sub-token table (values checked row by row
against the table), saved as a folder ``AutoModelForCausalLM`` loads."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from kfp import dsl
from safetensors.torch import load_file
from tokenizers import Tokenizer
from tokenizers.models import WordPiece
from train_inputs import TEXTS, tiny_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from crosskd import steps
from crosskd.cli import main
from crosskd.errors import ConfigError, CrosskdError, DataError
from crosskd.steps.config import load_run_config
from crosskd.steps.runtime import drop_none
from crosskd.tables.build import build_table
from crosskd.tables.format import Flag, SubTokenTable
from crosskd.tokenization import load_tokenizer
from crosskd.transplant import TransplantConfig, piece_mean, text_bits_per_byte, transplant
from crosskd.zoo import train_tiny_bpe

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """An old tiny model (330-token BPE, tied) and a new 420-token BPE of the same texts, plus
    an untied copy of the old model."""
    root = tmp_path_factory.mktemp("transplant")
    old = tiny_model(root / "old", TEXTS * 4, 330, seed=3)
    new = train_tiny_bpe(TEXTS * 4, 420, root / "new")
    untied = root / "untied"
    tied = AutoModelForCausalLM.from_pretrained(str(old))
    config = LlamaConfig(**{**tied.config.to_dict(), "tie_word_embeddings": False})
    torch.manual_seed(5)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(untied), safe_serialization=True)
    load_tokenizer(str(old)).hf.save_pretrained(str(untied))
    return {"root": root, "old": old, "new": new, "untied": untied}


def _weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def test_piece_mean_rows_by_hand():
    """Chains ``[2, 0]``, ``[1]`` and none: the mean of rows 2 and 0, row 1 exactly, and the
    mean of every old row."""
    old = torch.tensor([[1.0, 2.0], [3.0, 5.0], [7.0, 11.0]])
    table = SubTokenTable(
        offsets=np.array([0, 2, 3, 3]),
        chains=np.array([2, 0, 1], dtype=np.int32),
        flags=np.array([Flag.NORMAL, Flag.NORMAL, Flag.UNREPRESENTABLE], dtype=np.uint8),
        meta=None,
    )
    want = torch.tensor([[4.0, 6.5], [3.0, 5.0], [11 / 3, 6.0]])  # 11 / 3 rounded to float32
    assert torch.equal(piece_mean(old, table), want)
    assert piece_mean(old.bfloat16(), table).dtype == torch.bfloat16


def test_transplanted_rows_come_from_the_table(pair, tmp_path):
    old_tok, new_tok = load_tokenizer(str(pair["old"])), load_tokenizer(str(pair["new"]))
    report = transplant(TransplantConfig(str(pair["old"]), str(pair["new"]), str(tmp_path / "m")))
    old_rows = _weights(pair["old"])["model.embed_tokens.weight"]
    new_rows = _weights(tmp_path / "m")["model.embed_tokens.weight"]
    assert new_rows.shape == (new_tok.vocab_size, old_rows.shape[1])
    table = build_table(new_tok, old_tok, progress=False)
    identical = 0
    for token, new_id in new_tok.vocab.items():
        chain = table.chain(new_id).tolist()
        assert chain, token  # every byte is representable in a byte-level BPE
        assert torch.equal(new_rows[new_id], old_rows[chain].mean(dim=0)), token
        if token in old_tok.vocab:
            identical += 1
            assert chain == [old_tok.vocab[token]]
            assert torch.equal(new_rows[new_id], old_rows[old_tok.vocab[token]])  # exactly
    assert identical > 250  # the byte alphabet and common merges
    eos_new, eos_old = new_tok.role_ids["eos"], old_tok.role_ids["eos"]
    assert torch.equal(new_rows[eos_new], old_rows[eos_old])  # a special by its role
    assert (report.vocab_size, report.tied) == (new_tok.vocab_size, True)
    assert report.kept + report.averaged + report.fallback == new_tok.vocab_size
    assert report.averaged == int((table.lengths > 1).sum()) > 0
    # The body is untouched and the folder loads as a normal model with the new tokenizer.
    old_weights, new_weights = _weights(pair["old"]), _weights(tmp_path / "m")
    body = [k for k in old_weights if "embed_tokens" not in k and "lm_head" not in k]
    assert body and all(torch.equal(old_weights[k], new_weights[k]) for k in body)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["vocab_size"] == new_tok.vocab_size
    assert config["eos_token_id"] == new_tok.hf.eos_token_id
    assert load_tokenizer(str(tmp_path / "m")).fingerprint == new_tok.fingerprint
    ids = new_tok.hf("The quick brown fox.", return_tensors="pt")["input_ids"]
    assert torch.isfinite(model(ids).logits).all()


def test_an_untied_head_is_moved_by_its_own_rows(pair, tmp_path):
    transplant(TransplantConfig(str(pair["untied"]), str(pair["new"]), str(tmp_path / "m")))
    new_tok = load_tokenizer(str(pair["new"]))
    table = build_table(new_tok, load_tokenizer(str(pair["untied"])), progress=False)
    old, new = _weights(pair["untied"]), _weights(tmp_path / "m")
    assert not torch.equal(old["lm_head.weight"], old["model.embed_tokens.weight"])
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        assert torch.equal(new[name], piece_mean(old[name], table))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"))
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight


def test_onto_its_own_tokenizer_a_model_is_unchanged(pair, tmp_path):
    """Every row is a chain of one (the same token): the weights are the old ones, bit for bit,
    in the dtype asked for."""
    transplant(TransplantConfig(str(pair["old"]), str(pair["old"]), str(tmp_path / "same")))
    old, same = _weights(pair["old"]), _weights(tmp_path / "same")
    assert old.keys() == same.keys() and all(torch.equal(old[k], same[k]) for k in old)
    transplant(
        TransplantConfig(
            str(pair["old"]), str(pair["old"]), str(tmp_path / "bf16"), dtype="bfloat16"
        )
    )
    half = _weights(tmp_path / "bf16")
    assert all(half[k].dtype == torch.bfloat16 for k in half)
    assert all(torch.equal(old[k].to(torch.bfloat16), half[k]) for k in old)


def test_heldout_bits_per_byte_before_training(pair, tmp_path):
    """Onto its own tokenizer the moved model is the original, so the two figures are equal;
    onto another, each model is measured on its own tokens of the same texts, and the figure
    matches crosskd.evaluate's on those tokens."""
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:6]))
    same = transplant(
        TransplantConfig(
            str(pair["old"]), str(pair["old"]), str(tmp_path / "s"), heldout=str(heldout)
        )
    )
    assert set(same.bits_per_byte) == {"original", "mean"}
    assert same.bits_per_byte["original"] == same.bits_per_byte["mean"] > 0
    moved = transplant(
        TransplantConfig(
            str(pair["old"]), str(pair["new"]), str(tmp_path / "m"), heldout=str(heldout)
        )
    )
    assert moved.bits_per_byte["original"] == same.bits_per_byte["original"]
    new_tok = load_tokenizer(str(pair["new"]))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"))
    assert moved.bits_per_byte["mean"] == text_bits_per_byte(model, new_tok, TEXTS[:6])
    assert "; held-out bits/byte: original " in moved.line() and ", mean " in moved.line()
    chat = tmp_path / "chat.jsonl"
    chat.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"},
                ]
            }
        )
        + "\n"
    )
    with pytest.raises(DataError, match=r"heldout .*chat\.jsonl: row 1 .* is a conversation"):
        transplant(
            TransplantConfig(
                str(pair["old"]), str(pair["new"]), str(tmp_path / "c"), heldout=str(chat)
            )
        )
    assert not (tmp_path / "c").exists()


def _tuned(pair, model: str, out, rows) -> TransplantConfig:
    return TransplantConfig(
        str(pair[model]),
        str(pair["new"]),
        str(out),
        method="tuned",
        heldout=str(rows),
        tune_data=str(rows),
        tune_steps=20,
        tune_lr=1e-2,
        tune_length=16,
    )


def test_tuned_embeddings_learn_the_text_and_leave_the_body(pair, tmp_path):
    """``tuned``: the piece mean, then the embeddings trained alone on the tuning text: on that
    text the tuned model predicts better than the piece mean, the body is unchanged, and the
    same seed draws the same windows."""
    rows = tmp_path / "tune.jsonl"
    rows.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    config = _tuned(pair, "old", tmp_path / "t", rows)
    report = transplant(config)
    assert list(report.bits_per_byte) == ["original", "mean", "tuned"]
    assert report.bits_per_byte["tuned"] < report.bits_per_byte["mean"]
    old, tuned = _weights(pair["old"]), _weights(tmp_path / "t")
    body = [k for k in old if "embed_tokens" not in k and "lm_head" not in k]
    assert body and all(torch.equal(old[k], tuned[k]) for k in body)
    again = transplant(dataclasses.replace(config, output=str(tmp_path / "again")))
    assert again.bits_per_byte == report.bits_per_byte


def test_tuning_an_untied_model_leaves_unseen_input_rows_at_their_piece_mean(pair, tmp_path):
    """Untied: an input row of a token the tuning text never shows gets no gradient, so it keeps
    its piece mean exactly; every output row learns (through the softmax)."""
    rows = tmp_path / "tune.jsonl"
    rows.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:4]))
    transplant(_tuned(pair, "untied", tmp_path / "u", rows))
    new_tok = load_tokenizer(str(pair["new"]))
    table = build_table(new_tok, load_tokenizer(str(pair["untied"])), progress=False)
    old, tuned = _weights(pair["untied"]), _weights(tmp_path / "u")
    mean = piece_mean(old["model.embed_tokens.weight"], table)
    seen = {i for t in TEXTS[:4] for i in new_tok.hf(t, add_special_tokens=False)["input_ids"]}
    seen.add(new_tok.hf.eos_token_id)
    unseen = [i for i in range(new_tok.vocab_size) if i not in seen]
    assert unseen and seen
    embed = tuned["model.embed_tokens.weight"]
    assert torch.equal(embed[unseen], mean[unseen])
    assert not torch.equal(embed[sorted(seen)], mean[sorted(seen)])
    head = piece_mean(old["lm_head.weight"], table)
    assert not torch.isclose(tuned["lm_head.weight"], head).all(dim=1).any()


def test_bad_inputs_are_refused_by_name_and_nothing_is_written(pair, tmp_path, capsys):
    wordpiece = tmp_path / "wordpiece"
    wordpiece.mkdir()
    Tokenizer(WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(
        str(wordpiece / "tokenizer.json")
    )
    out = tmp_path / "out"
    code = main(
        [
            "transplant",
            "--model",
            str(pair["old"]),
            "--tokenizer",
            str(wordpiece),
            "--output",
            str(out),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and str(wordpiece) in err[0], err
    assert not out.exists()
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"output .*full exists and is not an empty folder"):
        transplant(TransplantConfig(str(pair["old"]), str(pair["new"]), str(full)))
    assert [p.name for p in full.iterdir()] == ["keep.txt"]
    # A ChatML template over a tokenizer without <|im_start|> and <|im_end|> as specials.
    bare = train_tiny_bpe(TEXTS, 300, tmp_path / "bare", special_tokens=("<|endoftext|>",))
    with pytest.raises(
        ConfigError,
        match=r"tokenizer .*bare: its chat template writes <\|im_end\|>, <\|im_start\|>, which",
    ):
        transplant(TransplantConfig(str(pair["old"]), str(bare), str(out)))
    assert not out.exists()
    with pytest.raises(ConfigError, match="tune_lr is 0; it must be a number > 0"):
        TransplantConfig("m", "t", "o", tune_lr=0)
    with pytest.raises(ConfigError, match="method is 'focus'; choose one of mean, tuned"):
        TransplantConfig("m", "t", "o", method="focus")
    with pytest.raises(CrosskdError, match="nowhere"):
        transplant(TransplantConfig(str(tmp_path / "nowhere"), str(pair["new"]), str(out)))
    assert not out.exists()


def test_the_command_line_writes_the_model_and_prints_the_report(pair, tmp_path, capsys):
    out = tmp_path / "cli"
    code = main(
        [
            "transplant",
            "--model",
            str(pair["old"]),
            "--tokenizer",
            str(pair["new"]),
            "--output",
            str(out),
        ]
    )
    assert code == 0
    line = capsys.readouterr().out.strip()
    size = load_tokenizer(str(pair["new"])).vocab_size
    assert line.startswith(f"{out}: {size} rows, ") and "tied output layer" in line
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()


def _transfer_run(pair, root, *overrides):
    """The ``tiny`` preset with the old model as the student, moved onto the new tokenizer."""
    return load_run_config(
        None,
        "tiny",
        [
            f"output={root}",
            f"student={pair['old']}",
            f"student_tokenizer={pair['new']}",
            "corpus_bytes=6000",
            "train.steps=2",
            *overrides,
        ],
    )


def test_a_run_moves_its_student_once_under_a_content_key(pair, tmp_path, monkeypatch):
    root = tmp_path / "root"
    config = _transfer_run(pair, root, "transplant={method: tuned, tune_steps: 2, tune_length: 16}")
    plan = steps.validate_inputs(config)
    spec = plan["transplant"]
    assert plan["student"] == str(pair["old"])  # moved by init_student, not here
    assert plan["student_fingerprint"] == load_tokenizer(str(pair["new"])).fingerprint
    assert spec["model"] == str(pair["old"]) and spec["tokenizer"] == str(pair["new"])
    assert spec["tune_data"] == plan["train_data"]  # the run's training rows, not held-out text
    assert spec["output"].startswith(f"{root}/inputs/students/")
    assert not (root / "inputs" / "students").exists()

    resolved = steps.init_student(plan)
    assert resolved["student"] == spec["output"]
    assert {**resolved, "student": plan["student"], "transplanted": None} == {
        **plan,
        "transplanted": None,
    }
    size = load_tokenizer(str(pair["new"])).vocab_size
    report = resolved["transplanted"]
    assert report["vocab_size"] == size == report["kept"] + report["averaged"] + report["fallback"]
    moved = AutoModelForCausalLM.from_pretrained(spec["output"])
    assert moved.get_input_embeddings().weight.shape[0] == size
    assert load_tokenizer(spec["output"]).fingerprint == plan["student_fingerprint"]

    # Done once: the same plan finds the published model (a second move would fail here).
    def refuse(config):
        raise AssertionError("moved again")

    monkeypatch.setattr("crosskd.transplant.transplant", refuse)
    assert steps.init_student(plan) == resolved
    sys.path.insert(0, str(ROOT))
    from components.init_student.component import init_student as component

    figures = dsl.Metrics(uri=str(tmp_path / "kfp" / "figures"))
    assert component.python_func(plan=plan, figures=figures) == drop_none(resolved)
    assert figures.metadata["transplant_vocab_size"] == size
    assert figures.metadata["transplant_kept"] == report["kept"]
    assert steps.init_student({**plan, "transplant": None})["student"] == str(pair["old"])
    other = steps.validate_inputs(_transfer_run(pair, root, "transplant={}"))
    assert other["transplant"]["output"] != spec["output"]  # the method is part of the key


def test_a_run_refuses_a_transplant_it_cannot_do(pair, tmp_path):
    root = tmp_path / "root"
    cases = {
        "transplant=5": "transplant is 5; give a mapping of transplant keys",
        "transplant={model: x}": "transplant: unknown key(s) model; known keys: dtype, ",
        "transplant={method: focus}": "transplant: method is 'focus'; choose one of mean, tuned",
        "transplant={tune_steps: 0}": "transplant: tune_steps is 0",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            _transfer_run(pair, root, override)
    with pytest.raises(ConfigError, match="transplant is set but student is init; give a"):
        load_run_config(None, "tiny", [f"output={root}", "transplant={}"])
    bare = train_tiny_bpe(TEXTS, 300, tmp_path / "bare", special_tokens=("<|endoftext|>",))
    config = _transfer_run(pair, root, f"student_tokenizer={bare}", "transplant={}")
    with pytest.raises(ConfigError, match=r"tokenizer .*bare: its chat template writes <\|im_end"):
        steps.validate_inputs(config)
    assert not (root / "inputs" / "students").exists()


def test_distill_trains_the_moved_student_and_measures_it_before_and_after(pair, tmp_path):
    from crosskd.distill import distill

    root = tmp_path / "root"
    config = _transfer_run(pair, root, "transplant={}", "compare_ce_only=false")
    result = distill(config, progress=False)
    spec = steps.validate_inputs(config)["transplant"]
    trained = AutoModelForCausalLM.from_pretrained(str(root / "kd" / "final"))
    size = load_tokenizer(str(pair["new"])).vocab_size
    assert trained.get_input_embeddings().weight.shape[0] == size
    assert set(result["bits_per_byte"]) == {"teacher", "student_init", "student_kd"}
    assert yaml.safe_load((root / "kd" / "train.yaml").read_text())["student"] == spec["output"]


def test_a_model_without_an_input_embedding_table_is_refused_by_name(pair, tmp_path, monkeypatch):
    """A causal LM whose input module is not a token embedding table (here the model's final
    norm stands in for one) is refused in one line naming it, and nothing is written."""
    monkeypatch.setattr(LlamaForCausalLM, "get_input_embeddings", lambda self: self.model.norm)
    out = tmp_path / "out"
    with pytest.raises(CrosskdError, match=r"has no input embedding table") as info:
        transplant(TransplantConfig(str(pair["old"]), str(pair["new"]), str(out)))
    assert str(pair["old"]) in str(info.value) and "\n" not in str(info.value)
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


def test_a_dataset_is_read_only_up_to_the_bytes_asked_for(tmp_path):
    """``corpus_texts`` on rows: whole rows in order until ``target_bytes`` are read (the
    row that reaches it included), never the rest of a large dataset."""
    from crosskd.transplant import corpus_texts

    rows = tmp_path / "rows.jsonl"
    texts = [f"row {i} " + "é" * 10 for i in range(100)]  # 26 UTF-8 bytes each (é is 2)
    rows.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert corpus_texts(str(rows), 52, "tune_data") == texts[:2]
    assert corpus_texts(str(rows), 53, "tune_data") == texts[:3]
    assert corpus_texts(str(rows), 10**6, "tune_data") == texts
