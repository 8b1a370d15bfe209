"""Benchmark: teacher scoring against a plain forward of the same model on the same batches,
fused with the output head and from the logits, with peak memory, and the bytes per token of
each storage option, in one run.

The teacher is SmolLM2-135M-Instruct (``zoo:smollm2``; V = 49,152, H = 576), or with ``--init
TOKENIZER`` a random-init Llama of ``--init-shape`` on that zoo tokenizer (default Qwen3-0.6B's
width and depth: hidden 1024, 28 layers, 16 / 8 heads of 64, intermediate 3072, about 0.5B
parameters; scoring's cost does not depend on the weights' values; nothing to download, for a GPU
machine without the SmolLM2 weights), on ``--device`` in ``--dtype``; the data is
:func:`crosskd.alignment.corpus.benchmark_corpus` text (``--bytes``) prepared for a Llama-3 student
and this teacher (samples of at most ``--length`` tokens), batched by a token budget as ``crosskd
score`` batches it. Timed on the same batches:

* ``forward``: ``model(input_ids, attention_mask).logits`` (the baseline);
* ``score``: :func:`crosskd.teacher.scoring.score_sequences` from the logits (the forward, then
  the exact tempered top-K over the whole vocabulary, the realized log probs at tau and 1, and
  the split into per-sample signals) plus :func:`crosskd.teacher.storage.encode` of the
  results;
* ``score (fused)``: the same with the teacher's head fused
  (:func:`crosskd.teacher.signal.signal_from_output_layer`: the forward hands over its last
  hidden states, the signal is computed a block of rows and of the vocabulary at a time, and
  the ``tokens x V`` logits never exist), as ``crosskd score`` runs it, plus the same encoding;
* ``encode only``: that encoding alone, of signals scored before the rounds: on a GPU the part
  of ``score`` the card does not do (``crosskd score`` encodes each shard after scoring it).

Each of ``--repeat`` rounds measures the four in turn (so a drift of the machine's speed hits
all four), each with :func:`inputs.measure`: one untimed pass over all batches, then one
timed pass and its peak memory, the largest rise of the process's peak resident set over the
pass (``VmHWM``, reset through ``/proc/self/clear_refs`` before it), on top of the model and
the inputs. Seconds are the median over the rounds, peak memory the largest; ratios are against
``forward`` of the same run. Goals: ``score (fused)`` at most 1.05x ``forward``'s time, and its
peak memory independent of V beyond the weight (so below ``forward``'s, which holds the
``tokens x V`` logits of the largest batch); ``score`` at most 1.10x. Bytes per token: the
encoded Parquet bytes of all samples over their tokens, for ``lossless`` and ``lossy`` at K =
128 (goals: at most 700 and 300).

    python benchmarks/teacher.py [--repeat 3] [--bytes 60000] [--length 512] [--budget 2048]
        [--device cuda] [--dtype bfloat16] [--init zoo:qwen3 [--init-shape JSON] [--init-dir DIR]]

On ``cuda`` times are synchronised and peak memory is the CUDA allocator's peak above what was
allocated before the pass (:func:`inputs.measure`).

Zoo tokenizers and the model are built into ``$CROSSKD_CACHE_DIR`` (default
``~/.cache/crosskd``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch
from inputs import add_init_options, device_name, init_teacher, measure

from crosskd.alignment.corpus import benchmark_corpus
from crosskd.data.collate import load_prepared
from crosskd.data.prepare import PrepareConfig, prepare
from crosskd.teacher.model import load_teacher
from crosskd.teacher.scoring import budget_batches, score_sequences
from crosskd.teacher.storage import ENCODINGS, encode

K = 128
GOAL_OVERHEAD, GOAL_FUSED, GOAL_BYTES = 1.10, 1.05, {"lossless": 700, "lossy": 300}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--bytes", type=int, default=60_000)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    add_init_options(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        reference = init_teacher(args, Path(tmp) / "teacher") or "zoo:smollm2"
        teacher = load_teacher(reference, device=args.device, dtype=args.dtype)
        tokenizer = args.init or reference
        data = Path(tmp) / "data.jsonl"
        data.write_text(
            "".join(
                json.dumps({"id": str(i), "text": t}) + "\n"
                for i, t in enumerate(benchmark_corpus(args.bytes))
            )
        )
        config = PrepareConfig(
            data=str(data),
            student_tokenizer="zoo:llama3",
            teacher_tokenizers=[tokenizer],
            output=str(Path(tmp) / "p"),
            max_length=args.length,
            teacher_max_length=args.length,
            pack=False,
        )
        prepare(config, progress=False)
        sequences = [
            np.asarray(s["teacher0_ids"])
            for row in load_prepared(config.output).packed_rows()
            for s in row
        ]
    batches = [
        [sequences[i] for i in b] for b in budget_batches([len(s) for s in sequences], args.budget)
    ]
    tokens = sum(len(s) for s in sequences)
    if teacher.head is None:
        raise SystemExit("the teacher's head is not fusable; nothing to compare")
    unfused = dataclasses.replace(teacher, head=None)

    @torch.no_grad()
    def forward() -> None:
        for batch in batches:
            width = max(len(s) for s in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for b, seq in enumerate(batch):
                ids[b, : len(seq)] = torch.from_numpy(seq)
                mask[b, : len(seq)] = 1
            ids, mask = ids.to(teacher.device), mask.to(teacher.device)
            teacher.model(input_ids=ids, attention_mask=mask).logits.sum()

    def scoring(scored) -> list:
        out = []
        for batch in batches:
            signals = score_sequences(scored, batch, k=K, tau=1.0)
            encode([str(i) for i in range(len(batch))], signals, "lossless")
            out += signals
        return out

    per_batch = [score_sequences(teacher, batch, k=K, tau=1.0) for batch in batches]

    def encoding() -> None:
        for signals in per_batch:
            encode([str(i) for i in range(len(signals))], signals, "lossless")

    steps = {
        "forward": forward,
        "score": lambda: scoring(unfused),
        "score (fused)": lambda: scoring(teacher),
        "encode only": encoding,
    }
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in steps}
    for _ in range(args.repeat):  # rounds over the four, so a drift of the machine hits all
        for name, step in steps.items():
            runs[name].append(measure(step, 1, args.device))
    seconds = {name: statistics.median(s for s, _ in got) for name, got in runs.items()}
    peaks = {name: max(p for _, p in got) for name, got in runs.items()}
    signals = [signal for batch in per_batch for signal in batch]
    print(
        f"{len(sequences)} samples, {tokens} tokens in {len(batches)} batches "
        f"(budget {args.budget} tokens), teacher {args.init or reference} "
        f"({sum(p.numel() for p in teacher.model.parameters()) / 1e6:.0f}M parameters"
        f"{', random init' if args.init else ''}) in {args.dtype} on {device_name(args.device)}, "
        f"{torch.get_num_threads()} CPU threads"
    )
    print(f"{'':14} {'seconds':>8} {'tokens/s':>9} {'time':>6} {'peak MB':>8} {'memory':>7}")
    goals = {"score": GOAL_OVERHEAD, "score (fused)": GOAL_FUSED}
    for name in steps:
        ratio = seconds[name] / seconds["forward"]
        verdict = (
            f"  (goal <= {goals[name]:.2f}x: {'met' if ratio <= goals[name] else 'NOT met'})"
            if name in goals
            else ""
        )
        print(
            f"{name:14} {seconds[name]:8.2f} {tokens / seconds[name]:9.0f} {ratio:5.2f}x "
            f"{peaks[name] / 2**20:8.0f} {peaks[name] / peaks['forward']:6.2f}x{verdict}"
        )
    names = [str(i) for i in range(len(signals))]
    for encoding in ENCODINGS:
        per_token = len(encode(names, signals, encoding)) / tokens
        goal = GOAL_BYTES[encoding]
        print(
            f"{encoding:9} {per_token:6.0f} bytes/token at K = {K} (goal <= {goal}: "
            f"{'met' if per_token <= goal else 'NOT met'})"
        )


if __name__ == "__main__":
    main()
