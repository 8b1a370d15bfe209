"""``crosskd prepare``: raw rows -> clipped, aligned, lockstep-packed Parquet shards + manifest.

For every row (text or chat): NFC-normalise once when any tokenizer normalises (so no tokenizer
changes bytes under the offsets), clip to the longest prefix every model holds, render and
tokenize with each model, align the student with every teacher, then pack all models in
lockstep (first-fit-decreasing over the vector of per-model lengths; every model's packed row
holds the same samples in the same order) or, unpacked, one sample per row.

Output (any fsspec URI): ``part-NNNNN.parquet`` shards, rows sorted by packed row (``bin``) with
whole bins per shard, and ``manifest.json`` (kind, format version, fingerprints, options, rows,
clipped rows, tokens per model, chunk shapes per teacher, bins, packing efficiency, per-shard
row counts and sha256). Every row is read and aligned before anything is written; shards go to
a staging folder first and the manifest is written last, so a failed run leaves no output that
looks complete.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import unicodedata
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field

import fsspec
import numpy as np
from tqdm.auto import tqdm

from crosskd import __version__
from crosskd.alignment import (
    SHAPE_NAMES,
    AlignedSample,
    ChatOptions,
    align_chat,
    align_text,
    render,
    render_text,
    split_reasoning,
)
from crosskd.data.clipping import clip_text
from crosskd.data.packing import pack_lockstep, packing_efficiency
from crosskd.data.records import Record, read_records
from crosskd.errors import DataError
from crosskd.tokenization import LoadedTokenizer, load_tokenizer

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
KIND = "crosskd.prepared-data"
FORMAT_VERSION = 1
FLAG_CORRECT, FLAG_PREDICTION, FLAG_KD = 1, 2, 4
"""Bits of the ``chunk_flags`` column."""


@dataclass
class PrepareConfig:
    """What ``crosskd prepare`` does. Lengths are token counts."""

    data: str
    """Input rows: JSONL, Parquet, a ``datasets`` folder, or a folder/glob of shards (any URI)."""
    student_tokenizer: str
    """The student's tokenizer (folder, tokenizer.json, ``zoo:NAME``, URI or cached hub id)."""
    teacher_tokenizers: list[str]
    """One tokenizer per teacher, in teacher order (``teacher0``, ``teacher1``, ...)."""
    output: str
    """Where shards and ``manifest.json`` go (must not already hold a manifest)."""
    text_column: str = "text"
    messages_column: str = "messages"
    id_column: str | None = "id"
    """Column with durable sample ids; rows without one get a content hash."""
    max_length: int = 2048
    """Student capacity: longest sample, and packed row length."""
    teacher_max_length: int | None = None
    """Teacher capacity (default: ``max_length``)."""
    pack: bool = True
    """Lockstep packing; off: one sample per row, padded by the collator."""
    included_regions: list[str] = field(default_factory=lambda: ["reasoning", "close", "answer"])
    """Chat regions whose chunks count for KD and whose tokens count for CE."""
    drop_first_chunk: bool = False
    """Leave the first chunk of each assistant message out of KD."""
    shard_rows: int = 4096
    """Samples per Parquet shard (whole packed rows per shard)."""


def model_names(n_teachers: int) -> list[str]:
    """``["student", "teacher0", ...]``: the names of the models in columns and the manifest."""
    return ["student", *(f"teacher{k}" for k in range(n_teachers))]


def prepare(config: PrepareConfig, *, progress: bool = True) -> dict:
    """Run the preparation; returns the manifest that was written."""
    fs, root = fsspec.core.url_to_fs(config.output)
    if fs.exists(f"{root}/{MANIFEST}"):
        raise DataError(
            f"output {config.output} already holds prepared data ({MANIFEST}); choose a new "
            f"output or remove the old one."
        )
    student = load_tokenizer(config.student_tokenizer)
    teachers = [load_tokenizer(t) for t in config.teacher_tokenizers]
    if not teachers:
        raise DataError("prepare needs at least one teacher tokenizer (--teacher-tokenizer).")
    models = [student, *teachers]
    capacities = [config.max_length] + [config.teacher_max_length or config.max_length] * len(
        teachers
    )
    nfc = any(_normalizes_nfc(t) for t in models)
    options = ChatOptions(tuple(config.included_regions), config.drop_first_chunk)
    records = list(
        read_records(
            config.data,
            text_column=config.text_column,
            messages_column=config.messages_column,
            id_column=config.id_column,
        )
    )
    if not records:
        raise DataError(f"data {config.data} has no rows; nothing to prepare.")
    rows = []
    for record in tqdm(records, desc="align", unit="row", disable=not progress):
        rows.append(_prepare_row(record, models, capacities, nfc, options))
    lengths = np.array([row["lengths"] for row in rows], dtype=np.int64)
    bins = (
        pack_lockstep(lengths, capacities)
        if config.pack
        else [np.array([i]) for i in range(len(rows))]
    )
    manifest = _manifest(config, models, capacities, nfc, rows, lengths, bins)
    _write(fs, root, config, rows, bins, manifest)
    log.info("prepared %d rows into %d packed rows at %s", len(rows), len(bins), config.output)
    return manifest


