"""Benchmark: the offset-cluster aligner against the two tokenizers' own time, in one run.

On :func:`crosskd.alignment.corpus.benchmark_corpus` (about 1 MB of Python sources, docstrings
and translation catalogues built from this machine's files), Llama-3 (student) vs Qwen3
(teacher) from the zoo:

* tokenization: :func:`crosskd.alignment.tokenize` of all documents on each side (one batched
  call with offsets, plus the int64 id and end arrays the aligner takes); the bare Hugging Face
  call is timed too, to show what the conversion costs;
* alignment: :func:`crosskd.alignment.align_many` over all documents (one vectorised pass), on
  the tokens above;
* TRL's greedy cross-tokenizer aligner (``ULDLoss._build_alignment_groups_from_ids`` of
  ``trl.experimental.gold``) on the same token ids, when ``trl`` is installed.

Seconds are the median of ``--repeat`` runs, wall clock unless marked CPU (process CPU time,
all threads: the Rust tokenizers use several cores, the aligner one); tokens/s count student
plus teacher tokens. Goal: alignment wall time at most 10% of tokenization wall time. Also
prints the pair report's 1:1 share.

    python benchmarks/alignment.py [--repeat 3] [--bytes 1000000] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import types
from collections.abc import Callable

from crosskd.alignment import align_many, tokenize
from crosskd.alignment.corpus import benchmark_corpus
from crosskd.alignment.report import pair_report
from crosskd.tokenization import LoadedTokenizer, load_tokenizer

GOAL = 0.10


def _timed(fn: Callable[[], object], repeat: int) -> tuple[float, float, object]:
    """Median wall seconds and median CPU seconds (all threads of the process) of ``repeat``
    calls, and the last result."""
    walls, cpus, result = [], [], None
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = fn()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - start_cpu)
    return statistics.median(walls), statistics.median(cpus), result


def _bare_hf(tok: LoadedTokenizer, texts: list[str]) -> object:
    return tok.hf(
        texts, add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=True
    )


def _trl_aligner(student: LoadedTokenizer, teacher: LoadedTokenizer) -> Callable | str:
    """TRL's aligner bound to both tokenizers, or why it is unavailable."""
    try:
        import trl
    except ImportError:
        return "trl is not installed"
    try:
        from trl.experimental.gold.gold_trainer import ULDLoss
    except ImportError as error:
        return f"trl {trl.__version__} has no trl.experimental.gold ({error})"
    method = getattr(ULDLoss, "_build_alignment_groups_from_ids", None)
    if method is None:
        return f"trl {trl.__version__}: ULDLoss has no _build_alignment_groups_from_ids"
    holder = types.SimpleNamespace(student_tokenizer=student.hf, teacher_tokenizer=teacher.hf)
    return lambda s_ids, t_ids: method(holder, s_ids, t_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--bytes", type=int, default=1_000_000, help="corpus size (UTF-8)")
    parser.add_argument("--cache-dir", default=None, help="zoo cache (default: the crosskd one)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    start = time.perf_counter()
    texts = benchmark_corpus(args.bytes)
    corpus_s = time.perf_counter() - start
    student = load_tokenizer("zoo:llama3", cache_dir=args.cache_dir)
    teacher = load_tokenizer("zoo:qwen3", cache_dir=args.cache_dir)

    hf_s_s, _, _ = _timed(lambda: _bare_hf(student, texts), args.repeat)
    hf_t_s, _, _ = _timed(lambda: _bare_hf(teacher, texts), args.repeat)
    tok_s_s, tok_s_cpu, s_tokens = _timed(lambda: tokenize(student, texts), args.repeat)
    tok_t_s, tok_t_cpu, t_tokens = _timed(lambda: tokenize(teacher, texts), args.repeat)
    pairs = list(zip(s_tokens, t_tokens, strict=True))
    align_s, align_cpu, _ = _timed(
        lambda: align_many(s_tokens, t_tokens, student, teacher), args.repeat
    )

    n_tokens = sum(len(s) + len(t) for s, t in pairs)
    tok_total, hf_total = tok_s_s + tok_t_s, hf_s_s + hf_t_s
    ratio = align_s / tok_total
    rows = [
        ("corpus: documents", f"{len(texts):,}"),
        ("corpus: UTF-8 bytes", f"{sum(len(t.encode()) for t in texts):,}"),
        ("corpus: built in", f"{corpus_s:.2f} s"),
        ("tokens (llama3 + qwen3)", f"{n_tokens:,}"),
        ("bare HF call llama3 / qwen3", f"{hf_s_s:.3f} s / {hf_t_s:.3f} s"),
        ("tokenize() llama3 / qwen3", f"{tok_s_s:.3f} s / {tok_t_s:.3f} s"),
        ("align_many() all documents", f"{align_s:.3f} s"),
        ("tokenization tokens/s", f"{n_tokens / tok_total:,.0f}"),
        ("aligner tokens/s", f"{n_tokens / align_s:,.0f}"),
        ("align / tokenize()", f"{ratio:.1%}"),
        ("align / bare HF calls", f"{align_s / hf_total:.1%}"),
        ("align / tokenize(), CPU seconds", f"{align_cpu / (tok_s_cpu + tok_t_cpu):.1%}"),
        (f"goal: align <= {GOAL:.0%} of tokenization", "met" if ratio <= GOAL else "MISSED"),
    ]
    trl = _trl_aligner(student, teacher)
    if isinstance(trl, str):
        rows.append(("TRL aligner", trl))
    else:
        ids = [(s.ids.tolist(), t.ids.tolist()) for s, t in pairs]
        trl_s, _, _ = _timed(lambda: [trl(s, t) for s, t in ids], 1)
        rows.append(("TRL aligner (1 run)", f"{trl_s:.3f} s"))
        rows.append(("TRL aligner / crosskd align", f"{trl_s / align_s:.1f} x"))

    report = pair_report(student, teacher, texts, progress=False)
    rows.append(
        ("pair report: 1:1 share of student tokens", f"{report.one_to_one_student_share:.1%}")
    )
    rows.append(("pair report: correct chunks", f"{report.correct_rate:.2%}"))
    width = max(len(name) for name, _ in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))


if __name__ == "__main__":
    main()
