"""``crosskd.shrink``: a model with some of its decoder layers removed, each kept layer's weights
copied unchanged and renumbered, saved as a folder ``AutoModelForCausalLM`` loads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_inputs import TEXTS, tiny_model
from transformers import AutoModelForCausalLM

from crosskd import steps
from crosskd.errors import ConfigError, CrosskdError
from crosskd.shrink import kept_layers, shrink
from crosskd.steps.config import load_run_config
from crosskd.teacher.model import write_model_folder
from crosskd.tokenization import load_tokenizer


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny random-init Llama with 6 decoder layers."""
    root = tmp_path_factory.mktemp("shrink")
    return tiny_model(root / "model", TEXTS * 4, 330, seed=4, num_hidden_layers=6)


@pytest.mark.parametrize(
    ("total", "keep", "expected"),
    [
        (30, 10, [0, 1, 22, 23, 24, 25, 26, 27, 28, 29]),
        (30, 30, list(range(30))),
        (6, 4, [0, 1, 4, 5]),
        (6, 3, [0, 1, 5]),
        (6, 2, [0, 5]),
        (6, 1, [5]),
        (6, [4, 0, 2], [0, 2, 4]),
    ],
)
def test_kept_layers_by_hand(total, keep, expected):
    assert kept_layers(total, keep) == expected


@pytest.mark.parametrize(
    ("keep", "words"),
    [
        (0, "keep 1 to 6"),
        (7, "keep 1 to 6"),
        ([], "distinct layer indices in [0, 6)"),
        ([1, 1], "distinct layer indices"),
        ([6], "distinct layer indices"),
        ([-1], "distinct layer indices"),
        (True, "a count of layers or a list"),
        ("3", "a count of layers or a list"),
    ],
)
def test_bad_layers_are_refused_by_name(keep, words):
    with pytest.raises(ConfigError, match="layers is") as info:
        kept_layers(6, keep)
    assert words in str(info.value)


