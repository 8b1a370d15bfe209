"""The training loop on tiny random-init models with different tiny tokenizers: learning,
kill-and-resume (also during a checkpoint write), the NaN guard, metrics over HTTP, 2-process
DDP against one process (and a resume on another world size), bad configs. Processes started
after this process has run a Trainer are fresh interpreters (:mod:`train_workers`)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import time
import urllib.request
from dataclasses import replace

import pytest
import torch
from train_inputs import train_config
from train_workers import (
    SPAWN,
    free_port,
    free_ports,
    input_failure_worker,
    run_ddp,
    run_ranks,
    train_hanging_at,
    train_hanging_in_checkpoint,
)

from crosskd.errors import ConfigError, CrosskdError
from crosskd.train import (
    DataOrder,
    ShardOrder,
    TrainConfig,
    Trainer,
    TrainingError,
    lr_at,
    rank_micro_batches,
)
from crosskd.train.checkpoint import checkpoint_name
from crosskd.train.schedule import group_lrs, kd_weight_at, step_loss


@pytest.fixture(scope="module")
def setup(train_inputs):
    """The session's tiny training inputs (:mod:`train_inputs`)."""
    return train_inputs


_config = train_config


def _schedule(**kw) -> TrainConfig:
    """A config for the schedule: 10 steps, warmup 2, lr 1, down to 0.1; ``kw`` adds keys."""
    values = {"student": "s", "data": "d", "output": "o", "teachers": ["c"]}
    return TrainConfig(**values, steps=10, warmup_steps=2, lr=1.0, min_lr_ratio=0.1, **kw)


def test_schedule_and_data_order():
    config = _schedule()
    # Warmup: (s + 1) / 2 for s = 0, 1. Then cosine over 8 steps from 1 to 0.1: step 9 is at
    # 7/8 of it: 0.1 + 0.9 * 0.5 * (1 + cos(7 pi / 8)) = 0.1 + 0.45 * 0.0761205 = 0.1342542.
    got = [lr_at(s, config) for s in (0, 1, 2, 9)]
    assert got == pytest.approx([0.5, 1.0, 1.0, 0.1342542], abs=1e-7)
    # Shards of 3, 2, 4, 1 and 2 packed rows (rows 0-2, 3-4, 5-8, 9, 10-11) in windows of 2.
    sizes, shard_of = [3, 2, 4, 1, 2], [0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4]
    order = ShardOrder(sizes, seed=4, window_shards=2)
    rows = [i for s in range(8) for i in order.step_rows(s, 3)]
    # Every epoch is a permutation of all rows; the order only depends on the seed.
    assert sorted(rows[:12]) == list(range(12)) and sorted(rows[12:24]) == list(range(12))
    assert rows == [i for s in range(8) for i in ShardOrder(sizes, 4, 2).step_rows(s, 3)]
    assert rows != [i for s in range(8) for i in ShardOrder(sizes, 5, 2).step_rows(s, 3)]
    # Shard-local: within an epoch the rows of each window of 2 shards come together, so
    # the shards change (a window boundary) at most twice per epoch (three windows).
    for epoch in (rows[:12], rows[12:]):
        groups = [set()]
        for r in epoch:
            if shard_of[r] not in groups[-1] and len(groups[-1]) == 2:
                groups.append(set())
            groups[-1].add(shard_of[r])
        assert len(groups) == 3
    assert [order.locate(r) for r in (0, 2, 3, 9, 11)] == [(0, 0), (0, 2), (1, 0), (3, 0), (4, 1)]
    # Rank r's micro-batch m holds the step's rows [(m * dp + r) * R, +R): over the ranks,
    # micro-batch m is the same rows whatever dp is, as long as dp * R is the same.
    step = list(range(10, 18))
    assert rank_micro_batches(step, 0, 2, 2) == [[10, 11], [14, 15]]
    assert rank_micro_batches(step, 1, 2, 2) == [[12, 13], [16, 17]]
    assert rank_micro_batches(step, 0, 1, 4) == [[10, 11, 12, 13], [14, 15, 16, 17]]
    with pytest.raises(ConfigError, match=r"a step of 8 rows does not split"):
        rank_micro_batches(step, 0, 3, 1)
    # The global batch decides grad_accum on each world size, or is refused by key.
    config = TrainConfig(
        student="s", data="d", output="o", teachers=["c"], global_batch_rows=8, micro_batch_rows=2
    )
    assert [config.batch_layout(dp) for dp in (1, 2, 4)] == [(8, 4), (8, 2), (8, 1)]
    with pytest.raises(ConfigError, match=r"global_batch_rows is 8, which micro_batch_rows"):
        config.batch_layout(3)
    config.grad_accum = 3
    with pytest.raises(ConfigError, match=r"grad_accum is 3 but global_batch_rows 8"):
        config.batch_layout(1)
    order = DataOrder(8, "abc", 40, 0, 8)
    order.require(order.to_json(), "out")
    with pytest.raises(ConfigError, match=r"global_batch_rows 4 there, 8 now; seed 1 there"):
        order.require({**order.to_json(), "global_batch_rows": 4, "seed": 1}, "out")
    with pytest.raises(ConfigError, match=r"window_shards None there, 8 now"):
        order.require({k: v for k, v in order.to_json().items() if k != "window_shards"}, "o")


