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
    render_many,
    render_text,
    rendered_text,
    tokenize,
)
from crosskd.alignment.own import student_tokens
from crosskd.alignment.sample import REGION_ANSWER, REGION_REASONING
from crosskd.data.clipping import ClipResult, clip_text, clip_texts
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

    def open_templates(self) -> None:
        """Load every model's ``transformers`` tokenizer (what renders its chat template) in
        this process, once: conversations need them, and worker processes forked afterwards
        share them instead of each importing ``transformers`` again."""
        for tok in self.models:
            _ = tok.hf

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
    if record.text is None:
        return _prepare_chats([record], preparation)[0]
    record = preparation.normalized(record)
    models, capacities = preparation.models, preparation.capacities
    student, teachers = models[0], models[1:]
    clip = clip_text(record.text, models, capacities)
    s_view = render_text(student, clip.text)
    own = student_tokens(student, s_view, None, preparation.options, sample_id=record.sample_id)
    aligned: list[AlignedSample | SameTokenizerSample] = [
        same_tokenizer_sample(student, s_view, own)
        if preparation.same[k]
        else align_text(student, t, clip.text, student=s_view)
        for k, t in enumerate(teachers)
    ]
    return _text_row(record, clip, s_view, own.loss_mask, aligned)


def prepare_rows(records: Sequence[Record], preparation: Preparation) -> list[dict]:
    """:func:`prepare_row` of every record, in order, with the same results, the plain-text rows
    together, a few hundred at a time: each model encodes their texts in one batch (once for
    clipping and rendering both; a text clipping cuts keeps the encoding of its cut), clipping
    searches them in lockstep (:func:`~crosskd.data.clipping.clip_texts`) and each teacher is
    aligned with the student over all of them in one vectorised pass
    (:func:`~crosskd.alignment.align_texts`). Conversations are prepared together too: their
    contents encoded per model in one batch, the answers that must be cut searched in lockstep
    (:func:`_longest_prefixes`)."""
    rows: list[dict | None] = [None] * len(records)
    for kind in (False, True):  # conversations first, as their errors came first before
        group = [i for i, record in enumerate(records) if (record.text is not None) is kind]
        for first in range(0, len(group), _TEXT_BATCH):
            batch = group[first : first + _TEXT_BATCH]
            prepare = _prepare_texts if kind else _prepare_chats
            for i, row in zip(
                batch, prepare([records[i] for i in batch], preparation), strict=True
            ):
                rows[i] = row
    return rows


_TEXT_BATCH = 256
"""Rows prepared together (plain texts, and apart from them conversations): enough for the
tokenizers' threads and the vectorised alignment, few enough that what they need on the way
(every model's encoding of every full text, the clipping's probes) stays small beside the
window's prepared rows."""


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
        rows.append(_text_row(record, clip, s_view, own.loss_mask, per_teacher))
    return rows


def _text_row(
    record: Record,
    clip: ClipResult,
    s_view: Rendered,
    loss_mask: np.ndarray,
    aligned: list[AlignedSample | SameTokenizerSample],
) -> dict:
    """A prepared plain-text row (:func:`_row`) of the text ``clip`` kept."""
    return _row(
        record,
        clip.text,
        None,
        clip.clipped,
        None,
        clip.original_lengths,
        s_view,
        loss_mask,
        aligned,
    )


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


def _prepare_chats(records: list[Record], preparation: Preparation) -> list[dict]:
    """The rows of conversation records, prepared together (:func:`prepare_rows`); the first
    bad record, in order, raises its :class:`~crosskd.errors.DataError`."""
    records = [preparation.normalized(r) for r in records]
    models, options, same = preparation.models, preparation.options, preparation.same
    student, teachers = models[0], models[1:]
    fitted = _fit_chats(records, models, preparation.capacities)
    rows = []
    for record, (messages, clipped, original, cut, views) in zip(records, fitted, strict=True):
        sid = record.sample_id
        s_view = views[0] if views else render(student, messages, sample_id=sid)
        own = student_tokens(student, s_view, messages, options, sample_id=sid, clipped_message=cut)
        aligned: list[AlignedSample | SameTokenizerSample] = [
            same_tokenizer_sample(student, s_view, own)
            if same[k]
            else align_chat(
                student,
                t,
                messages,
                sample_id=sid,
                options=options,
                student=s_view,
                teacher=views[k + 1] if views else None,
                clipped_message=cut,
            )
            for k, t in enumerate(teachers)
        ]
        rows.append(
            _row(record, None, messages, clipped, cut, original, s_view, own.loss_mask, aligned)
        )
    return rows


