"""One row as ``crosskd prepare`` stores it: normalised, clipped, rendered by every model and
aligned with every cross-tokenizer teacher (:func:`prepare_row`, with the run's fixed
:class:`Preparation`). ``crosskd prepare`` (:mod:`crosskd.data.prepare`) runs it over windows of
input rows; on-policy training (:mod:`crosskd.data.rollout`) over the student's own answers.
Normalisation, clipping and the masks are described in :mod:`crosskd.data.prepare`.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from crosskd.alignment import (
    AlignedSample,
    ChatOptions,
    Rendered,
    align_chat,
    align_text,
    align_texts,
    harmonize_reasoning,
    render,
    render_text,
    rendered_text,
    tokenize,
)
from crosskd.alignment.own import student_tokens
from crosskd.alignment.sample import REGION_ANSWER, REGION_REASONING
from crosskd.data.clipping import clip_text, clip_texts
from crosskd.data.records import Record
from crosskd.data.shards import SameTokenizerSample, same_tokenizer_sample
from crosskd.errors import ConfigError, DataError
from crosskd.tokenization import LoadedTokenizer


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
            any(t.strips_content for t in models),
        )

    def normalized(self, record: Record) -> Record:
        """``record`` as every model reads it: NFC-normalised when :attr:`nfc`, message content
        and reasoning stripped when :attr:`strip`."""
        if self.nfc:
            record = _nfc(record)
        if self.strip and record.messages is not None:
            record = _stripped(record)
        return record


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
    :func:`crosskd.data.shards.encode_shard` takes it: ``record`` (normalised), ``text`` /
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
        messages, clipped, original, cut, views = _fit_chat(record, models, capacities)
        s_view = views[0] if views else render(student, messages, sample_id=record.sample_id)
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
                    teacher=views[k + 1] if views else None,
                    clipped_message=cut,
                )
            )
    return _row(record, text, messages, clipped, cut, original, s_view, own.loss_mask, aligned)


def prepare_rows(records: Sequence[Record], preparation: Preparation) -> list[dict]:
    """:func:`prepare_row` of every record, in order, with the same results, the plain-text rows
    together, a few hundred at a time: each model encodes their texts in one batch (once for
    clipping and rendering both; a text clipping cuts keeps the encoding of its cut), clipping
    searches them in lockstep (:func:`~crosskd.data.clipping.clip_texts`) and each teacher is
    aligned with the student over all of them in one vectorised pass
    (:func:`~crosskd.alignment.align_texts`). Conversations are prepared one by one."""
    rows: list[dict | None] = [None] * len(records)
    texts = []
    for i, record in enumerate(records):
        if record.text is None:
            rows[i] = prepare_row(record, preparation)
        else:
            texts.append(i)
    for first in range(0, len(texts), _TEXT_BATCH):
        group = texts[first : first + _TEXT_BATCH]
        prepared = _prepare_texts([records[i] for i in group], preparation)
        for i, row in zip(group, prepared, strict=True):
            rows[i] = row
    return rows


_TEXT_BATCH = 256
"""Plain-text rows prepared together: enough for the tokenizers' threads and the vectorised
alignment, few enough that what they need on the way (every model's encoding of every full
text, the clipping's probes) stays small beside the window's prepared rows."""


def _prepare_texts(records: list[Record], preparation: Preparation) -> list[dict]:
    """The rows of plain-text records, prepared together (:func:`prepare_rows`)."""
    records = [preparation.normalized(r) for r in records]
    models, capacities, same = preparation.models, preparation.capacities, preparation.same
    texts = [r.text for r in records]
    encoded = [tokenize(tok, texts, add_special_tokens=True, with_starts=True) for tok in models]
    clips = clip_texts(texts, models, capacities, encoded=encoded)
    for i, clip in enumerate(clips):
        if clip.encoded is not None:
            for m, tokens in enumerate(clip.encoded):
                encoded[m][i] = tokens
    views = [
        [rendered_text(clip.text, tokens) for clip, tokens in zip(clips, per_model, strict=True)]
        for per_model in encoded
    ]
    students = views[0]
    aligned: list[list[AlignedSample | SameTokenizerSample]] = []
    for k, teacher in enumerate(models[1:]):
        if same[k]:
            aligned.append([None] * len(records))
        else:
            aligned.append(align_texts(models[0], teacher, students, views[k + 1]))
    rows = []
    for i, (record, clip, s_view) in enumerate(zip(records, clips, students, strict=True)):
        own = student_tokens(
            models[0], s_view, None, preparation.options, sample_id=record.sample_id
        )
        per_teacher = [
            same_tokenizer_sample(models[0], s_view, own) if same[k] else aligned[k][i]
            for k in range(len(aligned))
        ]
        rows.append(
            _row(
                record,
                clip.text,
                None,
                clip.clipped,
                None,
                clip.original_lengths,
                s_view,
                own.loss_mask,
                per_teacher,
            )
        )
    return rows


def _row(
    record: Record,
    text: str | None,
    messages: list[dict] | None,
    clipped: bool,
    cut: int | None,
    original: Sequence[int],
    s_view: Rendered,
    loss_mask: np.ndarray,
    aligned: list[AlignedSample | SameTokenizerSample],
) -> dict:
    """A prepared row as :func:`prepare_row` documents it."""
    return {
        "record": record,
        "text": text,
        "messages": messages,
        "clipped": clipped,
        "clip_reason": None
        if not clipped
        else ("text" if messages is None else "turns" if cut is None else "message"),
        "original_lengths": list(original),
        "lengths": [len(s_view.tokens), *(len(a.teacher.tokens) for a in aligned)],
        "student": s_view,
        "student_loss_mask": loss_mask,
        "aligned": aligned,
    }


def _chat_lengths(messages: list[dict], models: list[LoadedTokenizer], sample_id: str) -> list:
    return [len(view.tokens) for view in _renders(messages, models, sample_id)]


def _renders(messages: list[dict], models: list[LoadedTokenizer], sample_id: str) -> list:
    return [render(tok, messages, sample_id=sample_id) for tok in models]


def _fit_chat(
    record: Record, models: list[LoadedTokenizer], capacities: list[int]
) -> tuple[list[dict], bool, list[int], int | None, list | None]:
    """The longest conversation prefix (ending with an assistant message) every model holds.
    If even the first assistant turn is too long, its answer is clipped by bisection, and if an
    empty answer is still too long, its reasoning is. Returns the messages, whether they were
    clipped, the original lengths, the index of a message whose text was cut (or None), and
    every model's rendering of the messages when measuring them made it (a conversation that
    fits whole), else None."""
    messages = harmonize_reasoning(models, record.messages)
    sid = record.sample_id
    if not any(m.get("role") == "assistant" for m in messages):
        raise DataError(
            f"sample {sid}: the conversation has no assistant message, so nothing would be "
            f"distilled; drop the sample or add the assistant's answer."
        )
    views = _renders(messages, models, sid)
    original = [len(view.tokens) for view in views]
    if all(n <= c for n, c in zip(original, capacities, strict=True)):
        return messages, False, original, None, views
    ends = [i + 1 for i, m in enumerate(messages) if m["role"] == "assistant"]
    for end in reversed(ends):
        if end < len(messages) and _fits(messages[:end], models, capacities, sid):
            return messages[:end], True, original, None, None
    first = messages[: ends[0]]
    last = len(first) - 1
    for key in ("content", "reasoning_content"):
        if not first[last].get(key):
            continue
        whole = views if first == messages else None  # the renderings of ``first``, made above
        cut = _longest_prefix(first, key, models, capacities, sid, whole)
        if cut is not None:
            return cut, True, original, last, None
        first = [*first[:last], {**first[last], key: ""}]
    raise DataError(
        f"sample {sid} ({record.source}, row {record.row}): even with an empty first answer the "
        f"conversation needs {_chat_lengths(first, models, sid)} tokens, over the capacities "
        f"{capacities}; raise --max-length or drop the sample."
    )


def _longest_prefix(
    messages: list[dict],
    key: str,
    models: list,
    capacities: list[int],
    sid: str,
    views: list[Rendered] | None = None,
) -> list[dict] | None:
    """``messages`` with the last message's ``key`` cut to its longest fitting prefix (at
    least one character), or None.

    A bisection over the cut, in characters. A rendering is its pieces tokenized one by one
    (:func:`~crosskd.alignment.render`: the template around sentinels, then each content on
    its own), so a cut's length for a model is the length of every other piece, measured once
    from the whole text's rendering, plus the cut text's own tokens: a probe encodes only the
    cut text, model by model until one overflows. Where the whole text is not one piece of its
    rendering (reasoning split off it again), every probe renders the conversation. ``views``:
    the models' renderings of ``messages`` when the caller has them."""
    text = messages[-1][key]
    others = _other_pieces(messages, key, models, sid, views)
    if others is None:

        def fits(cut: int) -> bool:
            return _fits(
                [*messages[:-1], {**messages[-1], key: text[:cut]}], models, capacities, sid
            )

    else:
        room = [cap - n for cap, n in zip(capacities, others, strict=True)]

        def fits(cut: int) -> bool:
            return all(
                len(tokenize(tok, [text[:cut]])[0]) <= free
                for tok, free in zip(models, room, strict=True)
            )

    lo, hi = 0, len(text)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    if lo == 0:
        return None
    return [*messages[:-1], {**messages[-1], key: text[:lo]}]


def _other_pieces(
    messages: list[dict], key: str, models: list, sid: str, views: list[Rendered] | None
) -> list[int] | None:
    """Per model, the tokens of ``messages``' rendering (``views``, else rendered here) outside
    the last message's ``key``, or None where that text is not exactly one piece of a model's
    rendering."""
    index, text = len(messages) - 1, messages[-1][key]
    region = REGION_REASONING if key == "reasoning_content" else REGION_ANSWER
    out = []
    for m, tok in enumerate(models):
        view = views[m] if views is not None else render(tok, messages, sample_id=sid)
        spans = [(a, b) for i, r, a, b in view.regions if (i, r) == (index, region)]
        if len(spans) != 1 or view.text[spans[0][0] : spans[0][1]] != text:
            return None
        out.append(len(view.tokens) - len(tokenize(tok, [text])[0]))
    return out


def _fits(messages: list[dict], models: list, capacities: list[int], sample_id: str) -> bool:
    lengths = _chat_lengths(messages, models, sample_id)
    return all(n <= c for n, c in zip(lengths, capacities, strict=True))
