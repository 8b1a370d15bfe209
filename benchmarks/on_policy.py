"""On-policy against off-policy CSD, measured on held-out assistant turns of the chat demo's data.

The conversations are SmolLM2-135M-Instruct's answers to prompts made from this machine's
standard-library docstrings (``crosskd generate``, as ``make chat-demo`` makes them: 240
conversations, batches of 16), or ``--conversations FILE``. Each arm is a ``crosskd distill``
run of the ``on-policy-demo`` preset (the instruct model teaching a random-init
Llama-3-tokenizer student online, in the training process; the same student shape, data split,
steps, learning rate and seed in every arm):

* ``ce``: CE only, on the conversations;
* ``off-policy``: CSD on the conversations only (``train.on_policy: null``);
* ``on-policy``: CSD on the conversations plus, each step, rollout rows: the student's own
  answers to training prompts, sampled with its current weights and scored by the teacher
  (``--fraction`` of the step's rows; the prepared rows stay as they are, so the on-policy arm
  sees ``fraction / (1 - fraction)`` more rows per step).

The figure is the held-out bits per byte of the answers of the held-out conversations (10 %,
by id); the teacher and the untrained student are printed for reference, with each run's
seconds and, from the on-policy run's step log, where its step time goes (mean seconds per
step: the whole step, sampling the answers, preparing and scoring them). Everything is written
under ``--out``.

    python benchmarks/on_policy.py [--conversations FILE] [--seeds 1] [--steps 50]
        [--fraction 0.25] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

from crosskd.distill import distill
from crosskd.generate import GenerateConfig, generate
from crosskd.steps.config import load_run_config

ARMS = ("ce", "off-policy", "on-policy")


def _conversations(args: argparse.Namespace, out: Path) -> str:
    """The conversations file: ``--conversations``, else 240 generated into ``out``."""
    if args.conversations:
        return str(Path(args.conversations).resolve())
    path = out / "conversations.jsonl"
    generate(GenerateConfig(output=str(path), conversations=240, batch_size=16), progress=True)
    return str(path)


def _run(
    data: str, out: Path, seed: int, args: argparse.Namespace, on_policy: bool
) -> tuple[dict, float]:
    """One distill run of the preset; the held-out bits per byte and its seconds."""
    overrides = [
        f"output={out}",
        f"train_data={data}",
        f"seed={seed}",
        f"train.steps={args.steps}",
        f"train.on_policy.fraction={args.fraction}",
        f"train.on_policy.seed={seed}",
        f"compare_ce_only={str(on_policy).lower()}",
    ]
    if not on_policy:
        overrides.append("train.on_policy=null")
    config = load_run_config(None, "on-policy-demo", overrides)
    started = time.perf_counter()
    result = distill(config, progress=False)
    return result["bits_per_byte"], time.perf_counter() - started


def step_times(run: Path) -> dict[str, float]:
    """Mean seconds per step of the training run in ``run`` (its ``metrics-rank0.jsonl``): the
    whole step and, where it has rollouts, ``rollout_sample_s`` and ``rollout_score_s``; and
    the mean rollout rows and sampled tokens per step."""
    lines = (run / "metrics-rank0.jsonl").read_text().splitlines()
    history = [h for h in map(json.loads, lines) if "seconds" in h]
    keys = ("seconds", "rollout_sample_s", "rollout_score_s", "rollout_rows")
    keys += ("rollout_generated_tokens",)
    return {key: statistics.mean(h[key] for h in history) for key in keys if key in history[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", help="chat data (default: generate 240)")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--out", default="/tmp/crosskd-on-policy")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = _conversations(args, out)
    figures: dict[str, list[float]] = {arm: [] for arm in ("teacher", "student_init", *ARMS)}
    seconds: dict[str, list[float]] = {"on-policy + ce": [], "off-policy": []}
    for seed in range(args.seeds):
        on, on_s = _run(data, out / f"on-{seed}", seed, args, on_policy=True)
        off, off_s = _run(data, out / f"off-{seed}", seed, args, on_policy=False)
        figures["teacher"].append(on["teacher"])
        figures["student_init"].append(on["student_init"])
        figures["ce"].append(on["student_ce"])
        figures["on-policy"].append(on["student_kd"])
        figures["off-policy"].append(off["student_kd"])
        seconds["on-policy + ce"].append(on_s)
        seconds["off-policy"].append(off_s)
    (out / "results.json").write_text(json.dumps({"bits_per_byte": figures, "s": seconds}))
    print(f"held-out answers, bits per byte ({args.seeds} seed(s), {args.steps} steps)")
    print(f"{'model':14} {'mean':>8} {'sd':>8} {'x off':>7}")
    off_mean = statistics.mean(figures["off-policy"])
    for name, values in figures.items():
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        mean = statistics.mean(values)
        print(f"{name:14} {mean:8.4f} {sd:8.4f} {mean / off_mean:7.3f}")
    for name, values in seconds.items():
        print(f"seconds, {name}: {statistics.mean(values):.0f}")
    for name, run in (("on-policy", out / "on-0" / "kd"), ("off-policy", out / "off-0" / "kd")):
        means = ", ".join(f"{k} {v:.3f}" for k, v in step_times(run).items())
        print(f"per step, {name} (seed 0): {means}")


if __name__ == "__main__":
    main()