def _chat_lengths(messages: list[dict], models: list[LoadedTokenizer], sample_id: str) -> list:
    return [len(view.tokens) for view in _renders(messages, models, sample_id)]


def _renders(messages: list[dict], models: list[LoadedTokenizer], sample_id: str) -> list:
    return [render(tok, messages, sample_id=sample_id) for tok in models]


Fitted = tuple[list[dict], bool, list[int], int | None, list | None]
"""A conversation as clipping keeps it: the messages, whether they were clipped, the original
lengths, the index of a message whose text was cut (or None), and every model's rendering of
the messages when measuring them made it (a conversation that fits whole), else None."""


def _fit_chats(
    records: list[Record], models: list[LoadedTokenizer], capacities: list[int]
) -> list[Fitted]:
    """Each conversation's longest prefix (ending with an assistant message) every model
    holds. If even the first assistant turn is too long, its answer is clipped by bisection,
    and if an empty answer is still too long, its reasoning is; the bisections of all records
    run in lockstep (:func:`_longest_prefixes`). The first bad record, in order, raises."""
    fitted: list[Fitted | None] = [None] * len(records)
    errors: dict[int, DataError] = {}
    pending: dict[int, _FirstTurn] = {}
    conversations = {}
    for i, record in enumerate(records):
        try:
            conversations[i] = _conversation(record, models)
        except DataError as err:
            errors[i] = err
    renderings = _renders_many(records, conversations, models, errors)
    for i, views in renderings.items():
        try:
            turns = _fit_turns(records[i], conversations[i], views, models, capacities)
        except DataError as err:
            errors[i] = err
            continue
        if isinstance(turns, _FirstTurn):
            pending[i] = turns
        else:
            fitted[i] = turns
    for key in ("content", "reasoning_content"):
        asked = [i for i, turn in pending.items() if turn.messages[-1].get(key)]
        jobs = [(pending[i].messages, key, pending[i].views) for i in asked]
        sids = [records[i].sample_id for i in asked]
        for i, cut in zip(asked, _longest_prefixes(jobs, models, capacities, sids), strict=True):
            turn = pending[i]
            if cut is not None:
                fitted[i] = (cut, True, turn.original, len(cut) - 1, None)
                del pending[i]
            else:
                emptied = [*turn.messages[:-1], {**turn.messages[-1], key: ""}]
                pending[i] = _FirstTurn(emptied, None, turn.original)
    for i, turn in pending.items():
        record = records[i]
        errors[i] = DataError(
            f"sample {record.sample_id} ({record.source}, row {record.row}): even with an empty "
            f"first answer the conversation needs "
            f"{_chat_lengths(turn.messages, models, record.sample_id)} tokens, over the "
            f"capacities {capacities}; raise --max-length or drop the sample."
        )
    if errors:
        raise errors[min(errors)]
    return fitted


@dataclass(frozen=True)
class _FirstTurn:
    """A conversation whose first assistant turn alone is too long: those ``messages``, every
    model's rendering of them when the caller made it (else None) and the whole conversation's
    ``original`` lengths."""

    messages: list[dict]
    views: list[Rendered] | None
    original: list[int]


def _conversation(record: Record, models: list[LoadedTokenizer]) -> list[dict]:
    """``record``'s messages with the reasoning any model's template drops left out
    (:func:`~crosskd.alignment.harmonize_reasoning`); refused without an assistant message."""
    messages = harmonize_reasoning(models, record.messages)
    if not any(m.get("role") == "assistant" for m in messages):
        raise DataError(
            f"sample {record.sample_id}: the conversation has no assistant message, so nothing "
            f"would be distilled; drop the sample or add the assistant's answer."
        )
    return messages


def _renders_many(
    records: list[Record],
    conversations: dict[int, list[dict]],
    models: list[LoadedTokenizer],
    errors: dict[int, DataError],
) -> dict[int, list[Rendered]]:
    """Every model's rendering of each conversation (record index -> one per model), each
    model's in one batch (:func:`~crosskd.alignment.render_many`); a batch that cannot be
    rendered is rendered conversation by conversation, and each one that fails goes to
    ``errors``."""
    order = list(conversations)
    sids = [records[i].sample_id for i in order]
    try:
        per_model = [
            render_many(tok, [conversations[i] for i in order], sample_ids=sids) for tok in models
        ]
    except DataError:
        out = {}
        for i, sid in zip(order, sids, strict=True):
            try:
                out[i] = _renders(conversations[i], models, sid)
            except DataError as err:
                errors[i] = err
        return out
    return {i: [views[n] for views in per_model] for n, i in enumerate(order)}


