"""Inputs and measurements shared by the benchmark scripts (not a benchmark itself)."""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from crosskd.alignment.corpus import benchmark_corpus
from crosskd.data.collate import Batch, collate, load_prepared
from crosskd.data.prepare import PrepareConfig, prepare
from crosskd.loss import LossConfig, LossPlan, TeacherBatch, TeacherLossConfig, plan_loss
from crosskd.projection import Projection
from crosskd.tables import TablePair, build_table
from crosskd.teacher import TeacherSignal, signal_from_logits
from crosskd.teacher.storage import batch_signal, signal_samples
from crosskd.tokenization import LoadedTokenizer, load_tokenizer
from crosskd.zoo.models import init_llama

BIAS = 8.0
"""Added to the teacher's logit of each realized token, so the top K holds realized tokens and
other candidates as a trained teacher's would."""


def rss() -> tuple[int, int]:
    """Current and peak resident set of this process, bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def write_benchmark_jsonl(
    path: Path, n_bytes: int, *, document_bytes: int, pool_bytes: int = 2_000_000
) -> int:
    """JSON Lines (``{"id", "text"}``) of at least ``n_bytes`` UTF-8 bytes of text, in
    documents of about ``document_bytes`` bytes: :func:`benchmark_corpus` of ``pool_bytes``
    (or ``n_bytes`` where smaller), repeated with new ids as often as needed; returns the
    bytes of text written."""
    documents = benchmark_corpus(min(n_bytes, pool_bytes), document_bytes=document_bytes)
    total = n = 0
    with path.open("w", encoding="utf-8") as f:
        while total < n_bytes:
            for document in documents:
                f.write(json.dumps({"id": f"d{n}", "text": document}, ensure_ascii=False) + "\n")
                total += len(document.encode("utf-8"))
                n += 1
                if total >= n_bytes:
                    break
    return total


def measure(step: Callable[[], None], repeat: int, device: str = "cpu") -> tuple[float, int]:
    """Median seconds of ``repeat`` calls of ``step`` (after one untimed warm-up call), and the
    largest peak-memory rise, bytes: of the process's resident set on the CPU, of the CUDA
    allocator's peak over what was allocated before the call on ``device`` ``cuda`` (times
    synchronised).

    On the CPU, before each call the heap's free memory goes back to the system
    (``malloc_trim``), so memory an earlier step freed but the allocator kept does not hide this
    step's peak."""
    cuda = torch.device(device).type == "cuda"
    step()
    times, peaks = [], []
    libc = ctypes.CDLL("libc.so.6")
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            gc.collect()
            libc.malloc_trim(0)
            Path("/proc/self/clear_refs").write_text("5")
            before, _ = rss()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        peaks.append((torch.cuda.max_memory_allocated() if cuda else rss()[1]) - before)
    return statistics.median(times), max(peaks)


INIT_SHAPE = {
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "intermediate_size": 3072,
}
"""``--init``'s default teacher shape: Qwen3-0.6B's width and depth (tied embeddings, as that
model has); a Llama, so its heads are 64 wide (Qwen3's 128) and it has no q/k norms: about 0.5B
parameters on Qwen3's vocabulary."""


def add_init_options(parser: argparse.ArgumentParser) -> None:
    """``--init TOKENIZER`` and ``--init-shape JSON``: a random-init teacher (scoring's and
    serving's cost does not depend on the weights' values; nothing to download, so a GPU machine
    without the SmolLM2 weights can run the benchmark)."""
    parser.add_argument(
        "--init", default=None, metavar="TOKENIZER", help="a random-init teacher on this tokenizer"
    )
    parser.add_argument(
        "--init-shape",
        type=json.loads,
        default=INIT_SHAPE,
        metavar="JSON",
        help="--init: the model's shape, keys of crosskd.zoo.models.SHAPE_KEYS (default: "
        "Qwen3-0.6B's)",
    )
    parser.add_argument(
        "--init-dir",
        default=None,
        metavar="DIR",
        help="--init: keep the model here, and reuse the one already there (default: a "
        "temporary folder)",
    )


def init_teacher(args: argparse.Namespace, work: Path) -> str | None:
    """With ``--init``, the folder of a random-init Llama of ``--init-shape`` on that tokenizer
    (:func:`crosskd.zoo.models.init_llama`, seed 0, saved into ``--init-dir`` or else
    ``work``; a folder that holds one already is reused as it is); else None."""
    if not args.init:
        return None
    folder = Path(args.init_dir) if args.init_dir else work
    if not (folder / "model.safetensors").exists():  # built aside, so a killed run leaves none
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        init_llama(partial, args.init, args.init_shape, seed=0)
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)
    return str(folder)


