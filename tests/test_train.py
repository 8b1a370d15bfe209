"""The training loop on tiny random-init models with different tiny tokenizers: learning,
kill-and-resume, the NaN guard, metrics over HTTP, 2-process DDP against one process."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import time
import traceback
import urllib.request
from pathlib import Path

import pytest
import torch

from crosskd.data.prepare import PrepareConfig, prepare
from crosskd.errors import ConfigError, CrosskdError
from crosskd.loss import LossConfig, TeacherLossConfig
from crosskd.tables import build_table, save_table
from crosskd.teacher.scoring import ScoreConfig, score
from crosskd.tokenization import load_tokenizer
from crosskd.train import TrainConfig, Trainer, TrainingError, lr_at, step_rows
from crosskd.zoo import train_tiny_bpe
from crosskd.zoo.models import init_llama

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 2,
    "Pack my box with five dozen liquor jugs, 12 of them.",
    "Sphinx of black quartz, judge my vow!",
    "How vexingly quick daft zebras jump; 3.14159 and 2.71828.",
    "A short one.",
    "Water boils at 100 degrees and freezes at 0 degrees.",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time there was a little fox.",
] * 2


def _tiny_model(folder: Path, vocab_texts: list[str], vocab: int, seed: int) -> Path:
    """A tiny random-init Llama with a tiny BPE trained on ``vocab_texts``."""
    train_tiny_bpe(vocab_texts, vocab, folder)
    return init_llama(folder, str(folder), {"hidden_size": 32, "intermediate_size": 64}, seed)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Student and teacher folders, tables, prepared data and the teacher cache."""
    root = tmp_path_factory.mktemp("train")
    student = _tiny_model(root / "student", TEXTS * 4, 330, seed=1)
    teacher = _tiny_model(root / "teacher", [t.upper() + t for t in TEXTS] * 4, 420, seed=2)
    s_tok, t_tok = load_tokenizer(str(student)), load_tokenizer(str(teacher))
    s2t = save_table(build_table(s_tok, t_tok, progress=False), str(root / "s2t.safetensors"))
    t2s = save_table(build_table(t_tok, s_tok, progress=False), str(root / "t2s.safetensors"))
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"id": f"s{i}", "text": t}) + "\n"
                            for i, t in enumerate(TEXTS)))  # fmt: skip
    prep = PrepareConfig(data=str(data), student_tokenizer=str(student),
                         teacher_tokenizers=[str(teacher)], output=str(root / "prep"),
                         max_length=48)  # fmt: skip
    prepare(prep, progress=False)
    cache = str(root / "cache")
    score(ScoreConfig(data=prep.output, teacher=str(teacher), output=cache, k=16),
          progress=False)  # fmt: skip
    return {"student": str(student), "teacher": str(teacher), "data": prep.output,
            "cache": cache, "s2t": s2t.source, "t2s": t2s.source}  # fmt: skip


def _config(setup, output, **kw) -> TrainConfig:
    loss = LossConfig(dynamic_kd_scale=True, teachers=[TeacherLossConfig(
        k=16, student_to_teacher=setup["s2t"], teacher_to_student=setup["t2s"])])  # fmt: skip
    values = {"student": setup["student"], "data": setup["data"], "output": str(output),
              "teachers": [setup["cache"]], "loss": loss, "steps": 6, "micro_batch_rows": 2,
              "lr": 3e-3, "warmup_steps": 2} | kw  # fmt: skip
    return TrainConfig(**values)


def test_schedule_and_data_order():
    config = TrainConfig(student="s", data="d", output="o", teachers=[""], steps=10,
                         warmup_steps=2, lr=1.0, min_lr_ratio=0.1)  # fmt: skip
    # Warmup: (s + 1) / 2 for s = 0, 1. Then cosine over 8 steps from 1 to 0.1: step 9 is at
    # 7/8 of it: 0.1 + 0.9 * 0.5 * (1 + cos(7 pi / 8)) = 0.1 + 0.45 * 0.0761205 = 0.1342542.
    got = [lr_at(s, config) for s in (0, 1, 2, 9)]
    assert got == pytest.approx([0.5, 1.0, 1.0, 0.1342542], abs=1e-7)
    rows = [i for s in range(5) for i in step_rows(s, 7, 3, seed=4)]
    # Every epoch is a permutation of all rows; the order only depends on the seed.
    assert sorted(rows[:7]) == list(range(7)) and sorted(rows[7:14]) == list(range(7))
    assert rows == [i for s in range(5) for i in step_rows(s, 7, 3, seed=4)]
    assert rows != [i for s in range(5) for i in step_rows(s, 7, 3, seed=5)]


