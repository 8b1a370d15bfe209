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

Streaming: rows are read in windows of ``shard_rows`` input rows; each window is prepared,
packed on its own and written as one shard, so memory holds one window whatever the size of
the input (packing looks at the samples of one window). Output (any fsspec URI):
``part-NNNNNN.parquet`` (window ``N``; rows sorted by packed row ``bin``, numbered within the
shard), a record per shard under ``_prepare/shards/`` written after it, and, once every window
has its shard, ``manifest.json`` (:mod:`crosskd.data.merge`: kind, format version,
fingerprints, options, rows, clipped rows, tokens per model, chunk shapes per aligned teacher,
packed rows, packing efficiency, per-shard row counts, packed-row ranges, sha256 and footer
(for reads by byte ranges: :mod:`crosskd.ranges`), data fingerprint). Format version 2
(version 1 stored a same-tokenizer teacher as an alignment of the student with itself; a
manifest without footers, written before, is read shard by shard whole). A folder without a
manifest is not prepared data.

Resume and splits: a rerun into the same output (same settings, recorded in
``_prepare/run.json``) skips the windows whose shard record exists, after checking that their
input rows are unchanged, so a killed run resumes to the same shards, byte for byte, as an
uninterrupted one. ``split_count`` pods share the input: split ``i`` prepares the windows ``w``
with ``w % split_count == i`` (every pod reads the whole input, aligning only its windows),
records that it is done, and the manifest is written by the merge once every split is done
(by the last split to finish, or ``crosskd prepare-merge``); the shards are the same as one
process would write. Sample ids are checked for repeats at the merge.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field

import fsspec
import numpy as np
from tqdm.auto import tqdm

from crosskd import __version__
from crosskd.alignment import (
    SHAPE_NAMES,
    AlignedSample,
    ChatOptions,
)
from crosskd.artifacts import MANIFEST, start_run, write_whole
from crosskd.data.merge import merge_prepared, splits_done
from crosskd.data.packing import pack_lockstep
from crosskd.data.preparation import Preparation, prepare_rows
from crosskd.data.records import Record, read_records
from crosskd.data.run_files import RUN, SHARDS, SPLITS, id_hash, read_shard_record, shard_name
from crosskd.data.shards import encode_shard
from crosskd.data.workers import ordered_map
from crosskd.errors import ConfigError, DataError
from crosskd.tokenization import load_tokenizer

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
    """Column holding a row's plain text."""
    messages_column: str = "messages"
    """Column holding a row's conversation (a list of ``{"role", "content"}``)."""
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
    """Input rows per window: each window is packed on its own and written as one Parquet
    shard (so memory holds one window, and packing looks at ``shard_rows`` samples at once)."""
    split_index: int = 0
    """This pod's split: it prepares the windows ``w`` with ``w % split_count == split_index``."""
    split_count: int = 1
    """Pods sharing the input (1: one process prepares everything and writes the manifest)."""
    workers: int = 1
    """Processes preparing windows at once in this pod (:mod:`crosskd.data.workers`; the same
    bytes as one): 1 prepares in this process with the tokenizers' own threads; more run one
    single-threaded worker each, so set it to the pod's cores. Each holds a window in memory."""

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
        for key in ("max_length", "shard_rows", "split_count", "workers"):
            _count(key, getattr(self, key))
        index = self.split_index
        if (
            isinstance(index, bool)
            or not isinstance(index, int)
            or not 0 <= index < (self.split_count)
        ):
            raise ConfigError(
                f"split_index is {index!r}; it must be an integer from 0 to split_count - 1 "
                f"({self.split_count - 1})."
            )
        if self.teacher_max_length is not None:
            _count(
                "teacher_max_length",
                self.teacher_max_length,
                "an integer >= 1, or null for max_length",
            )
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


def prepare(
    config: PrepareConfig,
    *,
    progress: bool = True,
    on_row: Callable[[str | None], None] | None = None,
) -> dict:
    """Run the preparation (:func:`prepare_split` of the config's split) and, once every split
    has finished, merge the shards into the manifest (:func:`crosskd.data.merge.merge_prepared`);
    returns the manifest, or None while other splits are still to run. ``on_row`` is called
    once per row this call prepares with why it was clipped (``text``, ``turns``, ``message``;
    None: whole)."""
    prepare_split(config, progress=progress, on_row=on_row)
    if config.split_count > 1 and not splits_done(config.output):
        return None
    return merge_prepared(config.output)


