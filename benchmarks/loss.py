"""Benchmark: forward + backward time and peak memory of the CSD loss against the student's CE
alone and a dense same-vocabulary KD, at the same shape, in one run.

A real batch: :func:`crosskd.alignment.corpus.benchmark_corpus` text prepared by
:func:`crosskd.data.prepare.prepare` (packed rows of ``--length`` student tokens) and collated by
:func:`crosskd.data.collate.collate`, ``--rows`` rows; students SmolLM2 (V = 49,152) and
Llama-3 (V = 128,256) against a Qwen3 teacher, real tables. Logits are random float32 (the
teacher's biased towards the realized tokens, so the top K holds realized tokens and other
candidates as a trained teacher's would); the student logits are a leaf that needs a gradient.

Timed, each forward + backward from the student logits to their gradient:

* ``ce``: ``torch.nn.functional.cross_entropy`` over the loss-masked targets (the baseline);
* ``ce (ours)``: the same CE through :class:`crosskd.loss.LocalLogProbs` (the path the loss
  takes: log-normaliser in row blocks plus a gather), to show what the KD part adds;
* ``ce+csd K``: :func:`crosskd.loss.compute_loss`, CE plus the CSD term, with top-K signals of
  K = 32 and 128;
* ``ce+xtoken K``, ``ce+gold K``, ``ce+hkl K``: CE plus X-Token's projected KL
  (:mod:`crosskd.loss.xtoken`), gold loss and H-KL (:mod:`crosskd.loss.gold`), the projection
  built from the same tables, at K = 32: every loss-masked row's whole softmax times the
  columns of ``W`` the batch names, or each chunk's whole mean log-softmax;
* ``ce+uld K``: CE plus ULD's sorted L1 (:mod:`crosskd.loss.uld`) at K = 32: each paired row's
  whole softmax and its top K + 1;
* ``ce+dense kl``: CE plus a full-vocabulary KL(T || S) against a teacher on the student's own
  vocabulary (what same-tokenizer KD with a dense teacher costs).

The data side (:func:`crosskd.loss.plan_loss`: events from chunks, tables and signal, run in the
collator before the forward pass) is timed separately. Seconds are the median of ``--repeat``
runs. Peak memory is the rise of the process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` before each run) above its resident set before the run, i.e. on top of
the logits and the inputs; CPU float32. Goal: ``ce+csd`` at most 1.5x the time and 1.3x the peak
memory of ``ce``.

    python benchmarks/loss.py [--repeat 3] [--rows 4] [--length 512]

``--fused``: the loss fused with the output layer against the same loss on the head's logits.
The student's head is a random ``[V, H]`` weight at the hidden size of a real model of that
vocabulary (SmolLM2-135M: V = 49,152, H = 576; Llama-3.2-1B: 128,256, 2,048; Qwen2.5-0.5B:
151,936, 896; the last against a Llama-3 teacher); hidden states ``[B, L, H]`` are the leaf.
Timed, each forward + backward to the gradients of the hidden states and the weight:

* ``linear+ce``: ``F.linear`` then ``F.cross_entropy`` (the baseline: torch's CE on the full
  logits);
* ``linear+csd``: ``F.linear`` then :func:`crosskd.loss.compute_loss` (CE + CSD at K = 32, the
  unfused path);
* ``fused csd``: :func:`crosskd.loss.compute_loss` on a :class:`crosskd.output_layer.OutputLayer`
  (the logits never exist), at tau 1 and (``tau=2``) at tau 2 (CE at 1 and KD at 2 in the
  same pass over the head).

Each CSD row runs with each of ``--kernels`` (``loss.kernels``: ``eager``, ``compiled`` by
``torch.compile``; default both), the compiling done in the untimed warm-up call.

Peak memory is measured as above: on top of the inputs, so it includes the weight's gradient
(``V x H`` floats, printed as ``dW MB``) in every row. Goals: ``fused csd`` peak memory at most
0.2x and time at most 1.2x ``linear+ce``.

    python benchmarks/loss.py --fused [--repeat 3] [--rows 4] [--length 512] [--device cuda]
        [--bf16] [--kernels eager compiled] [--students smollm2 ...]
        [--dtypes bf16 fp32] [--shapes 2x8192 4x512] [--steps unfused fused tau2]
        [--fp32-steps fused]

``--dtypes`` and ``--shapes`` run every combination in this one process (each student's tables
built once, its batch, head and plans once per shape, torch.compile's caches shared; the random
teacher signals drawn on ``--device``); ``--steps`` picks the CSD rows (``--fp32-steps`` in
float32). A compiled row that fails is reported and the compiled kernels skipped from there.

With ``--device cuda`` the hidden states and the weight live on the GPU (float32), times are
synchronised and peak memory is the CUDA allocator's peak above what was allocated before the
step (:func:`inputs.measure` on ``cuda``). ``--bf16``: every step under bfloat16 autocast, as the
trainer runs the head (the baseline's logits bfloat16; the fused layer's products in
bfloat16, as the trainer captures them).

Zoo tokenizers are built into ``$CROSSKD_CACHE_DIR`` (default ``~/.cache/crosskd``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import tempfile
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
from inputs import (
    csd_plan,
    measure,
    real_batch,
    sample_signal,
    teacher_logits,
    zoo_pair,
)

from crosskd.data.collate import Batch
from crosskd.loss import (
    LocalLogProbs,
    LossConfig,
    LossPlan,
    compute_loss,
)
from crosskd.loss.config import PROJECTED
from crosskd.loss.uld import UldTerm
from crosskd.output_layer import OutputLayer
from crosskd.projection import build_projection
from crosskd.tables import TablePair
from crosskd.teacher import signal_from_logits
from crosskd.tokenization import LoadedTokenizer

GOAL_TIME, GOAL_MEMORY = 1.5, 1.3
STUDENTS = ("smollm2", "llama3")
TEACHER = "qwen3"
KS = (32, 128)
XTOKEN_K = 32


def _run_student(name: str, args: argparse.Namespace, work: Path) -> list[dict]:
    student, teacher, pair = zoo_pair(name, TEACHER)
    batch = real_batch(name, TEACHER, args.rows, args.length, work)
    s_ids = batch.models["student"].input_ids
    t_ids = batch.models["teacher0"].input_ids
    gen = torch.Generator().manual_seed(0)
    t_logits = teacher_logits(t_ids, teacher.vocab_size, gen)
    logits = torch.randn(*s_ids.shape, student.vocab_size, generator=gen).requires_grad_(True)
    mask = batch.loss_mask
    n_targets = int(mask.sum())
    targets = torch.where(mask[:, 1:], s_ids[:, 1:], -100)

    def ce_step() -> None:
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100
        )
        loss.backward()
        logits.grad = None

    dense_teacher = torch.log_softmax(
        torch.randn(*s_ids.shape, student.vocab_size, generator=gen), dim=-1
    )

    def dense_step() -> None:
        ce = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100
        )
        log_s = torch.log_softmax(logits[:, :-1], dim=-1)[mask[:, 1:]]
        kl = torch.nn.functional.kl_div(
            log_s, dense_teacher[:, :-1][mask[:, 1:]], log_target=True, reduction="sum"
        )
        (ce + kl / n_targets).backward()
        logits.grad = None

    rows = torch.nonzero(mask)
    flat_rows = (rows[:, 0] * s_ids.shape[1] + rows[:, 1] - 1).numpy()
    flat_ids = s_ids[mask].numpy()

    def own_ce_step() -> None:
        flat = LocalLogProbs(logits.flatten(0, 1))
        (-flat.log_prob(flat_rows, flat_ids).sum() / n_targets).backward()
        logits.grad = None

    results = []
    ce_s, ce_mem = measure(ce_step, args.repeat)
    results.append({"student": name, "loss": "ce", "seconds": ce_s, "peak": ce_mem})
    seconds, peak = measure(own_ce_step, args.repeat)
    results.append({"student": name, "loss": "ce (ours)", "seconds": seconds, "peak": peak})
    projection = build_projection(pair)
    losses = [("csd", k, None) for k in KS]
    losses += [(algorithm, XTOKEN_K, (algorithm, projection)) for algorithm in PROJECTED]
    losses += [("uld", XTOKEN_K, ("uld", None))]
    for algorithm, k, projected in losses:
        signal = signal_from_logits(t_logits, t_ids, k=k, tau=1.0)
        start = time.perf_counter()
        config, plan = csd_plan(batch, signal, pair, k, student.vocab_size, projection=projected)
        plan_s = time.perf_counter() - start

        def kd_step(plan=plan, config=config) -> None:
            compute_loss(logits, plan, config).loss.backward()
            logits.grad = None

        seconds, peak = measure(kd_step, args.repeat)
        results.append(
            {
                "student": name,
                "loss": f"ce+{algorithm} K={k}",
                "seconds": seconds,
                "peak": peak,
                "plan_seconds": plan_s,
                "chunks": plan.counts.chunks[0],
                "events": _events(plan.terms[0]),
            }
        )
    seconds, peak = measure(dense_step, args.repeat)
    results.append({"student": name, "loss": "ce+dense kl", "seconds": seconds, "peak": peak})
    shape = f"{tuple(s_ids.shape)} x V={student.vocab_size}"
    for row in results:
        row["shape"] = shape
        row["time_ratio"] = row["seconds"] / ce_s
        row["memory_ratio"] = row["peak"] / ce_mem
    return results


def _events(term: object) -> int:
    """A term's events (ULD's: the teacher probabilities its paired rows compare)."""
    if isinstance(term, UldTerm):
        return term.teacher_probs.numel()
    return len(term.events.teacher_lp)


FUSED_STUDENTS = (("smollm2", "qwen3", 576), ("llama3", "qwen3", 2048), ("qwen3", "llama3", 896))
FUSED_K = 32
GOAL_FUSED_TIME, GOAL_FUSED_MEMORY = 1.2, 0.2


FUSED_STEPS = ("unfused", "fused", "tau2")
"""The CSD rows ``--steps`` can choose: ``linear+csd``, ``fused csd`` and ``fused csd tau=2``."""


@dataclass
class FusedInputs:
    """One student's batch at one shape and everything its fused rows need but the dtype."""

    name: str
    vocab: int
    hidden: torch.Tensor  # [B, L, H] float32, on the device, a leaf that needs a gradient
    weight: torch.Tensor  # [V, H] float32, likewise
    targets: torch.Tensor  # [B, L - 1] the CE targets, -100 off the loss mask
    config: LossConfig
    plan: LossPlan
    hot: LossConfig  # tau 2
    hot_plan: LossPlan