def test_kept_layers_are_the_original_weights_renumbered(model, tmp_path):
    report = shrink(str(model), str(tmp_path / "small"), [1, 4])
    assert report.layers == [1, 4]
    old, new = (
        load_file(str(model / "model.safetensors")),
        load_file(str(tmp_path / "small" / "model.safetensors")),
    )
    for new_index, old_index in enumerate([1, 4]):
        for key in [k for k in old if k.startswith(f"model.layers.{old_index}.")]:
            moved = key.replace(f"layers.{old_index}.", f"layers.{new_index}.")
            assert torch.equal(new[moved], old[key]), moved
    assert not any(k.startswith("model.layers.2.") for k in new)
    for key in ("model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(new[key], old[key])
    config = json.loads((tmp_path / "small" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    assert report.parameters == sum(t.numel() for t in new.values())
    assert report.original_parameters == sum(t.numel() for t in old.values())
    assert (tmp_path / "small" / "tokenizer.json").read_bytes() == (
        model / "tokenizer.json"
    ).read_bytes()


def test_keeping_every_layer_computes_what_the_model_does(model, tmp_path):
    shrink(str(model), str(tmp_path / "all"), 6)
    ids = torch.tensor([[5, 17, 42, 8, 99, 3]])
    original = AutoModelForCausalLM.from_pretrained(str(model)).eval()
    copy = AutoModelForCausalLM.from_pretrained(str(tmp_path / "all")).eval()
    with torch.no_grad():
        assert torch.equal(original(ids).logits, copy(ids).logits)


def test_a_shrunk_model_decodes_with_its_cache_as_without(model, tmp_path):
    """Greedy decoding with the key-value cache gives what recomputing the whole prefix at every
    token gives (the loaded cut model's layers index the cache anew), and the cut model computes
    something else than the whole one."""
    shrink(str(model), str(tmp_path / "small"), [0, 3, 5])
    small = AutoModelForCausalLM.from_pretrained(str(tmp_path / "small")).eval()
    prompt = torch.tensor([[5, 17, 42, 8]])
    with torch.no_grad():
        cached = small.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
        ids = prompt
        for _ in range(6):
            logits = small(ids, use_cache=False).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, ids)
    with torch.no_grad():
        full = AutoModelForCausalLM.from_pretrained(str(model)).eval()
        assert not torch.allclose(full(prompt).logits, small(prompt).logits)


def test_per_layer_config_lists_are_cut_and_others_kept(model, tmp_path):
    """``layer_types`` (one entry per layer) keeps the kept layers' entries; a list of another
    meaning that happens to have one entry per layer (``eos_token_id`` here) is left alone."""
    folder = tmp_path / "typed"
    values = json.loads((model / "config.json").read_text())
    kinds = ["full_attention", "sliding_attention"] * 3
    values |= {"layer_types": kinds, "eos_token_id": [1, 2, 3, 4, 5, 6]}
    folder.mkdir()
    for path in model.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    (folder / "config.json").write_text(json.dumps(values))
    shrink(str(folder), str(tmp_path / "small"), [0, 3, 4])
    config = json.loads((tmp_path / "small" / "config.json").read_text())
    assert config["layer_types"] == ["full_attention", "sliding_attention", "full_attention"]
    assert config["eos_token_id"] == [1, 2, 3, 4, 5, 6]


def test_an_output_folder_with_files_is_refused_and_kept(model, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is not an empty folder"):
        shrink(str(model), str(out), 2)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_a_bad_count_writes_nothing(model, tmp_path):
    with pytest.raises(ConfigError, match="layers is 9"):
        shrink(str(model), str(tmp_path / "small"), 9)
    assert not (tmp_path / "small").exists()


def test_a_save_that_fails_leaves_no_folder_and_an_empty_one_is_filled(model, tmp_path):
    """``write_model_folder``, which shrink and transplant publish through: a tokenizer writer
    that fails leaves nothing at the output nor beside it; an empty output folder is
    replaced by the whole model folder."""
    loaded = AutoModelForCausalLM.from_pretrained(str(model))

    def broken(folder: Path) -> None:
        (folder / "tokenizer.json").write_text("{")
        raise OSError("disk full")

    out = tmp_path / "out"
    with pytest.raises(OSError, match="disk full"):
        write_model_folder(loaded, out, broken)
    assert list(tmp_path.iterdir()) == []
    out.mkdir()
    write_model_folder(loaded, out, lambda folder: (folder / "tokenizer.json").write_text("{}"))
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_model_without_decoder_layers_is_refused_by_name(model, tmp_path, monkeypatch):
    import transformers

    class Flat(torch.nn.Module):
        pass

    monkeypatch.setattr(
        transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Flat()
    )
    with pytest.raises(CrosskdError, match=r"has no model\.layers list"):
        shrink(str(model), str(tmp_path / "small"), 2)
    assert not (tmp_path / "small").exists()


def _run(model, root, *overrides):
    """The ``tiny`` preset with the 6-layer model as the student, cut to fewer layers."""
    return load_run_config(
        None,
        "tiny",
        [f"output={root}", f"student={model}", "corpus_bytes=6000", "train.steps=2", *overrides],
    )


def test_a_run_cuts_its_student_once_under_a_content_key(model, tmp_path, monkeypatch):
    root = tmp_path / "root"
    plan = steps.validate_inputs(_run(model, root, "student_layers=3"))
    student = plan["student"]
    assert student.startswith(f"{root}/inputs/students/")
    config = json.loads((Path(student) / "config.json").read_text())
    assert config["num_hidden_layers"] == 3
    old = load_file(str(model / "model.safetensors"))
    new = load_file(str(Path(student) / "model.safetensors"))
    assert torch.equal(
        new["model.layers.2.mlp.up_proj.weight"], old["model.layers.5.mlp.up_proj.weight"]
    )
    assert plan["student_fingerprint"] == load_tokenizer(str(model)).fingerprint

    def refuse(*args, **kwargs):
        raise AssertionError("cut again")

    monkeypatch.setattr("crosskd.steps.inputs.shrink", refuse)
    assert steps.validate_inputs(_run(model, root, "student_layers=3"))["student"] == student
    listed = steps.validate_inputs(_run(model, root, "student_layers=[0, 1, 5]"))
    assert listed["student"] == student  # the same layers: the same key
    monkeypatch.undo()
    other = steps.validate_inputs(_run(model, root, "student_layers=[0, 5]"))
    assert other["student"] != student


def test_a_run_refuses_layers_it_cannot_cut(model, tmp_path):
    root = tmp_path / "root"
    cases = {
        "student_layers=0": "student_layers is 0; give a count of decoder layers to keep",
        "student_layers=[]": "student_layers is []; give a count",
        "student_layers=[1, x]": "student_layers is [1, 'x']; give a count",
        "student_layers=true": "student_layers is True; give a count",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            _run(model, root, override)
    with pytest.raises(ConfigError, match="student_layers is set but student is init; give a"):
        load_run_config(None, "tiny", [f"output={root}", "student_layers=2"])
    with pytest.raises(
        ConfigError, match=re.escape("student_layers: layers is 7; the model has 6: keep 1 to 6.")
    ):
        steps.validate_inputs(_run(model, root, "student_layers=7"))
    assert not (root / "inputs" / "students").exists()
