"""What each rank holds of the student's training state under each parallel layout: the bytes
of parameters, gradients and AdamW state (``crosskd.parallel.parallelize.state_bytes``) after one
optimizer step, per rank, against one process holding all of it (measured in the same run).

    python benchmarks/parallel_memory.py [--hidden-size 512] [--layers 8] [--vocab 128256]

Each layout runs in real processes (gloo on CPU, torch's elastic agent) on a random-init Llama
of the given shape (default: ~91M parameters, 72% of them the tied 128k-row embedding of
the Llama-3 vocabulary, the share a small cross-tokenizer student really has): the layout is
applied by ``parallelize`` exactly as the trainer does, then one forward and backward pass of a
batch of 2 x 128 tokens (a sum of squared logits: the bytes do not depend on the loss) and one
AdamW step.

Then what a step's activations and logits take per rank under ``cp`` (and ``tp`` for
comparison): the rise of each process's peak resident set (``VmHWM``, reset just before) over
one forward and backward pass of one packed row of ``--length`` tokens (sdpa attention, the
packed-row mask; under ``cp`` each rank its window, attention gathering the row's keys and
values), against one process in the same run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

LAYOUTS = [
    (1, {}),
    (2, {"dp_shard": 2}),
    (2, {"tp": 2}),
    (4, {"dp_shard": 4}),
    (4, {"dp_shard": 2, "tp": 2}),
]
KINDS = ("parameters", "gradients", "optimizer")
STEP_LAYOUTS = [(1, {}), (2, {"cp": 2}), (4, {"cp": 4}), (2, {"tp": 2})]


def _spread(shape: dict, vocab: int, parallel: dict):
    """This rank's student: the process group joined (under the elastic agent), a seeded
    random-init Llama of ``shape``, spread over ``parallel`` as the trainer does."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from crosskd.parallel.layout import ParallelLayout
    from crosskd.parallel.mesh import build_parallel_mesh
    from crosskd.parallel.parallelize import parallelize

    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, tie_word_embeddings=True, **shape)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    return parallelize(model, build_parallel_mesh(ParallelLayout(**parallel), torch.device("cpu")))


def _leave() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _rank(shape: dict, vocab: int, parallel: dict) -> dict:
    """One rank: the layout applied, one step, what this rank holds."""
    import torch

    from crosskd.parallel.parallelize import state_bytes

    student = _spread(shape, vocab, parallel)
    optimizer = torch.optim.AdamW(student.model.parameters(), lr=1e-4)
    ids = torch.randint(0, vocab, (2, 128), generator=torch.Generator().manual_seed(1))
    logits = student.wrapped(input_ids=ids, use_cache=False).logits
    logits.float().square().mean().backward()
    optimizer.step()
    held = state_bytes(student, optimizer)
    _leave()
    return held


def _step_peak(shape: dict, vocab: int, parallel: dict, length: int) -> dict:
    """One rank: the layout applied, then the rise of the peak resident set over one forward
    and backward pass of one row of ``length`` tokens (bytes)."""
    import gc
    from pathlib import Path

    import torch
    from inputs import rss

    from crosskd.parallel.attention import packed_inputs

    student = _spread(shape, vocab, parallel)
    mesh = student.mesh
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(1))
    cp = mesh.layout.cp
    window = (
        None
        if cp == 1
        else (mesh.coordinate("cp") * length // cp, (mesh.coordinate("cp") + 1) * length // cp)
    )
    inputs = packed_inputs(
        "sdpa", ids, torch.zeros_like(ids), torch.arange(length)[None], torch.float32, window
    )
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before, _ = rss()
    logits = student.wrapped(use_cache=False, **inputs).logits
    logits.float().square().mean().backward()
    _, peak = rss()
    _leave()
    return {
        "peak_rise": peak - before,
        "positions": int(logits.shape[1]),
        "vocab_columns": int(logits.shape[2]),
    }


def run_layout(
    processes: int, parallel: dict, shape: dict, vocab: int, length: int = 0
) -> list[dict]:
    """Every rank's bytes under ``parallel`` on ``processes`` processes (``length`` > 0: the
    peak rise of a step over one row of that many tokens instead)."""
    work, args = (
        (_step_peak, (shape, vocab, parallel, length))
        if length
        else (_rank, (shape, vocab, parallel))
    )
    if processes == 1:
        return [work(*args)]
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from crosskd.parallel.rendezvous import rendezvous

    launch = LaunchConfig(
        nproc_per_node=processes,
        max_restarts=0,
        start_method="spawn",
        monitor_interval=0.5,
        **rendezvous({}),
    )
    results = elastic_launch(launch, work)(*args)
    return [results[r] for r in sorted(results)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument(
        "--length",
        type=int,
        default=2048,
        help="tokens of the row whose step's peak memory is measured",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    shape = {
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.layers,
        "intermediate_size": 3 * args.hidden_size,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    }
    rows, whole = [], None
    for processes, parallel in LAYOUTS:
        ranks = run_layout(processes, parallel, shape, args.vocab)
        if whole is None:
            whole = ranks[0]
        worst = {k: max(r[k] for r in ranks) for k in KINDS}
        rows.append(
            {
                "processes": processes,
                "parallel": parallel,
                "per_rank_max": worst,
                "total": sum(worst.values()),
                "ratio": sum(worst.values()) / sum(whole.values()),
            }
        )
    params = whole["parameters"] // 4
    print(
        f"student: {params / 1e6:.1f}M parameters (hidden {args.hidden_size}, {args.layers} "
        f"layers, vocabulary {args.vocab}, tied)"
    )
    print(
        f"{'procs':>5}  {'parallel':<26}{'params MiB':>11}{'grads MiB':>10}{'AdamW MiB':>10}"
        f"{'total MiB':>10}{'x one':>7}"
    )
    for row in rows:
        w = row["per_rank_max"]
        print(
            f"{row['processes']:>5}  {json.dumps(row['parallel']):<26}"
            f"{w['parameters'] / 2**20:>11.1f}{w['gradients'] / 2**20:>10.1f}"
            f"{w['optimizer'] / 2**20:>10.1f}{row['total'] / 2**20:>10.1f}{row['ratio']:>7.3f}"
        )
    steps, alone = [], None
    for processes, parallel in STEP_LAYOUTS:
        ranks = run_layout(processes, parallel, shape, args.vocab, args.length)
        worst = max(r["peak_rise"] for r in ranks)
        alone = alone or worst
        steps.append(
            {
                "processes": processes,
                "parallel": parallel,
                "peak_rise": worst,
                "positions": ranks[0]["positions"],
                "vocab_columns": ranks[0]["vocab_columns"],
                "ratio": worst / alone,
            }
        )
    print(
        f"one forward and backward pass of a row of {args.length} tokens: the largest rise "
        f"of a rank's peak resident set"
    )
    print(
        f"{'procs':>5}  {'parallel':<26}{'positions':>10}{'logit cols':>11}{'peak MiB':>10}"
        f"{'x one':>7}"
    )
    for row in steps:
        print(
            f"{row['processes']:>5}  {json.dumps(row['parallel']):<26}{row['positions']:>10}"
            f"{row['vocab_columns']:>11}{row['peak_rise'] / 2**20:>10.1f}{row['ratio']:>7.3f}"
        )
    print(
        json.dumps({"parameters": params, "layouts": rows, "length": args.length, "steps": steps})
    )


if __name__ == "__main__":
    main()