def _fused_inputs(
    name: str,
    hidden_size: int,
    tokenizers: tuple[LoadedTokenizer, LoadedTokenizer, TablePair],
    batch: Batch,
    device: torch.device,
) -> FusedInputs:
    """The head, hidden states and CSD plans (tau 1 and 2) of student ``name`` on ``batch``
    (its :func:`inputs.zoo_pair` ``tokenizers``); the teacher signals drawn on ``device``."""
    student, teacher_tok, pair = tokenizers
    s_ids = batch.models["student"].input_ids
    gen = torch.Generator().manual_seed(0)
    drawn = torch.Generator(device=device).manual_seed(0)
    vocab = student.vocab_size
    hidden = torch.randn(*s_ids.shape, hidden_size, generator=gen).to(device).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5).to(device)
    weight.requires_grad_()
    targets = torch.where(batch.loss_mask[:, 1:], s_ids[:, 1:], -100).to(device)
    signal = sample_signal(batch, teacher_tok.vocab_size, FUSED_K, drawn)
    config, plan = csd_plan(batch, signal, pair, FUSED_K, vocab)
    hot_signal = sample_signal(batch, teacher_tok.vocab_size, FUSED_K, drawn, tau=2.0)
    hot, hot_plan = csd_plan(batch, hot_signal, pair, FUSED_K, vocab, tau=2.0)
    return FusedInputs(name, vocab, hidden, weight, targets, config, plan, hot, hot_plan)


