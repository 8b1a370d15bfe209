"""``crosskd prepare``: raw rows -> clipped, aligned, lockstep-packed Parquet shards + manifest.

:class:`PrepareConfig` checks every value when it is built (and :func:`prepare` again before it
loads any tokenizer): a bad one is refused with a one-line
:class:`~crosskd.errors.ConfigError` naming the key, the value and what is allowed.

For every row (text or chat): NFC-normalise once when any tokenizer normalises (so no tokenizer
changes bytes under the offsets), clip to the longest prefix every model holds, render and
tokenize with each model, align the student with every cross-tokenizer teacher, then pack all
models in lockstep (first-fit-decreasing over the vector of per-model lengths; every model's
packed row holds the same samples in the same order) or, unpacked, one sample per row.

**Same-tokenizer teachers** (tokenizer fingerprint equal to the student's; spec section 5, "Same
tokenizer") are not aligned: their token ids are the student's, and the loss compares them
position by position. Their manifest model entry says ``"same_tokenizer": true`` (false for
aligned teachers), they have no entry in ``chunk_shapes``, and their shard columns keep the one
schema of every teacher (:mod:`crosskd.data.shards`): ``teacher{k}_ids`` is a copy of the
student's ids, the chunk range columns (``chunk_s0/s1/t0/t1``) are null, and
``chunk_shape/flags/region/message`` hold one entry per student token (token ``p`` is entry
``p``): shape ``1:1`` (``special`` for an added/special token), flags ``FLAG_CORRECT``,
``FLAG_PREDICTION`` unless ``p`` is the sample's first token, and ``FLAG_KD`` when the token is
a KD position. KD positions (:func:`crosskd.alignment.own.student_tokens`): plain text, every
token; chat, the tokens the student's own CE loss mask covers (the included regions of every
assistant message plus the end-of-turn token when ``answer`` is included: the tokens that the
alignment of the student with itself marks ``FLAG_KD``), less, under ``drop_first_chunk``, the
first position of each assistant message (one token, where that alignment would drop the whole
first chunk, e.g. every byte piece of a leading emoji). The student's ``student_loss_mask`` (CE
targets) is that own mask too, whatever the teachers (spec section 2: the student's assistant
content tokens and its end-of-turn token, even when a teacher's template writes none).

Output (any fsspec URI): ``part-NNNNN.parquet`` shards, rows sorted by packed row (``bin``) with
whole bins per shard, and ``manifest.json`` (kind, format version, fingerprints, options, rows,
clipped rows, tokens per model, chunk shapes per aligned teacher, bins, packing efficiency,
per-shard row counts and sha256). Format version 2 (version 1 stored a same-tokenizer teacher
as an alignment of the student with itself). Every row is read and aligned before anything is
written; shards go to a staging folder first and the manifest is written last, so a failed run
leaves no output that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import unicodedata
from collections import Counter
from collections.abc import Callable
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
    harmonize_reasoning,
    render,
    render_text,
)
from crosskd.alignment.own import student_tokens
from crosskd.data.clipping import clip_text
from crosskd.data.packing import pack_lockstep, packing_efficiency
from crosskd.data.records import Record, read_records
from crosskd.data.shards import (
    MANIFEST,
    SameTokenizerSample,
    same_tokenizer_sample,
    write_shards,
)
from crosskd.errors import ConfigError, DataError
from crosskd.tokenization import LoadedTokenizer, load_tokenizer

log = logging.getLogger(__name__)

KIND = "crosskd.prepared-data"
FORMAT_VERSION = 2
CHAT_REGIONS = ("reasoning", "close", "answer")
"""The names ``included_regions`` chooses from."""


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

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Refuse a bad value with a :class:`ConfigError` naming the key, the value and what is
        allowed (no tokenizer is loaded, no file is read)."""
        for key in ("data", "student_tokenizer", "output", "text_column", "messages_column"):
            _text(key, getattr(self, key))
        if self.id_column is not None:
            _text("id_column", self.id_column, "a column name, or null for content hashes")
        teachers = self.teacher_tokenizers
        if not isinstance(teachers, list | tuple) or not teachers:
            raise ConfigError(
                f"teacher_tokenizers is {teachers!r}; it must be a non-empty list of teacher "
                f"tokenizers (one per teacher: folder, tokenizer.json, zoo:NAME, URI or hub id)."
            )
        for i, value in enumerate(teachers):
            _text(f"teacher_tokenizers[{i}]", value)
        for key in ("max_length", "shard_rows"):
            _count(key, getattr(self, key))
        if self.teacher_max_length is not None:
            _count("teacher_max_length", self.teacher_max_length, "an integer >= 1, or null "
                   "for max_length")  # fmt: skip
        for key in ("pack", "drop_first_chunk"):
            value = getattr(self, key)
            if not isinstance(value, bool):
                raise ConfigError(f"{key} is {value!r}; it must be true or false.")
        regions = self.included_regions
        choose = ", ".join(CHAT_REGIONS)
        if not isinstance(regions, list | tuple) or not regions:
            raise ConfigError(
                f"included_regions is {regions!r}; it must be a non-empty list of chat regions "
                f"chosen from {choose}."
            )
        unknown = [r for r in regions if not isinstance(r, str) or r not in CHAT_REGIONS]
        if unknown:
            raise ConfigError(
                f"included_regions is {regions!r}: {unknown!r} are not regions; choose from "
                f"{choose}."
            )