def device_name(device: str) -> str:
    """The card's name with torch's and CUDA's versions for a ``cuda`` device, else ``device``."""
    if torch.device(device).type != "cuda":
        return device
    name = torch.cuda.get_device_name(device)
    return f"{name} (torch {torch.__version__}, CUDA {torch.version.cuda})"


def real_batch(student: str, teacher: str, rows: int, length: int, work: Path) -> Batch:
    """The ``rows`` longest packed rows of benchmark text (:func:`benchmark_corpus`, 200 kB)
    prepared by :func:`prepare` for zoo tokenizers ``student`` and one ``teacher`` (rows of at
    most ``length`` student tokens), collated."""
    work.mkdir(parents=True, exist_ok=True)
    data = work / f"{student}.jsonl"
    with data.open("w") as fh:
        for i, text in enumerate(benchmark_corpus(200_000)):
            fh.write(json.dumps({"id": str(i), "text": text}) + "\n")
    config = PrepareConfig(
        data=str(data),
        student_tokenizer=f"zoo:{student}",
        teacher_tokenizers=[f"zoo:{teacher}"],
        output=str(work / f"{student}-prepared"),
        max_length=length,
        teacher_max_length=2 * length,
    )
    prepare(config, progress=False)
    packed = list(load_prepared(config.output).packed_rows())
    packed.sort(key=lambda row: -sum(len(s["student_ids"]) for s in row))
    return collate(packed[:rows], n_teachers=1)


def teacher_logits(teacher_ids: torch.Tensor, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Random float32 teacher logits ``[B, L_t, vocab]`` biased towards the realized tokens, on
    the generator's device (a CUDA generator makes them on the GPU, many times faster than the
    CPU's one-thread generator at long rows and wide vocabularies)."""
    logits = torch.randn(*teacher_ids.shape, vocab, generator=gen, device=gen.device)
    realized = teacher_ids[:, 1:, None].to(gen.device)
    bias = torch.full(realized.shape, BIAS, device=gen.device)
    logits[:, :-1].scatter_add_(-1, realized, bias)
    return logits


def sample_signal(
    batch: Batch, vocab: int, k: int, gen: torch.Generator, tau: float = 1.0
) -> TeacherSignal:
    """A top-K teacher signal at ``tau`` of the batch's teacher rows from :func:`teacher_logits`,
    computed sample by sample as the scorer does, so that only one sample's logits exist at a
    time (long rows: ``rows x L_t x V_T`` logits would not fit), laid out as the batch's rows;
    on the generator's device, the signal itself on the CPU."""
    side = batch.models["teacher0"]
    ids, segments = side.input_ids.numpy(), side.segment_ids.numpy()
    rows = []
    for b in range(len(ids)):
        row = []
        for segment in np.unique(segments[b][segments[b] >= 0]).tolist():
            sequence = torch.from_numpy(ids[b][segments[b] == segment])[None].to(gen.device)
            logits = teacher_logits(sequence, vocab, gen)
            signal = signal_from_logits(logits, sequence, k=k, tau=tau)
            row += signal_samples(signal, [sequence.shape[1]])
        rows.append(row)
    return batch_signal(rows, ids.shape[1], k=k, tau=tau, vocab_size=vocab)


def zoo_pair(student: str, teacher: str) -> tuple[LoadedTokenizer, LoadedTokenizer, TablePair]:
    """Two zoo tokenizers and the table pair between them (built in memory)."""
    s_tok, t_tok = load_tokenizer(f"zoo:{student}"), load_tokenizer(f"zoo:{teacher}")
    pair = TablePair(
        build_table(s_tok, t_tok, progress=False), build_table(t_tok, s_tok, progress=False)
    )
    return s_tok, t_tok, pair


def csd_plan(
    batch: Batch,
    signal: TeacherSignal,
    pair: TablePair,
    k: int,
    student_vocab: int,
    tau: float = 1.0,
    projection: tuple[str, Projection | None] | None = None,
) -> tuple[LossConfig, LossPlan]:
    """The default loss config (one cross-tokenizer teacher at top-K ``k``, temperature
    ``tau``; with ``projection`` (another algorithm, and its projection or None for ``uld``)
    that algorithm in place of CSD) and the plan of ``batch`` with teacher ``signal``."""
    algorithm = {} if projection is None else {"algorithm": projection[0]}
    if projection is not None and projection[1] is not None:
        algorithm["projection"] = "w"
    config = LossConfig(
        tau=tau,
        teachers=[
            TeacherLossConfig(
                k=k,
                student_to_teacher="s2t",
                teacher_to_student="t2s",
                **algorithm,
            )
        ],
    )
    teacher = TeacherBatch(batch.models["teacher0"].input_ids, batch.chunks[0], signal)
    plan = plan_loss(
        config,
        batch.models["student"].input_ids,
        batch.loss_mask,
        [teacher],
        [pair],
        student_vocab=student_vocab,
        projections=[None if projection is None else projection[1]],
    )
    return config, plan