def test_training_lowers_the_loss_and_saves_a_loadable_student(setup, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = Trainer(_config(setup, tmp_path / "run", steps=12), progress=False)
    trainer.setup()
    history = trainer.train()
    assert history[-1]["ce"] < history[0]["ce"] and history[-1]["kd"] < history[0]["kd"]
    assert history[0]["kd"] > 0.05  # the sharp teacher: KD is not a rounding-sized number
    assert all(h["teacher0/1:1/valid"] > 0 for h in history)
    final = trainer.save()
    trainer.close()
    loaded = AutoModelForCausalLM.from_pretrained(final)
    assert loaded.config.vocab_size == trainer.vocab
    info = json.loads((tmp_path / "run" / "final" / "crosskd-model.json").read_text())
    assert info["step"] == 12 and info["heldout_bits_per_byte"] is None
    lines = (tmp_path / "run" / "metrics-rank0.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(1, 13))


def test_trainable_freezes_the_rest_and_a_resume_keeps_it_frozen(setup, tmp_path):
    """``trainable: [embed_tokens]``: the embedding (tied with the head) moves, no other
    parameter does (not even by weight decay: frozen ones have no optimizer state), and a run
    resumed from its checkpoint ends on the same curve with the body still as it started."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(setup["student"]).state_dict()
    config = _config(setup, tmp_path / "run", steps=4, checkpoint_every=2, trainable=["embed"])
    trainer = Trainer(config, progress=False)
    trainer.setup()
    (trained,) = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert trained is trainer.model.get_input_embeddings().weight
    reference = trainer.train()
    final = load_file(f"{trainer.save()}/model.safetensors")
    trainer.close()
    moved = {k for k in final if not torch.equal(final[k], start[k])}
    assert moved == {"model.embed_tokens.weight"}
    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.rmtree(checkpoints / checkpoint_name(4))
    shutil.rmtree(tmp_path / "run" / "final")
    (checkpoints / "latest.json").write_text(json.dumps({"step": 2, "path": checkpoint_name(2)}))
    _resume_from_step_2(config, reference)
    with pytest.raises(ConfigError, match=r"trainable: 'nothing' matches no parameter of the"):
        Trainer(dataclasses.replace(config, trainable=["embed", "nothing"]), progress=False).setup()


def test_first_trainable_and_kd_warmup_schedules_by_hand():
    """``first_trainable`` for 3 steps, warmup 2, lr 1, steps 10; KD fading in over 4 steps."""
    config = _schedule(
        first_trainable=["embed"], first_steps=3, kd_warmup_steps=4, loss={"kd_weight": 2.0}
    )
    # Steps 0-2: the first group on lr_at (0.5, 1, 1), the rest at 0. Step 3: the rest joins
    # at lr_at(3) * 1/2, lr_at(3) = 0.1 + 0.45 * (1 + cos(pi / 8)) = 0.9657458; step 4:
    # lr_at(4) * 2/2 = 0.1 + 0.45 * (1 + cos(pi / 4)) = 0.8681981.
    got = [lr for s in range(5) for lr in group_lrs(s, config, 2)]
    want = [0.5, 0.0, 1.0, 0.0, 1.0, 0.0, 0.9657458, 0.4828729, 0.8681981, 0.8681981]
    assert got == pytest.approx(want, abs=1e-7)
    assert group_lrs(3, config, 1) == [lr_at(3, config)]
    # KD: 2 * (s + 1) / 4 to the full 2.
    assert [kd_weight_at(s, config) for s in (0, 1, 2, 3, 9)] == [0.5, 1.0, 1.5, 2.0, 2.0]
    assert step_loss(0, config).kd_weight == 0.5 and step_loss(0, config).tau == 1.0
    assert step_loss(3, config) is config.loss


def test_first_trainable_trains_alone_first_kd_fades_in_and_a_resume_follows(setup, tmp_path):
    """``first_trainable: [embed]`` for 2 of 4 steps: after 2 steps the embedding (tied with
    the head) has moved and nothing else has, not even by weight decay, and only it has
    optimizer state; after 4 every parameter has moved. Resuming without first_trainable is
    refused naming it. KD fades in over 2 steps: the reported ``kd_weight`` is 0.5,
    then 1, and the dynamic ``kd_scale`` is that times ``|CE| / |KD|``. A run resumed at step 2
    ends on the same curve."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(setup["student"]).state_dict()
    config = _config(
        setup,
        tmp_path / "run",
        steps=4,
        checkpoint_every=2,
        first_trainable=["embed"],
        first_steps=2,
        kd_warmup_steps=2,
    )
    trainer = Trainer(config, progress=False)
    trainer.setup()
    (first,), rest = [g["params"] for g in trainer.optimizer.param_groups]
    assert first is trainer.model.get_input_embeddings().weight and len(rest) > 5
    reference = trainer.train(stop_after=2)
    state = {k: v.detach() for k, v in trainer.model.state_dict().items()}
    moved = {k for k in start if not torch.equal(state[k], start[k])}
    assert moved == {"model.embed_tokens.weight", "lm_head.weight"}  # one tied tensor
    assert list(trainer.optimizer.state) == [first]  # the others' gradients were dropped
    reference += trainer.train()  # steps 3 and 4
    final = load_file(f"{trainer.save()}/model.safetensors")
    trainer.close()
    assert all(not torch.equal(final[k], start[k]) for k in final if "norm" not in k)
    assert [h["kd_weight"] for h in reference] == [0.5, 1.0, 1.0, 1.0]
    # the others join at step 3 with a warmup of 2 steps of their own
    rest = [h["lr_rest"] / h["lr"] for h in reference]
    assert rest == pytest.approx([0.0, 0.0, 0.5, 1.0], abs=1e-12)
    for h in reference:
        assert h["kd_scale"] == pytest.approx(h["kd_weight"] * h["ce"] / h["kd"], rel=1e-5)
        assert h["loss"] == pytest.approx(h["ce"] + h["kd_scale"] * h["kd"], rel=1e-5)
    shutil.rmtree(tmp_path / "run" / "checkpoints" / checkpoint_name(4))
    shutil.rmtree(tmp_path / "run" / "final")
    latest = {"step": 2, "path": checkpoint_name(2)}
    (tmp_path / "run" / "checkpoints" / "latest.json").write_text(json.dumps(latest))
    unset = dataclasses.replace(config, first_trainable=[], first_steps=0)
    with pytest.raises(CrosskdError, match=r"2 parameter group\(s\) saved, 1 here; first_train"):
        Trainer(unset, progress=False).setup()
    _resume_from_step_2(config, reference)
    for patterns, message in (
        (["nothing"], r"first_trainable: 'nothing' matches no trained parameter"),
        (["."], r"first_trainable: '\.' matches every trained parameter"),
    ):
        with pytest.raises(ConfigError, match=message):
            Trainer(dataclasses.replace(config, first_trainable=patterns), progress=False).setup()


def _wait_for(predicate, what: str, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _assert_same_curve(got: list[dict], want: list[dict], rel: float = 1e-6) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "ce", "kd", "kd_scale", "lr"):
            assert g[key] == pytest.approx(w[key], rel=rel, abs=1e-9), key


def _kill(proc) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    assert proc.exitcode == -signal.SIGKILL


def _resume_from_step_2(config: TrainConfig, reference: list[dict]) -> None:
    """Restart ``config``'s run: it resumes at step 2 and ends on the reference curve."""
    second = Trainer(config, progress=False)
    second.setup()
    assert second.start == 2
    resumed = second.train()
    second.close()
    _assert_same_curve(resumed, reference[2:])


@pytest.fixture(scope="module")
def reference(setup, tmp_path_factory):
    """One uninterrupted 6-step run (checkpoints every 2 steps) the resume tests compare to."""
    trainer = Trainer(
        _config(setup, tmp_path_factory.mktemp("ref"), checkpoint_every=2), progress=False
    )
    trainer.setup()
    history = trainer.train()
    trainer.close()
    return history


def test_a_killed_run_resumes_to_the_same_loss_curve(setup, reference, tmp_path):
    """SIGKILL a training process during step 4 (last checkpoint: step 2), restart it: the
    steps from 3 on equal an uninterrupted run's."""
    config = _config(setup, tmp_path / "run", checkpoint_every=2)
    proc = SPAWN.Process(target=train_hanging_at, args=(config, 3))
    proc.start()
    log_path = tmp_path / "run" / "metrics-rank0.jsonl"
    _wait_for(
        lambda: log_path.exists() and len(log_path.read_text().splitlines()) == 3,
        "step 3 to be logged",
    )
    _kill(proc)
    latest = json.loads((tmp_path / "run" / "checkpoints" / "latest.json").read_text())
    assert latest["step"] == 2
    _resume_from_step_2(config, reference)


def test_a_kill_during_a_checkpoint_write_resumes_from_the_last_complete_one(
    setup, reference, tmp_path
):
    """SIGKILL while step 4's checkpoint is half-written (model file in the temporary folder,
    no optimizer file yet): latest.json still names step 2, the resumed run ends on the
    uninterrupted curve, and the half-written folder is gone after the next checkpoint."""
    config = _config(setup, tmp_path / "run", checkpoint_every=2)
    proc = SPAWN.Process(target=train_hanging_in_checkpoint, args=(config, 4))
    proc.start()
    half = tmp_path / "run" / "checkpoints" / ".tmp-step-0000004" / "rank-00000.json"
    _wait_for(half.exists, "step 4's checkpoint write to begin")
    _kill(proc)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert json.loads((checkpoints / "latest.json").read_text())["step"] == 2
    assert not (checkpoints / "step-0000004").exists()
    _resume_from_step_2(config, reference)
    names = sorted(p.name for p in checkpoints.iterdir())
    assert names == ["latest.json", "step-0000002", "step-0000004", "step-0000006"]


def test_checkpoint_retention_and_a_resume_that_would_change_the_data_order(setup, tmp_path):
    out = tmp_path / "run"
    trainer = Trainer(
        _config(setup, out, checkpoint_every=1, keep_checkpoints=2, steps=5), progress=False
    )
    trainer.setup()
    trainer.train(stop_after=4)
    trainer.close()
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["latest.json", "step-0000003", "step-0000004"]
    state = json.loads((out / "checkpoints" / "step-0000004" / "state.json").read_text())
    assert state["data_order"]["global_batch_rows"] == 2 and state["data_order"]["seed"] == 0
    for change, message in (
        ({"seed": 1}, r"seed 0 there, 1 now"),
        ({"global_batch_rows": 4}, r"global_batch_rows 2 there, 4 now"),
        ({"micro_batch_rows": 1, "grad_accum": 1}, r"global_batch_rows 2 there, 1 now"),
    ):
        again = Trainer(_config(setup, out, steps=5, **change), progress=False)
        with pytest.raises(ConfigError, match=message):
            again.setup()
    # Without an explicit batch, a restart keeps the recorded one (here on micro-batches of 1).
    again = Trainer(_config(setup, out, steps=5, micro_batch_rows=1), progress=False)
    again.setup()
    assert (again.start, again.global_batch, again.accum) == (4, 2, 2)
    again.close()
    (out / "checkpoints" / "latest.json").write_text("{not json")
    with pytest.raises(CrosskdError, match=r"latest.json is damaged"):
        Trainer(_config(setup, out, steps=5), progress=False).setup()


def test_a_nan_loss_stops_the_run_naming_step_and_term(setup, tmp_path, monkeypatch):
    trainer = Trainer(_config(setup, tmp_path / "run", checkpoint_every=1), progress=False)
    trainer.setup()
    trainer.train(stop_after=2)
    real = trainer._forward
    assert trainer.head is not None  # fused: the forward pass hands over the head's input

    def poisoned(student):
        layer = real(student)
        return replace(layer, hidden=layer.hidden * float("nan"))

    monkeypatch.setattr(trainer, "_forward", poisoned)
    with pytest.raises(TrainingError, match=r"step 3: the loss term is nan"):
        trainer.train_step(2)
    assert math.isnan(trainer.exporter.loss._value.get())  # what the alert reads
    assert trainer.exporter.nonfinite._value.get() == 1
    trainer.close()
    latest = json.loads((tmp_path / "run" / "checkpoints" / "latest.json").read_text())
    assert latest["step"] == 2


def test_an_infinite_gradient_under_a_finite_loss_stops_before_the_step(setup, tmp_path):
    """A gradient that overflows while the loss is finite: no optimizer step (the weights stay
    those of step 2), the gradient-norm gauge shows it, the stop is counted."""
    trainer = Trainer(_config(setup, tmp_path / "run"), progress=False)
    trainer.setup()
    trainer.train(stop_after=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    param = next(iter(trainer.model.parameters()))
    param.register_hook(lambda grad: torch.full_like(grad, float("inf")))
    stop = r"step 3: the gradient norm is inf \(the loss [0-9.]+\); stopping before the optimizer"
    with pytest.raises(TrainingError, match=stop):
        trainer.train_step(2)
    assert math.isinf(trainer.exporter.grad_norm._value.get())
    assert math.isfinite(trainer.exporter.loss._value.get())
    assert trainer.exporter.nonfinite._value.get() == 1
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p, before[n]), n
    trainer.close()


def test_metrics_are_served_over_http_during_the_run(setup, tmp_path):
    trainer = Trainer(
        _config(setup, tmp_path / "run", metrics_port=0, metrics_final_scrape_s=0), progress=False
    )
    trainer.setup()
    trainer.train(stop_after=2)
    port = trainer.exporter.port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    records = [
        json.loads(line)
        for line in (tmp_path / "run" / "metrics-rank0.jsonl").read_text().splitlines()
    ]
    last = records[-1]
    values = {}
    for line in text.splitlines():
        if line.startswith("crosskd_") and "{" in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    labels = 'rank="0"'
    assert values[f"crosskd_train_step{{{labels}}}"] == 2
    assert values[f"crosskd_train_steps_total{{{labels}}}"] == 2
    assert values[f"crosskd_train_planned_steps{{{labels}}}"] == trainer.config.steps
    assert values[f"crosskd_train_resumed_step{{{labels}}}"] == 0
    assert values[f"crosskd_train_loss{{{labels}}}"] == pytest.approx(last["loss"])
    assert values[f'crosskd_train_kd_loss{{{labels},teacher="teacher0"}}'] == pytest.approx(
        last["kd/teacher0"]
    )
    assert values[f"crosskd_train_learning_rate{{{labels}}}"] == pytest.approx(last["lr"])
    assert values[f"crosskd_train_grad_norm{{{labels}}}"] == pytest.approx(last["grad_norm"])
    assert last["grad_norm"] > 0
    assert values[f"crosskd_train_step_seconds_count{{{labels}}}"] == 2
    assert values[f"crosskd_train_tokens_total{{{labels}}}"] == sum(r["tokens"] for r in records)
    shapes = {k: v for k, v in values.items() if k.startswith("crosskd_train_chunks_total{")}
    assert shapes and all('teacher="teacher0"' in k for k in shapes)
    for key, value in shapes.items():  # each shape's count summed over the steps
        shape = key.split('shape="')[1].split('"')[0]
        assert value == sum(r.get(f"teacher0/{shape}/valid", 0) for r in records)
    assert not any("step=" in k or "job=" in k for k in values)
    # no held-out data: no held-out series (rather than a misleading 0)
    assert not any(k.startswith("crosskd_train_heldout_bits_per_byte") for k in values)
    trainer.close()


def test_metrics_port_is_per_local_rank(setup, tmp_path, monkeypatch):
    """Each pod numbers its processes by LOCAL_RANK; process k serves on metrics_port + k."""
    port = free_port()
    monkeypatch.setenv("LOCAL_RANK", "1")
    trainer = Trainer(
        _config(setup, tmp_path / "run", metrics_port=port - 1, metrics_final_scrape_s=0),
        progress=False,
    )
    trainer.setup()
    assert trainer.exporter.port == port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "crosskd_train_step" in text
    trainer.close()


def test_two_process_ddp_equals_one_process_and_resumes_on_one(setup, tmp_path):
    """2 gloo processes (1 row each per micro-batch) against 1 process (2 rows): the same
    curve, the KD term itself to 1e-5. Then a 2-process run stopped at step 2 resumes in one
    process and continues the same data order: the same micro-batches and the same curve as
    the uninterrupted one-process run."""
    single = Trainer(
        _config(setup, tmp_path / "one", micro_batch_rows=2, checkpoint_every=2), progress=False
    )
    single.setup()
    want = single.train()
    want_batches = [single.step_micro_batches(s) for s in range(6)]
    single.close()
    run_ddp(
        [
            ("two", _config(setup, tmp_path / "two", micro_batch_rows=1), None),
            ("stop", _config(setup, tmp_path / "stop", micro_batch_rows=1, checkpoint_every=2), 2),
        ],
        tmp_path,
    )
    for rank in (0, 1):
        got = json.loads((tmp_path / f"two-rank{rank}.json").read_text())
        for g, w in zip(got["history"], want, strict=True):
            for key in ("loss", "ce", "kd", "kd_scale"):
                assert g[key] == pytest.approx(w[key], rel=1e-5), key
        # Rank r's row of micro-batch m is row r of the one-process micro-batch m.
        for mine, whole in zip(got["micro_batches"], want_batches, strict=True):
            assert mine == [[rows[rank]] for rows in whole]
    assert json.loads((tmp_path / "two-rank0.json").read_text())["history"][0]["kd"] > 0.05
    resumed = Trainer(
        _config(setup, tmp_path / "stop", micro_batch_rows=2, checkpoint_every=2), progress=False
    )
    resumed.setup()
    assert resumed.start == 2
    assert [resumed.step_micro_batches(s) for s in range(6)] == want_batches
    rest = resumed.train()
    resumed.close()
    _assert_same_curve(rest, want[2:], rel=1e-5)


def test_uld_trains_and_two_processes_equal_one(setup, tmp_path):
    """``loss.kd: uld``: the KD term is the ULD mean over the step's pairs (its pair count
    reduced over the ranks first), so 2 gloo processes give the one-process curve."""
    loss = dataclasses.replace(_config(setup, tmp_path).loss, kd="uld")
    single = Trainer(
        _config(setup, tmp_path / "one", micro_batch_rows=2, loss=loss), progress=False
    )
    single.setup()
    want = single.train()
    single.close()
    assert all(math.isfinite(h["loss"]) for h in want) and 0 < want[0]["kd"] <= 2
    assert want[0]["teacher0/uld_pairs"] > 0 and not any(k.endswith("/valid") for k in want[0])
    assert want[0]["kd/teacher0"] == pytest.approx(
        want[0]["teacher0/uld_sum_l1"] / want[0]["teacher0/uld_pairs"]
    )
    run_ddp(
        [("two", _config(setup, tmp_path / "two", micro_batch_rows=1, loss=loss), None)], tmp_path
    )
    for rank in (0, 1):
        got = json.loads((tmp_path / f"two-rank{rank}.json").read_text())
        for g, w in zip(got["history"], want, strict=True):
            for key in ("loss", "ce", "kd", "kd_scale", "teacher0/uld_pairs"):
                assert g[key] == pytest.approx(w[key], rel=1e-5), key


def test_xtoken_trains_and_a_wrong_or_missing_projection_is_refused_before_a_step(setup, tmp_path):
    """``algorithm: xtoken`` through the projection of the inputs' tables trains (finite loss, a
    positive KD on counted chunks); a projection of another pair, or none at the path, is
    refused when the trainer starts, naming the key."""
    from crosskd.projection import Projection, build_projection, save_projection
    from crosskd.tables import load_table_pair

    w = save_projection(
        build_projection(load_table_pair(setup["s2t"], setup["t2s"])), str(tmp_path / "w")
    )
    loss = _config(setup, tmp_path).loss
    teacher = replace(loss.teachers[0], algorithm="xtoken", projection=w.source)
    trainer = Trainer(
        _config(setup, tmp_path / "run", steps=2, loss=replace(loss, teachers=[teacher])),
        progress=False,
    )
    trainer.setup()
    history = trainer.train()
    trainer.close()
    assert all(math.isfinite(h["loss"]) and h["kd/teacher0"] > 0 for h in history)
    assert history[0]["teacher0/1:1/valid"] > 0
    foreign = Projection(
        w.offsets,
        w.columns,
        w.weights,
        replace(w.meta, student_fingerprint="0" * 64, student_name="other"),
    )
    save_projection(foreign, str(tmp_path / "foreign"))
    for path, message in (
        (
            tmp_path / "foreign",
            r"loss.teachers\[0\].projection: projection .*foreign was built for a student",
        ),
        (tmp_path / "none", r"loss.teachers\[0\].projection: projection .*none: no such file"),
    ):
        wrong = replace(teacher, projection=str(path))
        config = _config(setup, tmp_path / "bad", loss=replace(loss, teachers=[wrong]))
        with pytest.raises(CrosskdError, match=message):
            Trainer(config, progress=False).setup()
        assert not (tmp_path / "bad" / "checkpoints").exists()


def test_a_rank_that_fails_alone_fails_every_rank_without_a_hang(setup, tmp_path):
    """Rank 1 cannot serve its metrics (its port is taken): it raises a named error, rank 0
    raises one pointing at it, and neither waits in a collective."""
    import socket

    with socket.socket() as busy:
        base = free_ports(2)
        busy.bind(("0.0.0.0", base + 1))
        busy.listen()
        port = base + 1
        config = _config(setup, tmp_path / "run", micro_batch_rows=1, metrics_port=base)
        with pytest.raises(AssertionError) as info:
            run_ddp([("fail", config, None)], tmp_path, timeout=120)
    text = str(info.value)
    assert f"metrics_host '0.0.0.0' / port {port}: cannot serve /metrics" in text
    assert "another rank failed to serve its metrics" in text


def test_a_rank_with_a_damaged_shard_stops_every_rank_with_its_error(setup, tmp_path):
    """Rank 1 reads a copy of the data whose shards are damaged (a torn download on its node);
    rank 0 reads intact ones. The step's all-reduce carries rank 1's missing inputs: both ranks
    stop at that step with the same one-line error naming rank 1 and the damaged shard, as bad
    input (exit code 2, not retried), neither waiting in a collective."""
    damaged = tmp_path / "damaged"
    shutil.copytree(setup["data_sharded"], damaged)
    for shard in damaged.glob("*.parquet"):
        payload = bytearray(shard.read_bytes())
        payload[len(payload) // 2] ^= 0xFF
        shard.write_bytes(bytes(payload))
    configs = [
        _config(
            setup,
            tmp_path / "run",
            data=data,
            teachers=[setup["cache_sharded"]],
            micro_batch_rows=1,
            collective_timeout_s=60,
        )
        for data in (setup["data_sharded"], str(damaged))
    ]
    run_ranks(input_failure_worker, (configs, tmp_path), tmp_path, world=2, timeout=120)
    outcomes = [json.loads((tmp_path / f"outcome{r}.json").read_text()) for r in (0, 1)]
    assert outcomes[0] == outcomes[1]
    assert outcomes[0]["type"] == "InputError" and outcomes[0]["exit_code"] == 2
    message = outcomes[0]["message"]
    assert "\n" not in message
    assert re.match(
        r"step 1: the inputs of 1 rank\(s\) are bad, so every rank stopped \(rank 1: "
        r".*part-\d+\.parquet",
        message,
    ), message


def test_inputs_that_failed_to_read_stop_every_rank_for_a_retry():
    """A rank whose object storage failed (not bad input) stops every rank with an error the
    launcher leaves unclassified (retried); any bad input among the reasons makes it final."""
    from crosskd.train.launch import EXIT_INPUT
    from crosskd.train.trainer import InputError, InputFailed, input_failure

    transient = input_failure(4, [(3, "ConnectionResetError: reset by peer", False)])
    assert isinstance(transient, InputFailed) and not isinstance(transient, CrosskdError)
    assert str(transient) == (
        "step 5: 1 rank(s) could not read their inputs, so every rank "
        "stopped (rank 3: ConnectionResetError: reset by peer)"
    )
    final = input_failure(0, [(0, "timeout", False), (2, "cache sample id s1 is not s2", True)])
    assert isinstance(final, InputError) and final.exit_code == EXIT_INPUT
    assert str(final).endswith("(rank 0: timeout; rank 2: cache sample id s1 is not s2)")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seed": 2**70}, r"seed is \d+; it must be < 2\*\*63"),
        (
            {"student": "init", "student_tokenizer": "t", "student_shape": {"hidden_size": 0}},
            r"student_shape.hidden_size is 0; it must be a positive integer",
        ),
        ({"loss": {"teachers": 5}}, r"loss: .*loss.teachers as a list of mappings"),
        ({"collective_timeout_s": 0}, r"collective_timeout_s is 0"),
        (
            {"student": "init", "student_tokenizer": "t", "student_shape": {"hiden_size": 64}},
            r"student_shape has unknown key\(s\) hiden_size; known: hidden_size, ",
        ),
        ({"metrics_final_scrape_s": -1}, r"metrics_final_scrape_s is -1; it must be a finite"),
        ({"steps": 0}, r"steps is 0; it must be an integer >= 1"),
        ({"steps": "10"}, r"steps is '10'; it must be an integer >= 1"),
        ({"micro_batch_rows": 1.5}, r"micro_batch_rows is 1.5; it must be an integer"),
        ({"grad_accum": 0}, r"grad_accum is 0; it must be an integer >= 1"),
        ({"global_batch_rows": True}, r"global_batch_rows is True"),
        ({"checkpoint_every": -1}, r"checkpoint_every is -1; it must be an integer >= 0"),
        ({"keep_checkpoints": -2}, r"keep_checkpoints is -2"),
        ({"eval_every": "x"}, r"eval_every is 'x'"),
        ({"lr": -1}, r"lr is -1"),
        ({"lr": float("nan")}, r"lr is nan; it must be a finite number"),
        ({"min_lr_ratio": 2.0}, r"min_lr_ratio is 2.0; it must be in \[0, 1\]"),
        ({"metrics_port": 70000}, r"metrics_port is 70000; it must be <= 65535"),
        ({"student": ""}, r"student is ''; it must be a non-empty string"),
        ({"output": 3}, r"output is 3; it must be a non-empty string"),
        ({"teachers": "cache"}, r"teachers is 'cache'; it must be a list"),
        ({"teachers": ["a", "b"]}, r"teachers lists 2 source\(s\) but loss.teachers has 1"),
        ({"attn_implementation": "flex"}, r"attn_implementation is 'flex'; packed rows are exact"),
        ({"student": "init"}, r"student is 'init' .* student_tokenizer is not set"),
        ({"student_shape": {"hidden_size": 8}}, r"student_shape is set but student is"),
        ({"student_shape": [1]}, r"student_shape is \[1\]; it must be a mapping"),
        ({"loss": {"kd_wieght": 1}}, r"loss: unknown key\(s\) kd_wieght"),
        ({"loss": {"tau": -1}}, r"loss.tau is -1"),
        ({"loss": {"teacher_mode": "average"}}, r"loss.teacher_mode is 'average'"),
        ({"trainable": "embed_tokens"}, r"trainable is 'embed_tokens'; give a list of regular"),
        ({"trainable": ["("]}, r"trainable: '\(' is not a regular expression"),
        ({"first_trainable": ["embed"]}, r"first_trainable is set but first_steps is 0; give"),
        ({"first_steps": 2}, r"first_steps is set but first_trainable is empty; give both"),
        (
            {"first_trainable": ["embed"], "first_steps": 10, "steps": 10},
            r"first_steps is 10, not below steps \(10\): the parameters outside",
        ),
        ({"kd_warmup_steps": -1}, r"kd_warmup_steps is -1; it must be an integer >= 0"),
    ],
)
def test_bad_configs_are_refused_by_key(setup, tmp_path, change, message):
    values = {"student": "s", "data": "d", "output": "o", "teachers": ["c"]} | change
    with pytest.raises(ConfigError, match=message) as info:
        TrainConfig(**values)
    assert "\n" not in str(info.value)


def test_distill_tiny_preset_end_to_end(tmp_path, capsys):
    """The whole pipeline (corpus, tiny tokenizers and models, tables, prepare, score, KD and
    CE-only training, evaluation, report) through the CLI."""
    from crosskd.cli import main

    out = tmp_path / "distill"
    assert main(["distill", "--preset", "tiny", f"output={out}", "train.steps=6"]) == 0
    printed = capsys.readouterr().out
    assert f"report: {out}/report/index.html" in printed
    metrics = json.loads((out / "report" / "metrics.json").read_text())
    bpb = metrics["bits_per_byte"]
    assert set(bpb) == {"teacher", "student_init", "student_kd", "student_ce"}
    assert all(0 < v < 16 for v in bpb.values())
    # Training lowers the student's held-out bits per byte from its random start.
    assert bpb["student_ce"] < bpb["student_init"]
    assert [len(h) for h in metrics["runs"].values()] == [6, 6]
    assert (out / "report" / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "report" / "index.html").read_text()
    assert "loss_curves.png" in page and "student_kd" in page
    assert main(["distill", "--preset", "tiny", f"output={out}", "stepz=3"]) == 2
    assert "unknown key(s) stepz" in capsys.readouterr().err


def _one_process(model: torch.nn.Module):
    """``model`` as a one-process student (what checkpoints are written from)."""
    from crosskd.parallel.layout import ParallelLayout
    from crosskd.parallel.mesh import build_parallel_mesh
    from crosskd.parallel.parallelize import parallelize

    return parallelize(model, build_parallel_mesh(ParallelLayout(), torch.device("cpu")))


def _saved_linear(folder) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A Linear(3, 2) after one AdamW step, checkpointed as step 5 under ``folder``."""
    from crosskd.train.checkpoint import save_checkpoint

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    save_checkpoint(str(folder), 5, _one_process(model), optimizer, {})
    return model, optimizer


def test_saving_a_step_again_replaces_its_checkpoint(tmp_path):
    from crosskd.train.checkpoint import load_checkpoint, save_checkpoint

    model, optimizer = _saved_linear(tmp_path)
    with torch.no_grad():
        model.weight.add_(1.0)
    save_checkpoint(str(tmp_path), 5, _one_process(model), optimizer, {"note": "again"})
    assert sorted(p.name for p in (tmp_path / "step-0000005").iterdir()) == [
        "index.json",
        "rank-00000.json",
        "rank-00000.safetensors",
        "state.json",
    ]
    fresh = torch.nn.Linear(3, 2)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    state = load_checkpoint(str(tmp_path), 5, _one_process(fresh), fresh_optimizer)
    assert state["note"] == "again" and torch.equal(fresh.weight, model.weight)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(fresh_optimizer.state[fresh.bias][key], optimizer.state[model.bias][key])
    (tmp_path / "step-0000005" / "rank-00000.safetensors").write_bytes(b"garbage")
    with pytest.raises(CrosskdError, match=r"checkpoint .* is incomplete or damaged"):
        load_checkpoint(
            str(tmp_path), 5, _one_process(fresh), torch.optim.AdamW(fresh.parameters(), lr=0.1)
        )
    with pytest.raises(CrosskdError, match=r"step-0000006 cannot be read here .* storage all"):
        load_checkpoint(
            str(tmp_path), 6, _one_process(fresh), torch.optim.AdamW(fresh.parameters(), lr=0.1)
        )


def test_a_checkpoint_for_another_optimizer_or_without_param_groups_is_refused(tmp_path):
    from crosskd.train.checkpoint import load_checkpoint

    _saved_linear(tmp_path)
    other = torch.nn.Linear(3, 2)
    two_groups = torch.optim.AdamW([{"params": [other.weight]}, {"params": [other.bias]}])
    with pytest.raises(
        CrosskdError,
        match=r"step-0000005: its optimizer state does not fit "
        r"this model's optimizer",
    ):
        load_checkpoint(str(tmp_path), 5, _one_process(other), two_groups)
    state_file = tmp_path / "step-0000005" / "state.json"
    state = json.loads(state_file.read_text())
    del state["param_groups"]
    state_file.write_text(json.dumps(state))
    with pytest.raises(
        CrosskdError,
        match=r"incomplete or damaged \(state.json has no "
        r"param_groups list\)",
    ):
        load_checkpoint(
            str(tmp_path), 5, _one_process(other), torch.optim.AdamW(other.parameters())
        )


def test_distill_refuses_loss_keys_it_sets(tmp_path, capsys):
    from crosskd.cli import main

    code = main(["distill", "--preset", "tiny", f"output={tmp_path}", "train.loss.tau=2.0"])
    assert code == 2
    assert (
        "train.loss.tau is set; the run sets it from the top-level keys" in capsys.readouterr().err
    )


def test_online_teacher_trains_like_the_cache(setup, tmp_path):
    """`online:REF` computes the same signal in the process as the lossless cache holds (up to
    float32 rounding: the teacher sees other batch shapes online, and the tiny KD of two random
    models, ~5e-5, moves by a few 1e-9)."""
    runs = {}
    for name, source in (("cache", setup["cache"]), ("online", f"online:{setup['teacher']}")):
        trainer = Trainer(
            _config(setup, tmp_path / name, teachers=[source], steps=3), progress=False
        )
        trainer.setup()
        runs[name] = trainer.train()
        trainer.close()
    for got, want in zip(runs["online"], runs["cache"], strict=True):
        for key in ("loss", "ce", "kd"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-8), key
        assert got["kd_scale"] == pytest.approx(want["kd_scale"], rel=1e-3)


def test_shard_local_reads_once_per_epoch_and_the_input_thread_changes_nothing(setup, tmp_path):
    """Six shards in windows of 2 over several epochs: every prepared and cache shard is read
    once per epoch it is used in, and the run with inputs read ahead by a thread trains exactly
    like the run that reads them inline."""
    runs = {}
    for depth in (0, 2):
        config = train_config(
            setup,
            tmp_path / f"run-{depth}",
            data=setup["data_sharded"],
            teachers=[setup["cache_sharded"]],
            steps=8,
            window_shards=2,
            prefetch_steps=depth,
            checkpoint_every=0,
        )
        trainer = Trainer(config, progress=False)
        trainer.setup()
        assert len(trainer.rows.shard_sizes()) == 6
        history = trainer.train()
        rows = [r for s in range(8) for micro in trainer.step_micro_batches(s) for r in micro]
        epochs = -(-len(rows) // trainer.shard_order.rows)  # epochs begun
        cache = trainer.teachers.sources[0].cache
        assert set(trainer.rows.reads) == set(cache.reads) == set(range(6))
        assert max(trainer.rows.reads.values()) <= epochs and max(cache.reads.values()) <= epochs
        assert all(h["input_wait_s"] >= 0 for h in history)
        assert all(h["cpu_share"] > 0 for h in history)  # a CPU run records its share
        waited = trainer.exporter.input_wait._value.get()
        assert waited == pytest.approx(sum(h["input_wait_s"] for h in history))
        trainer.close()
        runs[depth] = history
    assert epochs >= 2
    for inline, ahead in zip(runs[0], runs[2], strict=True):
        timing = ("input_wait_s", "cpu_share")  # measured, not computed
        assert {k: v for k, v in inline.items() if k not in timing} == {
            k: v for k, v in ahead.items() if k not in timing
        }
