"""Benchmark: build both directions of the Llama-3 <-> Qwen3 table pair and validate it,
against the naive text path measured in the same run.

The naive path decodes every source token to text and batch-encodes the texts with the
destination tokenizer (normalizer, pre-tokenizer and all); it is also wrong for tokens whose
bytes are not UTF-8 on their own, which this script counts. Prints seconds per phase (median of
``--repeat`` runs) and the ratio naive / crosskd.

    python benchmarks/tables.py [--repeat 3] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable

import numpy as np

from crosskd.tables import Flag, build_table, validate_pair
from crosskd.tokenization import KIND_NORMAL, LoadedTokenizer, load_tokenizer

log = logging.getLogger("benchmarks.tables")


def _timed(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    """Median seconds of ``repeat`` calls and the last result."""
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def naive_chains(src: LoadedTokenizer, dst: LoadedTokenizer) -> list[list[int]]:
    """The text path: decode each normal src token, encode the text with the dst tokenizer."""
    ids = np.flatnonzero(src.bytes.kind == KIND_NORMAL).tolist()
    texts = src.hf.batch_decode([[i] for i in ids])
    return dst.hf(texts, add_special_tokens=False)["input_ids"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cache-dir", default=None, help="zoo cache (default: the crosskd one)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    start = time.perf_counter()
    student = load_tokenizer("zoo:llama3", cache_dir=args.cache_dir)
    teacher = load_tokenizer("zoo:qwen3", cache_dir=args.cache_dir)
    load_s = time.perf_counter() - start

    s2t_s, s2t = _timed(lambda: build_table(student, teacher, progress=False), args.repeat)
    t2s_s, t2s = _timed(lambda: build_table(teacher, student, progress=False), args.repeat)
    val_s, reports = _timed(lambda: validate_pair(student, teacher, s2t, t2s), args.repeat)
    assert all(r.ok for r in reports), [r.violations for r in reports]
    naive_s2t_s, naive_s2t = _timed(lambda: naive_chains(student, teacher), args.repeat)
    naive_t2s_s, naive_t2s = _timed(lambda: naive_chains(teacher, student), args.repeat)

    ours_total = s2t_s + t2s_s + val_s
    naive_total = naive_s2t_s + naive_t2s_s
    wrong = 0
    for table, naive, src in ((s2t, naive_s2t, student), (t2s, naive_t2s, teacher)):
        ids = np.flatnonzero(src.bytes.kind == KIND_NORMAL).tolist()
        for i, chain in zip(ids, naive, strict=True):
            if table.flags[i] == Flag.NORMAL and table.chain(i).tolist() != chain:
                wrong += 1
    rows = [
        ("load both tokenizers (not timed below)", load_s),
        ("build llama3 -> qwen3", s2t_s),
        ("build qwen3 -> llama3", t2s_s),
        ("validate both directions", val_s),
        ("crosskd total (build x2 + validate)", ours_total),
        ("naive text path llama3 -> qwen3", naive_s2t_s),
        ("naive text path qwen3 -> llama3", naive_t2s_s),
        ("naive total (no validation)", naive_total),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {seconds:7.3f} s" for name, seconds in rows]
    lines.append(f"{'speed-up naive / crosskd':<{width}}  {naive_total / ours_total:7.2f} x")
    lines.append(f"{'chains the naive path gets wrong':<{width}}  {wrong:7d}")
    lines.append(
        f"{'goal: total < 5 s and >= 3x':<{width}}  "
        f"{'met' if ours_total < 5 and naive_total / ours_total >= 3 else 'MISSED'}"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
