"""What a training run must get right beyond its loop: packed rows exact under each attention
implementation, gradient accumulation, two teachers at tau 2 against the slow reference, inputs
that do not belong together refused, checkpoints on S3, held-out evaluation and ``best/``, and
the ``crosskd train`` / ``crosskd evaluate`` commands."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from loss_reference import reference_kd
from train_inputs import tiny_model, train_config

from crosskd.cli import main
from crosskd.data.collate import collate
from crosskd.errors import ConfigError, CrosskdError, TableError
from crosskd.evaluate import EvaluateConfig, evaluate
from crosskd.loss import LossConfig, TeacherLossConfig
from crosskd.train import Trainer


def _trainer(config) -> Trainer:
    trainer = Trainer(config, progress=False)
    trainer.setup()
    return trainer


ATTENTION = [
    "eager",
    "sdpa",
    pytest.param(
        "flash_attention_2",
        marks=pytest.mark.skipif(
            not (torch.cuda.is_available() and importlib.util.find_spec("flash_attn")),
            reason="flash-attention needs CUDA and the flash_attn package",
        ),
    ),
]


@pytest.mark.parametrize("implementation", ATTENTION)
def test_a_packed_row_computes_what_each_sample_alone_does(train_inputs, tmp_path, implementation):
    """The trainer's own forward call, in train mode, on a batch of two packed rows (one
    padded): each sample's logits equal the sample's forward alone. (A boolean mask under eager
    attention is added as +1/0 and misses this by ~0.2.)"""
    trainer = _trainer(train_config(train_inputs, tmp_path, attn_implementation=implementation))
    assert trainer.attention == implementation and trainer.model.training
    every, _ = trainer.read_rows(list(range(trainer.shard_order.rows)))
    packed = [row for row in every if len(row) >= 2]
    rows = [packed[0], packed[1]]
    batch = collate(rows, n_teachers=1).models["student"]
    # float32 on CPU; bf16 autocast on GPU rounds packed and lone forwards differently.
    tolerance = 1e-5 if trainer.device.type == "cpu" else 5e-2
    with torch.no_grad():
        logits = trainer._forward(batch).whole_logits()
        for r, row in enumerate(rows):
            start = 0
            for sample in row:
                alone = trainer._forward(
                    collate([[sample]], n_teachers=1).models["student"]
                ).whole_logits()
                n = len(sample["student_ids"])
                assert (logits[r, start : start + n] - alone[0, :n]).abs().max() < tolerance
                start += n
    trainer.close()


def test_flash_attention_gets_the_micro_batch_as_one_row_of_packed_samples():
    """No GPU here: the contract with transformers instead. Its flash-attention path finds the
    samples in ``position_ids`` only for one row, so a micro-batch is flattened to [1, B * L]
    and the logits reshape back."""
    from transformers import modeling_flash_attention_utils as fa

    from crosskd.parallel.attention import packed_inputs

    ids = torch.tensor([[5, 6, 7, 8, 9], [1, 2, 3, 0, 0]])
    segments = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, -1, -1]])
    positions = torch.tensor([[0, 1, 0, 1, 2], [0, 1, 2, 0, 0]])
    inputs = packed_inputs("flash_attention_2", ids, segments, positions, torch.bfloat16)
    assert inputs["attention_mask"] is None
    assert inputs["input_ids"].tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 0, 0]]
    assert inputs["position_ids"].tolist() == [[0, 1, 0, 1, 2, 0, 1, 2, 0, 0]]
    assert fa._is_packed_sequence(inputs["position_ids"], batch_size=1)
    assert not fa._is_packed_sequence(positions, batch_size=2)  # why it is flattened


def test_a_window_of_positions_gets_its_rows_of_the_whole_mask():
    """Context parallelism: the window [3, 6) of a packed batch is its ids and positions with
    the whole mask's rows of those queries over every key (worked out by hand for row 0);
    flash attention, one flattened row, refuses a window."""
    from crosskd.parallel.attention import packed_inputs

    ids = torch.tensor([[5, 6, 7, 8, 9, 4], [1, 2, 3, 4, 0, 0]])
    segments = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, -1, -1]])
    positions = torch.tensor([[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 0, 0]])
    for implementation in ("sdpa", "eager"):
        whole = packed_inputs(implementation, ids, segments, positions, torch.float32)
        window = packed_inputs(implementation, ids, segments, positions, torch.float32, (3, 6))
        assert window["input_ids"].tolist() == [[8, 9, 4], [4, 0, 0]]
        assert window["position_ids"].tolist() == [[1, 2, 0], [3, 0, 0]]
        assert torch.equal(window["attention_mask"], whole["attention_mask"][:, :, 3:6])
    allowed = packed_inputs("sdpa", ids, segments, positions, torch.float32, (3, 6))
    assert allowed["attention_mask"][0, 0].int().tolist() == [
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    with pytest.raises(ConfigError, match=r"windows of positions need eager or sdpa"):
        packed_inputs("flash_attention_2", ids, segments, positions, torch.bfloat16, (3, 6))


def test_gradient_accumulation_equals_one_bigger_batch(train_inputs, tmp_path):
    """Two micro-batches of one row per step train exactly like one micro-batch of two rows
    (static kd_scale: the dynamic one is per micro-batch by definition)."""
    loss = LossConfig(
        kd_weight=0.7,
        teachers=[
            TeacherLossConfig(
                k=16, student_to_teacher=train_inputs["s2t"], teacher_to_student=train_inputs["t2s"]
            )
        ],
    )
    runs = {}
    for name, rows, accum in (("accum", 1, 2), ("big", 2, 1)):
        trainer = _trainer(
            train_config(
                train_inputs,
                tmp_path / name,
                loss=loss,
                steps=3,
                micro_batch_rows=rows,
                grad_accum=accum,
            )
        )
        runs[name] = (trainer.train(), [p.detach().clone() for p in trainer.model.parameters()])
        trainer.close()
    for got, want in zip(runs["accum"][0], runs["big"][0], strict=True):
        for key in ("loss", "ce", "kd", "tokens"):
            assert got[key] == pytest.approx(want[key], rel=1e-6), key
    # AdamW divides by sqrt(v): float32 rounding of a near-zero gradient moves a weight by up
    # to ~1e-6 (a step moves it by ~lr = 3e-3).
    for a, b in zip(runs["accum"][1], runs["big"][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_two_teachers_at_tau_2_match_the_slow_reference(train_inputs, tmp_path):
    """Sum mode, weights 1 and 0.5, both caches scored at tau 2: the trainer's first-step KD
    equals 1 * KD_A + 0.5 * KD_B of the slow reference (float64, loops) on the same batch and
    the student's initial logits, and its CE equals cross_entropy over the loss mask."""
    teachers = [
        TeacherLossConfig(
            weight=1.0,
            k=16,
            student_to_teacher=train_inputs["s2t"],
            teacher_to_student=train_inputs["t2s"],
        ),
        TeacherLossConfig(
            weight=0.5,
            k=16,
            student_to_teacher=train_inputs["s2t_b"],
            teacher_to_student=train_inputs["t2s_b"],
        ),
    ]
    # mismatch_weight 5, the reference's default (not the library's 1: the weight is checked)
    loss = LossConfig(tau=2.0, teachers=teachers, mismatch_weight=5.0)
    config = train_config(
        train_inputs,
        tmp_path,
        data=train_inputs["data2"],
        loss=loss,
        steps=2,
        teachers=[train_inputs["cache2_0"], train_inputs["cache2_1"]],
    )
    trainer = _trainer(config)
    (micro,) = trainer.step_micro_batches(0)
    packed, where = trainer.read_rows(micro)
    batch = collate(packed, n_teachers=2)
    with torch.no_grad():
        logits = trainer._forward(batch.models["student"]).whole_logits().double()
    student_ids = batch.models["student"].input_ids
    want_kd = 0.0
    for i, weight in enumerate((1.0, 0.5)):
        signal = trainer.teachers.sources[i].signal(batch, i, where)
        kd, n = reference_kd(
            logits,
            student_ids,
            batch.models[f"teacher{i}"].input_ids,
            signal,
            batch.chunks[i],
            trainer.teachers.pairs[i],
            tau=2.0,
        )
        assert n > 0
        want_kd += weight * float(kd)
    targets = student_ids[:, 1:][batch.loss_mask[:, 1:]]
    want_ce = torch.nn.functional.cross_entropy(logits[:, :-1][batch.loss_mask[:, 1:]], targets)
    history = trainer.train()
    trainer.close()
    assert history[0]["kd"] == pytest.approx(want_kd, rel=1e-5)
    assert history[0]["ce"] == pytest.approx(float(want_ce), rel=1e-5)
    assert history[0]["teacher0/1:1/valid"] > 0 and history[0]["teacher1/1:1/valid"] > 0


