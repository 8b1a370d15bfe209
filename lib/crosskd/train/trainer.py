"""The student training loop: setup, train, save.

It runs the same way in one process, under ``torchrun`` on a laptop (gloo) and in a PyTorchJob
pod (NCCL): the process group comes from the environment when ``WORLD_SIZE`` > 1, the device
from ``LOCAL_RANK``, and the student is spread over the ranks by ``parallel``
(:mod:`crosskd.parallel.layout`: DDP, FSDP2, a vocabulary-parallel head, position windows) in one
place (:func:`crosskd.parallel.parallelize.parallelize`). The ``dp`` data-parallel shards each read
their slice of every step's rows; the ``cp x tp`` ranks of a shard read the same rows and feed
their slice of the logits to the sharded loss (:mod:`crosskd.loss.parallel`).

One optimizer step: the step's packed rows (``global_batch_rows`` of them, a deterministic order
fixed by the data, the seed and the global batch: :mod:`crosskd.train.order`) are split into
this rank's micro-batches; for each micro-batch the data side of the loss is planned first
(:func:`crosskd.loss.plan_loss`, with the teacher signal read from the cache or computed
online), the plans' counts are summed over the micro-batches and all-reduced over the ranks,
then every micro-batch's forward and backward run with those step totals (so the summed
gradients are the step's mean), gradients are clipped, AdamW steps, and the warmup + cosine
schedule moves on. With ``on_policy``, the step's extra micro-batches of the student's own
answers (sampled here with the step's weights, scored online: :mod:`crosskd.train.rollout`) are
planned in the main thread before the counts and trained on with the prepared ones. Packed rows
get the attention inputs their attention implementation needs
(:mod:`crosskd.parallel.attention`). bf16 autocast on GPU, float32 on CPU (``compute_dtype``; the
held-out evaluation runs under the same). A NaN or infinite loss
(or gradient norm) stops the run with an error naming the step and the term, before the
optimizer step, keeping the last good checkpoint.

Resume: rank 0 reads which checkpoint is the latest and broadcasts its step; every rank loads
its part of that checkpoint, whatever layout wrote it (so ``output`` must be storage every rank
sees; :mod:`crosskd.train.checkpoint`), and the run refuses to go on with another data order.
Held-out evaluation (``eval_data``; not with ``cp`` or ``tp``): bits per byte of the student,
each rank scoring its share of the samples, logged, exported, and the best student kept under
``best/``. Model folders (``final/``, ``best/``) are gathered one tensor at a time
(:mod:`crosskd.train.export`) and hold ``crosskd-model.json`` (written last: the step, the
held-out figure and the best step).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import fsspec
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from crosskd.artifacts import move_folder
from crosskd.data.collate import Batch, collate, load_prepared
from crosskd.data.rows import PackedRows
from crosskd.errors import (
    ConfigError,
    CrosskdError,
    InputError,
    InputFailed,
    NonFiniteLoss,
    PeerFailed,
    Stopped,
)
from crosskd.evaluate import nll_bits_and_bytes, prepared_sequences, prepared_targets
from crosskd.loss import LossConfig, LossPlan, StepCounts, TeacherBatch, compute_loss, plan_loss
from crosskd.loss.metrics import add_sums, summarize
from crosskd.loss.objective import ReportLayout, term_names
from crosskd.loss.parallel import sharded_loss
from crosskd.metrics import JsonlLog, MetricsExporter
from crosskd.metrics.contention import cpu_share, usable_threads
from crosskd.output_layer import OutputHead, OutputLayer, head_output_unchanged, use_output_head
from crosskd.parallel.attention import layer_windows, packed_inputs, refuse_state_mixers
from crosskd.parallel.mesh import build_parallel_mesh
from crosskd.parallel.parallelize import Lockstep, parallelize, state_bytes
from crosskd.teacher.model import model_folder
from crosskd.tokenization import load_tokenizer
from crosskd.train.checkpoint import (
    begin_checkpoint,
    latest_step,
    load_checkpoint,
    publish_checkpoint,
    write_parts,
)
from crosskd.train.config import INIT, TrainConfig
from crosskd.train.export import save_gathered
from crosskd.train.loader import Prefetcher
from crosskd.train.order import DataOrder, ShardOrder, rank_micro_batches
from crosskd.train.rollout import Rollouts, Sampler, rollout_preparation, rollout_rows
from crosskd.train.schedule import group_lrs, step_loss
from crosskd.train.teachers import TrainingTeachers, load_teachers
from crosskd.train.trainable import first_groups, freeze_except
from crosskd.zoo.models import new_llama

log = logging.getLogger(__name__)

MODEL_INFO = "crosskd-model.json"
"""The file a model folder written by the trainer holds last: which step it is."""


def input_failure(step: int, reasons: list[tuple[int, str, bool]]) -> Exception:
    """The error every rank raises when ranks had no inputs for optimizer step ``step``
    (0-based): ``reasons`` holds each such rank's ``(rank, reason, bad input)``;
    :class:`InputError` when any input is bad, else :class:`InputFailed`."""
    named = "; ".join(f"rank {rank}: {reason}" for rank, reason, _ in reasons)
    if any(bad for *_, bad in reasons):
        return InputError(
            f"step {step + 1}: the inputs of {len(reasons)} rank(s) are bad, so "
            f"every rank stopped ({named})"
        )
    return InputFailed(
        f"step {step + 1}: {len(reasons)} rank(s) could not read their inputs, "
        f"so every rank stopped ({named})"
    )


def finished_model(config: TrainConfig) -> dict | None:
    """The ``crosskd-model.json`` of the run's ``final/`` model when the run is complete (its
    step is ``config.steps``), else None: a finished run started again has nothing to do. A
    config with another seed, data or global batch than the finished run is refused."""
    fs, root = fsspec.core.url_to_fs(f"{config.output}/final/{MODEL_INFO}")
    if not fs.exists(root):
        return None
    try:
        info = json.loads(fs.cat_file(root))
    except ValueError as exc:
        raise CrosskdError(
            f"{config.output}/final/{MODEL_INFO} is damaged ({exc}); delete final/ and run "
            f"again to write it from the last checkpoint."
        ) from exc
    if info.get("step") != config.steps:
        return None
    recorded = info.get("data_order") or {}
    now = {
        "seed": config.seed,
        "global_batch_rows": config.global_batch_rows,
        "data_fingerprint": load_prepared(config.data).manifest["data_fingerprint"],
    }
    differ = [
        f"{key} {recorded.get(key)!r} there, {value!r} now"
        for key, value in now.items()
        if value is not None and recorded.get(key) != value
    ]
    if differ:
        raise ConfigError(
            f"{config.output} holds a finished run with another data order ({'; '.join(differ)});"
            f" use a new output for a new run."
        )
    return info


@contextlib.contextmanager
def _sigterm_flag():
    """A flag set by SIGTERM while the block runs (in the main thread; elsewhere a flag that
    stays clear); the previous handler is restored after."""
    flag = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: flag.set())
    try:
        yield flag
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class Trainer:
    """``Trainer(config).setup()``, ``.train()``, ``.save()``, ``.close()``."""

    config: TrainConfig
    progress: bool = True
    exporter: MetricsExporter | None = field(default=None, init=False)
    log: JsonlLog | None = field(default=None, init=False)
    teachers: TrainingTeachers | None = field(default=None, init=False)

    def setup(self) -> None:
        """Process group, data, tokenizers, teachers (checked against each other), student,
        optimizer, resume point, held-out data, metrics."""
        self._distributed()
        cfg = self.config
        self.student_tok = load_tokenizer(
            cfg.student_tokenizer if cfg.student == INIT else cfg.student
        )
        fingerprints = {"student": self.student_tok.fingerprint}
        self.data = load_prepared(cfg.data, fingerprints=fingerprints)
        # Two windows of shards: a step that spans a window boundary reads both.
        self.rows = PackedRows(self.data, keep_shards=2 * cfg.window_shards)
        self.shard_order = ShardOrder(self.rows.shard_sizes(), cfg.seed, cfg.window_shards)
        self.teachers = load_teachers(cfg, self.data, self.student_tok, self.device)
        for source in self.teachers.sources:
            if source.cache is not None:
                source.cache.keep_shards = 2 * cfg.window_shards
        self.global_batch, self.accum = cfg.batch_layout(self.layout.dp)
        self.rollouts = self._rollouts()
        self._student()
        self.state_bytes: dict[str, int] | None = None
        self.best: dict | None = None
        self.start = self._resume()
        self.done = self.start
        self.order = self._data_order()
        self.eval_sequences = self.eval_targets = None
        self.last_heldout: tuple[int, float | None] = (-1, None)
        if cfg.eval_data is not None:
            if self.layout.model_parallel > 1:
                raise ConfigError(
                    f"eval_data is set with parallel {self.layout.to_json()}: held-out "
                    f"evaluation needs whole logits (cp and tp 1); evaluate final/ with "
                    f"crosskd evaluate, or drop eval_data."
                )
            heldout = load_prepared(cfg.eval_data, fingerprints=fingerprints)
            self.eval_sequences = prepared_sequences(heldout, "student")
            self.eval_targets = prepared_targets(heldout, "student", self.student_tok)
        self.log = JsonlLog(f"{cfg.output}/metrics-rank{self.rank}.jsonl")
        names = term_names(cfg.loss, len(self.teachers.sources))
        self.exporter = MetricsExporter(
            self.rank, names, planned_steps=cfg.steps, count_totals=self.rank == 0
        )
        self.exporter.start(self.start)
        if cfg.metrics_port is not None:
            port = self._together("serve its metrics", self._serve_metrics)
            log.info("rank %d serves /metrics on port %d", self.rank, port)

    def _rollouts(self) -> Rollouts | None:
        """The on-policy rows of this rank (``on_policy``; None when off)."""
        cfg = self.config.on_policy
        if cfg is None:
            return None
        return Rollouts(
            cfg,
            rollout_preparation(self.data, self.student_tok),
            rows=rollout_rows(cfg.fraction, self.global_batch // self.layout.dp),
            micro_batch_rows=self.config.micro_batch_rows,
            dp_rank=self.mesh.dp_rank,
            dp=self.layout.dp,
        )

    def _serve_metrics(self) -> int:
        cfg = self.config
        port = cfg.metrics_port + self.local_rank if cfg.metrics_port else 0
        if port > 65535:
            raise ConfigError(
                f"metrics_port {cfg.metrics_port} + LOCAL_RANK {self.local_rank} "
                f"is past 65535; choose a lower metrics_port."
            )
        try:
            return self.exporter.serve(port, host=cfg.metrics_host)
        except OSError as exc:
            raise ConfigError(
                f"metrics_host {cfg.metrics_host!r} / port {port}: cannot serve /metrics "
                f"({exc}); choose a free metrics_port (0: any) or another metrics_host."
            ) from exc

    def _distributed(self) -> None:
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device(
            f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu"
        )
        self.cpu_threads = usable_threads()  # the denominator of a CPU step's cpu_share
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            dist.init_process_group(
                "nccl" if self.device.type == "cuda" else "gloo",
                timeout=timedelta(seconds=self.config.collective_timeout_s),
            )
        self.rank, self.world = (
            (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        )
        self.mesh = self._together(
            "build the parallel layout",
            lambda: build_parallel_mesh(self.config.parallel, self.device),
        )
        self.layout = self.mesh.layout

    def _student(self) -> None:
        # lazy: transformers costs ~1 s over torch; every pipeline step imports crosskd.steps, which
        # imports this module (crosskd.steps.config imports crosskd.train), and only a step that
        # trains needs it
        from transformers import AutoModelForCausalLM

        cfg = self.config
        torch.manual_seed(cfg.seed)
        if cfg.student == INIT:
            self.model = new_llama(
                self.student_tok,
                cfg.student_shape,
                cfg.seed,
                attn_implementation=cfg.attn_implementation,
            )
        else:
            folder = model_folder(cfg.student, role="student")
            extra = (
                {"attn_implementation": cfg.attn_implementation}
                if (cfg.attn_implementation)
                else {}
            )
            self.model = AutoModelForCausalLM.from_pretrained(
                str(folder),
                dtype=torch.float32,
                use_safetensors=True,
                local_files_only=True,
                **extra,
            )
        trained = freeze_except(self.model, cfg.trainable)
        if cfg.trainable:
            log.info(
                "training %.1fM of the student's %.1fM parameters (trainable: %s)",
                trained / 1e6,
                sum(p.numel() for p in self.model.parameters()) / 1e6,
                ", ".join(cfg.trainable),
            )
        if self.layout.dp_shard == 1:  # FSDP2 moves its shards to the device a layer at a time
            self.model.to(self.device)
        fused = self._fused_head()
        self.model.train()
        self.attention = self.model.config._attn_implementation
        # Rows of one sample get the model's own masks; packed rows and cp windows get ours.
        self.packed = bool(self.data.manifest["packing"]["packed"])
        self.windows = None
        if self.packed or self.layout.cp > 1:
            self.windows = layer_windows(self.model.config)
        if self.packed:
            refuse_state_mixers(
                self.model,
                f"the samples of the packed rows of {cfg.data}",
                "prepare the data with pack=false (one sample per row)",
            )
        self.compute_dtype = torch.bfloat16 if self.device.type == "cuda" else None
        self.student = self._together(
            "spread the student over the ranks",
            lambda: parallelize(
                self.model,
                self.mesh,
                activation_checkpointing=cfg.activation_checkpointing,
                compute_dtype=self.compute_dtype,
            ),
        )
        self.wrapped = self.student.wrapped
        self.vocab = self.student.vocab
        # under tp the head is now its vocabulary slice (an OutputHead too)
        self.head: OutputHead | None = self.model.get_output_embeddings() if fused else None
        groups = first_groups(self.model, cfg.first_trainable)
        self.optimizer = torch.optim.AdamW(
            [{"params": group} for group in groups], lr=cfg.lr, weight_decay=cfg.weight_decay
        )

    def _fused_head(self) -> bool:
        """Whether the loss is fused with the student's output head (``fused_head``, where that
        is exact); if so, the head is now an :class:`~crosskd.output_layer.OutputHead`. Logs
        why not otherwise."""
        if not self.config.fused_head:
            return False
        whole = self.config.loss.whole_rows()
        why = f"loss {whole} needs whole logits" if whole else head_output_unchanged(self.model)
        if why is not None:
            log.info("the loss takes the student's logits, not its fused output head: %s", why)
            return False
        use_output_head(self.model)
        return True

    def _resume(self) -> int:
        """Rank 0 decides the step to resume from (its latest complete checkpoint) and
        broadcasts it; every rank loads it and checks the data order. Returns the step."""
        cfg = self.config
        uri = f"{cfg.output}/checkpoints"
        step = self._on_rank0(f"read {uri}/latest.json", lambda: latest_step(uri))
        code = self._broadcast(-1 if step is None else step)
        if code == -1:
            return 0
        state = self._together(
            f"load checkpoint step {code} of {uri}",
            lambda: load_checkpoint(uri, code, self.student, self.optimizer),
        )
        for group in self.optimizer.param_groups:  # moments from the checkpoint, settings not
            group["weight_decay"] = cfg.weight_decay
        recorded = state.get("data_order") or {}
        if cfg.global_batch_rows is None and cfg.grad_accum is None and recorded:
            # A restart without an explicit batch keeps the one the run was started with.
            cfg.global_batch_rows = recorded.get("global_batch_rows")
            self.global_batch, self.accum = cfg.batch_layout(self.layout.dp)
        self._data_order().require(recorded, cfg.output)
        self.best = state.get("best")
        log.info("resumed from step %d", code)
        return code

    def _data_order(self) -> DataOrder:
        cfg = self.config
        return DataOrder(
            self.global_batch,
            self.data.manifest["data_fingerprint"],
            self.shard_order.rows,
            cfg.seed,
            cfg.window_shards,
        )

    def _on_rank0(self, what: str, work):
        """``work()`` on rank 0 only (its result there, None elsewhere); if it raises, every
        rank raises (rank 0 its error, the others one that points at it), none waits."""
        return self._together(what, work if self.rank == 0 else lambda: None)

    def _together(self, what: str, work):
        """``work()`` on every rank, then agree: if it raised on any rank, every rank raises
        (so no rank is left waiting in a collective); returns its result."""
        failure = None
        try:
            result = work()
        except Exception as exc:  # re-raised below, after the others know
            failure, result = exc, None
        if not self._all_ok(failure is None):
            if failure is not None:
                raise failure
            raise PeerFailed(f"another rank failed to {what}; see its error.")
        return result

    def _broadcast(self, value: int) -> int:
        """Rank 0's ``value`` on every rank."""
        if self.world == 1:
            return value
        out = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.broadcast(out, src=0)
        return int(out.item())

    def _all_ok(self, ok: bool) -> bool:
        """Whether every rank's ``ok`` is true."""
        if self.world == 1:
            return ok
        flag = torch.tensor([int(ok)], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def read_rows(self, rows: list[int]) -> tuple[list[list[dict]], list[tuple[int, int]]]:
        """The packed rows ``rows`` (global numbers): each one's samples, and where it is (its
        shard and the row of its first sample there, how a teacher cache finds its signal)."""
        packed, where = [], []
        for row in rows:
            shard, index = self.shard_order.locate(row)
            samples, first = self.rows.row(shard, index)
            packed.append(samples)
            where.append((shard, first))
        return packed, where

    def _plan(self, rows: list[int]) -> tuple[Batch, LossPlan]:
        """Read, collate and plan one micro-batch of packed rows (global numbers)."""
        return self.plan_rows(*self.read_rows(rows))

    def plan_rows(
        self, packed: list[list[dict]], where: list[tuple[int, int]] | None = None
    ) -> tuple[Batch, LossPlan]:
        """Collate and plan one micro-batch of ``packed`` rows (each a list of prepared
        samples); ``where``: per row its shard and first sample there (for a cache; None for
        rows that are not in the prepared data, which online teachers score)."""
        sources = self.teachers.sources
        batch = collate(packed, n_teachers=len(sources), student_multiple=self.layout.cp)
        teachers = [
            TeacherBatch(
                batch.models[f"teacher{i}"].input_ids,
                batch.chunks[i],
                source.signal(batch, i, where),
            )
            for i, source in enumerate(sources)
        ]
        plan = plan_loss(
            self.config.loss,
            batch.models["student"].input_ids,
            batch.loss_mask,
            teachers,
            self.teachers.pairs,
            student_vocab=self.vocab,
            teacher_bytes=self.teachers.token_bytes,
            projections=self.teachers.projections,
        )
        return batch, plan

    def _reduce(self, values: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Sum over the ranks of ``group`` (all of them by default; on the training device:
        NCCL reduces CUDA tensors only)."""
        if self.world == 1:
            return values
        out = values.detach().to(self.device, copy=True)
        dist.all_reduce(out, group=group)
        return out.to(values.device)

    def _counts(
        self, step: int, plans: list[LossPlan], failure: Exception | None = None
    ) -> StepCounts:
        """The step's counts (this data-parallel shard's micro-batches, summed over the shards;
        the ``cp x tp`` ranks of a shard planned the same rows), agreed with the ranks' inputs
        being there: one all-reduce over every rank of ``[ranks without inputs, tokens, chunks
        per KD term]``. When a rank has no inputs (``failure``: a damaged shard, a cache that
        does not match, object storage that failed), every rank raises the same one-line error
        naming the ranks and their reasons (:func:`input_failure`) instead of waiting for them
        in the next collective."""
        n_terms = len(term_names(self.config.loss, len(self.teachers.sources)))
        counts = StepCounts(0, (0,) * n_terms)
        for plan in plans:
            counts = counts + plan.counts
        vector = torch.tensor(
            [int(failure is not None), counts.tokens, *counts.chunks], dtype=torch.int64
        )
        failed, tokens, *chunks = (
            self._reduce(vector) // torch.tensor([1] + [self.layout.model_parallel] * (1 + n_terms))
        ).tolist()
        if failed:
            raise input_failure(step, self._reasons(failure))
        return StepCounts(tokens, tuple(chunks))

    def _reasons(self, failure: Exception | None) -> list[tuple[int, str, bool]]:
        """Every rank's ``(rank, reason, bad input)`` of not having its inputs (gathered only
        when one has not)."""
        mine = (
            None
            if failure is None
            else (
                self.rank,
                " ".join(str(failure).split()) or type(failure).__name__,
                isinstance(failure, CrosskdError),
            )
        )
        if self.world == 1:
            return [mine]
        everyone = [None] * self.world
        dist.all_gather_object(everyone, mine)
        return [reason for reason in everyone if reason is not None]

    def step_micro_batches(self, step: int) -> list[list[int]]:
        """This rank's micro-batches (packed-row indices) of optimizer step ``step``."""
        rows = self.shard_order.step_rows(step, self.global_batch)
        return rank_micro_batches(
            rows, self.mesh.dp_rank, self.layout.dp, self.config.micro_batch_rows
        )

    def step_inputs(self, step: int) -> list[tuple[Batch, LossPlan]]:
        """This rank's micro-batches of step ``step``, read, collated and planned (what the
        input thread produces ahead of the step)."""
        return [self._plan(micro) for micro in self.step_micro_batches(step)]

    def train_step(
        self,
        step: int,
        inputs: list[tuple[Batch, LossPlan]] | None = None,
        failure: Exception | None = None,
    ) -> dict[str, float]:
        """One optimizer step (on ``inputs`` from :meth:`step_inputs`, read here when None);
        returns its metrics. ``failure``: why this rank has no inputs for the step; every rank
        then raises the same error (:meth:`_counts`)."""
        cfg = self.config
        planned = [] if failure else self.step_inputs(step) if inputs is None else inputs
        rollouts: dict[str, float] = {}
        if self.rollouts is not None and failure is None:
            try:
                extra, rollouts = self.rollouts.step(step, self._sampler(), self.plan_rows)
                planned = [*planned, *extra]
            except Exception as exc:  # every rank raises it after the step's all-reduce
                planned, failure = [], exc
        counts = self._counts(step, [plan for _, plan in planned], failure)
        groups = self.optimizer.param_groups
        lrs = group_lrs(step, cfg, len(groups))
        for group, lr in zip(groups, lrs, strict=True):
            group["lr"] = lr
        reported = []
        loss = step_loss(step, cfg)
        for m, (batch, plan) in enumerate(planned):
            with self.student.gradient_sync(m == len(planned) - 1):
                logits = self._forward(batch.models["student"])
                out = self._loss(logits, plan, counts, loss)
                # DDP and FSDP average gradients over the data-parallel ranks; each rank's
                # loss is its share of a sum.
                (out.loss * self.layout.dp).backward()
            reported.append((out.reported, out.layout))
        totals, scale, sums = self._read_reported(step, reported)
        self.student.sync_copies()
        if step < cfg.first_steps:  # the others wait: no update, and no part in the clipping
            for param in groups[1]["params"]:
                param.grad = None
        # The norm before clipping (an infinite max_norm measures without clipping).
        grad_norm = self.student.clip_gradients(cfg.clip_norm if cfg.clip_norm > 0 else math.inf)
        if not math.isfinite(grad_norm):  # a finite loss can still overflow a gradient
            self.exporter.stopped_by("grad_norm", grad_norm)
            raise NonFiniteLoss(
                f"step {step + 1}: the gradient norm is {grad_norm} (the loss {totals['loss']}); "
                f"stopping before the optimizer step. The last good checkpoint is kept; lower "
                f"lr or check the data."
            )
        self.optimizer.step()
        if step == self.start:
            self.state_bytes = state_bytes(self.student, self.optimizer)
            log.info(
                "rank %d holds %s MiB of parameters, gradients and optimizer state",
                self.rank,
                " + ".join(f"{v / 2**20:.1f}" for v in self.state_bytes.values()),
            )
        self.optimizer.zero_grad(set_to_none=True)
        return {
            **totals,
            "kd_scale": scale,
            "lr": lrs[0],
            **({"lr_rest": lrs[1]} if len(lrs) > 1 else {}),
            "kd_weight": loss.kd_weight,
            "grad_norm": float(grad_norm),
            "tokens": float(counts.tokens),
            **rollouts,
        } | summarize(sums)

    def _sampler(self) -> Sampler:
        """How the rollouts of a step sample: the student module (never DDP's wrapper: a
        sampling pass is no training step), the step's autocast; every rank in each forward
        pass where the parameters are sharded (FSDP2)."""
        return Sampler(self.model, self.device, self.compute_dtype, self.layout.dp_shard > 1)

    def _read_reported(
        self, step: int, reported: list[tuple[torch.Tensor, ReportLayout]]
    ) -> tuple[dict[str, float], float, dict[str, float]]:
        """The step's totals (summed over its micro-batches), ``kd_scale`` (the last one's) and
        metric sums, from each micro-batch's reported vector, read to the host at once: the
        step's one read of the loss, after every backward pass and before the optimizer step.
        A non-finite ``loss``, ``ce`` or ``kd`` of any micro-batch stops the run here."""
        totals: dict[str, float] = {}
        sums: dict[str, float] = {}
        scale = 0.0
        rows = torch.stack([vector for vector, _ in reported]).tolist()
        for m, (row, (_, layout)) in enumerate(zip(rows, reported, strict=True)):
            values, scale, more = layout.read(row)
            for term in ("loss", "ce", "kd"):
                if not math.isfinite(values[term]):
                    self.exporter.stopped_by(term, values[term])
                    raise NonFiniteLoss(
                        f"step {step + 1}: the {term} term is {values[term]} (micro-batch {m}); "
                        f"stopping before the optimizer step. The last good checkpoint is "
                        f"kept; lower lr, check the data, or set kd_weight."
                    )
            for term, value in values.items():
                totals[term] = totals.get(term, 0.0) + value
            sums = add_sums(sums, more)
        return totals, scale, sums

    def _loss(
        self,
        logits: torch.Tensor | OutputLayer,
        plan: LossPlan,
        counts: StepCounts,
        loss: LossConfig,
    ):
        """This rank's share of a micro-batch's loss under the step's ``loss`` config
        (:func:`~crosskd.train.schedule.step_loss`; the sharded loss where the logits are a
        slice of the vocabulary or of the positions)."""
        if self.mesh.loss is not None:
            return sharded_loss(logits, plan, loss, counts, self.mesh.loss)
        return compute_loss(
            logits, plan, loss, counts, reduce=self._reduce if self.world > 1 else None
        )

    def _forward(self, student) -> torch.Tensor | OutputLayer:
        """Logits ``[B, L / cp, V / tp]`` of the student's side of a batch, or with the fused
        head the :class:`~crosskd.output_layer.OutputLayer` that stands for them (hidden states
        ``[B, L / cp, H]`` and the head's weight): the call every training step makes (packed
        rows, the attention inputs of the model's implementation, no cache)."""
        window = None
        if self.layout.cp > 1:  # this rank's window of positions (crosskd.parallel.context)
            width = student.input_ids.shape[1] // self.layout.cp
            window = (self.mesh.coordinate("cp") * width, (self.mesh.coordinate("cp") + 1) * width)
        inputs = packed_inputs(
            self.attention,
            student.input_ids,
            student.segment_ids,
            student.position_ids,
            next(self.model.parameters()).dtype,
            window,
            self.windows,
            self.device,
            packed=self.packed,
        )
        rows = student.input_ids.shape[0]
        with torch.autocast(
            self.device.type, dtype=self.compute_dtype, enabled=self.compute_dtype is not None
        ):
            if self.head is None:
                logits = self.wrapped(use_cache=False, **inputs).logits
                return logits.reshape(rows, -1, logits.shape[-1])
            with self.head.capture() as captured:
                self.wrapped(use_cache=False, **inputs)
        (layer,) = captured
        return replace(layer, hidden=layer.hidden.reshape(rows, -1, layer.hidden.shape[-1]))

    def heldout_bits_per_byte(self) -> float:
        """The student's bits per byte on ``eval_data`` (each rank scores every world-th
        sample; the sums are reduced), under the training steps' autocast (``compute_dtype``:
        bfloat16 on GPU, where DDP keeps float32 weights that flash attention refuses)."""
        shares = self.eval_sequences[self.rank :: self.world]
        targets = self.eval_targets[self.rank :: self.world]
        budget = self.config.micro_batch_rows * int(self.data.manifest["models"][0]["capacity"])
        # Under FSDP2 every forward pass is a collective: the ranks run theirs in lockstep.
        lockstep = Lockstep(self.model, self.device) if self.layout.dp_shard > 1 else None
        bits, n_bytes = nll_bits_and_bytes(
            self.model,
            shares,
            self.student_tok.bytes.lengths,
            device=self.device,
            token_budget=budget,
            targets=targets,
            lockstep=lockstep,
            compute_dtype=self.compute_dtype,
        )
        total = self._reduce(torch.tensor([bits, float(n_bytes)], dtype=torch.float64))
        return float(total[0] / total[1]) if total[1] > 0 else float("nan")

    def train(self, *, stop_after: int | None = None) -> list[dict[str, float]]:
        """Run the steps from where this trainer is (its resume point, or where a call with
        ``stop_after`` stopped) to ``config.steps`` (or stop after ``stop_after`` steps of this
        call, for tests of resuming); returns their metrics.

        Raises:
            Stopped: SIGTERM arrived (on any rank: the decision is all-reduced after every
                step); every rank finished its step and the step was checkpointed.
        """
        cfg = self.config
        history = []
        first = self.done
        last = cfg.steps if stop_after is None else min(cfg.steps, first + stop_after)
        eval_every = cfg.checkpoint_every if cfg.eval_every is None else cfg.eval_every
        bar = tqdm(
            total=cfg.steps,
            initial=first,
            desc="train",
            unit="step",
            disable=not self.progress or self.rank != 0,
        )
        inputs = Prefetcher(self.step_inputs, range(first, last), cfg.prefetch_steps)
        with _sigterm_flag() as stop, contextlib.closing(inputs):
            for step in range(first, last):
                started, cpu_started = time.perf_counter(), time.process_time()
                try:
                    (planned, waited), failure = inputs.get(step), None
                except Exception as exc:  # every rank raises it after the step's all-reduce
                    (planned, waited), failure = (None, 0.0), exc
                metrics = self.train_step(step, planned, failure)
                metrics["input_wait_s"] = waited
                seconds = time.perf_counter() - started
                if self.device.type == "cpu":  # on a GPU the process waits on the device
                    used = time.process_time() - cpu_started
                    metrics["cpu_share"] = cpu_share(used, seconds, self.cpu_threads)
                done = self.done = step + 1
                if self.eval_sequences is not None and (
                    done == cfg.steps or (eval_every and done % eval_every == 0)
                ):
                    metrics["heldout_bits_per_byte"] = self.heldout_bits_per_byte()
                self.exporter.record(done, metrics, seconds)
                if self.rank == 0:
                    self.log.write({"step": done, "seconds": seconds, **metrics})
                history.append(metrics)
                if "heldout_bits_per_byte" in metrics:
                    self.last_heldout = (done, metrics["heldout_bits_per_byte"])
                    self._keep_best(*self.last_heldout)
                saved = done == cfg.steps or (
                    cfg.checkpoint_every and done % cfg.checkpoint_every == 0
                )
                if saved:
                    self._checkpoint(done)
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['loss']:.4f}")
                log.info(
                    "step %d/%d loss %.4f ce %.4f kd %.4f",
                    done,
                    cfg.steps,
                    metrics["loss"],
                    metrics["ce"],
                    metrics["kd"],
                )
                if not self._all_ok(not stop.is_set()):
                    if not saved:
                        self._checkpoint(done)
                    bar.close()
                    raise Stopped(
                        f"stopped by SIGTERM after step {done} (checkpointed); run again to resume."
                    )
        bar.close()
        return history

    def _keep_best(self, step: int, bpb: float) -> None:
        if math.isfinite(bpb) and (self.best is None or bpb < self.best["bits_per_byte"]):
            self.best = {"step": step, "bits_per_byte": bpb}
            self._publish(f"{self.config.output}/best", step, bpb)

    def _checkpoint(self, step: int) -> None:
        uri = f"{self.config.output}/checkpoints"
        started = time.perf_counter()
        what = f"write checkpoint step {step} to {uri}"
        self._on_rank0(what, lambda: begin_checkpoint(uri, step))
        self._together(what, lambda: write_parts(uri, step, self.student, self.optimizer))
        self._on_rank0(
            what,
            lambda: publish_checkpoint(
                uri,
                step,
                self.student,
                self.optimizer,
                {"seed": self.config.seed, "data_order": self.order.to_json(), "best": self.best},
                keep=self.config.keep_checkpoints,
            ),
        )
        self.exporter.checkpoint_seconds.observe(time.perf_counter() - started)
        self.exporter.checkpoint.set(step)
        if self.rank == 0:
            self.log.flush()

    def save(self) -> str:
        """The student as a Hugging Face folder (model, tokenizer, ``crosskd-model.json`` with
        the last step done: ``config.steps`` once the run is complete) under ``output/final``
        (any fsspec URI); returns its path."""
        path = f"{self.config.output}/final"
        heldout = None
        if self.eval_sequences is not None:
            step, heldout = self.last_heldout
            if step != self.done:
                heldout = self.heldout_bits_per_byte()
        self._publish(path, self.done, heldout)
        return path

    def _publish(self, path: str, step: int, heldout: float | None) -> None:
        """Write the student to ``path`` as a model folder: gathered by every rank into a local
        folder of rank 0, every file copied into ``path.tmp``, then renamed,
        ``crosskd-model.json`` last (rank 0; the others wait)."""
        info = {
            "step": step,
            "heldout_bits_per_byte": heldout,
            "best": self.best,
            "data_order": self.order.to_json(),
        }
        with tempfile.TemporaryDirectory() as local:
            self._together(
                f"gather the model for {path}",
                lambda: save_gathered(self.student, Path(local) if self.rank == 0 else None),
            )
            self._on_rank0(
                f"write the model folder {path}", lambda: self._write_model(path, Path(local), info)
            )

    def _write_model(self, path: str, local: Path, info: dict) -> None:
        fs, root = fsspec.core.url_to_fs(path)
        staging = f"{root}.tmp"
        if fs.exists(staging):
            fs.rm(staging, recursive=True)
        fs.makedirs(staging, exist_ok=True)
        self.student_tok.hf.save_pretrained(str(local))
        for file in sorted(local.iterdir()):
            fs.put_file(str(file), f"{staging}/{file.name}")
        if fs.exists(root):
            fs.rm(root, recursive=True)
        move_folder(fs, staging, root)
        fs.pipe_file(f"{root}/{MODEL_INFO}", json.dumps(info, indent=1).encode())

    def close(self) -> None:
        """Close the teacher servers' connections, write the rest of the step log and stop the
        metrics endpoint (if setup got that far), after one more scrape where Prometheus has
        been scraping it (``metrics_final_scrape_s``)."""
        if self.teachers is not None:
            self.teachers.close()
        if self.log is not None:
            self.log.close()
        if self.exporter is not None:
            self.exporter.close(self.config.metrics_final_scrape_s)
