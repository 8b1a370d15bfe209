"""Teacher scoring: the top-K teacher signal of every sample of prepared data, written to a
cache (local folder or any fsspec URI) that training reads back (:mod:`crosskd.teacher.cache`).

Samples are scored one by one in their own context (a packed row's samples never attend to each
other), grouped into batches by a token budget (samples sorted by length within a shard, each
batch right-padded; padding is masked out of attention and never read back). The signal of each
batch comes from :func:`score_sequences`, which the online mode of training shares.

Output: one signal shard per prepared shard (same name, the same samples in the same order),
written under a temporary name and renamed when complete, then ``manifest.json`` last (format
version 2: per shard its path, samples, tokens, sha256 and bytes, and the total samples; no
index of sample ids: a sample is found by its place in the prepared data). A run writes
``run.json`` first (config, data and teacher fingerprints, device type, dtype and token budget:
everything that changes the stored numbers); a rerun with the same values skips the shards that
exist and scores the rest, so an interrupted run and its rerun give a cache identical to an
uninterrupted run (scoring is deterministic for a given device and batch composition). A rerun
with other values into the same output is refused, and so is a ``run.json`` that is not a JSON
object with exactly those keys (damaged, or from another version), in one line naming the file
and saying to delete the output or choose another.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import fsspec
import numpy as np
import torch
from tqdm import tqdm

from crosskd import __version__
from crosskd.artifacts import start_run, write_whole
from crosskd.data.collate import ModelBatch, load_prepared
from crosskd.errors import CrosskdError
from crosskd.metrics.steps import ScoringMetrics
from crosskd.ranges import footer_record
from crosskd.teacher.model import LoadedTeacher, load_teacher
from crosskd.teacher.signal import (
    SignalError,
    TeacherSignal,
    signal_from_logits,
    signal_from_output_layer,
)
from crosskd.teacher.storage import (
    ENCODINGS,
    SampleSignal,
    batch_signal,
    decode,
    encode,
    signal_samples,
)
from crosskd.tokenization import LoadedTokenizer, load_tokenizer

log = logging.getLogger(__name__)

KIND = "crosskd-teacher-cache"
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
RUN = "run.json"
PARTS = "parts"
"""Folder of the per-range records that :func:`merge_cache` joins into the manifest."""


@dataclass
class ScoreConfig:
    """What ``crosskd score`` does."""

    data: str
    """Prepared data (``crosskd prepare`` output), any fsspec URI."""
    teacher: str
    """The teacher model: HF folder, ``zoo:NAME``, fsspec URI of a folder, or cached hub id."""
    output: str
    """Where the signal shards and ``manifest.json`` go (any fsspec URI)."""
    teacher_index: int = 0
    """Which teacher of the prepared data (``teacher0``, ``teacher1``, ...) this model is."""
    k: int = 128
    """Top-K size (>= 1)."""
    tau: float = 1.0
    """Temperature of the stored log probs (the training config must use the same)."""
    encoding: str = "lossless"
    """``lossless`` (exact float32) or ``lossy`` (8-bit quantised log probs)."""
    token_budget: int = 4096
    """Padded tokens per forward batch."""
    device: str | None = None
    """``cpu``, ``cuda``, ... (default: CUDA when available)."""
    dtype: str | None = None
    """``float32``, ``bfloat16``, ... (default: bfloat16 on GPU, float32 on CPU)."""
    trust_remote_code: bool = False
    """Passed to transformers; off unless you trust the model's code."""
    processes: int = 1
    """Processes that share the teacher (one per GPU of the pod): its weights are sharded over
    them (FSDP2, each holds ~1/N) and each scores its own contiguous part of the shards
    (:mod:`crosskd.teacher.sharded`). The stored numbers do not depend on it."""
    collective_timeout_s: int = 1800
    """With ``processes`` > 1: seconds a collective among them may wait before their process
    group gives up (torch's NCCL default is 600): the first forward pass waits for the slowest
    process to load its part of the teacher, and every pass for the slowest batch."""

    def check(self) -> None:
        """Refuse bad values naming the key."""
        for key in ("processes", "collective_timeout_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CrosskdError(f"{key} is {value!r}; it must be an integer >= 1.")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise CrosskdError(f"k is {self.k!r}; the cache stores a top K, so k must be >= 1.")
        if not isinstance(self.tau, int | float) or not math.isfinite(self.tau) or self.tau <= 0:
            raise CrosskdError(f"tau is {self.tau!r}; it must be a finite number > 0.")
        if self.encoding not in ENCODINGS:
            raise CrosskdError(
                f"encoding is {self.encoding!r}; choose one of {', '.join(ENCODINGS)}."
            )
        if not isinstance(self.token_budget, int) or self.token_budget < 1:
            raise CrosskdError(f"token_budget is {self.token_budget!r}; it must be >= 1.")

    def fingerprint(self) -> str:
        """sha256 of what decides the stored values (k, tau, encoding, teacher index)."""
        keys = {
            "k": self.k,
            "tau": float(self.tau),
            "encoding": self.encoding,
            "teacher_index": self.teacher_index,
        }
        return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()


@torch.no_grad()
def score_sequences(
    teacher: LoadedTeacher, sequences: list[np.ndarray], *, k: int, tau: float
) -> list[SampleSignal]:
    """The signal of each token sequence (int ``[L_i]``), scored together as one right-padded
    batch with an attention mask; log probs (top K, realized at ``tau`` and at 1) in float32
    whatever the model's dtype, within a few float32 ulps of float64 (:func:`signal_from_logits`).
    A teacher with a fusable head (``teacher.head``) hands over its last hidden states instead
    of logits and the signal is computed fused with the head, so the ``tokens x V`` logits never
    exist (:func:`signal_from_output_layer`: the same signal up to the last bits of the
    logits); any other is scored from its logits.
    """
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for b, seq in enumerate(sequences):
        ids[b, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        mask[b, : len(seq)] = 1
    ids, mask = ids.to(teacher.device), mask.to(teacher.device)
    with teacher.lock:
        if teacher.lockstep is not None:
            teacher.lockstep()
        if teacher.head is None:
            logits = teacher.model(input_ids=ids, attention_mask=mask).logits
            _check_vocab(teacher, logits.shape[-1])
            signal = signal_from_logits(logits, ids, k=k, tau=tau)
        else:
            with teacher.head.capture() as captured:
                teacher.model(input_ids=ids, attention_mask=mask)
            (layer,) = captured
            _check_vocab(teacher, layer.weight.shape[0])
            signal = signal_from_output_layer(layer, ids, k=k, tau=tau)
    return signal_samples(signal, [len(s) for s in sequences])


def _check_vocab(teacher: LoadedTeacher, width: int) -> None:
    """Refuse a forward pass that gave ``width`` logits per row (or output-layer rows) where the
    teacher's output layer has ``teacher.vocab_size``."""
    if width != teacher.vocab_size:
        raise SignalError(
            f"teacher {teacher.name} returned {width} logits per row, its output layer has "
            f"{teacher.vocab_size}."
        )


def online_signal(
    score: Callable[[list[np.ndarray]], list[SampleSignal]],
    batch: ModelBatch,
    *,
    k: int,
    tau: float,
    vocab_size: int,
) -> TeacherSignal:
    """The teacher signal of a collated batch scored now (online mode: a teacher in this
    process, or a teacher server): the teacher's side of the batch (``batch.models[
    "teacher0"]``) is split into its samples by ``segment_ids``, ``score`` gives each sample's
    signal in order (top K at ``tau``; :func:`score_all` here, or
    :meth:`crosskd.teacher.remote.TeacherClient.score`), and the signals are laid out as the
    batch's rows (as :meth:`crosskd.teacher.cache.TeacherCache.batch` does for cached signals);
    ``vocab_size``: the teacher's ``V``."""
    ids, segments = batch.input_ids.cpu().numpy(), batch.segment_ids.cpu().numpy()
    sequences, owner = [], []
    for b in range(len(ids)):
        for seg in np.unique(segments[b][segments[b] >= 0]).tolist():
            sequences.append(ids[b][segments[b] == seg])
            owner.append(b)
    signals = score(sequences)
    rows: list[list[SampleSignal]] = [[] for _ in range(len(ids))]
    for b, sig in zip(owner, signals, strict=True):
        rows[b].append(sig)
    return batch_signal(rows, ids.shape[1], k=k, tau=tau, vocab_size=vocab_size)


def score_all(
    teacher: LoadedTeacher, sequences: list[np.ndarray], *, k: int, tau: float, token_budget: int
) -> list[SampleSignal]:
    """The signal of every sequence, in order, scored in :func:`budget_batches`."""
    signals: list = [None] * len(sequences)
    for group in budget_batches([len(s) for s in sequences], token_budget):
        scored = score_sequences(teacher, [sequences[i] for i in group], k=k, tau=tau)
        for i, sig in zip(group, scored, strict=True):
            signals[i] = sig
    return signals


def budget_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices grouped into batches whose padded size (count x longest) stays within
    ``budget`` tokens (a longer sample goes alone), longest first."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def score_shards(
    config: ScoreConfig,
    start: int = 0,
    stop: int | None = None,
    *,
    progress: bool = True,
    metrics: ScoringMetrics | None = None,
    teacher: LoadedTeacher | None = None,
) -> dict:
    """Score the prepared shards ``start .. stop - 1`` (``stop`` None: to the last) into the
    cache at ``config.output`` and record them in ``parts/START-STOP.json`` (written last);
    returns that record. Several of these, over ranges that cover every shard once (one per
    pod), followed by :func:`merge_cache`, write the same cache as :func:`score`. A range whose
    record exists returns it once the run's values are checked (the teacher is loaded); an
    interrupted one keeps its finished shards. ``metrics``: counted as shards are scored (and
    served by the caller; default: counted, not served). ``teacher``: the loaded teacher
    (default: loaded here from ``config``)."""
    config.check()
    fs, root = fsspec.core.url_to_fs(config.output)
    prepared = load_prepared(config.data)
    total = len(prepared.manifest["shards"])
    stop = total if stop is None else stop
    if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop <= total):
        raise CrosskdError(
            f"shard range {start}..{stop} of {config.data}: it has {total} shards; give "
            f"0 <= start < stop <= {total}."
        )
    name = f"teacher{config.teacher_index}"
    metrics = ScoringMetrics(name) if metrics is None else metrics
    models = {m["name"]: m for m in prepared.manifest["models"]}
    if name not in models:
        raise CrosskdError(
            f"teacher_index is {config.teacher_index}, but prepared data {config.data} has "
            f"teachers {', '.join(n for n in models if n != 'student')}."
        )
    if teacher is None:
        teacher = load_teacher(
            config.teacher,
            device=config.device,
            dtype=config.dtype,
            trust_remote_code=config.trust_remote_code,
        )
    tokenizer = _check_tokenizer(teacher, models[name], config)
    begin_cache(
        config,
        prepared.manifest["data_fingerprint"],
        teacher.fingerprint,
        teacher.device,
        teacher.dtype,
    )
    part_path = f"{root}/{PARTS}/{start:05d}-{stop:05d}.json"
    metrics.shards.set(stop - start)
    if fs.exists(part_path):
        metrics.shards_done.set(stop - start)
        log.info(
            "shards %d..%d of %s are scored already (%s)", start, stop - 1, config.output, part_path
        )
        return json.loads(fs.cat_file(part_path))
    bytes_of = tokenizer.bytes.lengths
    shards, n_samples = [], 0
    whole = (start, stop) == (0, total)
    bar = tqdm(
        total=models[name]["tokens"] if whole else None,
        desc=f"score {name}",
        unit="tok",
        unit_scale=True,
        disable=not progress,
    )
    for i in range(start, stop):
        shard = prepared.manifest["shards"][i]
        path = f"{root}/{shard['path']}"
        samples = prepared.shard_samples(i)
        ids = [np.asarray(s[f"{name}_ids"], dtype=np.int64) for s in samples]
        sample_ids = [s["sample_id"] for s in samples]
        if fs.exists(path):
            payload = fs.cat_file(path)
            log.info("shard %s exists (from an earlier run); skipping it", shard["path"])
            signals = [sig for _, sig in decode(payload, config.encoding, config.k)]
        else:
            started = time.perf_counter()
            signals = _score_shard(teacher, ids, config)
            payload = encode(sample_ids, signals, config.encoding)
            write_whole(fs, path, payload)
            metrics.samples.inc(len(ids))
            metrics.tokens.inc(sum(len(x) for x in ids))
            metrics.bytes.inc(len(payload))
            metrics.shard_seconds.observe(time.perf_counter() - started)
        n_samples += len(sample_ids)
        shards.append(
            {
                "path": shard["path"],
                "samples": len(samples),
                "tokens": sum(len(x) for x in ids),
                "sha256": hashlib.sha256(payload).hexdigest(),
                "bytes": len(payload),
                "nll_bits": -sum(float(sig.realized_t1.astype(np.float64).sum()) for sig in signals)
                / math.log(2),
                "predicted_bytes": sum(int(bytes_of[seq[1:]].sum()) for seq in ids),
                **footer_record(payload),
            }
        )
        bar.update(shards[-1]["tokens"])
        metrics.shards_done.inc()
    bar.close()
    part = {
        "start": start,
        "stop": stop,
        "total": total,
        "teacher": {
            "name": config.teacher,
            "fingerprint": teacher.fingerprint,
            "vocab_size": teacher.vocab_size,
        },
        "tokenizer": {"name": models[name]["tokenizer"], "fingerprint": tokenizer.fingerprint},
        "data": {
            "uri": config.data,
            "fingerprint": prepared.manifest["data_fingerprint"],
            "teacher": name,
        },
        "config": asdict(config) | {"fingerprint": config.fingerprint()},
        "shards": shards,
        "samples": n_samples,
    }
    fs.makedirs(f"{root}/{PARTS}", exist_ok=True)
    fs.pipe_file(part_path, json.dumps(part).encode("utf-8"))
    log.info("scored shards %d..%d (%d samples) into %s", start, stop - 1, n_samples, config.output)
    return part


