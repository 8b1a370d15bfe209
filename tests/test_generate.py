"""``crosskd generate``: a conversation set sampled from a (tiny, random) chat model: the rows
``crosskd prepare`` reads, the same file after a kill and a rerun as without, refusals that name
the setting, and the machine's prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_inputs import TEXTS, tiny_model

from crosskd.cli import main
from crosskd.errors import ConfigError
from crosskd.generate import INSTRUCTIONS, GenerateConfig, generate, machine_prompts

PROMPTS = [f"Question {i}: {t}" for i, t in enumerate(TEXTS[:7])]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return str(tiny_model(tmp_path_factory.mktemp("chat-model"), TEXTS, 300, seed=5))


def _config(tmp_path, model, **changes) -> GenerateConfig:
    prompts = tmp_path / "prompts.jsonl"
    if not prompts.exists():
        tmp_path.mkdir(parents=True, exist_ok=True)
        prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    values = {
        "output": str(tmp_path / "out" / "conversations.jsonl"),
        "model": model,
        "prompts": str(prompts),
        "conversations": 7,
        "batch_size": 2,
        "max_new_tokens": 6,
        "temperature": 1.0,
        "device": "cpu",
    }
    return GenerateConfig(**{**values, **changes})


def config_text(config: GenerateConfig) -> str:
    return Path(config.output).read_text()


def test_conversations_are_chat_rows_that_prepare_reads(tmp_path, chat_model):
    from crosskd.data.records import read_records

    config = _config(tmp_path, chat_model)
    result = generate(config, progress=False)
    rows = [
        json.loads(x) for x in (tmp_path / "out" / "conversations.jsonl").read_text().splitlines()
    ]
    assert result["conversations"] == len(rows) == 7 - result["dropped"]
    assert result["generated"] == len(rows) and result["unfinished"] <= len(rows)
    for row in rows:
        index = row["generation"]["prompt_index"]
        assert row["id"] == f"conv-{index:06d}"
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
        assert row["messages"][0]["content"] == PROMPTS[index]
        assert row["messages"][1]["content"] == row["messages"][1]["content"].strip() != ""
        assert row["generation"]["batch"] == index // 2
        assert row["generation"]["temperature"] == 1.0 and row["generation"]["seed"] == 0
    records = list(read_records(config.output))
    assert [r.sample_id for r in records] == [r["id"] for r in rows]
    assert all(r.messages is not None for r in records)
    # A rerun of a finished set writes nothing; another seed samples other answers.
    assert generate(config, progress=False)["generated"] == 0
    other = generate(
        _config(tmp_path / "b", chat_model, seed=1, prompts=config.prompts), progress=False
    )
    assert other["conversations"] and (
        tmp_path / "b" / "out" / "conversations.jsonl"
    ).read_text() != config_text(config)


def test_a_killed_run_resumes_to_the_same_file(tmp_path, chat_model, monkeypatch):
    import crosskd.generate as module

    whole = _config(tmp_path / "whole", chat_model)
    generate(whole, progress=False)
    expected = config_text(whole)

    killed = _config(tmp_path / "killed", chat_model, prompts=whole.prompts)
    real = module._answer
    calls = []

    def dies_in_the_third_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "_answer", dies_in_the_third_batch)
    with pytest.raises(KeyboardInterrupt):
        generate(killed, progress=False)
    monkeypatch.setattr(module, "_answer", real)
    # A torn write of the batch that was being written when the process died.
    with open(killed.output, "a", encoding="utf-8") as handle:
        handle.write('{"id": "conv-000004", "messages": [{"rol')
    result = generate(killed, progress=False)
    assert config_text(killed) == expected
    assert result["generated"] == result["conversations"] - sum(
        1 for x in expected.splitlines() if json.loads(x)["generation"]["batch"] < 2
    )


def test_refusals_name_the_setting(tmp_path, chat_model):
    generate(_config(tmp_path, chat_model, conversations=2, batch_size=1), progress=False)
    with pytest.raises(ConfigError, match=r"generated with temperature=1\.0, not 0\.5; write to"):
        generate(
            _config(tmp_path, chat_model, conversations=2, batch_size=1, temperature=0.5),
            progress=False,
        )
    with pytest.raises(ConfigError, match=r"holds 2 batches, more than the 1 of conversations=1"):
        generate(_config(tmp_path, chat_model, conversations=1, batch_size=1), progress=False)
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"id": "x", "text": "mine"}\n')
    with pytest.raises(ConfigError, match=r"has no foreign\.jsonl\.progress\.json: it was not "):
        generate(_config(tmp_path, chat_model, output=str(foreign)), progress=False)
    assert foreign.read_text() == '{"id": "x", "text": "mine"}\n'  # left alone
    for changes, message in (
        ({"output": "s3://b/c.jsonl"}, "appends to a local file"),
        ({"temperature": 0}, r"temperature is 0; it must be a number in"),
        ({"top_p": 1.5}, r"top_p is 1\.5"),
        ({"conversations": 0}, "conversations is 0"),
    ):
        with pytest.raises(ConfigError, match=message):
            _config(tmp_path, chat_model, **changes)


def test_machine_prompts_wrap_docstrings_in_the_instructions():
    prompts = machine_prompts(6)
    assert len(prompts) == 6 and len(set(prompts)) == 6
    for i, prompt in enumerate(prompts):
        head = INSTRUCTIONS[i % len(INSTRUCTIONS)].split("{text}")[0]
        assert prompt.startswith(head)
        assert 60 <= len(prompt) - len(head) <= 400
    assert machine_prompts(6) == prompts  # the same on every run


def test_cli_errors_are_one_line(tmp_path, capsys, chat_model):
    code = main(
        [
            "generate",
            "--model",
            chat_model,
            "--output",
            str(tmp_path / "c.jsonl"),
            "--prompts",
            str(tmp_path / "missing.jsonl"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("crosskd: error: ")
    assert "missing.jsonl" in err[0]
