"""Benchmark: teacher scoring against a plain forward of the same model on the same batches,
and the bytes per token of each storage option, in one run.

The teacher is SmolLM2-135M-Instruct (``zoo:smollm2``, float32 on CPU); the data is
:func:`crosskd.alignment.corpus.benchmark_corpus` text (``--bytes``) prepared for a Llama-3
student and this teacher (samples of at most ``--length`` tokens), batched by a token budget as
``crosskd score`` batches it. Timed on the same batches:

* ``forward``: ``model(input_ids, attention_mask).logits`` (the baseline);
* ``score``: :func:`crosskd.teacher.scoring.score_sequences` (the forward, then the exact
  tempered top-K over the whole vocabulary, the realized log probs at tau and 1, and the split
  into per-sample signals) plus :func:`crosskd.teacher.storage.encode` of the results.

Seconds are the median of ``--repeat`` passes over all batches. Goal: ``score`` at most 1.10x
``forward``. Bytes per token: the encoded Parquet bytes of all samples over their tokens, for
``lossless`` and ``lossy`` at K = 128 (goals: at most 700 and 300).

    python benchmarks/teacher.py [--repeat 3] [--bytes 60000] [--length 512] [--budget 2048]

Zoo tokenizers and the model are built into ``$CROSSKD_CACHE_DIR`` (default
``~/.cache/crosskd``).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from crosskd.alignment.corpus import benchmark_corpus
from crosskd.data.collate import load_prepared
from crosskd.data.prepare import PrepareConfig, prepare
from crosskd.teacher.model import load_teacher
from crosskd.teacher.scoring import budget_batches, score_sequences
from crosskd.teacher.storage import ENCODINGS, encode

K = 128
GOAL_OVERHEAD, GOAL_BYTES = 1.10, {"lossless": 700, "lossy": 300}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--bytes", type=int, default=60_000)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--budget", type=int, default=2048)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    teacher = load_teacher("zoo:smollm2", device="cpu", dtype="float32")
    with tempfile.TemporaryDirectory() as tmp:
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
            teacher_tokenizers=["zoo:smollm2"],
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

    @torch.no_grad()
    def forward() -> None:
        for batch in batches:
            width = max(len(s) for s in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for b, seq in enumerate(batch):
                ids[b, : len(seq)] = torch.from_numpy(seq)
                mask[b, : len(seq)] = 1
            teacher.model(input_ids=ids, attention_mask=mask).logits.sum()

    def scoring() -> list:
        out = []
        for batch in batches:
            signals = score_sequences(teacher, batch, k=K, tau=1.0)
            encode([str(i) for i in range(len(batch))], signals, "lossless")
            out += signals
        return out

    def timed(fn) -> tuple[float, object]:
        fn()
        times, result = [], None
        for _ in range(args.repeat):
            start = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times), result

    forward_s, _ = timed(forward)
    score_s, signals = timed(scoring)
    print(
        f"{len(sequences)} samples, {tokens} tokens in {len(batches)} batches "
        f"(budget {args.budget} tokens), SmolLM2-135M float32 on CPU"
    )
    print(f"forward  {forward_s:7.2f} s  {tokens / forward_s:8.0f} tokens/s  1.00x")
    ratio = score_s / forward_s
    print(
        f"score    {score_s:7.2f} s  {tokens / score_s:8.0f} tokens/s  {ratio:.2f}x  "
        f"(goal <= {GOAL_OVERHEAD:.2f}x: {'met' if ratio <= GOAL_OVERHEAD else 'NOT met'})"
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
