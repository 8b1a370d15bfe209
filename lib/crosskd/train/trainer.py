"""The student training loop: setup, train, save.

It runs the same way in one process, under ``torchrun`` on a laptop (gloo) and in a PyTorchJob
pod (NCCL): the process group comes from the environment when ``WORLD_SIZE`` > 1, and the
student is wrapped in DDP in one place (:meth:`Trainer.setup`).

One optimizer step: the step's packed rows (a deterministic, resumable order: a seeded
permutation per epoch, the position in it derived from the step) are split into micro-batches
per rank; for each micro-batch the data side of the loss is planned first
(:func:`crosskd.loss.plan_loss`, with the teacher signal read from the cache or computed
online), the plans' counts are summed over the micro-batches and all-reduced over the ranks,
then every micro-batch's forward and backward run with those step totals (so the summed
gradients are the step's mean), gradients are clipped, AdamW steps, and the warmup + cosine
schedule moves on. bf16 autocast on GPU, float32 on CPU. A NaN or infinite loss stops the run
with an error naming the step and the term, before the optimizer step, keeping the last good
checkpoint.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import fsspec
import numpy as np
import torch
import torch.distributed as dist

from crosskd.data.collate import collate, load_prepared
from crosskd.errors import CrosskdError
from crosskd.loss import LossPlan, StepCounts, TeacherBatch, compute_loss, plan_loss
from crosskd.loss.metrics import add_sums, summarize
from crosskd.metrics import JsonlLog, MetricsExporter
from crosskd.tables import load_table_pair
from crosskd.teacher.cache import open_cache
from crosskd.teacher.model import load_teacher
from crosskd.teacher.scoring import online_signal
from crosskd.tokenization import load_tokenizer
from crosskd.train.checkpoint import load_checkpoint, save_checkpoint
from crosskd.train.config import TrainConfig

log = logging.getLogger(__name__)


class TrainingError(CrosskdError):
    """Training cannot go on (a non-finite loss, inputs that do not fit together)."""


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup over
    ``warmup_steps``, then cosine from ``lr`` down to ``lr * min_lr_ratio`` at ``steps``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(config.steps - config.warmup_steps, 1)
    progress = min((step - config.warmup_steps) / span, 1.0)
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def step_rows(step: int, n_rows: int, per_step: int, seed: int) -> list[int]:
    """The packed-row indices of optimizer step ``step`` (``per_step`` of them): a seeded
    permutation of all rows per epoch, read in order across epochs."""
    start = step * per_step
    out = []
    for position in range(start, start + per_step):
        epoch, offset = divmod(position, n_rows)
        out.append(int(_epoch_order(seed, epoch, n_rows)[offset]))
    return out


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, n_rows: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n_rows)


@dataclass
class _Source:
    """Where one teacher's signal comes from."""

    cache: object | None = None
    online: object | None = None
    k: int = 0
    tau: float = 1.0