def prepare_split(
    config: PrepareConfig,
    *,
    progress: bool = True,
    on_row: Callable[[str | None], None] | None = None,
) -> dict:
    """Prepare the windows of ``shard_rows`` input rows that belong to this split (window ``w``
    when ``w % split_count == split_index``), each into its shard ``part-<w>.parquet`` and its
    record (:data:`SHARDS`), skipping windows whose record exists (after checking that their
    input rows are the same); then record that the split is done (:data:`SPLITS`, with the
    number of windows of the whole input). Returns that record."""
    config.check()
    fs, root = fsspec.core.url_to_fs(config.output)
    if fs.exists(f"{root}/{MANIFEST}"):
        raise DataError(
            f"output {config.output} already holds prepared data ({MANIFEST}); choose a new "
            f"output or remove the old one."
        )
    student = load_tokenizer(config.student_tokenizer)
    teachers = [load_tokenizer(t) for t in config.teacher_tokenizers]
    capacities = [config.max_length] + [config.teacher_max_length or config.max_length] * len(
        teachers
    )
    options = ChatOptions(tuple(config.included_regions), config.drop_first_chunk)
    preparation = Preparation.of(student, teachers, capacities, options)
    run = _run_record(config, preparation)
    records = read_records(
        config.data,
        text_column=config.text_column,
        messages_column=config.messages_column,
        id_column=config.id_column,
        unique_ids=False,
    )
    bar = tqdm(desc="align", unit="row", disable=not progress)
    recorded = fs.exists(f"{root}/{RUN}")
    if recorded:  # a resume: the settings must be the run's
        start_run(fs, f"{root}/{RUN}", config.output, run, what="prepared data", activity="prepare")
    counted = {"windows": 0}

    def todo() -> Iterator[tuple[int, tuple[Record, ...], str]]:
        """This split's windows still to prepare: ``(index, rows, input digest)``. The chat
        templates are loaded here, before the first window with a conversation goes to a
        worker, so that workers forked after it share them."""
        for w, window in enumerate(batched(records, config.shard_rows)):
            counted["windows"] = w + 1
            if w % config.split_count != config.split_index:
                continue
            digest = _input_digest(window)
            done = read_shard_record(fs, root, w)
            if done is None:
                if any(r.messages is not None for r in window):
                    preparation.open_templates()
                yield w, window, digest
                continue
            if done["input_sha256"] != digest:
                raise DataError(
                    f"output {config.output}: shard {done['path']} was prepared from other "
                    f"input rows than window {w} (rows from {w * config.shard_rows}) of "
                    f"{config.data} now (the input changed since); prepare into a new output."
                )
            bar.update(len(window))

    def work(task: tuple[int, tuple[Record, ...], str]) -> PreparedWindow:
        return prepare_window(*task, preparation, config.pack, capacities)

    prepared = 0
    for window in ordered_map(work, todo(), config.workers, describe=_describe_window):
        if on_row is not None:
            for reason in window.clip_reasons:
                on_row(reason)
        if not recorded:  # not before a row is prepared: bad input leaves nothing behind
            start_run(
                fs, f"{root}/{RUN}", config.output, run, what="prepared data", activity="prepare"
            )
            recorded = True
        write_whole(fs, f"{root}/{window.record['path']}", window.payload)
        fs.makedirs(f"{root}/{SHARDS}", exist_ok=True)
        write_whole(
            fs,
            f"{root}/{SHARDS}/{window.record['path']}.json",
            json.dumps(window.record).encode("utf-8"),
        )
        prepared += window.record["rows"]
        bar.update(window.record["rows"])
    windows = counted["windows"]
    bar.close()
    if windows == 0:
        raise DataError(f"data {config.data} has no rows; nothing to prepare.")
    start_run(fs, f"{root}/{RUN}", config.output, run, what="prepared data", activity="prepare")
    marker = {
        "split_index": config.split_index,
        "split_count": config.split_count,
        "windows": windows,
    }
    fs.makedirs(f"{root}/{SPLITS}", exist_ok=True)
    write_whole(
        fs,
        f"{root}/{SPLITS}/{config.split_index}-of-{config.split_count}.json",
        json.dumps(marker).encode("utf-8"),
    )
    log.info(
        "split %d of %d: prepared %d rows (%d windows in the input) at %s",
        config.split_index,
        config.split_count,
        prepared,
        windows,
        config.output,
    )
    return marker