def _normalizes_nfc(tok: LoadedTokenizer) -> bool:
    node = tok.backend_json.get("normalizer") or {}
    return "NFC" in json.dumps(node)


def _nfc(record: Record) -> Record:
    def fold(text: str | None) -> str | None:
        return None if text is None else unicodedata.normalize("NFC", text)

    messages = None
    if record.messages is not None:
        messages = [
            {**m, **{k: fold(m[k]) for k in ("content", "reasoning_content") if m.get(k)}}
            for m in record.messages
        ]
    return Record(record.sample_id, fold(record.text), messages, record.source, record.row)


def _prepare_row(
    record: Record,
    models: list[LoadedTokenizer],
    capacities: list[int],
    nfc: bool,
    options: ChatOptions,
) -> dict:
    if nfc:
        record = _nfc(record)
    student, teachers = models[0], models[1:]
    if record.text is not None:
        clip = clip_text(record.text, models, capacities)
        text, clipped, original = clip.text, clip.clipped, clip.original_lengths
        s_view = render_text(student, text)
        aligned = [align_text(student, t, text, student=s_view) for t in teachers]
        messages = None
    else:
        messages, clipped, original = _fit_chat(record, models, capacities)
        s_view = render(student, messages, sample_id=record.sample_id)
        aligned = [
            align_chat(student, t, messages, sample_id=record.sample_id, options=options,
                       student=s_view)
            for t in teachers
        ]  # fmt: skip
        text = None
    lengths = [len(s_view.tokens), *(len(a.teacher.tokens) for a in aligned)]
    return {
        "record": record,
        "text": text,
        "messages": messages,
        "clipped": clipped,
        "original_lengths": list(original),
        "lengths": lengths,
        "student": s_view,
        "aligned": aligned,
    }


def _chat_lengths(messages: list[dict], models: list[LoadedTokenizer], sample_id: str) -> list:
    return [len(render(tok, messages, sample_id=sample_id).tokens) for tok in models]


def _fit_chat(
    record: Record, models: list[LoadedTokenizer], capacities: list[int]
) -> tuple[list[dict], bool, list[int]]:
    """The longest conversation prefix (ending with an assistant message) every model holds;
    if even the first assistant turn is too long, its content is clipped by bisection."""
    messages = split_reasoning(record.messages)
    sid = record.sample_id
    original = _chat_lengths(messages, models, sid)
    if all(n <= c for n, c in zip(original, capacities, strict=True)):
        return messages, False, original
    ends = [i + 1 for i, m in enumerate(messages) if m["role"] == "assistant"]
    for end in reversed(ends):
        if _fits(messages[:end], models, capacities, sid):
            return messages[:end], True, original
    first = messages[: ends[0]]
    answer = first[-1]["content"]
    lo, hi = -1, len(answer)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        trial = [*first[:-1], {**first[-1], "content": answer[:mid]}]
        if _fits(trial, models, capacities, sid):
            lo = mid
        else:
            hi = mid
    if lo < 0:
        prompt_only = [*first[:-1], {**first[-1], "content": ""}]
        raise DataError(
            f"sample {sid} ({record.source}, row {record.row}): even with an empty answer the "
            f"conversation needs {_chat_lengths(prompt_only, models, sid)} tokens, over the "
            f"capacities {capacities}; raise --max-length or drop the sample."
        )
    return [*first[:-1], {**first[-1], "content": answer[:lo]}], True, original


def _fits(messages: list[dict], models: list, capacities: list[int], sample_id: str) -> bool:
    lengths = _chat_lengths(messages, models, sample_id)
    return all(n <= c for n, c in zip(lengths, capacities, strict=True))


def _manifest(
    config: PrepareConfig,
    models: list[LoadedTokenizer],
    capacities: list[int],
    nfc: bool,
    rows: list[dict],
    lengths: np.ndarray,
    bins: list[np.ndarray],
) -> dict:
    names = model_names(len(models) - 1)
    shapes = []
    for k in range(len(models) - 1):
        counts = Counter()
        for row in rows:
            counts.update(SHAPE_NAMES[s] for s in row["aligned"][k].chunks.shape.tolist())
        shapes.append({name: counts.get(name, 0) for name in SHAPE_NAMES})
    fallback = [False] * len(models)
    for row in rows:
        fallback[0] |= row["student"].fallback_template
        for k, aligned in enumerate(row["aligned"]):
            fallback[k + 1] |= aligned.teacher.fallback_template
    return {
        "kind": KIND,
        "format_version": FORMAT_VERSION,
        "created_by": f"crosskd {__version__}",
        "source": config.data,
        "config": asdict(config),
        "models": [
            {
                "name": name,
                "tokenizer": tok.name,
                "fingerprint": tok.fingerprint,
                "vocab_size": tok.vocab_size,
                "capacity": capacities[m],
                "chatml_fallback": fallback[m],
                "tokens": int(lengths[:, m].sum()),
            }
            for m, (name, tok) in enumerate(zip(names, models, strict=True))
        ],
        "nfc_normalized": nfc,
        "rows": len(rows),
        "clipped_rows": sum(bool(row["clipped"]) for row in rows),
        "chunk_shapes": dict(zip(names[1:], shapes, strict=True)),
        "packing": {
            "packed": config.pack,
            "bins": len(bins),
            "efficiency": dict(
                zip(names, packing_efficiency(lengths, bins, capacities), strict=True)
            ),
        },
        "shards": [],
    }