def test_a_same_tokenizer_teacher_trains_on_emoji_text(train_inputs, tmp_path):
    """Spec 5, "Same tokenizer": no tables and no chunks; every valid position is compared,
    including each byte piece of an emoji (the aligner would make one n:n chunk of them, and
    that used to stop the run). The step's KD equals the slow same-tokenizer computation
    (top K + REST against the student's log-softmax) worked out here."""

    def jsd(s: torch.Tensor, t: torch.Tensor) -> float:
        m = 0.5 * (s + t)
        return float(0.5 * (t * (t / m).log()).sum() + 0.5 * (s * (s / m).log()).sum())

    def with_rest(p: torch.Tensor) -> torch.Tensor:
        return torch.cat([p, (1 - p.sum()).clamp(min=1e-12)[None]])

    loss = LossConfig(teachers=[TeacherLossConfig(k=16)])
    config = train_config(
        train_inputs,
        tmp_path,
        data=train_inputs["data_same"],
        loss=loss,
        teachers=[train_inputs["cache_same"]],
        steps=2,
    )
    trainer = _trainer(config)
    (micro,) = trainer.step_micro_batches(0)
    rows, where = trainer.read_rows(micro)
    assert any(ch in s["text"] for row in rows for s in row for ch in "🎉🙂🚀👍")
    batch = collate(rows, n_teachers=1)
    with torch.no_grad():
        log_s = torch.log_softmax(
            trainer._forward(batch.models["student"]).whole_logits().double(), -1
        )
    signal = trainer.teachers.sources[0].signal(batch, 0, where)
    ids = batch.models["student"].input_ids
    segments = batch.models["student"].segment_ids
    total, n = 0.0, 0
    for b in range(ids.shape[0]):
        for p in range(1, ids.shape[1]):
            if segments[b, p] < 0 or segments[b, p] != segments[b, p - 1]:
                continue  # padding, or a sample's first token: no prediction
            top = signal.ids[b, p - 1]
            t = signal.log_probs[b, p - 1].double().exp()
            s = log_s[b, p - 1, top].exp()
            total += jsd(with_rest(s), with_rest(t))
            n += 1
    history = trainer.train()
    trainer.close()
    assert n > 0
    assert history[0]["teacher0/token/valid"] == n
    assert history[0]["kd"] == pytest.approx(total / n, rel=1e-5)
    assert history[1]["kd"] > 0