@dataclass
class Trainer:
    """``Trainer(config).train()`` runs setup, the steps and the final save."""

    config: TrainConfig
    progress: bool = True
    rank: int = field(default=0, init=False)
    world: int = field(default=1, init=False)

    def setup(self) -> None:
        """Process group, data, tokenizers, tables, teacher sources, student, optimizer."""
        from transformers import AutoModelForCausalLM

        cfg = self.config
        self.device = torch.device(
            f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
        )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        if dist.is_initialized():
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.student_tok = load_tokenizer(cfg.student)
        self.data = load_prepared(cfg.data, fingerprints={"student": self.student_tok.fingerprint})
        self.rows = list(self.data.packed_rows())
        self.pairs = [
            None if t.same_tokenizer
            else load_table_pair(t.student_to_teacher, t.teacher_to_student)
            for t in cfg.loss.teachers
        ]  # fmt: skip
        self.sources = []
        models = {m["name"]: m for m in self.data.manifest["models"]}
        if len(models) - 1 != len(cfg.teachers):
            raise TrainingError(
                f"the config has {len(cfg.teachers)} teacher(s) but {cfg.data} was prepared for "
                f"{len(models) - 1}; give one teachers[] entry per prepared teacher."
            )
        self.teacher_bytes = [
            load_tokenizer(models[f"teacher{i}"]["tokenizer"],
                           vocab_size=models[f"teacher{i}"]["vocab_size"]).bytes.lengths
            for i in range(len(cfg.teachers))
        ]  # fmt: skip
        for i, (ref, entry) in enumerate(zip(cfg.teachers, cfg.loss.teachers, strict=True)):
            if ref.startswith("online:"):
                teacher = load_teacher(ref[len("online:") :], device=self.device)
                self.sources.append(_Source(online=teacher, k=entry.k, tau=cfg.loss.tau))
            else:
                cache = open_cache(
                    ref, tokenizer_fingerprint=models[f"teacher{i}"]["fingerprint"],
                    data_fingerprint=self.data.manifest["data_fingerprint"], k=entry.k,
                    tau=cfg.loss.tau,
                )  # fmt: skip
                self.sources.append(_Source(cache=cache, k=entry.k, tau=cfg.loss.tau))
        torch.manual_seed(cfg.seed)
        self.model = AutoModelForCausalLM.from_pretrained(
            cfg.student, dtype=torch.float32, use_safetensors=True, local_files_only=True
        ).to(self.device)
        self.model.train()
        self.vocab = int(self.model.get_output_embeddings().weight.shape[0])
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay
        )
        self.wrapped = self.model
        if self.world > 1:
            self.wrapped = torch.nn.parallel.DistributedDataParallel(self.model)
        self.start = 0
        state = load_checkpoint(f"{cfg.output}/checkpoints", self.model, self.optimizer)
        if state is not None:
            self.start = int(state["step"])
            log.info("resumed from step %d", self.start)
        self.log = JsonlLog(f"{cfg.output}/metrics-rank{self.rank}.jsonl")
        self.exporter = MetricsExporter(cfg.job, self.rank, count_totals=self.rank == 0)
        if cfg.metrics_port is not None:
            port = self.exporter.serve(
                cfg.metrics_port + self.rank if cfg.metrics_port else 0, host=cfg.metrics_host
            )
            log.info("rank %d serves /metrics on port %d", self.rank, port)

    def _signal(self, source: _Source, batch, index: int):
        side = batch.models[f"teacher{index}"]
        if source.cache is not None:
            return source.cache.batch(batch.sample_ids, side.input_ids.shape[1])
        return online_signal(source.online, side, k=source.k, tau=source.tau)

    def _plan(self, rows: list) -> tuple:
        batch = collate(rows, n_teachers=len(self.sources))
        teachers = [
            TeacherBatch(batch.models[f"teacher{i}"].input_ids, batch.chunks[i],
                         self._signal(s, batch, i))
            for i, s in enumerate(self.sources)
        ]  # fmt: skip
        plan = plan_loss(self.config.loss, batch.models["student"].input_ids, batch.loss_mask,
                         teachers, self.pairs, student_vocab=self.vocab,
                         teacher_bytes=self.teacher_bytes)  # fmt: skip
        return batch, plan

    def _reduce(self, values: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (on the training device: NCCL reduces CUDA tensors only)."""
        if self.world == 1:
            return values
        out = values.detach().to(self.device, copy=True)
        dist.all_reduce(out)
        return out.to(values.device)

    def _counts(self, plans: list[LossPlan]) -> StepCounts:
        counts = plans[0].counts
        for plan in plans[1:]:
            counts = counts + plan.counts
        values = self._reduce(torch.tensor([counts.tokens, *counts.chunks], dtype=torch.int64))
        tokens, *chunks = values.tolist()
        return StepCounts(tokens, tuple(chunks))

    def train_step(self, step: int) -> dict[str, float]:
        """One optimizer step; returns its metrics."""
        cfg = self.config
        per_step = cfg.micro_batch_rows * cfg.grad_accum * self.world
        indices = step_rows(step, len(self.rows), per_step, cfg.seed)
        micro = []
        for m in range(cfg.grad_accum):
            first = (m * self.world + self.rank) * cfg.micro_batch_rows
            micro.append([self.rows[i] for i in indices[first : first + cfg.micro_batch_rows]])
        planned = [self._plan(rows) for rows in micro]
        counts = self._counts([plan for _, plan in planned])
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        totals = {"loss": 0.0, "ce": 0.0, "kd": 0.0}
        sums: dict[str, float] = {}
        scale = 0.0
        for m, (batch, plan) in enumerate(planned):
            student = batch.models["student"]
            sync = m == len(planned) - 1 or self.world == 1
            context = self.wrapped.no_sync() if not sync else _Null()
            with context:
                logits = self._forward(student)
                out = compute_loss(logits, plan, cfg.loss, counts,
                                   reduce=self._reduce if self.world > 1 else None)  # fmt: skip
                for term in ("loss", "ce", "kd"):
                    value = out.totals[term]
                    if not math.isfinite(value):
                        raise TrainingError(
                            f"step {step + 1}: the {term} term is {value} (micro-batch {m}); "
                            f"stopping before the optimizer step. The last good checkpoint is "
                            f"kept; lower lr, check the data, or set kd_weight."
                        )
                    totals[term] += value
                # DDP averages gradients over ranks; each rank's loss is its share of a sum.
                (out.loss * self.world).backward()
            scale = out.kd_scale
            sums = add_sums(sums, out.sums)
        if cfg.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {**totals, "kd_scale": scale, "lr": lr_at(step, cfg),
                "tokens": float(counts.tokens)} | summarize(sums)  # fmt: skip

    def _forward(self, student) -> torch.Tensor:
        ids = student.input_ids.to(self.device)
        segments = student.segment_ids.to(self.device)
        width = ids.shape[1]
        causal = torch.tril(torch.ones(width, width, dtype=torch.bool, device=self.device))
        mask = (segments[:, :, None] == segments[:, None, :]) & causal & (segments >= 0)[:, None]
        # A padding row attends to itself only, so no row of the mask is empty.
        mask |= torch.eye(width, dtype=torch.bool, device=self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16,
                            enabled=self.device.type == "cuda"):  # fmt: skip
            return self.wrapped(input_ids=ids, attention_mask=mask[:, None],
                                position_ids=student.position_ids.to(self.device)).logits

    def train(self, *, stop_after: int | None = None) -> list[dict[str, float]]:
        """Run the steps from the resume point to ``config.steps`` (or stop after
        ``stop_after`` steps of this call, for tests of resuming); returns their metrics."""
        cfg = self.config
        history = []
        last = cfg.steps if stop_after is None else min(cfg.steps, self.start + stop_after)
        for step in range(self.start, last):
            started = time.perf_counter()
            metrics = self.train_step(step)
            seconds = time.perf_counter() - started
            self.exporter.record(step + 1, metrics, seconds)
            if self.rank == 0:
                self.log.write({"step": step + 1, "seconds": seconds, **metrics})
            history.append(metrics)
            if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                self._checkpoint(step + 1)
            log.info("step %d/%d loss %.4f ce %.4f kd %.4f", step + 1, cfg.steps,
                     metrics["loss"], metrics["ce"], metrics["kd"])  # fmt: skip
        checkpointed = cfg.checkpoint_every and cfg.steps % cfg.checkpoint_every == 0
        if history and last == cfg.steps and not checkpointed:
            self._checkpoint(cfg.steps)
        return history

    def _checkpoint(self, step: int) -> None:
        if self.rank == 0:
            save_checkpoint(f"{self.config.output}/checkpoints", step, self.model,
                            self.optimizer, {"seed": self.config.seed})  # fmt: skip
        if self.world > 1:
            dist.barrier()

    def save(self) -> str:
        """The final student as a Hugging Face folder (model and tokenizer) under
        ``output/final`` (any fsspec URI); returns its path."""
        path = f"{self.config.output}/final"
        if self.rank == 0:
            with tempfile.TemporaryDirectory() as local:
                self.model.save_pretrained(local, safe_serialization=True)
                self.student_tok.hf.save_pretrained(local)
                fs, root = fsspec.core.url_to_fs(path)
                fs.makedirs(root, exist_ok=True)
                for file in sorted(Path(local).iterdir()):
                    fs.put_file(str(file), f"{root}/{file.name}")
        if self.world > 1:
            dist.barrier()
        return path

    def close(self) -> None:
        """Stop the metrics endpoint."""
        self.exporter.close()


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None
