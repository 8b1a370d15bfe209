"""Command-line options derived from the config dataclasses (``crosskd.config``:
``add_config_options``, ``config_flags``, ``flag_overrides``) and their use by every ``crosskd``
command that builds a config. Cheap: no model or tokenizer is loaded."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from crosskd.cli import build_parser, main
from crosskd.config import (
    add_config_options,
    config_flags,
    field_docs,
    flag_overrides,
    load_config,
)
from crosskd.data.prepare import PrepareConfig
from crosskd.evaluate import EvaluateConfig
from crosskd.generate import GenerateConfig
from crosskd.k8s.job import JobConfig
from crosskd.steps.config import RunConfig
from crosskd.teacher.scoring import ScoreConfig
from crosskd.train.config import TrainConfig
from crosskd.transplant import TransplantConfig


@dataclass
class Sample:
    """A config with a field of every kind."""

    name: str
    """The name,
    over   two lines."""
    count: int = 3
    """How many (100% of them)."""
    ratio: float = 0.5
    """A ratio."""
    label: str | None = None
    """An optional label."""
    fast: bool = False
    """Go fast."""
    items: list[str] = field(default_factory=lambda: ["a"])
    """The items."""
    extra: dict = field(default_factory=dict)
    """A mapping."""
    rows: list[dict] = field(default_factory=list)
    """Rows of mappings."""


def _sample_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sample")
    parser.add_argument("--config")
    add_config_options(parser, Sample)
    return parser


def test_field_docs_are_the_attribute_docstrings_with_whitespace_collapsed():
    assert dict(field_docs(Sample)) == {
        "name": "The name, over two lines.",
        "count": "How many (100% of them).",
        "ratio": "A ratio.",
        "label": "An optional label.",
        "fast": "Go fast.",
        "items": "The items.",
        "extra": "A mapping.",
        "rows": "Rows of mappings.",
    }


def test_each_kind_of_field_gets_exactly_its_option_with_the_docstring_as_help():
    actions = {
        a.option_strings[0] if a.option_strings else a.dest: a
        for a in _sample_parser()._actions
        if a.dest not in ("help", "config")
    }
    described = {flag: (type(a).__name__, a.type, a.default, a.help) for flag, a in actions.items()}
    assert described == {
        "--name": ("_StoreAction", str, None, "The name, over two lines. (required)"),
        "--count": ("_StoreAction", int, None, "How many (100%% of them). (default: 3)"),
        "--ratio": ("_StoreAction", float, None, "A ratio. (default: 0.5)"),
        "--label": ("_StoreAction", str, None, "An optional label. (default: None)"),
        "--fast": ("BooleanOptionalAction", None, None, "Go fast. (default: false)"),
        "--items": ("_AppendAction", str, None, "The items. (repeatable; default: ['a'])"),
        "overrides": ("_StoreAction", None, None, actions["overrides"].help),
    }
    assert actions["--fast"].option_strings == ["--fast", "--no-fast"]
    assert actions["overrides"].nargs == "*"
    assert "set in the file or here: extra, rows" in actions["overrides"].help
    assert "How many (100% of them). (default: 3)" in _sample_parser().format_help()


def _file(tmp_path: Path) -> str:
    path = tmp_path / "sample.yaml"
    values = {"name": "n", "count": 5, "ratio": 0.25, "label": "file", "fast": True}
    path.write_text(yaml.safe_dump({**values, "items": ["f"]}))
    return str(path)


def test_given_options_override_the_file_and_key_value_overrides_win(tmp_path):
    argv = ["--count", "7", "--no-fast", "--items", "x", "--items", "y", "ratio=0.75", "count=9"]
    args = _sample_parser().parse_args(["--config", _file(tmp_path), *argv])
    flags = config_flags(args, Sample)
    assert flags == {"count": 7, "fast": False, "items": ["x", "y"]}
    config = load_config(Sample, args.config, args.overrides, flags=flags)
    assert config == Sample(
        name="n", count=9, ratio=0.75, label="file", fast=False, items=["x", "y"]
    )
    args = _sample_parser().parse_args(["--config", _file(tmp_path), "--count", "7"])
    assert (
        load_config(Sample, args.config, args.overrides, flags=config_flags(args, Sample)).count
        == 7
    )


def test_options_not_given_leave_the_file_alone(tmp_path):
    args = _sample_parser().parse_args(["--config", _file(tmp_path)])
    assert config_flags(args, Sample) == {}
    assert load_config(Sample, args.config, args.overrides, flags={}) == Sample(
        name="n", count=5, ratio=0.25, label="file", fast=True, items=["f"]
    )


@pytest.mark.parametrize(
    "values",
    [
        {"name": "4096", "ratio": 1e-5, "label": "true", "fast": False, "items": ["a b", "c: d"]},
        {"name": "line\nbreak", "count": 12, "label": None, "items": ["", "#x", "it's"]},
    ],
)
def test_flag_overrides_read_back_as_the_same_values(values):
    assert load_config(Sample, None, flag_overrides(values)) == Sample(**values)


def _help(argv: list[str], capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "10000")  # one line per option: no hyphen split by wrapping
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*argv, "--help"])
    assert exit_info.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_prepare_help_lists_every_field_option_with_its_docstring(capsys, monkeypatch):
    text = _help(["prepare"], capsys, monkeypatch)
    for name, doc in field_docs(PrepareConfig).items():
        assert f"--{name.replace('_', '-')} " in text
        assert doc in text
    assert "--pack, --no-pack" in text and "--teacher-tokenizers" in text


SCALARS = {"int", "float", "str", "bool", "list[str]"}
COMMANDS = [
    (["prepare"], PrepareConfig),
    (["score"], ScoreConfig),
    (["train"], TrainConfig),
    (["evaluate"], EvaluateConfig),
    (["generate"], GenerateConfig),
    (["transplant"], TransplantConfig),
    (["distill"], RunConfig),
    (["job", "render"], JobConfig),
    (["job", "submit"], JobConfig),
    (["pipeline", "run-local"], RunConfig),
]


@pytest.mark.parametrize(("argv", "cls"), COMMANDS, ids=[" ".join(a) for a, _ in COMMANDS])
def test_every_scalar_field_of_the_config_has_an_option(argv, cls, capsys, monkeypatch):
    args = vars(build_parser().parse_args(argv))
    text = _help(argv, capsys, monkeypatch)
    overrides = text[text.index("key=value any ") :]
    for f in dataclasses.fields(cls):
        kinds = {k.strip() for k in str(f.type).split("|")} - {"None"}
        option = f"--{f.name.replace('_', '-')}"
        if kinds <= SCALARS and len(kinds) == 1:
            assert args[f.name] is None, f"{cls.__name__}.{f.name}: {option} not given"
            assert f"{option} " in text, f"{cls.__name__}.{f.name} has no option {option}"
            if kinds == {"bool"}:
                assert f"--no-{f.name.replace('_', '-')}" in text
        else:
            assert f.name not in args and f"{option} " not in text
            assert f.name in overrides.split("(a dotted")[0], f"{f.name} unnamed in key=value"


def test_a_bad_option_value_is_one_argparse_line_naming_the_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["prepare", "--max-length", "abc"])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert errors == ["crosskd prepare: error: argument --max-length: invalid int value: 'abc'"]


class Captured(Exception):
    """Raised by a stand-in for a command's work, carrying what it was given."""


