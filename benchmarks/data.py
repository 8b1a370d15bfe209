"""The data path at scale: prepare's speed against its tokenizers alone on the same text (1, 2
and 3 teachers, one process and one per core) and where its time goes, its peak memory and
throughput as the input grows, lockstep packing time and efficiency (windowed, as prepare packs
now, against packing every sample at once, as it did), the training step's wait for its inputs
(background thread against inline) and shard reads per epoch (shard-local order against a
global permutation with 8 shards kept).

    python benchmarks/data.py [--sizes-mb 10 100] [--speed-mb 10] [--workers CORES]
                              [--chat-mb 5] [--packing 10000 100000 1000000]
                              [--skip prepare speed chat packing training]

Prepare runs in a fresh process per size (peak RSS: its VmHWM) on text read from this machine
(the standard library, docstrings and message catalogues; repeated with new ids to reach the
size), for the Llama-3 student and Qwen3 teacher tokenizers. Packing uses document lengths drawn
from a log-normal (median 300 tokens, clipped at 2048) with the teacher's about 1.1x the
student's. Training uses the ``tiny`` preset's inputs with 24 shards of 2 rows. The chat
measurement prepares conversations made of the same text (a user turn of a document's first 150
characters, the next document as the answer) against the tokenizers alone on the messages.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from inputs import write_benchmark_jsonl

PREPARE = """
import json, sys, time
from pathlib import Path
from crosskd.data.prepare import PrepareConfig, prepare
started = time.perf_counter()
config = PrepareConfig(data=sys.argv[1], output=sys.argv[2], student_tokenizer="zoo:llama3",
                       teacher_tokenizers=["zoo:qwen3"], max_length=512, shard_rows=4096)
manifest = prepare(config, progress=False)
seconds = time.perf_counter() - started
status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
print(json.dumps({"seconds": seconds, "peak_rss": int(status["VmHWM"].split()[0]) * 1024,
                  "rows": manifest["rows"], "shards": len(manifest["shards"])}))