def test_training_lowers_the_loss_and_saves_a_loadable_student(setup, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = Trainer(_config(setup, tmp_path / "run", steps=12), progress=False)
    trainer.setup()
    history = trainer.train()
    assert history[-1]["ce"] < history[0]["ce"] and history[-1]["kd"] < history[0]["kd"]
    assert all(h["teacher0/1:1/valid"] > 0 for h in history)
    final = trainer.save()
    trainer.close()
    loaded = AutoModelForCausalLM.from_pretrained(final)
    assert loaded.config.vocab_size == trainer.vocab
    lines = (tmp_path / "run" / "metrics-rank0.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(1, 13))


def _killable_run(config: TrainConfig) -> None:
    """Train, hanging in step 4 (after step 3's metrics are logged) until killed."""
    real = Trainer.train_step

    def slow(self, step):
        if step == 3:
            time.sleep(600)
        return real(self, step)

    Trainer.train_step = slow
    trainer = Trainer(config, progress=False)
    trainer.setup()
    trainer.train()
    os._exit(0)


def test_a_killed_run_resumes_to_the_same_loss_curve(setup, tmp_path):
    """SIGKILL a training process during step 4 (last checkpoint: step 2), restart it: the
    steps from 3 on equal an uninterrupted run's."""
    reference = Trainer(_config(setup, tmp_path / "ref", checkpoint_every=2), progress=False)
    reference.setup()
    full = reference.train()
    reference.close()
    config = _config(setup, tmp_path / "run", checkpoint_every=2)
    proc = multiprocessing.get_context("fork").Process(target=_killable_run, args=(config,))
    proc.start()
    log_path = tmp_path / "run" / "metrics-rank0.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if log_path.exists() and len(log_path.read_text().splitlines()) == 3:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    assert proc.exitcode == -signal.SIGKILL
    latest = json.loads((tmp_path / "run" / "checkpoints" / "latest.json").read_text())
    assert latest["step"] == 2
    second = Trainer(config, progress=False)
    second.setup()
    assert second.start == 2
    resumed = second.train()
    second.close()
    for got, want in zip(resumed, full[2:], strict=True):
        for key in ("loss", "ce", "kd", "kd_scale", "lr"):
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key


def test_a_nan_loss_stops_the_run_naming_step_and_term(setup, tmp_path, monkeypatch):
    trainer = Trainer(_config(setup, tmp_path / "run", checkpoint_every=1), progress=False)
    trainer.setup()
    trainer.train(stop_after=2)
    real = trainer._forward
    monkeypatch.setattr(trainer, "_forward", lambda student: real(student) * float("nan"))
    with pytest.raises(TrainingError, match=r"step 3: the loss term is nan"):
        trainer.train_step(2)
    trainer.close()
    latest = json.loads((tmp_path / "run" / "checkpoints" / "latest.json").read_text())
    assert latest["step"] == 2


def test_metrics_are_served_over_http_during_the_run(setup, tmp_path):
    trainer = Trainer(_config(setup, tmp_path / "run", metrics_port=0, job="unit"),
                      progress=False)  # fmt: skip
    trainer.setup()
    trainer.train(stop_after=2)
    port = trainer.exporter.port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    last = json.loads((tmp_path / "run" / "metrics-rank0.jsonl").read_text().splitlines()[-1])
    values = {}
    for line in text.splitlines():
        if line.startswith("crosskd_") and "{" in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    labels = 'job="unit",rank="0"'
    assert values[f"crosskd_train_step{{{labels}}}"] == 2
    assert values[f"crosskd_train_loss{{{labels}}}"] == pytest.approx(last["loss"])
    assert values[f"crosskd_learning_rate{{{labels}}}"] == pytest.approx(last["lr"])
    assert values[f"crosskd_step_seconds_count{{{labels}}}"] == 2
    shapes = [k for k in values if k.startswith("crosskd_chunks_total{")]
    assert shapes and all('teacher="teacher0"' in k for k in shapes)
    assert not any("step=" in k for k in values)
    trainer.close()


def _ddp_worker(rank: int, port: int, config: TrainConfig, out: Path) -> None:
    try:
        os.environ.update({"WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank),
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})  # fmt: skip
        torch.set_num_threads(1)
        trainer = Trainer(config, progress=False)
        trainer.setup()
        history = trainer.train()
        (out / f"rank{rank}.json").write_text(json.dumps(history))
        trainer.close()
        torch.distributed.destroy_process_group()
    except BaseException:
        (out / f"error{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def test_two_process_ddp_equals_one_process(setup, tmp_path):
    single = Trainer(_config(setup, tmp_path / "one", micro_batch_rows=2), progress=False)
    single.setup()
    want = single.train()
    single.close()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = _config(setup, tmp_path / "two", micro_batch_rows=1)
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_ddp_worker, args=(r, port, config, tmp_path)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    errors = [f.read_text() for f in tmp_path.glob("error*.txt")]
    assert all(p.exitcode == 0 for p in procs), "\n".join(errors)
    # The loss curve to 1e-5. The KD term of these two random models is ~2e-4 against a loss of
    # ~10, so its float32 rounding (other batch shapes, another summation order of the
    # gradients) is compared on the loss's scale, and kd_scale (CE / KD) inherits it.
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for g, w in zip(got, want, strict=True):
            for key in ("loss", "ce"):
                assert g[key] == pytest.approx(w[key], rel=1e-5), key
            assert g["kd"] == pytest.approx(w["kd"], abs=1e-5 * w["loss"])
            assert g["kd_scale"] == pytest.approx(w["kd_scale"], rel=2e-4)


def test_bad_configs_are_refused_by_key(setup, tmp_path):
    with pytest.raises(ConfigError, match=r"steps is 0; it must be an integer >= 1"):
        _config(setup, tmp_path, steps=0)
    with pytest.raises(ConfigError, match=r"lr is -1"):
        _config(setup, tmp_path, lr=-1)
    with pytest.raises(ConfigError, match=r"teachers lists 2 source\(s\) but loss.teachers has 1"):
        _config(setup, tmp_path, teachers=["a", "b"])
    with pytest.raises(ConfigError, match=r"loss: unknown key\(s\) kd_wieght"):
        TrainConfig(student="s", data="d", output="o", teachers=[""], loss={"kd_wieght": 1})


def test_distill_tiny_preset_end_to_end(tmp_path, capsys):
    """The whole pipeline (corpus, tiny tokenizers and models, tables, prepare, score, KD and
    CE-only training, evaluation, report) through the CLI."""
    from crosskd.cli import main

    out = tmp_path / "distill"
    assert main(["distill", "--preset", "tiny", f"output={out}", "steps=6"]) == 0
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


def test_saving_a_step_again_replaces_its_checkpoint(tmp_path):
    from crosskd.train.checkpoint import load_checkpoint, save_checkpoint

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    save_checkpoint(str(tmp_path), 5, model, optimizer, {})
    with torch.no_grad():
        model.weight.add_(1.0)
    save_checkpoint(str(tmp_path), 5, model, optimizer, {"note": "again"})
    assert sorted(p.name for p in (tmp_path / "step-0000005").iterdir()) == [
        "model.safetensors", "optimizer.safetensors", "state.json",
    ]  # fmt: skip
    fresh = torch.nn.Linear(3, 2)
    state = load_checkpoint(str(tmp_path), fresh, torch.optim.AdamW(fresh.parameters(), lr=0.1))
    assert state["note"] == "again" and torch.equal(fresh.weight, model.weight)
    (tmp_path / "step-0000005" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CrosskdError, match=r"checkpoint .* is incomplete or damaged"):
        load_checkpoint(str(tmp_path), fresh, torch.optim.AdamW(fresh.parameters(), lr=0.1))


def test_distill_refuses_loss_keys_it_sets(tmp_path, capsys):
    from crosskd.cli import main

    code = main(["distill", "--preset", "tiny", f"output={tmp_path}", "loss={tau: 2.0}"])
    assert code == 2
    assert "loss.tau is set; distill sets it from the top-level keys" in capsys.readouterr().err


def test_online_teacher_trains_like_the_cache(setup, tmp_path):
    """`online:REF` computes the same signal in the process as the lossless cache holds (up to
    float32 rounding: the teacher sees other batch shapes online, and the tiny KD of two random
    models, ~5e-5, moves by a few 1e-9)."""
    runs = {}
    for name, source in (("cache", setup["cache"]), ("online", f"online:{setup['teacher']}")):
        trainer = Trainer(_config(setup, tmp_path / name, teachers=[source], steps=3),
                          progress=False)  # fmt: skip
        trainer.setup()
        runs[name] = trainer.train()
        trainer.close()
    for got, want in zip(runs["online"], runs["cache"], strict=True):
        for key in ("loss", "ce", "kd"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-8), key
        assert got["kd_scale"] == pytest.approx(want["kd_scale"], rel=1e-3)