def _run_fused(inputs: FusedInputs, bf16: bool, args: argparse.Namespace) -> list[dict]:
    """The fused rows (module docstring) of one student's ``inputs``, under bfloat16 autocast
    when ``bf16`` (else float32): ``linear+ce`` and the ``--steps`` rows (``--fp32-steps`` in
    float32) per ``--kernels``. A compiled row that fails (no compiler, Triton cannot build) is
    a row with its error, and ``compiled`` is dropped from ``args.kernels`` for the rest."""
    hidden, weight, plan, hot_plan = inputs.hidden, inputs.weight, inputs.plan, inputs.hot_plan
    device = hidden.device
    compute_dtype = torch.bfloat16 if bf16 else None

    def amp() -> contextlib.AbstractContextManager:
        if compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=compute_dtype)

    def clear() -> None:
        hidden.grad = weight.grad = None

    def ce_step() -> None:
        with amp():
            logits = torch.nn.functional.linear(hidden, weight)
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), inputs.targets.flatten(), ignore_index=-100
            )
        loss.backward()
        clear()

    def csd_step(config: LossConfig) -> None:
        with amp():
            loss = compute_loss(torch.nn.functional.linear(hidden, weight), plan, config).loss
        loss.backward()
        clear()

    def fused_step(plan: LossPlan, config: LossConfig) -> None:
        with amp():
            layer = OutputLayer(hidden, weight, None, compute_dtype)
            loss = compute_loss(layer, plan, config).loss
        loss.backward()
        clear()

    chosen = args.steps if bf16 else args.fp32_steps
    steps = [("linear+ce", "-", ce_step)]
    for kernels in args.kernels:
        config, hot = replace(inputs.config, kernels=kernels), replace(inputs.hot, kernels=kernels)
        rows = {
            "unfused": ("linear+csd", partial(csd_step, config)),
            "fused": ("fused csd", partial(fused_step, plan, config)),
            "tau2": ("fused csd tau=2", partial(fused_step, hot_plan, hot)),
        }
        steps += [(rows[s][0], kernels, rows[s][1]) for s in FUSED_STEPS if s in chosen]
    results = []
    for loss, kernels, step in steps:
        if kernels not in ("-", *args.kernels):
            continue  # compiled kernels failed in an earlier row
        row = {"student": inputs.name, "loss": loss, "kernels": kernels}
        try:
            row["seconds"], row["peak"] = measure(step, args.repeat, device.type)
        except Exception as exc:
            if kernels != "compiled":
                raise
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            print(f"compiled kernels failed ({type(exc).__name__}: {first}); skipped from here")
            args.kernels.remove("compiled")
            clear()
            continue
        results.append(row)
    shape = f"{tuple(hidden.shape[:2])} V={inputs.vocab} H={hidden.shape[-1]}"
    for row in results:
        row["shape"] = shape
        row["dtype"] = "bf16" if bf16 else "fp32"
        row["weight_grad"] = inputs.vocab * hidden.shape[-1] * 4
        row["time_ratio"] = row["seconds"] / results[0]["seconds"]
        row["memory_ratio"] = row["peak"] / results[0]["peak"]
    return results