def test_inputs_that_do_not_belong_together_are_refused_by_name(train_inputs, tmp_path):
    """Tables of another teacher tokenizer (teacher B's, with teacher A's data and cache), a
    cache scored at another tau, an online teacher of another tokenizer."""
    wrong = LossConfig(
        teachers=[
            TeacherLossConfig(
                k=16,
                student_to_teacher=train_inputs["s2t_b"],
                teacher_to_student=train_inputs["t2s_b"],
            )
        ]
    )
    with pytest.raises(TableError, match=r"was built for a teacher tokenizer with fingerprint"):
        _trainer(train_config(train_inputs, tmp_path / "a", loss=wrong))
    swapped = LossConfig(
        teachers=[
            TeacherLossConfig(
                k=16, student_to_teacher=train_inputs["t2s"], teacher_to_student=train_inputs["s2t"]
            )
        ]
    )
    with pytest.raises(TableError, match=r"student tokenizer with fingerprint"):
        _trainer(train_config(train_inputs, tmp_path / "b", loss=swapped))
    at_tau_1 = LossConfig(
        teachers=[
            TeacherLossConfig(
                k=16,
                student_to_teacher=train_inputs[f"s2t{x}"],
                teacher_to_student=train_inputs[f"t2s{x}"],
            )
            for x in ("", "_b")
        ]
    )
    with pytest.raises(CrosskdError, match=r"cache2-0: tau is 2\.0, the config asks for 1\.0"):
        _trainer(
            train_config(
                train_inputs,
                tmp_path / "c",
                data=train_inputs["data2"],
                loss=at_tau_1,
                teachers=[train_inputs["cache2_0"], train_inputs["cache2_1"]],
            )
        )
    same = LossConfig(teachers=[TeacherLossConfig(k=16)])
    with pytest.raises(ConfigError, match=r"no tables .* same-tokenizer teacher, but its tok"):
        _trainer(train_config(train_inputs, tmp_path / "d", loss=same))
    with pytest.raises(ConfigError, match=r"loss.teachers\[0\] names tables, but .* same-tok"):
        _trainer(
            train_config(
                train_inputs,
                tmp_path / "f",
                data=train_inputs["data_same"],
                teachers=[train_inputs["cache_same"]],
            )
        )
    online = f"online:{train_inputs['teacher_b']}"
    with pytest.raises(ConfigError, match=r"teachers\[0\] online:.* prepared for teacher0"):
        _trainer(train_config(train_inputs, tmp_path / "e", teachers=[online]))