def begin_cache(
    config: ScoreConfig,
    data_fingerprint: str,
    teacher_fingerprint: str,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Write the cache's ``run.json`` (or check it against a resumed run's): everything that
    changes the stored numbers, so a rerun must match to resume."""
    run = {
        "config_fingerprint": config.fingerprint(),
        "data_fingerprint": data_fingerprint,
        "teacher_fingerprint": teacher_fingerprint,
        "device_type": device.type,
        "dtype": str(dtype),
        "token_budget": config.token_budget,
    }
    fs, root = fsspec.core.url_to_fs(config.output)
    start_run(fs, f"{root}/{RUN}", config.output, run, what="a cache", activity="scoring")


def merge_cache(output: str) -> dict:
    """Write the cache manifest at ``output`` from the range records of :func:`score_shards`,
    which must cover every shard of the data (ranges may overlap where a rerun split them
    otherwise: a shard recorded twice must have the same digest); returns the manifest (at
    once when it exists)."""
    fs, root = fsspec.core.url_to_fs(output)
    if fs.exists(f"{root}/{MANIFEST}"):
        return json.loads(fs.cat_file(f"{root}/{MANIFEST}"))
    paths = sorted(fs.glob(f"{root}/{PARTS}/*.json"))
    if not paths:
        raise CrosskdError(
            f"teacher cache {output}: no scored shard ranges under {PARTS}/; run "
            f"`crosskd score` (or the score step) first."
        )
    parts = sorted((json.loads(fs.cat_file(p)) for p in paths), key=lambda p: p["start"])
    total = parts[0]["total"]
    by_index: dict[int, dict] = {}
    for part in parts:
        for key in ("teacher", "tokenizer", "data", "config"):
            if part[key] != parts[0][key]:
                raise CrosskdError(
                    f"teacher cache {output}: shard ranges were scored with another {key}; "
                    f"delete the cache and score it again."
                )
        if part["total"] != total:
            raise CrosskdError(
                f"teacher cache {output}: shard ranges were scored from data of "
                f"{part['total']} and {total} shards; delete the cache and score "
                f"it again."
            )
        for index, entry in enumerate(part["shards"], start=part["start"]):
            seen = by_index.setdefault(index, entry)
            if seen["sha256"] != entry["sha256"]:
                raise CrosskdError(
                    f"teacher cache {output}: shard {index} is recorded twice with different "
                    f"digests (ranges overlap); delete the cache and score it again."
                )
    missing = [i for i in range(total) if i not in by_index]
    if missing:
        raise CrosskdError(
            f"teacher cache {output}: shards {_ranges(missing)} are not scored "
            f"yet; score them, then merge."
        )
    shards = [by_index[i] for i in range(total)]
    first = parts[0]
    tokens = sum(s["tokens"] for s in shards)
    nll_bits = sum(s["nll_bits"] for s in shards)
    predicted_bytes = sum(s["predicted_bytes"] for s in shards)
    config = first["config"]
    manifest = {
        "kind": KIND,
        "format_version": FORMAT_VERSION,
        "created_by": f"crosskd {__version__}",
        "teacher": first["teacher"],
        "tokenizer": first["tokenizer"],
        "data": first["data"],
        "config": config,
        "k": config["k"],
        "tau": float(config["tau"]),
        "encoding": config["encoding"],
        "value_dtype": "float32" if config["encoding"] == "lossless" else "uint8 steps of 1/16 nat",
        "bits_per_byte": nll_bits / predicted_bytes if predicted_bytes else None,
        "tokens": tokens,
        "bytes_per_token": sum(s["bytes"] for s in shards) / max(tokens, 1),
        "shards": [
            {k: v for k, v in s.items() if k not in ("nll_bits", "predicted_bytes")} for s in shards
        ],
        "samples": sum(s["samples"] for s in shards),
    }
    fs.pipe_file(f"{root}/{MANIFEST}", json.dumps(manifest, indent=1).encode("utf-8"))
    log.info(
        "merged %d shard range(s) into %s (%.1f bytes/token)",
        len(parts),
        output,
        manifest["bytes_per_token"],
    )
    return manifest


def _ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0..2, 5..5``."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}..{b}" for a, b in runs)


def _score_shard(
    teacher: LoadedTeacher, ids: list[np.ndarray], config: ScoreConfig
) -> list[SampleSignal]:
    return score_all(teacher, ids, k=config.k, tau=config.tau, token_budget=config.token_budget)


def _check_tokenizer(
    teacher: LoadedTeacher, recorded: dict, config: ScoreConfig
) -> LoadedTokenizer:
    """The teacher folder's tokenizer, which must be the one the data was prepared with."""
    tokenizer = load_tokenizer(str(teacher.folder), vocab_size=teacher.vocab_size)
    if tokenizer.fingerprint != recorded["fingerprint"]:
        raise CrosskdError(
            f"teacher {config.teacher}: its tokenizer has fingerprint {tokenizer.fingerprint}, but "
            f"{recorded['name']} of {config.data} was prepared with {recorded['tokenizer']} "
            f"(fingerprint {recorded['fingerprint']}); prepare the data with this teacher's "
            f"tokenizer or score with the matching teacher."
        )
    return tokenizer