def _capture(*args, **kwargs):
    raise Captured(*args, kwargs)


def test_prepare_takes_options_over_its_file_and_key_value_over_both(tmp_path, monkeypatch):
    import crosskd.data.prepare

    monkeypatch.setattr(crosskd.data.prepare, "prepare", _capture)
    path = tmp_path / "p.yaml"
    path.write_text(
        "data: rows.jsonl\nstudent_tokenizer: zoo:x\nteacher_tokenizers: [zoo:y]\n"
        f"output: {tmp_path / 'out'}\nmax_length: 100\npack: false\nshard_rows: 3\n"
    )
    argv = ["--config", str(path), "--max-length", "64", "--shard-rows", "4", "shard_rows=5"]
    argv += ["--teacher-tokenizers", "zoo:a", "--teacher-tokenizers", "zoo:b"]
    with pytest.raises(Captured) as captured:
        main(["prepare", *argv])
    config = captured.value.args[0]
    assert (config.max_length, config.pack, config.shard_rows) == (64, False, 5)
    assert config.teacher_tokenizers == ["zoo:a", "zoo:b"] and config.data == "rows.jsonl"


def test_train_passes_its_options_to_the_workers_before_the_overrides(tmp_path, monkeypatch):
    import crosskd.train.launch

    monkeypatch.setattr(crosskd.train.launch, "launch", _capture)
    argv = ["--student", "init", "--data", "d", "--output", str(tmp_path / "run")]
    argv += ["--teachers", "cache0"]
    argv += ["--nproc-per-node", "2", "--steps", "5", "--lr", "1e-5", "student_tokenizer=zoo:t"]
    with pytest.raises(Captured) as captured:
        main(["train", *argv, "warmup_steps=2"])
    config, worker_args, nproc, _ = captured.value.args
    assert nproc == 2 and (config.steps, config.lr, config.warmup_steps) == (5, 1e-5, 2)
    output = str(tmp_path / "run")
    assert worker_args == [
        "student=init",
        "data=d",
        f"output={output}",
        "teachers=[cache0]",
        "steps=5",
        "lr=1.0e-05",
        "student_tokenizer=zoo:t",
        "warmup_steps=2",
    ]


def test_distill_puts_its_options_between_the_preset_and_the_overrides(tmp_path, monkeypatch):
    import crosskd.distill

    monkeypatch.setattr(crosskd.distill, "distill", _capture)
    argv = ["--preset", "tiny", "--output", str(tmp_path), "--max-length", "32", "--no-pack"]
    with pytest.raises(Captured) as captured:
        main(["distill", *argv, "--k", "4", "k=8"])
    config = captured.value.args[0]
    tiny = yaml.safe_load(Path(crosskd.distill.preset_path("tiny")).read_text())
    assert (config.output, config.max_length, config.pack, config.k) == (
        str(tmp_path),
        32,
        False,
        8,
    )
    assert config.teachers == tiny["teachers"]


def test_job_render_takes_job_config_options(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text("run_id: r1\nimage: registry.example.com/crosskd:1\nnodes: 1\n")
    argv = ["job", "render", "--config", str(path), "--nodes", "3", "--namespace", "ml"]
    assert main([*argv, "--elastic", "metrics_port=9500"]) == 0
    job = yaml.safe_load(capsys.readouterr().out)
    assert job["metadata"]["namespace"] == "ml"
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3
    assert "metrics_port=9500" in str(job)