def test_checkpoints_and_the_final_model_on_s3(train_inputs, s3, tmp_path):
    """The student read from an S3 folder, checkpoints, the log and the final model on S3."""
    from transformers import AutoModelForCausalLM

    from crosskd.metrics import read_jsonl_log

    s3.put(train_inputs["student"] + "/", "crosskd-test/student-folder/", recursive=True)
    student = "s3://crosskd-test/student-folder"
    output = "s3://crosskd-test/train-run"
    trainer = _trainer(
        train_config(train_inputs, output, steps=4, checkpoint_every=2, student=student)
    )
    first = trainer.train(stop_after=2)
    trainer.close()
    assert s3.exists("crosskd-test/train-run/checkpoints/step-0000002/rank-00000.safetensors")
    resumed = _trainer(
        train_config(train_inputs, output, steps=4, checkpoint_every=2, student=student)
    )
    assert resumed.start == 2
    rest = resumed.train()
    final = resumed.save()
    resumed.close()
    assert len(first) == 2 and len(rest) == 2
    local = tmp_path / "final"
    s3.get("crosskd-test/train-run/final/", str(local), recursive=True)
    info = json.loads((local / "crosskd-model.json").read_text())
    assert final == f"{output}/final" and info["step"] == 4
    reloaded = AutoModelForCausalLM.from_pretrained(str(local))
    assert reloaded.config.vocab_size == resumed.vocab
    for name, param in resumed.model.named_parameters():  # the gathered folder is the student
        assert torch.equal(reloaded.get_parameter(name), param.detach()), name
    # The step log in parts, one per run of the trainer (the resumed one numbered on).
    assert not s3.exists("crosskd-test/train-run/metrics-rank0.jsonl")
    parts = sorted(s3.ls("crosskd-test/train-run/metrics-rank0.jsonl.parts"))
    assert [p.rsplit("/", 1)[-1] for p in parts] == ["part-000000.jsonl", "part-000001.jsonl"]
    assert [r["step"] for r in read_jsonl_log(f"{output}/metrics-rank0.jsonl")] == [1, 2, 3, 4]


