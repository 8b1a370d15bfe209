"""On-policy distillation in the trainer (:mod:`crosskd.train.rollout`): a step with rollouts
trains on exactly the answer tokens the student sampled (re-tokenised: the rollout rows' loss
mask is the answer's student tokens and its end-of-turn token) and counts them in CE and KD;
the same seed samples the same (two runs, and a run resumed from a checkpoint, give the same
losses); FSDP2 on two gloo ranks samples with every rank in each forward pass (answers of
other lengths per rank) and trains as DDP does; a cache teacher, tp > 1 and a bad fraction
are refused in one line.
Tiny random-init student and teacher (``tests/train_inputs.py``), an ``online:`` teacher."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_teacher_remote import SERVE_TOKEN, _serve, _stop
from train_inputs import train_config
from train_workers import run_ddp

from crosskd.config import load_config
from crosskd.errors import ConfigError
from crosskd.teacher.remote import TOKEN_ENV
from crosskd.train import TrainConfig, Trainer, rollout
from crosskd.train.config import OnPolicyConfig
from crosskd.train.rollout import Rollouts, rollout_rows

PROMPTS = [
    [{"role": "user", "content": "Pack my box with five dozen jugs."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "The quick brown fox?"},
        {"role": "assistant", "content": "It jumps."},
        {"role": "user", "content": "Over what?"},
    ],
    [{"role": "user", "content": "Water boils at"}],
    [{"role": "user", "content": "def add(a, b):"}],
]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    # chat data: the recorded answers (ignored) after each prompt
    answer = {"role": "assistant", "content": "A recorded answer."}
    rows = [{"id": f"p{i}", "messages": [*m, answer]} for i, m in enumerate(PROMPTS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _config(train_inputs: dict, output: Path, prompts: str, **kw):
    """Three steps of 2 prepared rows (one micro-batch) and 2 rollout rows (fraction 0.5) with
    teacher A run in the process."""
    on_policy = {"prompts": prompts, "fraction": 0.5, "max_new_tokens": 12, "seed": 7}
    values = {
        "teachers": [f"online:{train_inputs['teacher']}"],
        "on_policy": on_policy,
        "steps": 3,
        "prefetch_steps": 0,
        "checkpoint_every": 0,
    }
    return train_config(train_inputs, output, **(values | kw))


def _run(config, **train) -> tuple[list[dict], Trainer]:
    trainer = Trainer(config, progress=False)
    trainer.setup()
    try:
        return trainer.train(**train), trainer
    finally:
        trainer.close()


def _record_answers(monkeypatch) -> list[tuple[str, int]]:
    """The list every answer the rollouts sample is appended to (text, tokens sampled)."""
    answers: list[tuple[str, int]] = []
    sample = Rollouts._sample

    def recorded(self, group, sampler):
        out = sample(self, group, sampler)
        answers.extend(out)
        return out

    monkeypatch.setattr(Rollouts, "_sample", recorded)
    return answers


def test_a_step_trains_on_exactly_the_sampled_answers(train_inputs, prompts, tmp_path, monkeypatch):
    answers = _record_answers(monkeypatch)
    # short answers: none outgrows the tiny capacity (48 tokens; an answer cut to fit has no
    # end-of-turn token in the loss)
    on_policy = {"prompts": prompts, "fraction": 0.5, "max_new_tokens": 6, "seed": 7}
    config = _config(train_inputs, tmp_path / "run", prompts, on_policy=on_policy)
    trainer = Trainer(config, progress=False)
    trainer.setup()
    try:
        assert trainer.rollouts.rows == 2
        extra, metrics = trainer.rollouts.step(0, trainer._sampler(), trainer.plan_rows)
        kept = [a for a, _ in answers if a]
        assert metrics["rollout_rows"] == len(kept) and metrics["rollout_empty"] == 2 - len(kept)
        assert metrics["rollout_generated_tokens"] == sum(n for _, n in answers)
        assert len(kept) > 0  # the seed samples non-empty answers
        student = trainer.student_tok
        (batch, plan) = extra[0]
        ids = batch.models["student"].input_ids
        prompts_of_step = trainer.rollouts.step_prompts(0)
        rows = [p for p, (a, _) in zip(prompts_of_step, answers, strict=True) if a]
        for r, (answer, prompt) in enumerate(zip(kept, rows, strict=True)):
            masked = np.flatnonzero(batch.loss_mask[r].numpy())
            # the loss covers the answer's student tokens and the end-of-turn token, after
            # the prompt the sampler continued
            start = len(trainer.rollouts.ids[prompt])
            assert ids[r, :start].tolist() == trainer.rollouts.ids[prompt].tolist()
            assert masked[0] >= start and masked.tolist() == list(range(masked[0], masked[-1] + 1))
            assert ids[r, masked[-1]] == student.role_ids["eot"]
            assert ids[r, masked[:-1]].tolist() == student.hf.encode(
                answer, add_special_tokens=False
            )
        assert plan.counts.tokens == int(batch.loss_mask.sum()) > 0
        assert all(c > 0 for c in plan.counts.chunks)  # the KD term counts the answers' chunks
        # a whole step: its tokens are the prepared ones and the rollouts'
        prepared = trainer.step_inputs(0)
        step_metrics = trainer.train_step(0, prepared)
        rollout_tokens = step_metrics["tokens"] - sum(p.counts.tokens for _, p in prepared)
        assert rollout_tokens == plan.counts.tokens
        assert step_metrics["rollout_rows"] == len(kept)
    finally:
        trainer.close()


def test_text_prompts_are_continued_as_text_and_trained_on_the_continuation(
    train_inputs, tmp_path, monkeypatch
):
    """Text prompts (pretraining-style rows): the student continues the first half of each
    text (a text too short to split is left out), and the rollout row's loss covers exactly the
    student tokens of what it wrote, after the prompt ids it continued."""
    path = tmp_path / "texts.jsonl"
    texts = ["The quick brown fox jumps over the lazy dog.", "a", "Water boils at 100 degrees."]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    answers = _record_answers(monkeypatch)
    on_policy = {"prompts": str(path), "fraction": 0.5, "max_new_tokens": 6, "seed": 3}
    config = _config(train_inputs, tmp_path / "run", str(path), on_policy=on_policy)
    trainer = Trainer(config, progress=False)
    trainer.setup()
    try:
        assert [p.text for p in trainer.rollouts.prompts] == ["The quick brown fox", "Water boils"]
        extra, metrics = trainer.rollouts.step(0, trainer._sampler(), trainer.plan_rows)
        kept = [a for a, _ in answers if a]
        assert metrics["rollout_rows"] == len(kept) > 0
        (batch, plan) = extra[0]
        ids = batch.models["student"].input_ids
        rows = [p for p, (a, _) in zip(trainer.rollouts.step_prompts(0), answers, strict=True) if a]
        student = trainer.student_tok.hf
        for r, (answer, prompt) in enumerate(zip(kept, rows, strict=True)):
            start = len(trainer.rollouts.ids[prompt])
            assert ids[r, :start].tolist() == trainer.rollouts.ids[prompt].tolist()
            masked = np.flatnonzero(batch.loss_mask[r].numpy())
            whole = trainer.rollouts.prompts[prompt].text + answer
            assert ids[r, masked].tolist() == student.encode(whole)[masked[0] :]
            assert masked.tolist() == list(range(start, masked[-1] + 1))
        assert plan.counts.tokens == int(batch.loss_mask.sum()) > 0
        assert all(c > 0 for c in plan.counts.chunks)
    finally:
        trainer.close()


def test_the_same_seed_gives_the_same_losses_and_a_resume_too(train_inputs, prompts, tmp_path):
    first, _ = _run(_config(train_inputs, tmp_path / "a", prompts))
    second, _ = _run(_config(train_inputs, tmp_path / "b", prompts))
    keys = ("loss", "ce", "kd", "tokens", "rollout_rows", "rollout_generated_tokens")
    assert [[m[k] for k in keys] for m in first] == [[m[k] for k in keys] for m in second]
    assert all(m["rollout_rows"] + m["rollout_empty"] == 2 for m in first)
    resumed = _config(train_inputs, tmp_path / "c", prompts, checkpoint_every=1)
    head, _ = _run(resumed, stop_after=2)
    tail, trainer = _run(resumed)
    assert trainer.start == 2
    assert [[m[k] for k in keys] for m in head + tail] == [[m[k] for k in keys] for m in first]
    other, _ = _run(
        _config(
            train_inputs,
            tmp_path / "d",
            prompts,
            on_policy={"prompts": prompts, "fraction": 0.5, "max_new_tokens": 12, "seed": 8},
        )
    )
    assert [m["loss"] for m in other] != [m["loss"] for m in first]


def test_fsdp2_samples_in_step_on_two_ranks_and_trains_as_ddp(train_inputs, tmp_path):
    """Two gloo ranks, one prepared and one rollout row each per step: a long prompt leaves 6
    tokens of room, a short one 20, so the ranks' answers end at other lengths and the FSDP2
    ranks run each other's extra forward passes (``synced_gpus``; without it they hang). The
    same losses as DDP, which samples on the unwrapped module."""
    path = tmp_path / "prompts.jsonl"
    contents = ["Pack my box.", "Once upon a time there was a little fox.", "Water boils at"]
    answer = {"role": "assistant", "content": "x"}
    rows = [
        {"id": f"p{i}", "messages": [{"role": "user", "content": c}, answer]}
        for i, c in enumerate(contents)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    on_policy = {"prompts": str(path), "fraction": 0.5, "max_new_tokens": 20, "seed": 3}
    keys = {"on_policy": on_policy, "micro_batch_rows": 1, "global_batch_rows": 2}
    runs = [
        (name, _config(train_inputs, tmp_path / name, str(path), **keys, parallel=layout), None)
        for name, layout in (("ddp", {}), ("fsdp", {"dp_shard": 2}))
    ]
    run_ddp(runs, tmp_path, timeout=120)
    seen = {
        (name, rank): json.loads((tmp_path / f"{name}-rank{rank}.json").read_text())["history"]
        for name in ("ddp", "fsdp")
        for rank in (0, 1)
    }
    lengths = [[m["rollout_generated_tokens"] for m in seen["fsdp", r]] for r in (0, 1)]
    assert lengths[0] != lengths[1]  # the ranks sampled answers of other lengths
    for rank in (0, 1):
        for got, want in zip(seen["fsdp", rank], seen["ddp", rank], strict=True):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
            assert got["rollout_generated_tokens"] == want["rollout_generated_tokens"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"teachers": ["CACHE"]}, r"^teachers\[0\] is '.*', a cache, but on_policy is set"),
        ({"parallel": {"tp": 2}}, r"^parallel.tp is 2 with on_policy"),
        ({"parallel": {"cp": 2}}, r"^parallel.cp is 2 with on_policy"),
        ({"fraction": 1.0}, r"^on_policy.fraction is 1.0; it must be a number in \(0.0, 1.0\)"),
        ({"fraction": 0}, r"^on_policy.fraction is 0;"),
        ({"temperature": 0.0}, r"^on_policy.temperature is 0.0;"),
        ({"top_p": 1.5}, r"^on_policy.top_p is 1.5; it must be a number in \(0.0, 1.0\]"),
        ({"max_new_tokens": 0}, r"^on_policy.max_new_tokens is 0;"),
        ({"stride": 2}, r"^on_policy: unknown key\(s\) stride;"),
        ({"prompts": None}, r"^on_policy.prompts is None;"),
    ],
)
def test_refused_in_one_line(train_inputs, prompts, tmp_path, change, message):
    on_policy = {"prompts": prompts, "fraction": 0.5}
    kw = {}
    for key, value in change.items():
        if key in OnPolicyConfig.__dataclass_fields__ or key == "stride":
            on_policy[key] = value
        else:
            kw[key] = [train_inputs["cache"]] if value == ["CACHE"] else value
    with pytest.raises(ConfigError, match=message) as caught:
        _config(train_inputs, tmp_path, prompts, on_policy=on_policy, **kw)
    assert "\n" not in str(caught.value)


def test_rollout_rows_per_rank():
    assert [rollout_rows(f, 4) for f in (0.2, 0.25, 0.5, 0.75)] == [1, 1, 4, 12]
    with pytest.raises(ConfigError, match=r"^on_policy.fraction 0.05 adds no rollout row"):
        rollout_rows(0.05, 4)


def test_off_by_default_and_set_by_key_value(train_inputs, prompts, tmp_path):
    assert train_config(train_inputs, tmp_path).on_policy is None
    path = tmp_path / "train.yaml"
    values = {"student": "s", "data": "d", "output": "o", "teachers": ["online:t"]}
    path.write_text(json.dumps(values | {"loss": {"teachers": [{}]}}))
    config = load_config(
        TrainConfig, str(path), [f"on_policy.prompts={prompts}", "on_policy.fraction=0.3"]
    )
    assert config.on_policy == OnPolicyConfig(prompts=prompts, fraction=0.3)


def test_a_group_of_empty_answers_is_a_placeholder_row(
    train_inputs, prompts, tmp_path, monkeypatch
):
    """Every answer empty: dropped and counted, and the group still gives its micro-batch (so
    every rank runs as many passes), one row with nothing in its loss."""
    monkeypatch.setattr(rollout, "answer_text", lambda tokenizer, ids, stops: ("", True))
    trainer = Trainer(_config(train_inputs, tmp_path / "run", prompts), progress=False)
    trainer.setup()
    try:
        extra, metrics = trainer.rollouts.step(0, trainer._sampler(), trainer.plan_rows)
        assert (metrics["rollout_rows"], metrics["rollout_empty"]) == (0, 2)
        ((batch, plan),) = extra
        assert batch.loss_mask.shape[0] == 1 and not batch.loss_mask.any()
        assert plan.counts.tokens == 0 and all(c == 0 for c in plan.counts.chunks)
        step = trainer.train_step(0, trainer.step_inputs(0))
        assert step["tokens"] == sum(p.counts.tokens for _, p in trainer.step_inputs(0))
    finally:
        trainer.close()


def test_a_server_teaches_as_the_teacher_in_the_process(
    train_inputs, prompts, tmp_path, monkeypatch
):
    """The same two steps with teacher A in the process and from a `crosskd serve` server: the
    same rollouts and losses (up to float32 rounding of the teacher's forward pass in other
    batch shapes)."""
    monkeypatch.setenv(TOKEN_ENV, SERVE_TOKEN)
    proc, url = _serve(tmp_path, train_inputs["teacher"], "a", k=16)
    try:
        served, _ = _run(_config(train_inputs, tmp_path / "served", prompts, teachers=[url]))
    finally:
        _stop(proc)
    online, _ = _run(_config(train_inputs, tmp_path / "online", prompts))
    for got, want in zip(served, online, strict=True):
        for key in ("loss", "ce", "kd"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-8), key
        for key in ("tokens", "rollout_rows", "rollout_generated_tokens"):
            assert got[key] == want[key], key


def test_a_distill_run_trains_on_policy_with_online_teachers(train_inputs, tmp_path):
    """``crosskd distill`` with ``teacher_scoring: online`` and ``on_policy.prompts: train``:
    no teacher cache is made; the KD run's teacher is ``online:`` and its prompts are the
    training rows after the held-out split (no held-out prompt among them); each step adds
    rollout rows; the CE-only run learns from the data alone."""
    from crosskd import steps
    from crosskd.distill import distill
    from crosskd.steps.prepare import held_out

    answer = {"role": "assistant", "content": "A recorded answer, long enough to learn from."}
    rows = [
        {"id": f"c{i}", "messages": [{"role": "user", "content": f"Tell me about {i}."}, answer]}
        for i in range(24)
    ]
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = steps.RunConfig(
        output=str(tmp_path / "run"),
        teachers=[train_inputs["teacher"]],
        student=train_inputs["student"],
        train_data=str(data),
        teacher_scoring="online",
        heldout_fraction=0.25,
        max_length=128,
        k=8,
        train={
            "steps": 2,
            "on_policy": {"prompts": "train", "fraction": 0.5, "max_new_tokens": 6},
        },
        token_budget=2048,
        device="cpu",
    )
    result = distill(config, progress=False)
    assert set(result["bits_per_byte"]) == {"teacher", "student_init", "student_kd", "student_ce"}
    assert not (tmp_path / "run" / "cache").exists()
    kd = load_config(TrainConfig, str(tmp_path / "run" / "kd" / "train.yaml"), [])
    ce = load_config(TrainConfig, str(tmp_path / "run" / "ce" / "train.yaml"), [])
    assert kd.teachers == [f"online:{train_inputs['teacher']}"] == ce.teachers
    assert ce.on_policy is None and ce.loss.kd_weight == 0
    ids = [json.loads(line)["id"] for line in Path(kd.on_policy.prompts).read_text().splitlines()]
    assert ids == [r["id"] for r in rows if not held_out(r["id"], 0.25)]
    assert 0 < len(ids) < len(rows)
    history = [
        json.loads(line)
        for line in (tmp_path / "run" / "kd" / "metrics-rank0.jsonl").read_text().splitlines()
    ]
    assert [h["rollout_rows"] > 0 for h in history if "rollout_rows" in h] == [True, True]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"train": {"on_policy": {"prompts": "train"}}},
            r"^train.on_policy is set but teacher_scoring is cache: .* Set teacher_scoring: online",
        ),
        ({"teacher_scoring": "server"}, r"^teacher_scoring is 'server'; choose one of cache, on"),
    ],
)
def test_a_run_config_refuses_on_policy_without_online_teachers(change, message):
    from crosskd import steps

    with pytest.raises(ConfigError, match=message):
        steps.RunConfig(output="out", **change)


def test_the_on_policy_demo_preset_is_a_distill_run_the_pipeline_refuses(tmp_path):
    from crosskd.pipeline.run import preset_arguments
    from crosskd.steps import load_run_config

    config = load_run_config(None, "on-policy-demo", [f"output={tmp_path}"])
    assert config.teacher_scoring == "online"
    assert config.train["on_policy"]["prompts"] == "train"
    with pytest.raises(
        ConfigError, match=r"^teacher_scoring is online, .* --teacher-serving server"
    ):
        preset_arguments(config)