def _fit_turns(
    record: Record,
    messages: list[dict],
    views: list[Rendered],
    models: list[LoadedTokenizer],
    capacities: list[int],
) -> Fitted | _FirstTurn:
    """The conversation ``messages`` (every model's rendering: ``views``) whole, or its
    longest prefix of whole turns every model holds, or (when even the first turn is too long)
    that first turn, for its answer to be cut."""
    sid = record.sample_id
    original = [len(view.tokens) for view in views]
    if all(n <= c for n, c in zip(original, capacities, strict=True)):
        return messages, False, original, None, views
    ends = [i + 1 for i, m in enumerate(messages) if m["role"] == "assistant"]
    for end in reversed(ends):
        if end < len(messages) and _fits(messages[:end], models, capacities, sid):
            return messages[:end], True, original, None, None
    first = messages[: ends[0]]
    return _FirstTurn(first, views if first == messages else None, original)


def _longest_prefix(
    messages: list[dict],
    key: str,
    models: list,
    capacities: list[int],
    sid: str,
    views: list[Rendered] | None = None,
) -> list[dict] | None:
    """``messages`` with the last message's ``key`` cut to its longest fitting prefix (at
    least one character), or None; ``views``: the models' renderings of ``messages`` when the
    caller has them (:func:`_longest_prefixes`)."""
    return _longest_prefixes([(messages, key, views)], models, capacities, [sid])[0]


def _longest_prefixes(
    jobs: list[tuple[list[dict], str, list[Rendered] | None]],
    models: list,
    capacities: list[int],
    sids: list[str],
) -> list[list[dict] | None]:
    """:func:`_longest_prefix` of each job ``(messages, key, views)``: a bisection over the
    cut, in characters, all jobs in lockstep.

    A rendering is its pieces tokenized one by one (:func:`~crosskd.alignment.render`: the
    template around sentinels, then each content on its own), so a cut's length for a model is
    the length of every other piece, measured once from the whole text's rendering, plus the
    cut text's own tokens: a round of the bisections encodes the cut texts all unfinished jobs
    ask for, in one batch per model, model by model while they fit. A job whose whole text is
    not one piece of its rendering (reasoning split off it again) renders every probe."""
    texts = [messages[-1][key] for messages, key, _ in jobs]
    bounds = [[0, len(text)] for text in texts]
    rooms: dict[int, list[int]] = {}
    for j, (messages, key, views) in enumerate(jobs):
        others = _other_pieces(messages, key, models, sids[j], views)
        if others is not None:
            rooms[j] = [cap - n for cap, n in zip(capacities, others, strict=True)]
            continue
        lo, hi = bounds[j]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            probe = [*messages[:-1], {**messages[-1], key: texts[j][:mid]}]
            lo, hi = (mid, hi) if _fits(probe, models, capacities, sids[j]) else (lo, mid)
        bounds[j] = [lo, hi]
    active = [j for j in rooms if bounds[j][1] - bounds[j][0] > 1]
    while active:
        mids = {j: sum(bounds[j]) // 2 for j in active}
        fits = dict.fromkeys(active, True)
        for m, tok in enumerate(models):
            asked = [j for j in active if fits[j]]
            if not asked:
                break
            encoded = tokenize(tok, [texts[j][: mids[j]] for j in asked])
            for j, tokens in zip(asked, encoded, strict=True):
                fits[j] = len(tokens) <= rooms[j][m]
        for j in active:
            bounds[j][0 if fits[j] else 1] = mids[j]
        active = [j for j in active if bounds[j][1] - bounds[j][0] > 1]
    out: list[list[dict] | None] = []
    for (messages, key, _), text, (lo, _) in zip(jobs, texts, bounds, strict=True):
        out.append(None if lo == 0 else [*messages[:-1], {**messages[-1], key: text[:lo]}])
    return out


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
        # the piece's own tokens are those starting in its span (every token covers a byte)
        inside = np.searchsorted(view.starts, spans[0], side="left")
        out.append(len(view.tokens) - int(inside[1] - inside[0]))
    return out


def _fits(messages: list[dict], models: list, capacities: list[int], sample_id: str) -> bool:
    lengths = _chat_lengths(messages, models, sample_id)
    return all(n <= c for n, c in zip(lengths, capacities, strict=True))
