"""``crosskd distill``: the whole run on one machine, step by step.

corpus -> models -> tables (built and validated) -> prepare (train and held-out) -> score the
teacher -> train the student with CSD (and, to compare, with CE only on the same budget) ->
evaluate (held-out bits per byte of the student before and after, and of the teacher) -> report
(``metrics.json``, ``loss_curves.png``, ``index.html`` under ``output/report``).

The corpus is text already on the machine: Python standard-library docstrings and sources and
translation catalogues (:func:`crosskd.alignment.corpus.benchmark_corpus`), every
``heldout_every``-th document held out. Models are references (an HF folder, ``zoo:smollm2``,
...) or ``init``: a random-init Llama of the given shape for the given tokenizer. A tokenizer
reference may be ``tiny:N``: a byte-level BPE of N tokens trained on the training corpus. Presets
ship with the package (``--preset tiny``, ``--preset demo``). Steps whose outputs exist are not
redone and training runs resume from their checkpoints, so a rerun into the same output
finishes an interrupted run; use a new output for a new configuration.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import yaml

from crosskd.alignment.corpus import benchmark_corpus
from crosskd.config import load_config
from crosskd.data.collate import load_prepared
from crosskd.data.prepare import PrepareConfig, prepare
from crosskd.errors import ConfigError
from crosskd.evaluate import bits_per_byte, prepared_sequences
from crosskd.loss import LossConfig, TeacherLossConfig
from crosskd.metrics.report import write_report
from crosskd.tables import build_table, save_table, validate_pair
from crosskd.teacher.model import load_teacher
from crosskd.teacher.scoring import ScoreConfig, score
from crosskd.tokenization import load_tokenizer
from crosskd.train import TrainConfig, Trainer
from crosskd.train.config import loss_from_mapping
from crosskd.zoo import train_tiny_bpe
from crosskd.zoo.models import init_llama

log = logging.getLogger(__name__)

PRESETS = ("tiny", "demo")


@dataclass
class DistillConfig:
    """A whole distillation run (see the module docstring)."""

    output: str
    """Local folder of the run (everything is written under it)."""
    teacher: str = "zoo:smollm2"
    """Teacher model reference, or ``init`` (random-init with ``teacher_tokenizer``)."""
    teacher_tokenizer: str = "tiny:420"
    """Tokenizer of an ``init`` teacher."""
    teacher_shape: dict = field(default_factory=dict)
    """Llama shape of an ``init`` teacher (keys ``hidden_size``, ``num_hidden_layers``, ...)."""
    student_tokenizer: str = "zoo:llama3"
    """The student's tokenizer (the teacher's own makes a same-tokenizer teacher: no tables)."""
    student_shape: dict = field(default_factory=dict)
    """Llama shape of the random-init student."""
    corpus_bytes: int = 200_000
    heldout_every: int = 10
    max_length: int = 256
    k: int = 32
    tau: float = 1.0
    encoding: str = "lossless"
    steps: int = 100
    micro_batch_rows: int = 4
    grad_accum: int = 1
    lr: float = 3e-3
    warmup_steps: int = 10
    seed: int = 0
    loss: dict = field(default_factory=dict)
    """LossConfig keys (the teacher entry is filled in)."""
    compare_ce_only: bool = True
    """Also train the same student with CE only (kd_weight 0) on the same budget."""
    token_budget: int = 2048

    def __post_init__(self) -> None:
        for key in ("tau", "teachers"):
            if key in self.loss:
                raise ConfigError(
                    f"loss.{key} is set; distill sets it from the top-level keys (tau, k and "
                    f"the built tables). Remove loss.{key}."
                )
        loss_from_mapping(self.loss)  # every other loss key is checked now, not after scoring


def preset_path(name: str) -> str:
    """The YAML file of a shipped preset."""
    if name not in PRESETS:
        raise ConfigError(f"preset {name!r} does not exist; choose one of {', '.join(PRESETS)}.")
    return str(resources.files("crosskd") / "presets" / f"{name}.yaml")


def load_distill_config(
    path: str | None, preset: str | None, overrides: list[str]
) -> DistillConfig:
    """A preset (or none), then the file, then ``key=value`` overrides."""
    values: dict[str, Any] = {}
    for source in (preset_path(preset) if preset else None, path):
        if source is None:
            continue
        loaded = yaml.safe_load(Path(source).read_text()) or {}
        known = {f for f in DistillConfig.__dataclass_fields__}
        unknown = sorted(set(loaded) - known)
        if unknown:
            raise ConfigError(f"config {source}: unknown key(s) {', '.join(unknown)}; known keys: "
                              f"{', '.join(sorted(known))}.")  # fmt: skip
        values.update(loaded)
    return load_config(DistillConfig, None, overrides, flags=values)


def distill(config: DistillConfig, *, progress: bool = True) -> dict:
    """Run every step; returns the report's metrics."""
    out = Path(config.output)
    out.mkdir(parents=True, exist_ok=True)
    documents = benchmark_corpus(config.corpus_bytes)
    train_docs = [d for i, d in enumerate(documents) if i % config.heldout_every]
    heldout_docs = [d for i, d in enumerate(documents) if not i % config.heldout_every]
    for name, docs in (("train", train_docs), ("heldout", heldout_docs)):
        (out / f"{name}.jsonl").write_text(
            "".join(json.dumps({"id": f"{name}-{i}", "text": d}) + "\n" for i, d in enumerate(docs))
        )
    log.info("corpus: %d training and %d held-out documents", len(train_docs), len(heldout_docs))
    student_tok = _tokenizer(config.student_tokenizer, out / "student-tokenizer", train_docs)
    if config.teacher == "init":
        teacher_tok = _tokenizer(config.teacher_tokenizer, out / "teacher-tokenizer", train_docs)
        teacher_ref = str(init_llama(out / "teacher-init", teacher_tok, config.teacher_shape,
                                      config.seed + 1))  # fmt: skip
    else:
        teacher_ref = config.teacher
    teacher = load_teacher(teacher_ref, device="cpu")
    teacher_tok = str(teacher.folder)
    student_init = init_llama(out / "student-init", student_tok, config.student_shape,
                               config.seed)  # fmt: skip
    s = load_tokenizer(str(student_init))
    t = load_tokenizer(teacher_tok, vocab_size=teacher.vocab_size)
    tables = None  # a teacher with the student's tokenizer needs none (compared per position)
    if s.fingerprint != t.fingerprint:
        s2t, t2s = build_table(s, t, progress=progress), build_table(t, s, progress=progress)
        reports = validate_pair(s, t, s2t, t2s)
        if not all(r.ok for r in reports):
            raise ConfigError(f"the tables of {config.student_tokenizer} and {teacher_ref} do "
                              f"not validate: {[r.violations[:3] for r in reports]}")  # fmt: skip
        tables = (save_table(s2t, str(out / "tables" / "s2t.safetensors")).source,
                  save_table(t2s, str(out / "tables" / "t2s.safetensors")).source)  # fmt: skip
    prepared = {}
    for name in ("train", "heldout"):
        target = out / f"prepared-{name}"
        if not (target / "manifest.json").exists():
            prepare(PrepareConfig(
                data=str(out / f"{name}.jsonl"), student_tokenizer=str(student_init),
                teacher_tokenizers=[teacher_tok], output=str(target),
                max_length=config.max_length, teacher_max_length=2 * config.max_length,
            ), progress=progress)  # fmt: skip
        prepared[name] = str(target)
    cache = str(out / "cache")
    if not (out / "cache" / "manifest.json").exists():
        score(ScoreConfig(data=prepared["train"], teacher=teacher_ref, output=cache, k=config.k,
                          tau=config.tau, encoding=config.encoding,
                          token_budget=config.token_budget, device="cpu"),
              progress=progress)  # fmt: skip
    runs = {"kd": _train(config, student_init, prepared["train"], cache, tables,
                         out / "runs" / "kd", kd=True)}  # fmt: skip
    if config.compare_ce_only:
        runs["ce"] = _train(config, student_init, prepared["train"], cache, tables,
                            out / "runs" / "ce", kd=False)  # fmt: skip
    heldout = load_prepared(prepared["heldout"])
    student_seqs = prepared_sequences(heldout, "student")
    teacher_seqs = prepared_sequences(heldout, "teacher0")
    from transformers import AutoModelForCausalLM

    bpb = {"teacher": bits_per_byte(teacher.model, teacher_seqs, t.bytes.lengths,
                                    token_budget=config.token_budget)}  # fmt: skip
    for name, folder in [("student_init", student_init)] + [
        (f"student_{k}", v["final"]) for k, v in runs.items()
    ]:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        bpb[name] = bits_per_byte(model, student_seqs, s.bytes.lengths,
                                  token_budget=config.token_budget)  # fmt: skip
    metrics = {"bits_per_byte": bpb, "config": asdict(config),
               "runs": {k: v["history"] for k, v in runs.items()}}  # fmt: skip
    write_report(out / "report", metrics)
    return metrics