def test_heldout_evaluation_keeps_the_best_student(train_inputs, tmp_path):
    """Every 2 steps: held-out bits per byte logged and exported; ``best/`` is the student of
    the lowest one and says its step; ``crosskd evaluate`` of ``best/`` gives the same figure."""
    config = train_config(
        train_inputs,
        tmp_path / "run",
        steps=6,
        checkpoint_every=3,
        eval_every=2,
        eval_data=train_inputs["heldout"],
        lr=1e-2,
    )
    trainer = _trainer(config)
    history = trainer.train()
    final = trainer.save()
    trainer.close()
    evaluated = {
        i + 1: h["heldout_bits_per_byte"]
        for i, h in enumerate(history)
        if "heldout_bits_per_byte" in h
    }
    assert sorted(evaluated) == [2, 4, 6]
    best_step = min(evaluated, key=evaluated.get)
    best = json.loads((tmp_path / "run" / "best" / "crosskd-model.json").read_text())
    assert best["step"] == best_step
    assert best["heldout_bits_per_byte"] == pytest.approx(evaluated[best_step])
    assert trainer.exporter.heldout.labels(rank="0")._value.get() == pytest.approx(evaluated[6])
    info = json.loads((tmp_path / "run" / "final" / "crosskd-model.json").read_text())
    assert info["step"] == 6 and info["best"]["step"] == best_step
    out = evaluate(
        EvaluateConfig(
            data=train_inputs["heldout"],
            models=[
                f"best={tmp_path / 'run' / 'best'}",
                f"final={final}",
                f"teacher={train_inputs['teacher']}",
            ],
        )
    )
    rows = out["models"]
    assert rows["best"]["bits_per_byte"] == pytest.approx(evaluated[best_step], rel=1e-6)
    assert rows["final"]["bits_per_byte"] == pytest.approx(evaluated[6], rel=1e-6)
    assert rows["teacher"]["prepared_model"] == "teacher0"
    assert rows["best"]["prepared_model"] == "student"


def test_heldout_evaluation_runs_under_the_training_autocast(train_inputs, tmp_path):
    """On GPU the steps run under bfloat16 autocast (DDP keeps float32 weights, which flash
    attention refuses): the held-out forward passes must run under the same. Here the CPU
    trainer is given bfloat16 as its compute dtype; a hook on the head records the autocast
    state of every forward pass, training and held-out, and the figure is the bfloat16 one."""
    config = train_config(train_inputs, tmp_path, eval_data=train_inputs["heldout"], steps=1)
    trainer = _trainer(config)
    trainer.compute_dtype = torch.bfloat16
    seen = []
    hook = trainer.model.lm_head.register_forward_hook(
        lambda module, args, out: seen.append(
            (
                module.training,
                torch.is_autocast_enabled("cpu"),
                torch.get_autocast_dtype("cpu"),
                out.dtype,
            )
        )
    )
    trainer.train()
    bf16 = trainer.heldout_bits_per_byte()
    hook.remove()
    assert {training for training, *_ in seen} == {True, False}
    assert {tuple(state) for _, *state in seen} == {(True, torch.bfloat16, torch.bfloat16)}
    trainer.compute_dtype = None
    fp32 = trainer.heldout_bits_per_byte()
    assert bf16 != fp32 and bf16 == pytest.approx(fp32, rel=0.05)
    trainer.close()


def test_best_is_the_lowest_heldout_and_survives_a_resume(train_inputs, tmp_path, monkeypatch):
    """Held-out figures 3.0, 2.0, 2.5 at steps 2, 4, 6, with a stop (and resume) after step 4:
    best/ is step 4 and stays so; final/ says which step it holds (4, then 6); only the
    complete run counts as finished, and a finished run restarted with another seed is
    refused."""
    from crosskd.train import finished_model

    figures = iter([3.0, 2.0, 2.5])
    monkeypatch.setattr(Trainer, "heldout_bits_per_byte", lambda self: next(figures))
    config = train_config(
        train_inputs,
        tmp_path / "run",
        steps=6,
        checkpoint_every=2,
        eval_data=train_inputs["heldout"],
    )
    run = tmp_path / "run"

    def info(folder: str) -> dict:
        return json.loads((run / folder / "crosskd-model.json").read_text())

    first = _trainer(config)
    first.train(stop_after=4)
    first.save()
    first.close()
    assert (info("best")["step"], info("best")["heldout_bits_per_byte"]) == (4, 2.0)
    assert info("final")["step"] == 4 and finished_model(config) is None
    second = _trainer(config)
    assert second.start == 4 and second.best == {"step": 4, "bits_per_byte": 2.0}
    second.train()
    second.save()
    second.close()
    assert info("best")["step"] == 4
    assert info("final")["step"] == 6 and info("final")["heldout_bits_per_byte"] == 2.5
    assert info("final")["best"] == {"step": 4, "bits_per_byte": 2.0}
    assert finished_model(config)["step"] == 6
    config.seed = 1
    with pytest.raises(ConfigError, match=r"finished run with another data order \(seed 0 "):
        finished_model(config)