"""


def bench_prepare(sizes: list[float], work: Path) -> None:
    print("prepare (one process, Llama-3 / Qwen3 tokenizers, max_length 512, shard_rows 4096):")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = None
    for mb in sizes:
        data = work / f"text-{mb:g}MB.jsonl"
        n_bytes = write_benchmark_jsonl(data, int(mb * 1e6), document_bytes=1536)
        done = subprocess.run(
            [sys.executable, "-c", PREPARE, str(data), str(work / f"out-{mb:g}")],
            capture_output=True,
            text=True,
            env=env,
        )
        if done.returncode:
            sys.exit(done.stderr[-3000:])
        result = json.loads(done.stdout.strip().splitlines()[-1])
        base = base or result
        print(
            f"  {mb:g} MB ({result['rows']} rows, {result['shards']} shards): "
            f"{result['seconds']:.1f} s, {n_bytes / result['seconds'] / 1e6:.2f} MB/s, peak RSS "
            f"{result['peak_rss'] / 2**20:.0f} MiB (x{result['peak_rss'] / base['peak_rss']:.2f} "
            f"of the first size)"
        )


TOKENIZERS_ALONE = """
import json, sys, time
from crosskd.tokenization import load_tokenizer
started = time.perf_counter()
tokenizers = [load_tokenizer(name) for name in sys.argv[2:]]
loaded = time.perf_counter()
with open(sys.argv[1], encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
texts = [m["content"] for r in rows for m in r["messages"]] if "messages" in rows[0] else [
    r["text"] for r in rows]
read = time.perf_counter()
for tok in tokenizers:
    backend = tok.backend
    for i in range(0, len(texts), 4096):
        backend.encode_batch(texts[i : i + 4096])
print(json.dumps({"load": loaded - started, "read": read - loaded,
                  "encode": time.perf_counter() - read}))
"""

PREPARE_SPEED = """
import json, sys, time
started = time.perf_counter()
from crosskd.data.prepare import PrepareConfig, prepare
data, output, workers, student, *teachers = sys.argv[1:]
config = PrepareConfig(data=data, output=output, student_tokenizer=student,
                       teacher_tokenizers=teachers, max_length=512, shard_rows=1024,
                       workers=int(workers))
manifest = prepare(config, progress=False)
print(json.dumps({"seconds": time.perf_counter() - started, "rows": manifest["rows"],
                  "clipped": manifest["clipped_rows"]}))
"""

PROFILE = """
import cProfile, json, pstats, sys
from crosskd.data.prepare import PrepareConfig, prepare
data, output, student, *teachers = sys.argv[1:]
config = PrepareConfig(data=data, output=output, student_tokenizer=student,
                       teacher_tokenizers=teachers, max_length=512)
profile = cProfile.Profile()
profile.runcall(prepare, config, progress=False)
stats = pstats.Stats(profile).stats
def cumulative(name, module, caller=None):
    total = 0.0
    for (path, _, func), (_, _, _, ct, callers) in stats.items():
        if func == name and path.endswith(module):
            total += ct if caller is None else sum(
                c[3] for (_, _, f), c in callers.items() if f == caller)
    return total
print(json.dumps({
    "total": cumulative("prepare", "data/prepare.py"),
    "start-up (load the tokenizers)": cumulative("load_tokenizer", "tokenization/__init__.py"),
    "read rows (JSON Lines, window digests)": cumulative("read_records", "data/records.py")
        + cumulative("_input_digest", "data/prepare.py"),
    "tokenize the texts (every model, with offsets)":
        cumulative("tokenize", "alignment/core.py")
        - cumulative("tokenize", "alignment/core.py", "clip_texts"),
    "clip (the over-long texts' probe encodings)": cumulative("clip_texts", "data/clipping.py"),
    "align (every teacher, vectorised)": cumulative("align_texts", "alignment/sample.py"),
    "masks (the student's own view)": cumulative("student_tokens", "alignment/own.py"),
    "pack": cumulative("pack_lockstep", "data/packing.py"),
    "encode the shard (Arrow, Parquet, sha256)": cumulative("encode_shard", "data/shards.py"),
    "write (shards, records, run files)": cumulative("write_whole", "artifacts.py"),
}))
"""

TEACHER_SETS = (
    ["zoo:qwen3"],
    ["zoo:qwen3", "zoo:smollm2"],
    ["zoo:qwen3", "zoo:smollm2", "zoo:deepseek-v3"],
)
"""The teachers of the speed comparison (the student is Llama-3's tokenizer)."""


def _run_json(script: str, args: list[str], threads: bool = True) -> dict:
    """Run ``script`` in a fresh Python with ``args``; its last output line, as JSON.
    ``threads`` false: the tokenizers single-threaded (``TOKENIZERS_PARALLELISM=false``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not threads:
        env["TOKENIZERS_PARALLELISM"] = "false"
    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env
    )
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_prepare_speed(mb: float, work: Path, workers: int) -> None:
    """Prepare's throughput against its tokenizers alone on the same text, 1 to 3 teachers:
    one process with its tokenizers on one thread and on their own threads, and ``workers``
    processes; and where one process spends its time."""
    data = work / f"speed-{mb:g}MB.jsonl"
    n_bytes = write_benchmark_jsonl(data, int(mb * 1e6), document_bytes=1536)
    print(
        f"prepare against its tokenizers alone ({n_bytes / 1e6:.1f} MB, Llama-3 student, "
        f"max_length 512, shard_rows 1024, {os.cpu_count()} cores; MB/s of text, wall time with "
        "start-up):"
    )
    student = "zoo:llama3"
    for teachers in TEACHER_SETS:
        models = [student, *teachers]
        alone = _run_json(TOKENIZERS_ALONE, [str(data), *models])
        alone_1 = _run_json(TOKENIZERS_ALONE, [str(data), *models], threads=False)
        base = n_bytes / alone["encode"] / 1e6
        print(
            f"  {len(teachers)} teacher(s) ({', '.join(t[4:] for t in teachers)}): tokenizers "
            f"alone {base:.2f} MB/s (their threads; {n_bytes / alone_1['encode'] / 1e6:.2f} "
            f"MB/s on one thread; loading them {alone_1['load']:.1f} s, {alone['load']:.1f} s in "
            "the first process)"
        )
        runs = [("1 process, tokenizers on one thread", 1, False)]
        runs += [("1 process, the tokenizers' threads", 1, True)]
        runs += [(f"{workers} worker processes", workers, True)] if workers > 1 else []
        single = None
        for label, count, threads in runs:
            out = work / f"out-{len(teachers)}-{count}-{threads}"
            args = [str(data), str(out), str(count), *models]
            result = _run_json(PREPARE_SPEED, args, threads=threads)
            speed = n_bytes / result["seconds"] / 1e6
            single = single or speed
            steady = n_bytes / max(result["seconds"] - alone_1["load"], 1e-9) / 1e6
            print(
                f"    prepare, {label}: {result['seconds']:.1f} s, {speed:.2f} MB/s "
                f"(x{speed / base:.2f} the tokenizers alone, x{speed / single:.2f} one thread; "
                f"without loading the tokenizers {steady:.2f} MB/s, x{steady / base:.2f}); "
                f"{result['clipped']} of {result['rows']} rows clipped"
            )
    shares = _run_json(PROFILE, [str(data), str(work / "profiled"), student, *TEACHER_SETS[0]])
    total = shares.pop("total")
    print(f"  where one process spends its time (1 teacher, cProfile, {total:.1f} s in all):")
    for stage, seconds in shares.items():
        print(f"    {stage}: {seconds:.2f} s ({seconds / total:.0%})")
    rest = total - sum(shares.values())
    print(
        f"    the rest (normalising, row objects, bookkeeping): {rest:.2f} s ({rest / total:.0%})"
    )


def bench_prepare_chat(mb: float, work: Path) -> None:
    """Prepare's throughput on conversations against the tokenizers alone on their messages
    (Llama-3 student, Qwen3 teacher, one process with its tokenizers' threads)."""
    text = work / f"chat-source-{mb:g}MB.jsonl"
    write_benchmark_jsonl(text, int(mb * 1e6), document_bytes=1536)
    documents = [json.loads(line)["text"] for line in text.read_text(encoding="utf-8").splitlines()]
    data = work / f"chat-{mb:g}MB.jsonl"
    n_bytes = 0
    with data.open("w", encoding="utf-8") as f:
        for i in range(0, len(documents) - 1, 2):
            question, answer = documents[i][:150], documents[i + 1]
            n_bytes += len(question.encode("utf-8")) + len(answer.encode("utf-8"))
            messages = [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
            ]
            f.write(json.dumps({"id": f"c{i}", "messages": messages}, ensure_ascii=False) + "\n")
    models = ["zoo:llama3", "zoo:qwen3"]
    alone = _run_json(TOKENIZERS_ALONE, [str(data), *models])
    base = n_bytes / alone["encode"] / 1e6
    result = _run_json(PREPARE_SPEED, [str(data), str(work / "out-chat"), "1", *models])
    speed = n_bytes / result["seconds"] / 1e6
    steady = n_bytes / max(result["seconds"] - alone["load"], 1e-9) / 1e6
    print(
        f"prepare on conversations ({n_bytes / 1e6:.1f} MB of messages, {result['rows']} "
        f"conversations, Llama-3 student, Qwen3 teacher, max_length 512): tokenizers alone on "
        f"the messages {base:.2f} MB/s (their threads); prepare, 1 process, the tokenizers' "
        f"threads: {result['seconds']:.1f} s, {speed:.2f} MB/s (x{speed / base:.2f}; without "
        f"loading the tokenizers {steady:.2f} MB/s, x{steady / base:.2f}); "
        f"{result['clipped']} conversations clipped"
    )


def lengths(n: int, seed: int = 0) -> np.ndarray:
    """``[n, 2]`` token counts (student, teacher) of a realistic mix of document lengths."""
    rng = np.random.default_rng(seed)
    student = np.clip(rng.lognormal(np.log(300), 1.0, n), 8, 2048).astype(np.int64)
    teacher = np.clip(student * rng.normal(1.1, 0.05, n), 8, 2048).astype(np.int64)
    return np.stack([student, teacher], axis=1)


def bench_packing(counts: list[int], window: int = 4096, global_limit: int = 100_000) -> None:
    from crosskd.data.packing import pack_lockstep, packing_efficiency

    caps = [2048, 2048]
    print(f"lockstep packing (capacities {caps}; windowed: {window} samples at a time):")
    first = None
    for n in counts:
        data = lengths(n)
        started = time.perf_counter()
        bins = []
        for start in range(0, n, window):
            bins += [b + start for b in pack_lockstep(data[start : start + window], caps)]
        windowed = time.perf_counter() - started
        eff = packing_efficiency(data, bins, caps)[0]
        first = first or (n, windowed)
        growth = (windowed / first[1]) / (n / first[0])
        line = (
            f"  {n:>9,} samples: windowed {windowed:7.2f} s (time/sample x{growth:.2f} of "
            f"{first[0]:,}), efficiency {eff:.4f}"
        )
        if n <= global_limit:
            started = time.perf_counter()
            whole = pack_lockstep(data, caps)
            seconds = time.perf_counter() - started
            line += (
                f"; all at once {seconds:7.2f} s (x{seconds / windowed:.1f} the windowed "
                f"time), efficiency {packing_efficiency(data, whole, caps)[0]:.4f}"
            )
        else:
            line += "; all at once not run (quadratic)"
        print(line)


def bench_training(work: Path, steps: int = 100) -> None:
    from crosskd import steps as run_steps
    from crosskd.distill import checked_tables, teacher_caches
    from crosskd.metrics import read_jsonl_log
    from crosskd.steps.config import load_run_config
    from crosskd.train import TrainConfig, Trainer

    config = load_run_config(
        None, "tiny", [f"output={work / 'run'}", "shard_rows=2", "max_length=64"]
    )
    plan = run_steps.validate_inputs(config)
    tables = checked_tables(plan, progress=False)
    prepared = run_steps.prepare_data(
        plan, max_length=config.max_length, shard_rows=config.shard_rows, progress=False
    )
    caches = teacher_caches(plan, prepared, config.scoring(), 1, progress=False)
    (item, *_) = [
        i
        for i in run_steps.plan_training(config, plan, prepared, tables, caches, str(work / "run"))
        if i["variant"] == "kd"
    ]
    shards = len(json.loads(Path(prepared["train"], "manifest.json").read_text())["shards"])
    print(f"training input (tiny preset, {shards} shards, {steps} steps; the first 5 not counted):")
    cases = [
        ("inline, global order, 8 shards kept (before)", 0, shards, 8),
        ("inline, shard-local order", 0, 4, None),
        ("thread 2 steps ahead, shard-local order (now)", 2, 4, None),
    ]
    base = None
    for name, depth, window, keep in cases:
        values = {
            **item["train"],
            "steps": steps,
            "checkpoint_every": 0,
            "eval_data": None,
            "output": str(work / f"train-{depth}-{window}"),
            "prefetch_steps": depth,
            "window_shards": window,
            "global_batch_rows": 4,
            "micro_batch_rows": 2,
            "grad_accum": None,
        }
        trainer = Trainer(TrainConfig(**values), progress=False)
        trainer.setup()
        if keep is not None:
            trainer.rows.keep_shards = keep
            for source in trainer.teachers.sources:
                source.cache.keep_shards = keep
        started = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - started
        trainer.close()
        logged = read_jsonl_log(f"{values['output']}/metrics-rank0.jsonl")[5:]
        waits = [h["input_wait_s"] for h in logged]
        step_seconds = [h["seconds"] for h in logged]
        begun = -(-steps * 4 // trainer.shard_order.rows)
        cache_reads = trainer.teachers.sources[0].cache.reads
        base = base or wall
        print(
            f"  {name}: {wall:.2f} s (x{wall / base:.2f}), input wait "
            f"{sum(waits) / sum(step_seconds):.1%} of step time (median "
            f"{statistics.median(waits) * 1e3:.1f} ms), reads per shard over {begun} epochs "
            f"begun: cache at most {max(cache_reads.values())}, prepared at most "
            f"{max(trainer.rows.reads.values())}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[10, 100])
    parser.add_argument("--packing", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--speed-mb", type=float, default=10)
    parser.add_argument("--chat-mb", type=float, default=5)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=["prepare", "speed", "chat", "packing", "training"]
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="crosskd-data-") as tmp:
        work = Path(tmp)
        if "packing" not in args.skip:
            bench_packing(args.packing)
        if "training" not in args.skip:
            bench_training(work)
        if "speed" not in args.skip:
            bench_prepare_speed(args.speed_mb, work, args.workers)
        if "chat" not in args.skip:
            bench_prepare_chat(args.chat_mb, work)
        if "prepare" not in args.skip:
            bench_prepare(args.sizes_mb, work)


if __name__ == "__main__":
    main()