def _train(config: DistillConfig, student: Path, data: str, cache: str,
           tables: tuple[str, str] | None, output: Path, *, kd: bool) -> dict:  # fmt: skip
    loss_values = dict(config.loss)
    if not kd:
        loss_values.update(kd_weight=0.0, dynamic_kd_scale=False)
    s2t, t2s = tables or (None, None)
    loss = LossConfig(**loss_values, tau=config.tau, teachers=[TeacherLossConfig(
        k=config.k, student_to_teacher=s2t, teacher_to_student=t2s)])  # fmt: skip
    trainer = Trainer(TrainConfig(
        student=str(student), data=data, output=str(output), teachers=[cache], loss=loss,
        steps=config.steps, micro_batch_rows=config.micro_batch_rows,
        grad_accum=config.grad_accum, lr=config.lr, warmup_steps=config.warmup_steps,
        seed=config.seed,
    ))  # fmt: skip
    trainer.setup()
    trainer.train()
    final = trainer.save()
    trainer.close()
    # The whole curve, including steps of an earlier (resumed) invocation.
    lines = (output / "metrics-rank0.jsonl").read_text().splitlines()
    by_step = {record["step"]: record for record in map(json.loads, lines)}
    return {"history": [by_step[s] for s in sorted(by_step)], "final": final}


def _tokenizer(ref: str, folder: Path, docs: list[str]) -> str:
    """A tokenizer reference, training ``tiny:N`` on the documents."""
    if not ref.startswith("tiny:"):
        return ref
    if not (folder / "tokenizer.json").exists():
        train_tiny_bpe(docs, int(ref[len("tiny:") :]), folder)
    return str(folder)
