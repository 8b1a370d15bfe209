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
import json
import logging
import unicodedata
from collections import Counter
from dataclasses import asdict, dataclass, field

import fsspec
import numpy as np
from tqdm.auto import tqdm

from crosskd import __version__
from crosskd.alignment import (
    SHAPE_NAMES,
    ChatOptions,
    align_chat,
    align_text,
    harmonize_reasoning,
    render,
    render_text,
)
from crosskd.data.clipping import clip_text
from crosskd.data.packing import pack_lockstep, packing_efficiency
from crosskd.data.records import Record, read_records
from crosskd.data.shards import MANIFEST, write_shards
from crosskd.errors import DataError
from crosskd.tokenization import LoadedTokenizer, load_tokenizer

log = logging.getLogger(__name__)

KIND = "crosskd.prepared-data"
FORMAT_VERSION = 1


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
    nfc = any(t.normalizes_nfc for t in models)
    strip = any(_template_strips(t) for t in models)
    unknown = sorted(set(config.included_regions) - {"reasoning", "close", "answer"})
    if unknown:
        raise DataError(
            f"included_regions: {unknown} are not regions; choose from reasoning, close, answer."
        )
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
        rows.append(_prepare_row(record, models, capacities, nfc, strip, options))
    lengths = np.array([row["lengths"] for row in rows], dtype=np.int64)
    bins = (
        pack_lockstep(lengths, capacities)
        if config.pack
        else [np.array([i]) for i in range(len(rows))]
    )
    manifest = _manifest(config, models, capacities, nfc, rows, lengths, bins)
    manifest["content_stripped"] = strip
    manifest["data_fingerprint"] = _data_fingerprint(rows)
    write_shards(fs, root, config.shard_rows, rows, bins, manifest)
    log.info("prepared %d rows into %d packed rows at %s", len(rows), len(bins), config.output)
    return manifest


def _data_fingerprint(rows: list[dict]) -> str:
    """sha256 of the canonical JSON of every prepared sample's id and text or messages."""
    payload = [[r["record"].sample_id, r["text"], r["messages"]] for r in rows]
    canonical = json.dumps(payload, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _template_strips(tok: LoadedTokenizer) -> bool:
    """Whether ``tok``'s chat template strips whitespace around message content (Llama-3's
    ``| trim``): then content is stripped once for every model, so all read what their own
    template would show."""
    if not tok.hf.chat_template:
        return False
    probe = [{"role": "user", "content": " \uE002 "}, {"role": "assistant", "content": " \uE003 "}]
    rendered = tok.hf.apply_chat_template(probe, tokenize=False)
    return " \uE003 " not in rendered


def _stripped(record: Record) -> Record:
    messages = [
        {**m, **{k: m[k].strip() for k in ("content", "reasoning_content") if m.get(k)}}
        for m in record.messages
    ]
    return Record(record.sample_id, record.text, messages, record.source, record.row)


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
    strip: bool,
    options: ChatOptions,
) -> dict:
    if nfc:
        record = _nfc(record)
    if strip and record.messages is not None:
        record = _stripped(record)
    student, teachers = models[0], models[1:]
    if record.text is not None:
        clip = clip_text(record.text, models, capacities)
        text, clipped, original = clip.text, clip.clipped, clip.original_lengths
        s_view = render_text(student, text)
        aligned = [align_text(student, t, text, student=s_view) for t in teachers]
        messages = None
    else:
        messages, clipped, original, cut = _fit_chat(record, models, capacities)
        s_view = render(student, messages, sample_id=record.sample_id)
        aligned = [
            align_chat(student, t, messages, sample_id=record.sample_id, options=options,
                       student=s_view, clipped_message=cut)
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
) -> tuple[list[dict], bool, list[int], int | None]:
    """The longest conversation prefix (ending with an assistant message) every model holds.
    If even the first assistant turn is too long, its answer is clipped by bisection, and if an
    empty answer is still too long, its reasoning is. Returns the messages, whether they were
    clipped, the original lengths, and the index of a message whose text was cut (or None)."""
    messages = harmonize_reasoning(models, record.messages)
    sid = record.sample_id
    original = _chat_lengths(messages, models, sid)
    if all(n <= c for n, c in zip(original, capacities, strict=True)):
        return messages, False, original, None
    ends = [i + 1 for i, m in enumerate(messages) if m["role"] == "assistant"]
    for end in reversed(ends):
        if _fits(messages[:end], models, capacities, sid):
            return messages[:end], True, original, None
    first = messages[: ends[0]]
    last = len(first) - 1
    for key in ("content", "reasoning_content"):
        if not first[last].get(key):
            continue
        cut = _longest_prefix(first, key, models, capacities, sid)
        if cut is not None:
            return cut, True, original, last
        first = [*first[:last], {**first[last], key: ""}]
    raise DataError(
        f"sample {sid} ({record.source}, row {record.row}): even with an empty first answer the "
        f"conversation needs {_chat_lengths(first, models, sid)} tokens, over the capacities "
        f"{capacities}; raise --max-length or drop the sample."
    )


def _longest_prefix(
    messages: list[dict], key: str, models: list, capacities: list[int], sid: str
) -> list[dict] | None:
    """``messages`` with the last message's ``key`` cut to its longest fitting prefix (at
    least one character), or None."""
    text = messages[-1][key]
    lo, hi = 0, len(text)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fits([*messages[:-1], {**messages[-1], key: text[:mid]}], models, capacities, sid):
            lo = mid
        else:
            hi = mid
    if lo == 0:
        return None
    return [*messages[:-1], {**messages[-1], key: text[:lo]}]


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