def _shape(text: str) -> tuple[int, int]:
    """``ROWSxLENGTH`` as ``(rows, length)``."""
    rows, sep, length = text.partition("x")
    if not (sep and rows.isdigit() and length.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r} is not ROWSxLENGTH (e.g. 2x8192)")
    return int(rows), int(length)


def _fused_main(args: argparse.Namespace) -> None:
    """Every ``--shapes`` x ``--dtypes`` x student in this one process (tables built once per
    student, inputs once per student and shape, torch.compile's caches shared); each row
    printed as soon as it is measured, and each shape and dtype's goal as soon as every student
    has it (a run stopped early keeps what it printed)."""
    shapes = args.shapes or [(args.rows, args.length)]
    dtypes = args.dtypes or (["bf16"] if args.bf16 else ["fp32"])
    args.fp32_steps = args.fp32_steps or args.steps
    device = torch.device(args.device)
    students = [s for s in FUSED_STUDENTS if not args.students or s[0] in args.students]
    print(
        f"{'student':8} {'dtype':5} {'shape':34} {'loss':16} {'kernels':9} {'s':>8} {'x CE':>6} "
        f"{'peak MB':>8} {'x CE':>6} {'dW MB':>6}",
        flush=True,
    )
    tokenizers = {name: zoo_pair(name, teacher) for name, teacher, _ in students}
    with tempfile.TemporaryDirectory() as tmp:
        for rows, length in shapes:
            inputs = {}
            for name, teacher, hidden_size in students:
                work = Path(tmp) / f"{rows}x{length}"
                batch = real_batch(name, teacher, rows, length, work)
                inputs[name] = _fused_inputs(name, hidden_size, tokenizers[name], batch, device)
            for dtype in dtypes:
                met: dict[str, bool] = {}
                for name, _, _ in students:
                    for r in _run_fused(inputs[name], dtype == "bf16", args):
                        if r["loss"] == "fused csd":
                            met[r["kernels"]] = met.get(r["kernels"], True) and (
                                r["time_ratio"] <= GOAL_FUSED_TIME
                                and r["memory_ratio"] <= GOAL_FUSED_MEMORY
                            )
                        print(
                            f"{r['student']:8} {r['dtype']:5} {r['shape']:34} {r['loss']:16} "
                            f"{r['kernels']:9} {r['seconds']:8.3f} {r['time_ratio']:6.2f} "
                            f"{r['peak'] / 2**20:8.0f} {r['memory_ratio']:6.2f} "
                            f"{r['weight_grad'] / 2**20:6.0f}",
                            flush=True,
                        )
                for kernels, ok in met.items():
                    print(
                        f"goal: fused csd ({kernels}, {dtype}, {rows}x{length}) <= "
                        f"{GOAL_FUSED_TIME}x the time and <= {GOAL_FUSED_MEMORY}x the peak memory "
                        f"of linear+ce, every student: {'met' if ok else 'NOT met'}",
                        flush=True,
                    )
            del inputs
            if device.type == "cuda":  # the shape's heads and plans go back
                torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--fused", action="store_true", help="the fused output layer")
    parser.add_argument(
        "--students", nargs="*", default=None, help="--fused: only these zoo students"
    )
    parser.add_argument("--device", default="cpu", help="--fused: cpu or cuda")
    parser.add_argument("--bf16", action="store_true", help="--fused: under bfloat16 autocast")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=("bf16", "fp32"),
        default=None,
        help="--fused: each of these in turn, in this process (default: --bf16's choice)",
    )
    parser.add_argument(
        "--shapes",
        nargs="+",
        type=_shape,
        default=None,
        metavar="ROWSxLENGTH",
        help="--fused: each of these batch shapes in turn (default: --rows x --length)",
    )
    parser.add_argument(
        "--steps",
        nargs="+",
        choices=FUSED_STEPS,
        default=list(FUSED_STEPS),
        help="--fused: the CSD rows beside linear+ce: linear+csd (unfused), fused csd (fused), "
        "fused csd at tau 2 (tau2)",
    )
    parser.add_argument(
        "--fp32-steps",
        nargs="+",
        choices=FUSED_STEPS,
        default=None,
        help="--fused: the CSD rows in float32 (default: --steps)",
    )
    parser.add_argument(
        "--kernels",
        nargs="+",
        choices=("eager", "compiled"),
        default=["eager", "compiled"],
        help="--fused: the CSD rows with these loss.kernels (the compiled ones compile in the "
        "untimed warm-up call)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    if args.fused:
        _fused_main(args)
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in STUDENTS:
            results += _run_student(name, args, Path(tmp))
    print(
        f"{'student':8} {'shape':26} {'loss':14} {'s':>7} {'x CE':>6} {'peak MB':>8} "
        f"{'x CE':>6} {'plan s':>7} {'chunks':>6} {'events':>7}"
    )
    met = True
    for r in results:
        extra = ""
        if "plan_seconds" in r:
            extra = f" {r['plan_seconds']:7.3f} {r['chunks']:6d} {r['events']:7d}"
            if r["loss"].startswith("ce+csd"):
                met &= r["time_ratio"] <= GOAL_TIME and r["memory_ratio"] <= GOAL_MEMORY
        print(
            f"{r['student']:8} {r['shape']:26} {r['loss']:14} {r['seconds']:7.3f} "
            f"{r['time_ratio']:6.2f} {r['peak'] / 2**20:8.0f} {r['memory_ratio']:6.2f}{extra}"
        )
    print(
        f"goal: ce+csd <= {GOAL_TIME}x the time and <= {GOAL_MEMORY}x the peak memory of ce: "
        f"{'met' if met else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