def _text(key: str, value: object, allowed: str = "a non-empty string") -> None:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{key} is {value!r}; it must be {allowed}.")


def _count(key: str, value: object, allowed: str = "an integer >= 1") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key} is {value!r}; it must be {allowed}.")


def model_names(n_teachers: int) -> list[str]:
    """``["student", "teacher0", ...]``: the names of the models in columns and the manifest."""
    return ["student", *(f"teacher{k}" for k in range(n_teachers))]


def prepare(config: PrepareConfig, *, progress: bool = True,
            on_row: Callable[[str | None], None] | None = None) -> dict:  # fmt: skip
    """Run the preparation; returns the manifest that was written. ``on_row`` is called once
    per prepared row with why it was clipped (``text``, ``turns``, ``message``; None: whole)."""
    config.check()
    fs, root = fsspec.core.url_to_fs(config.output)
    if fs.exists(f"{root}/{MANIFEST}"):
        raise DataError(
            f"output {config.output} already holds prepared data ({MANIFEST}); choose a new "
            f"output or remove the old one."
        )
    student = load_tokenizer(config.student_tokenizer)
    teachers = [load_tokenizer(t) for t in config.teacher_tokenizers]
    models = [student, *teachers]
    same = [t.fingerprint == student.fingerprint for t in teachers]
    capacities = [config.max_length] + [config.teacher_max_length or config.max_length] * len(
        teachers
    )
    nfc = any(t.normalizes_nfc for t in models)
    strip = any(_template_strips(t) for t in models)
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
        rows.append(_prepare_row(record, models, capacities, nfc, strip, options, same))
        if on_row is not None:
            on_row(rows[-1]["clip_reason"])
    lengths = np.array([row["lengths"] for row in rows], dtype=np.int64)
    bins = (
        pack_lockstep(lengths, capacities)
        if config.pack
        else [np.array([i]) for i in range(len(rows))]
    )
    manifest = _manifest(config, models, capacities, nfc, rows, lengths, bins, same)
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
    same: list[bool],
) -> dict:
    """One row clipped, rendered by every model and aligned with every cross-tokenizer teacher
    (``same[k]``: teacher k shares the student's tokenizer and is not aligned)."""
    if nfc:
        record = _nfc(record)
    if strip and record.messages is not None:
        record = _stripped(record)
    student, teachers = models[0], models[1:]
    if record.text is not None:
        clip = clip_text(record.text, models, capacities)
        text, clipped, original = clip.text, clip.clipped, clip.original_lengths
        messages, cut = None, None
        s_view = render_text(student, text)
    else:
        messages, clipped, original, cut = _fit_chat(record, models, capacities)
        s_view = render(student, messages, sample_id=record.sample_id)
        text = None
    own = student_tokens(student, s_view, messages, options, sample_id=record.sample_id,
                         clipped_message=cut)  # fmt: skip
    aligned: list[AlignedSample | SameTokenizerSample] = []
    for k, t in enumerate(teachers):
        if same[k]:
            aligned.append(same_tokenizer_sample(student, s_view, own))
        elif messages is None:
            aligned.append(align_text(student, t, text, student=s_view))
        else:
            aligned.append(align_chat(student, t, messages, sample_id=record.sample_id,
                                      options=options, student=s_view, clipped_message=cut))
    lengths = [len(s_view.tokens), *(len(a.teacher.tokens) for a in aligned)]
    return {
        "record": record,
        "text": text,
        "messages": messages,
        "clipped": clipped,
        "clip_reason": None if not clipped else (
            "text" if messages is None else "turns" if cut is None else "message"),
        "original_lengths": list(original),
        "lengths": lengths,
        "student": s_view,
        "student_loss_mask": own.loss_mask,
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
    if not any(m.get("role") == "assistant" for m in messages):
        raise DataError(
            f"sample {sid}: the conversation has no assistant message, so nothing would be "
            f"distilled; drop the sample or add the assistant's answer."
        )
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
    same: list[bool],
) -> dict:
    names = model_names(len(models) - 1)
    shapes = {}
    for k in range(len(models) - 1):
        if same[k]:
            continue
        counts = Counter()
        for row in rows:
            counts.update(SHAPE_NAMES[s] for s in row["aligned"][k].chunks.shape.tolist())
        shapes[names[k + 1]] = {name: counts.get(name, 0) for name in SHAPE_NAMES}
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
                **({} if m == 0 else {"same_tokenizer": same[m - 1]}),
            }
            for m, (name, tok) in enumerate(zip(names, models, strict=True))
        ],
        "nfc_normalized": nfc,
        "rows": len(rows),
        "clipped_rows": sum(bool(row["clipped"]) for row in rows),
        "chunk_shapes": shapes,
        "packing": {
            "packed": config.pack,
            "bins": len(bins),
            "efficiency": dict(
                zip(names, packing_efficiency(lengths, bins, capacities), strict=True)
            ),
        },
        "shards": [],
    }
