"""Inputs of the training tests: tiny random-init Llamas with tiny BPE tokenizers of their own,
their tables, prepared data (and a held-out split) and teacher caches. Not collected as tests;
``tests/conftest.py`` builds them once per session.

The teachers have large init weights (``initializer_range`` 0.5): sharp next-token
distributions, so the KD term against the near-uniform random student is large (~0.3), not a
rounding-sized number that a wrong KD could hide behind.
"""

from __future__ import annotations

import json
from pathlib import Path

from crosskd.data.prepare import PrepareConfig, prepare
from crosskd.loss import LossConfig, TeacherLossConfig
from crosskd.tables import build_table, save_table
from crosskd.teacher.scoring import ScoreConfig
from crosskd.teacher.sharded import score
from crosskd.tokenization import load_tokenizer
from crosskd.train import TrainConfig
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
EMOJI = [
    "Party time 🎉🎉 at the café, naïve as ever ✓",
    "日本語のテキストと絵文字 🙂 が混ざる文。",
    "Rocket 🚀 launch at 3.14, crowd says 👍👍.",
    "Plain words between emoji 🎉 and more plain words.",
]
HELDOUT = [
    "The lazy fox sleeps; the quick dog jumps over it twice.",
    "def mul(a, b):\n    return a * b\n",
    "Ice melts at 0 degrees.",
]


def tiny_model(folder: Path, vocab_texts: list[str], vocab: int, seed: int, **shape) -> Path:
    """A tiny random-init Llama with a tiny BPE of ``vocab`` tokens trained on ``vocab_texts``."""
    train_tiny_bpe(vocab_texts, vocab, folder)
    return init_llama(
        folder, str(folder), {"hidden_size": 32, "intermediate_size": 64} | shape, seed
    )


def tables(root: Path, student: Path, teacher: Path, name: str) -> tuple[str, str]:
    """Both tables of a pair, saved under ``root``; returns (S->T, T->S) paths."""
    s_tok, t_tok = load_tokenizer(str(student)), load_tokenizer(str(teacher))
    s2t = save_table(build_table(s_tok, t_tok, progress=False), str(root / f"{name}-s2t.st"))
    t2s = save_table(build_table(t_tok, s_tok, progress=False), str(root / f"{name}-t2s.st"))
    return s2t.source, t2s.source


def _jsonl(path: Path, texts: list[str], prefix: str) -> str:
    path.write_text(
        "".join(json.dumps({"id": f"{prefix}{i}", "text": t}) + "\n" for i, t in enumerate(texts))
    )
    return str(path)


def make_train_inputs(root: Path) -> dict:
    """Student, two teachers, their tables; prepared data with teacher A (+ a held-out split)
    and its top-16 cache at tau 1 (and the same in 6 shards); prepared data with both teachers
    and their caches at tau 2; emoji text prepared and scored for a teacher with the student's
    own tokenizer."""
    student = tiny_model(root / "student", TEXTS * 4, 330, seed=1)
    teacher = tiny_model(
        root / "teacher", [t.upper() + t for t in TEXTS] * 4, 420, seed=2, initializer_range=0.5
    )
    teacher_b = tiny_model(
        root / "teacher-b", [t[::-1] + t for t in TEXTS] * 4, 380, seed=3, initializer_range=0.5
    )
    # The student's own tokenizer (not trained on emoji: byte pieces) with a sharp model.
    teacher_same = init_llama(
        root / "teacher-same",
        str(student),
        {"hidden_size": 32, "intermediate_size": 64, "initializer_range": 0.5},
        4,
    )
    s2t, t2s = tables(root, student, teacher, "a")
    s2t_b, t2s_b = tables(root, student, teacher_b, "b")
    data = _jsonl(root / "data.jsonl", TEXTS, "s")
    out = {
        "student": str(student),
        "teacher": str(teacher),
        "teacher_b": str(teacher_b),
        "teacher_same": str(teacher_same),
        "s2t": s2t,
        "t2s": t2s,
        "s2t_b": s2t_b,
        "t2s_b": t2s_b,
    }
    for name, source, teachers in (
        ("data", data, [teacher]),
        ("heldout", _jsonl(root / "heldout.jsonl", HELDOUT, "h"), [teacher]),
        ("data2", data, [teacher, teacher_b]),
        ("data_same", _jsonl(root / "emoji.jsonl", EMOJI * 2, "e"), [teacher_same]),
    ):
        prepare(
            PrepareConfig(
                data=source,
                student_tokenizer=str(student),
                teacher_tokenizers=[str(t) for t in teachers],
                output=str(root / name),
                max_length=48,
            ),
            progress=False,
        )
        out[name] = str(root / name)
    # The same rows in shards of 3 (6 shards), for the shard-local data order.
    out["data_sharded"] = str(root / "data-sharded")
    prepare(
        PrepareConfig(
            data=data,
            student_tokenizer=str(student),
            teacher_tokenizers=[str(teacher)],
            output=out["data_sharded"],
            max_length=48,
            shard_rows=3,
        ),
        progress=False,
    )
    out["cache"] = str(root / "cache")
    score(
        ScoreConfig(data=out["data"], teacher=str(teacher), output=out["cache"], k=16),
        progress=False,
    )
    out["cache_sharded"] = str(root / "cache-sharded")
    score(
        ScoreConfig(
            data=out["data_sharded"], teacher=str(teacher), output=out["cache_sharded"], k=16
        ),
        progress=False,
    )
    out["cache_same"] = str(root / "cache-same")
    score(
        ScoreConfig(
            data=out["data_same"], teacher=str(teacher_same), output=out["cache_same"], k=16
        ),
        progress=False,
    )
    for index, model in enumerate((teacher, teacher_b)):
        out[f"cache2_{index}"] = str(root / f"cache2-{index}")
        score(
            ScoreConfig(
                data=out["data2"],
                teacher=str(model),
                output=out[f"cache2_{index}"],
                k=16,
                tau=2.0,
                teacher_index=index,
            ),
            progress=False,
        )
    return out


def train_config(inputs: dict, output: Path, **kw) -> TrainConfig:
    """A 6-step run of the student against teacher A's cache (dynamic kd_scale, 2 rows per
    micro-batch); ``kw`` overrides any key."""
    # mismatch_weight 5: the weight these runs' parity checks were written with. At the default
    # 1, 3 of the 10,560 embedding entries of the tp = 2 run end 7e-4 (relative) from one
    # process's after 6 AdamW steps: rounding, amplified where an entry's gradient is near 0.
    loss = LossConfig(
        dynamic_kd_scale=True,
        mismatch_weight=5.0,
        teachers=[
            TeacherLossConfig(
                k=16, student_to_teacher=inputs["s2t"], teacher_to_student=inputs["t2s"]
            )
        ],
    )
    values = {
        "student": inputs["student"],
        "data": inputs["data"],
        "output": str(output),
        "teachers": [inputs["cache"]],
        "loss": loss,
        "steps": 6,
        "micro_batch_rows": 2,
        "lr": 3e-3,
        "warmup_steps": 2,
    } | kw
    return TrainConfig(**values)
