"""What serving and scraping the training metrics costs: the same training run (the ``tiny``
preset's KD run, in this process) without ``metrics_port`` and with it while a scraper reads
``/metrics`` every ``--scrape`` seconds (far more often than a PodMonitor's 15 s). Prints each
run's mean seconds per optimizer step (from the run's own step times) and their ratio, and the
cost of one ``MetricsExporter.record`` call.

    python benchmarks/metrics.py [--steps 60] [--repeats 3] [--scrape 0.05]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

from crosskd import steps
from crosskd.config import load_config
from crosskd.distill import checked_tables, teacher_caches
from crosskd.metrics import MetricsExporter
from crosskd.steps.config import load_run_config
from crosskd.train import TrainConfig, Trainer


def kd_train_config(root: Path) -> Path:
    """The tiny preset's steps up to the KD run's train config (written under ``root``)."""
    config = load_run_config(None, "tiny", [f"output={root}", "device=cpu"])
    plan = steps.validate_inputs(config)
    tables = checked_tables(plan, progress=False)
    prepared = steps.prepare_data(plan, max_length=config.max_length, progress=False)
    caches = teacher_caches(plan, prepared, config.scoring(), 1, progress=False)
    item = next(
        i
        for i in steps.plan_training(config, plan, prepared, tables, caches, str(root))
        if i["variant"] == "kd"
    )
    path = root / "kd-train.yaml"
    path.write_text(yaml.safe_dump(item["train"]))
    return path


def seconds_per_step(config_path: Path, output: Path, n_steps: int, scrape: float | None) -> float:
    """Mean step seconds of one run; ``scrape``: serve metrics and read them that often."""
    overrides = [f"output={output}", f"steps={n_steps}", "checkpoint_every=0"]
    if scrape is not None:
        overrides += ["metrics_port=0", "metrics_host=127.0.0.1", "metrics_final_scrape_s=0"]
    trainer = Trainer(load_config(TrainConfig, str(config_path), overrides), progress=False)
    trainer.setup()
    stop = threading.Event()
    reads = []

    def scraper() -> None:
        url = f"http://127.0.0.1:{trainer.exporter.port}/metrics"
        while not stop.is_set():
            reads.append(len(urllib.request.urlopen(url, timeout=10).read()))
            stop.wait(scrape)

    thread = threading.Thread(target=scraper) if scrape is not None else None
    if thread is not None:
        thread.start()
    try:
        trainer.train()
    finally:
        stop.set()
        if thread is not None:
            thread.join()
        trainer.close()
    if scrape is not None and not reads:
        raise SystemExit("the scraper never read /metrics")
    log = [json.loads(line) for line in (output / "metrics-rank0.jsonl").read_text().splitlines()]
    return statistics.fmean(r["seconds"] for r in log[1:])  # the first step warms up


def record_microseconds(calls: int = 20000) -> float:
    """Microseconds per ``MetricsExporter.record`` of a one-teacher step's metrics."""
    exporter = MetricsExporter(0, ["teacher0"], planned_steps=calls)
    metrics = {
        "loss": 2.0,
        "ce": 1.5,
        "kd": 0.5,
        "kd/teacher0": 0.5,
        "kd_scale": 1.0,
        "lr": 3e-4,
        "grad_norm": 1.0,
        "tokens": 4096.0,
    } | {
        f"teacher0/{shape}/valid": 10.0
        for shape in ("token", "one_one", "one_many", "many_one", "many_many")
    }
    start = time.perf_counter()
    for step in range(calls):
        exporter.record(step + 1, metrics, 0.1)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scrape", type=float, default=0.05, help="seconds between reads")
    args = parser.parse_args()
    logging.disable(logging.INFO)
    with tempfile.TemporaryDirectory(prefix="crosskd-bench-") as tmp:
        config = kd_train_config(Path(tmp) / "inputs")
        plain, served = [], []
        for repeat in range(args.repeats):  # interleaved, so drift hits both alike
            plain.append(seconds_per_step(config, Path(tmp) / f"plain{repeat}", args.steps, None))
            served.append(
                seconds_per_step(config, Path(tmp) / f"served{repeat}", args.steps, args.scrape)
            )
    base, with_metrics = statistics.median(plain), statistics.median(served)
    print(
        f"tiny KD run, {args.steps} steps x {args.repeats}: {base * 1000:.2f} ms/step without "
        f"metrics, {with_metrics * 1000:.2f} ms/step served and scraped every {args.scrape} s, "
        f"ratio {with_metrics / base:.3f}"
    )
    print(f"MetricsExporter.record: {record_microseconds():.1f} us per step")


if __name__ == "__main__":
    main()
