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
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
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
from crosskd.artifacts import MANIFEST, start_run, write_whole
from crosskd.data.clipping import clip_text
from crosskd.data.merge import merge_prepared, splits_done
from crosskd.data.packing import pack_lockstep
from crosskd.data.records import Record, read_records
from crosskd.data.run_files import RUN, SHARDS, SPLITS, id_hash, read_shard_record, shard_name
from crosskd.data.shards import SameTokenizerSample, same_tokenizer_sample, write_shard
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
        for key in ("max_length", "shard_rows", "split_count"):
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


@dataclass(frozen=True, eq=False)
class Preparation:
    """What :func:`prepare_row` needs besides the row, fixed for a run: the models (student
    first, then the teachers in order), their capacities (max tokens per model), the chat
    options, which teachers share the student's tokenizer (``same[k]``: teacher ``k`` is not
    aligned), and the normalisations the models call for (``nfc``: NFC-normalise once; ``strip``:
    strip message content once; module docstring). Build it with :meth:`of`."""

    models: list[LoadedTokenizer]
    capacities: list[int]
    options: ChatOptions
    same: list[bool]
    nfc: bool
    strip: bool

    @classmethod
    def of(
        cls,
        student: LoadedTokenizer,
        teachers: Sequence[LoadedTokenizer],
        capacities: Sequence[int],
        options: ChatOptions,
        same: Sequence[bool] | None = None,
    ) -> Preparation:
        """The preparation for ``student`` and ``teachers`` with ``capacities`` (one per model,
        student first, in tokens). ``same`` (one per teacher; None: from the fingerprints) must
        agree with the fingerprints, as ``crosskd prepare`` decides it."""
        models = [student, *teachers]
        if len(capacities) != len(models):
            raise ConfigError(
                f"capacities {list(capacities)} give {len(capacities)} lengths for "
                f"{len(models)} models; give one per model, the student's first."
            )
        shared = [t.fingerprint == student.fingerprint for t in teachers]
        if same is not None and list(same) != shared:
            raise ConfigError(
                f"same-tokenizer teachers {list(same)} disagree with the tokenizer fingerprints "
                f"({shared}: teacher k shares the student's tokenizer iff its fingerprint is "
                f"the student's); pass the flags of the prepared data's manifest."
            )
        return cls(
            models,
            list(capacities),
            options,
            shared,
            any(t.normalizes_nfc for t in models),
            any(_template_strips(t) for t in models),
        )

    def normalized(self, record: Record) -> Record:
        """``record`` as every model reads it: NFC-normalised when :attr:`nfc`, message content
        and reasoning stripped when :attr:`strip`."""
        if self.nfc:
            record = _nfc(record)
        if self.strip and record.messages is not None:
            record = _stripped(record)
        return record


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
    windows = prepared = 0
    for w, window in enumerate(batched(records, config.shard_rows)):
        windows = w + 1
        if w % config.split_count != config.split_index:
            continue
        digest = _input_digest(window)
        done = read_shard_record(fs, root, w)
        if done is not None:
            if done["input_sha256"] != digest:
                raise DataError(
                    f"output {config.output}: shard {done['path']} was prepared from other "
                    f"input rows than window {w} (rows from {w * config.shard_rows}) of "
                    f"{config.data} now (the input changed since); prepare into a new output."
                )
            bar.update(len(window))
            continue
        rows = []
        for record in window:
            rows.append(prepare_row(record, preparation))
            if on_row is not None:
                on_row(rows[-1]["clip_reason"])
            bar.update(1)
        if not recorded:  # not before a row is prepared: bad input leaves nothing behind
            start_run(
                fs, f"{root}/{RUN}", config.output, run, what="prepared data", activity="prepare"
            )
            recorded = True
        _write_window(fs, root, w, rows, config.pack, capacities, digest)
        prepared += len(rows)
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
    settings = {k: v for k, v in asdict(config).items() if k not in ("split_index", "split_count")}
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


def _write_window(
    fs: fsspec.AbstractFileSystem,
    root: str,
    window: int,
    rows: list[dict],
    pack: bool,
    capacities: list[int],
    input_sha256: str,
) -> None:
    """Pack one window's prepared rows, write its shard, then its record (last: a record means
    a complete shard). The record holds what the manifest sums over shards."""
    lengths = np.array([row["lengths"] for row in rows], dtype=np.int64)
    bins = pack_lockstep(lengths, capacities) if pack else [np.array([i]) for i in range(len(rows))]
    shard = write_shard(fs, root, shard_name(window), rows, bins)
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
    fs.makedirs(f"{root}/{SHARDS}", exist_ok=True)
    write_whole(fs, f"{root}/{SHARDS}/{shard['path']}.json", json.dumps(record).encode("utf-8"))


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


def _template_strips(tok: LoadedTokenizer) -> bool:
    """Whether ``tok``'s chat template strips whitespace around message content (Llama-3's
    ``| trim``): then content is stripped once for every model, so all read what their own
    template would show."""
    if not tok.hf.chat_template:
        return False
    probe = [{"role": "user", "content": " \ue002 "}, {"role": "assistant", "content": " \ue003 "}]
    rendered = tok.hf.apply_chat_template(probe, tokenize=False)
    return " \ue003 " not in rendered


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


def prepare_row(record: Record, preparation: Preparation) -> dict:
    """One row normalised (:meth:`Preparation.normalized`), clipped (text: :func:`clip_text`;
    chat: the longest conversation prefix every model holds, then the first answer cut),
    rendered by every model and aligned with every cross-tokenizer teacher, as
    :func:`crosskd.data.shards.write_shard` takes it: ``record`` (normalised), ``text`` /
    ``messages`` (as kept), ``clipped``, ``clip_reason`` (None, ``text``, ``turns`` or
    ``message``), ``original_lengths`` (tokens per model before clipping), ``lengths`` (after),
    ``student`` (its :class:`~crosskd.alignment.Rendered`), ``student_loss_mask`` (bool
    ``[n_student]``, CE targets) and ``aligned`` (per teacher an
    :class:`~crosskd.alignment.AlignedSample`, or a
    :class:`~crosskd.data.shards.SameTokenizerSample` for a same-tokenizer teacher)."""
    record = preparation.normalized(record)
    models, capacities, options = preparation.models, preparation.capacities, preparation.options
    same = preparation.same
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
    own = student_tokens(
        student, s_view, messages, options, sample_id=record.sample_id, clipped_message=cut
    )
    aligned: list[AlignedSample | SameTokenizerSample] = []
    for k, t in enumerate(teachers):
        if same[k]:
            aligned.append(same_tokenizer_sample(student, s_view, own))
        elif messages is None:
            aligned.append(align_text(student, t, text, student=s_view))
        else:
            aligned.append(
                align_chat(
                    student,
                    t,
                    messages,
                    sample_id=record.sample_id,
                    options=options,
                    student=s_view,
                    clipped_message=cut,
                )
            )
    lengths = [len(s_view.tokens), *(len(a.teacher.tokens) for a in aligned)]
    return {
        "record": record,
        "text": text,
        "messages": messages,
        "clipped": clipped,
        "clip_reason": None
        if not clipped
        else ("text" if messages is None else "turns" if cut is None else "message"),
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