def _columns(rows: list[dict], order: np.ndarray, bin_of: np.ndarray, n_teachers: int) -> dict:
    """Column name -> list of values for the rows in ``order``."""
    names = ["sample_id", "source", "row", "text", "messages", "clipped", "original_lengths"]
    names += ["bin", "student_ids", "student_loss_mask"]
    cols: dict[str, list] = {name: [] for name in names}
    for k in range(n_teachers):
        for suffix in ("ids", "chunk_s0", "chunk_s1", "chunk_t0", "chunk_t1", "chunk_shape",
                       "chunk_flags", "chunk_region", "chunk_message"):  # fmt: skip
            cols[f"teacher{k}_{suffix}"] = []
    for i in order.tolist():
        row = rows[i]
        record = row["record"]
        cols["sample_id"].append(record.sample_id)
        cols["source"].append(record.source)
        cols["row"].append(record.row)
        cols["text"].append(row["text"])
        cols["messages"].append(None if row["messages"] is None else json.dumps(row["messages"]))
        cols["clipped"].append(bool(row["clipped"]))
        cols["original_lengths"].append(row["original_lengths"])
        cols["bin"].append(int(bin_of[i]))
        cols["student_ids"].append(row["student"].tokens.ids.astype(np.int32))
        cols["student_loss_mask"].append(row["aligned"][0].loss_mask)
        for k, aligned in enumerate(row["aligned"]):
            _teacher_columns(cols, f"teacher{k}", aligned)
    return cols


def _teacher_columns(cols: dict, name: str, aligned: AlignedSample) -> None:
    chunks = aligned.chunks
    flags = (
        chunks.is_correct * FLAG_CORRECT
        + chunks.has_prediction * FLAG_PREDICTION
        + aligned.kd_mask * FLAG_KD
    ).astype(np.uint8)
    cols[f"{name}_ids"].append(aligned.teacher.tokens.ids.astype(np.int32))
    cols[f"{name}_chunk_s0"].append(chunks.student[:, 0].astype(np.int32))
    cols[f"{name}_chunk_s1"].append(chunks.student[:, 1].astype(np.int32))
    cols[f"{name}_chunk_t0"].append(chunks.teacher[:, 0].astype(np.int32))
    cols[f"{name}_chunk_t1"].append(chunks.teacher[:, 1].astype(np.int32))
    cols[f"{name}_chunk_shape"].append(chunks.shape)
    cols[f"{name}_chunk_flags"].append(flags)
    cols[f"{name}_chunk_region"].append(aligned.chunk_region)
    cols[f"{name}_chunk_message"].append(aligned.chunk_message)


def _write(
    fs: fsspec.AbstractFileSystem,
    root: str,
    config: PrepareConfig,
    rows: list[dict],
    bins: list[np.ndarray],
    manifest: dict,
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    bin_of = np.empty(len(rows), dtype=np.int64)
    for b, members in enumerate(bins):
        bin_of[members] = b
    staging = f"{root}/.staging-{uuid.uuid4().hex[:8]}"
    fs.makedirs(staging, exist_ok=True)
    shards, start = [], 0
    try:
        while start < len(bins):
            stop, count = start, 0
            while stop < len(bins) and (count == 0 or count + len(bins[stop]) <= config.shard_rows):
                count += len(bins[stop])
                stop += 1
            order = np.concatenate(bins[start:stop])
            table = pa.table(_columns(rows, order, bin_of, len(rows[0]["aligned"])))
            buffer = io.BytesIO()
            pq.write_table(table, buffer)
            name = f"part-{len(shards):05d}.parquet"
            payload = buffer.getvalue()
            fs.pipe_file(f"{staging}/{name}", payload)
            shards.append({"path": name, "rows": len(order), "bins": [start, stop],
                           "sha256": hashlib.sha256(payload).hexdigest()})  # fmt: skip
            start = stop
        for shard in shards:
            fs.mv(f"{staging}/{shard['path']}", f"{root}/{shard['path']}")
        manifest["shards"] = shards
        fs.pipe_file(f"{root}/{MANIFEST}", json.dumps(manifest, indent=2).encode("utf-8"))
    except BaseException:
        for shard in shards:
            if fs.exists(f"{root}/{shard['path']}"):
                fs.rm(f"{root}/{shard['path']}")
        raise
    finally:
        if fs.exists(staging):
            fs.rm(staging, recursive=True)