def _write_yaml(path, values: dict) -> str:
    import yaml

    path.write_text(yaml.safe_dump(values))
    return str(path)


def test_crosskd_train_runs_resumes_and_refuses_by_one_line(train_inputs, tmp_path, capsys):
    """A random-init student of a given shape through ``crosskd train``; started again when
    complete it exits 0 at once; a config error and a damaged latest.json exit 2 with one
    line."""
    out = tmp_path / "run"
    config = _write_yaml(
        tmp_path / "train.yaml",
        {
            "student": "init",
            "student_tokenizer": train_inputs["student"],
            "student_shape": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1},
            "data": train_inputs["data"],
            "output": str(out),
            "teachers": [train_inputs["cache"]],
            "loss": {
                "teachers": [
                    {
                        "k": 16,
                        "student_to_teacher": train_inputs["s2t"],
                        "teacher_to_student": train_inputs["t2s"],
                    }
                ]
            },
            "steps": 3,
            "micro_batch_rows": 2,
            "warmup_steps": 1,
        },
    )
    assert main(["train", "--config", config, "loss.kd_weight=0.5"]) == 0
    assert "trained steps 1..3 into" in capsys.readouterr().out
    info = json.loads((out / "final" / "crosskd-model.json").read_text())
    assert info["step"] == 3
    config_json = json.loads((out / "final" / "config.json").read_text())
    assert config_json["hidden_size"] == 16 and config_json["num_hidden_layers"] == 1
    assert main(["train", "--config", config]) == 0
    assert "is complete (final/ holds step 3); nothing to do" in capsys.readouterr().out
    # More steps: it resumes from the last checkpoint by itself.
    assert main(["train", "--config", config, "steps=4"]) == 0
    assert "trained steps 4..4" in capsys.readouterr().out
    for args, message in (
        (["steps=0"], "steps is 0; it must be an integer >= 1"),
        (["stepz=3"], "unknown key(s) stepz"),
        (["loss.kd_wieght=1"], "loss: unknown key(s) kd_wieght"),
    ):
        assert main(["train", "--config", config, *args]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "Traceback" not in err
    (out / "checkpoints" / "latest.json").write_text("{oops")
    assert main(["train", "--config", config, "steps=5"]) == 2
    err = capsys.readouterr().err
    assert "latest.json is damaged" in err and err.count("\n") == 1


def test_crosskd_evaluate_writes_json_and_refuses_a_foreign_model(train_inputs, tmp_path, capsys):
    out = tmp_path / "eval" / "result.json"
    code = main(
        [
            "evaluate",
            "--data",
            train_inputs["heldout"],
            "--models",
            f"student={train_inputs['student']}",
            "--models",
            train_inputs["teacher"],
            "--output",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert set(result["models"]) == {"student", train_inputs["teacher"]}
    assert all(0 < r["bits_per_byte"] < 30 for r in result["models"].values())
    assert "held-out bits per byte" in printed and "(teacher0 tokens)" in printed
    other = tiny_model(tmp_path / "other", ["zzz yyy xxx"] * 20, 300, seed=5)
    capsys.readouterr()
    assert main(["evaluate", "--data", train_inputs["heldout"], "--models", str(other)]) == 2
    err = capsys.readouterr().err
    assert "is none of the tokenizers" in err and err.count("\n") == 1