def _run_record(config: PrepareConfig, preparation: Preparation) -> dict:
    """What every split of a run must share: the manifest's fields that do not depend on the
    rows (config without the split, models, normalisation)."""
    models, capacities, same = preparation.models, preparation.capacities, preparation.same
    names = model_names(len(models) - 1)
    local = ("split_index", "split_count", "workers")  # how this process runs, not what it makes
    settings = {k: v for k, v in asdict(config).items() if k not in local}
    return {
        "kind": KIND,
        "format_version": FORMAT_VERSION,
        "created_by": f"crosskd {__version__}",
        "source": config.data,
        "config": settings,
        "models": [
            {
                "name": name,
                "tokenizer": tok.name,
                "fingerprint": tok.fingerprint,
                "vocab_size": tok.vocab_size,
                "capacity": capacities[m],
                **({} if m == 0 else {"same_tokenizer": same[m - 1]}),
            }
            for m, (name, tok) in enumerate(zip(names, models, strict=True))
        ],
        "nfc_normalized": preparation.nfc,
        "content_stripped": preparation.strip,
        "packed": config.pack,
    }


def _input_digest(records: tuple[Record, ...]) -> str:
    """sha256 of a window's input rows as read (ids and content): a resume checks it."""
    payload = [[r.sample_id, r.text, r.messages] for r in records]
    return hashlib.sha256(_canonical(payload).encode("utf-8")).hexdigest()


def _canonical(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class PreparedWindow:
    """One input window prepared, ready to write: the Parquet bytes of its shard, the shard's
    record (:data:`~crosskd.data.run_files.SHARDS`: what the manifest sums over shards; its
    ``path`` is the shard's name) and each row's clip reason (None: whole), in input order."""

    payload: bytes
    record: dict
    clip_reasons: list[str | None]


def prepare_window(
    window: int,
    records: tuple[Record, ...],
    input_sha256: str,
    preparation: Preparation,
    pack: bool,
    capacities: list[int],
) -> PreparedWindow:
    """Prepare the rows of input window ``window`` (:func:`~crosskd.data.preparation
    .prepare_rows`), pack them (lockstep, or one sample per row) and encode the shard and its
    record; nothing is written."""
    rows = prepare_rows(records, preparation)
    lengths = np.array([row["lengths"] for row in rows], dtype=np.int64)
    bins = pack_lockstep(lengths, capacities) if pack else [np.array([i]) for i in range(len(rows))]
    payload, shard = encode_shard(shard_name(window), rows, bins)
    shapes = {}
    for k, aligned in enumerate(rows[0]["aligned"]):
        if isinstance(aligned, AlignedSample):
            counts = Counter()
            for row in rows:
                counts.update(SHAPE_NAMES[s] for s in row["aligned"][k].chunks.shape.tolist())
            shapes[f"teacher{k}"] = {name: counts.get(name, 0) for name in SHAPE_NAMES}
    fallback = [any(row["student"].fallback_template for row in rows)]
    fallback += [
        any(row["aligned"][k].teacher.fallback_template for row in rows)
        for k in range(len(rows[0]["aligned"]))
    ]
    content = [[r["record"].sample_id, r["text"], r["messages"]] for r in rows]
    ids = sorted(id_hash(r["record"].sample_id) for r in rows)
    record = shard | {
        "window": window,
        "input_sha256": input_sha256,
        "content_sha256": hashlib.sha256(_canonical(content).encode("utf-8")).hexdigest(),
        "clipped_rows": sum(bool(row["clipped"]) for row in rows),
        "tokens": lengths.sum(axis=0).tolist(),
        "chunk_shapes": shapes,
        "chatml_fallback": fallback,
        "id_hashes": base64.b64encode(np.array(ids, dtype="<u8").tobytes()).decode("ascii"),
    }
    return PreparedWindow(payload, record, [row["clip_reason"] for row in rows])


def _describe_window(task: tuple[int, tuple[Record, ...], str]) -> str:
    window, records, _ = task
    first = records[0]
    return f"input window {window} (from {first.source} row {first.row})"


def batched(items: Iterable, size: int) -> Iterator[tuple]:
    """``items`` in tuples of ``size`` (the last one shorter), read lazily."""
    chunk: list = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield tuple(chunk)
            chunk = []
    if chunk:
        yield tuple(chunk)
