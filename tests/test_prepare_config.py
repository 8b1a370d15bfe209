"""Every bad value of :class:`PrepareConfig` is refused with a one-line ConfigError naming the
key, the value and what is allowed, before any tokenizer is loaded (the tokenizer names here do
not exist: loading one would raise a TokenizerError instead), in code and through the CLI."""

from __future__ import annotations

import pytest

from crosskd.cli import main
from crosskd.data.prepare import PrepareConfig, prepare
from crosskd.errors import ConfigError

BASE = {
    "data": "rows.jsonl",
    "student_tokenizer": "zoo:no-such-student",
    "teacher_tokenizers": ["zoo:no-such-teacher"],
    "output": "out",
}

BAD = [
    # integer counts >= 1
    ("max_length", 0, "an integer >= 1"),
    ("max_length", -3, "an integer >= 1"),
    ("max_length", "2048", "an integer >= 1"),
    ("max_length", 2048.0, "an integer >= 1"),
    ("max_length", True, "an integer >= 1"),
    ("max_length", None, "an integer >= 1"),
    ("teacher_max_length", 0, "an integer >= 1, or null"),
    ("teacher_max_length", 1.5, "an integer >= 1, or null"),
    ("teacher_max_length", "long", "an integer >= 1, or null"),
    ("shard_rows", 0, "an integer >= 1"),
    ("shard_rows", False, "an integer >= 1"),
    ("workers", 0, "an integer >= 1"),
    ("workers", 2.5, "an integer >= 1"),
    # booleans
    ("pack", "yes", "true or false"),
    ("pack", 1, "true or false"),
    ("pack", None, "true or false"),
    ("drop_first_chunk", "false", "true or false"),
    # regions
    ("included_regions", ["answers"], "not regions; choose from reasoning, close, answer"),
    ("included_regions", ["answer", 3], "not regions; choose from reasoning, close, answer"),
    ("included_regions", [], "non-empty list of chat regions"),
    ("included_regions", "answer", "non-empty list of chat regions"),
    # teacher tokenizers
    ("teacher_tokenizers", [], "non-empty list of teacher tokenizers"),
    ("teacher_tokenizers", "zoo:qwen3", "non-empty list of teacher tokenizers"),
    ("teacher_tokenizers", None, "non-empty list of teacher tokenizers"),
    ("teacher_tokenizers[1]", ["zoo:qwen3", ""], "a non-empty string"),
    ("teacher_tokenizers[0]", [7], "a non-empty string"),
    # strings
    ("data", "", "a non-empty string"),
    ("student_tokenizer", None, "a non-empty string"),
    ("output", 5, "a non-empty string"),
    ("text_column", "", "a non-empty string"),
    ("messages_column", ["messages"], "a non-empty string"),
    ("id_column", "", "a column name, or null"),
    ("id_column", 0, "a column name, or null"),
]


def _field(key: str) -> str:
    return key.split("[")[0]


@pytest.mark.parametrize(("key", "value", "allowed"), BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_bad_values_are_refused_naming_key_value_and_what_is_allowed(key, value, allowed):
    with pytest.raises(ConfigError) as caught:
        PrepareConfig(**{**BASE, _field(key): value})
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{key} is ")
    shown = value[-1] if key.endswith("]") else value
    assert repr(shown) in message and allowed in message


def test_prepare_checks_again_before_loading_a_tokenizer(tmp_path):
    config = PrepareConfig(**{**BASE, "output": str(tmp_path / "out")})
    config.shard_rows = 0
    with pytest.raises(ConfigError, match=r"^shard_rows is 0; it must be an integer >= 1\.$"):
        prepare(config, progress=False)
    assert not (tmp_path / "out").exists()


def test_good_values_pass():
    config = PrepareConfig(
        **BASE,
        teacher_max_length=4096,
        pack=False,
        id_column=None,
        included_regions=["answer"],
        drop_first_chunk=True,
        shard_rows=1,
    )
    assert config.max_length == 2048


CLI = [
    (["--max-length", "0"], "max_length is 0"),
    (["--teacher-max-length", "-1"], "teacher_max_length is -1"),
    (["pack=maybe"], "pack is 'maybe'"),
    (["shard_rows=many"], "shard_rows is 'many'"),
    (["included_regions=[answers]"], "included_regions is ['answers']"),
    (["included_regions=[]"], "included_regions is []"),
    (["drop_first_chunk=2"], "drop_first_chunk is 2"),
    (["text_column=''"], "text_column is ''"),
    (["id_column=3"], "id_column is 3"),
    (["teacher_tokenizers=[]"], "teacher_tokenizers is []"),
]


@pytest.mark.parametrize(("extra", "message"), CLI, ids=[" ".join(e) for e, _ in CLI])
def test_cli_prints_one_line_and_returns_2(tmp_path, capsys, extra, message):
    argv = [
        "prepare",
        "--data",
        "rows.jsonl",
        "--student-tokenizer",
        "zoo:no-such-student",
        "--teacher-tokenizers",
        "zoo:no-such-teacher",
        "--output",
        str(tmp_path / "out"),
        *extra,
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("crosskd: error: ")
    assert message in err
    assert not (tmp_path / "out").exists()


def test_cli_refuses_a_bad_value_from_the_config_file(tmp_path, capsys):
    (tmp_path / "p.yaml").write_text(
        "data: rows.jsonl\nstudent_tokenizer: zoo:x\nteacher_tokenizers: [zoo:y]\n"
        f"output: {tmp_path / 'out'}\nmax_length: 12.5\n"
    )
    assert main(["prepare", "--config", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "max_length is 12.5; it must be an integer >= 1" in err
