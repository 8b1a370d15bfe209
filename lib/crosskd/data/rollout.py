"""On-policy rows (GKD style): the prompts the student continues, and its continuations
prepared exactly as ``crosskd prepare`` stores a conversation or a text, so that the trainer
scores them with its teachers and trains on them with the CSD loss on the generated part only.

The way through, for one chat data record (:class:`~crosskd.data.records.Record`; a text
record: below):

1. :func:`rollout_prompt`: its messages before the first assistant message (the prompt).
2. :func:`prompt_ids`: the prompt normalised as preparation normalises it, rendered with the
   student's chat template and its generation prompt, as student token ids (what a sampler
   continues; message content tokenized as prepare tokenizes it, a typed ``<|eot_id|>`` is
   text).
3. The sampler continues them; :func:`answer_text` turns the sampled ids back into the answer
   (cut at the first of :func:`stop_ids`, special tokens dropped, surrounding whitespace
   stripped: ``crosskd generate``'s decoding, which uses it too).
4. :func:`continued`: the prompt followed by the answer as an assistant message.
5. :func:`rollout_samples`: each conversation through :func:`crosskd.data.preparation.prepare_row`
   (normalised, clipped to the capacities as prepare clips it: an answer too long is cut, and
   then has no end-of-turn token; rendered with each model's chat template; aligned with every
   cross-tokenizer teacher by :func:`~crosskd.alignment.align_chat`), returned as a reader
   gets prepared samples back from a shard: column name -> Python value, the columns of
   :func:`crosskd.data.shards.schema`, the dicts :func:`crosskd.data.collate.collate` takes,
   each sample its own packed row (``bin`` its index in the list).

A plain-text record (pretraining-style data) is continued as text: its prompt is the start of
its text (:func:`rollout_prompt`: ``text_share`` of its characters, cut back to a whitespace
so the student writes the next word whole), read as :func:`crosskd.alignment.render_text`
reads text (the tokenizer's BOS, no end token); the answer is what the sampled ids add to the
prompt's decoded text (:func:`continuation_text`: not stripped); the rollout is the prompt's
text followed by the answer, prepared as prepare stores a text, then masked to the answer
(:func:`rollout_samples` with its ``answer_starts``): the student's CE targets and every
teacher's KD chunks that start at or after the answer's first character.

A rollout's only assistant message is its answer (anything else is refused), so the student's
loss mask (CE) and the KD chunks (``FLAG_KD``) cover exactly the answer's included regions and
its end-of-turn token: the generated part, less the text the template writes itself (as for
prepared data: Llama-3's ``<think>`` line before reasoning it writes into the content). The
prompt ids are the start of the stored ``student_ids`` when the student's template writes an
assistant turn as its generation prompt followed by the content (Llama-3, ChatML). The stored
answer tokens are the student tokenizer's encoding of the answer text, which can differ from
the sampled ids where the sampler picked a non-canonical tokenization.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import numpy as np

from crosskd.alignment import render, render_text, split_reasoning
from crosskd.data.preparation import Preparation, prepare_row
from crosskd.data.records import Record
from crosskd.data.shards import FLAG_KD, shard_table
from crosskd.errors import DataError
from crosskd.tokenization import LoadedTokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def rollout_prompt(record: Record, text_share: float = 0.5) -> Record:
    """``record`` cut to the prompt the student continues, same id, source and row: a
    conversation's messages before its first assistant message (all of them if it has none);
    a text's first ``text_share`` of its characters, cut back to the last run of whitespace
    before that point (where there is one after the first character). Raises
    :class:`~crosskd.errors.DataError` naming the sample for a prompt without a user message and
    for a text too short to leave a prompt and an answer."""
    if record.messages is None:
        return _text_prompt(record, text_share)
    first = next(
        (i for i, m in enumerate(record.messages) if m.get("role") == "assistant"),
        len(record.messages),
    )
    prompt = record.messages[:first]
    if not any(m.get("role") == "user" for m in prompt):
        roles = [m.get("role") for m in record.messages]
        raise DataError(
            f"{_where(record)} has no user message before its first assistant message (roles "
            f"{roles}), so there is no prompt to continue; drop the sample or fix its roles."
        )
    return Record(record.sample_id, None, prompt, record.source, record.row)


def _text_prompt(record: Record, share: float) -> Record:
    """The start of a text record's text (:func:`rollout_prompt`)."""
    text = record.text or ""
    cut = int(len(text) * share)
    space = max(text.rfind(c, 1, cut + 1) for c in " \t\n")
    if space > 0:  # before the whole run of whitespace, so the answer starts with all of it
        cut = len(text[:space].rstrip()) or space
    if cut < 1 or not text[cut:].strip():
        raise DataError(
            f"{_where(record)} is a text of {len(text)} character(s), too short to give the "
            f"student a prompt and leave it text to write; drop it from the prompts."
        )
    return Record(record.sample_id, text[:cut], None, record.source, record.row)


def text_prompt_fits(prompt: Record, preparation: Preparation) -> bool:
    """Whether every model reads a text ``prompt`` (:func:`rollout_prompt`, normalised) in
    fewer tokens than its capacity, so that some of an answer survives clipping for all."""
    return all(
        len(render_text(model, prompt.text).tokens) < capacity
        for model, capacity in zip(preparation.models, preparation.capacities, strict=True)
    )


def prompt_ids(prompt: Record, preparation: Preparation) -> np.ndarray:
    """The student token ids (int64 ``[P]``) a sampler continues for ``prompt``
    (:func:`rollout_prompt`): normalised as :func:`crosskd.data.preparation.prepare_row` normalises
    it, rendered with the student's chat template followed by its generation prompt (a text:
    as :func:`~crosskd.alignment.render_text` reads it, less an end token the tokenizer
    appends). An answer is clipped by :func:`rollout_samples` where it outgrows a capacity: the
    student's room is its capacity less ``P`` tokens, its end-of-turn token included."""
    prompt = preparation.normalized(prompt)
    student = preparation.models[0]
    if prompt.messages is None:
        ids = render_text(student, prompt.text).tokens.ids
        eos = student.hf.eos_token_id
        return ids[:-1] if len(ids) > 1 and eos is not None and ids[-1] == eos else ids
    rendered = render(
        student, prompt.messages, sample_id=prompt.sample_id, add_generation_prompt=True
    )
    return rendered.tokens.ids


def stop_ids(tokenizer: LoadedTokenizer) -> frozenset[int]:
    """The ids that end an answer: the tokenizer's eos token and its ``eos`` / ``eot`` role
    tokens (:mod:`crosskd.tokenization.roles`)."""
    ids = {tokenizer.hf.eos_token_id, *(tokenizer.role_ids.get(r) for r in ("eos", "eot"))}
    return frozenset(ids - {None})


def answer_text(
    tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], stops: Collection[int]
) -> tuple[str, bool]:
    """A sampled continuation ``ids`` (token ids after the prompt) as answer text: cut before
    the first id in ``stops``, decoded with special tokens dropped, stripped of surrounding
    whitespace; and whether a stop id ended it (False: it ran to the sampler's limit)."""
    ended = next((i for i, t in enumerate(ids) if t in stops), None)
    tokens = ids if ended is None else ids[:ended]
    return tokenizer.decode(tokens, skip_special_tokens=True).strip(), ended is not None


def continuation_text(
    tokenizer: PreTrainedTokenizerBase,
    prompt: Sequence[int],
    ids: Sequence[int],
    stops: Collection[int],
) -> tuple[str, bool]:
    """A sampled continuation ``ids`` of a text ``prompt`` (its token ids) as the text it adds:
    cut before the first id in ``stops``, the decoding of prompt and continuation together
    less the prompt's own decoding (special tokens dropped, no clean-up of spaces, nothing
    stripped: a leading space is the answer's), and whether a stop id ended it."""
    ended = next((i for i, t in enumerate(ids) if t in stops), None)
    tokens = list(ids if ended is None else ids[:ended])
    options = {"skip_special_tokens": True, "clean_up_tokenization_spaces": False}
    head = tokenizer.decode(list(prompt), **options)
    whole = tokenizer.decode([*prompt, *tokens], **options)
    if not whole.startswith(head):  # a merge across the boundary: decode the answer alone
        return tokenizer.decode(tokens, **options), ended is not None
    return whole[len(head) :], ended is not None


def continued(prompt: Record, answer: str) -> Record:
    """The conversation of ``prompt`` (:func:`rollout_prompt`) followed by the student's
    ``answer`` as an assistant message (a text prompt: its text followed by ``answer``), same
    id, source and row."""
    if prompt.messages is None:
        return Record(prompt.sample_id, prompt.text + answer, None, prompt.source, prompt.row)
    messages = [*prompt.messages, {"role": "assistant", "content": answer}]
    return Record(prompt.sample_id, None, messages, prompt.source, prompt.row)


def rollout_samples(
    conversations: Sequence[Record],
    preparation: Preparation,
    answer_starts: Sequence[int | None] | None = None,
) -> list[dict]:
    """The prepared samples of ``conversations`` (each a prompt followed by the student's
    answer, :func:`continued`), one per conversation in order, each a dict of the prepared
    shard's columns as a reader gets them (module docstring). ``answer_starts``: per text
    continuation the character of its (normalised) text where the answer starts (the length of
    its prompt's text); None for a conversation. Raises :class:`~crosskd.errors.DataError`
    naming the sample for a conversation that is not a prompt and one assistant message, for an
    empty answer, for a text without its answer's start, and for a prompt over a capacity."""
    starts = list(answer_starts or [None] * len(conversations))
    rows = [
        prepare_row(_checked(c, a), preparation) for c, a in zip(conversations, starts, strict=True)
    ]
    if not rows:
        return []
    samples = shard_table(rows, [np.array([i]) for i in range(len(rows))]).to_pylist()
    for sample, row, start in zip(samples, rows, starts, strict=True):
        if start is not None:
            _answer_only(sample, int(np.searchsorted(row["student"].starts, start)))
    return samples


def _answer_only(sample: dict, first: int) -> None:
    """Clear, in a prepared text sample, the student's CE targets before its token ``first``
    (the answer's first) and every teacher's KD chunks that start before it."""
    mask = sample["student_loss_mask"]
    sample["student_loss_mask"] = [m and i >= first for i, m in enumerate(mask)]
    k = 0
    while f"teacher{k}_chunk_flags" in sample:
        flags, s0 = sample[f"teacher{k}_chunk_flags"], sample[f"teacher{k}_chunk_s0"]
        starts = range(len(flags)) if s0 is None else s0  # same tokenizer: per student token
        sample[f"teacher{k}_chunk_flags"] = [
            f if at >= first else f & ~FLAG_KD for f, at in zip(flags, starts, strict=True)
        ]
        k += 1


def _checked(conversation: Record, answer_start: int | None) -> Record:
    """``conversation`` if it is a prompt followed by one non-empty assistant message (a text:
    with an answer after ``answer_start``)."""
    if conversation.messages is not None and answer_start is not None:
        raise DataError(
            f"{_where(conversation)} is a conversation but has an answer start "
            f"({answer_start}); give None for a conversation (its answer is its assistant "
            f"message)."
        )
    if conversation.messages is None:
        if answer_start is None or not 0 < answer_start < len(conversation.text or ""):
            raise DataError(
                f"{_where(conversation)} is a text continuation without its answer's start "
                f"({answer_start!r} of {len(conversation.text or '')} characters): give "
                f"answer_starts, the length of its prompt's text, with an answer after it."
            )
        return conversation
    prompt = rollout_prompt(conversation)
    rest = conversation.messages[len(prompt.messages) :]
    roles = [m.get("role") for m in conversation.messages]
    if not rest:
        raise DataError(
            f"{_where(conversation)} has no assistant message (roles {roles}): no answer of the "
            f"student's to distil; append it (crosskd.data.rollout.continued)."
        )
    if len(rest) > 1:
        raise DataError(
            f"{_where(conversation)} goes on after its first assistant message (roles {roles}); "
            f"a rollout is its prompt and the student's answer, last: cut it with "
            f"crosskd.data.rollout.rollout_prompt and append the answer."
        )
    answer = split_reasoning(rest)[0]
    if not answer["content"].strip() and not (answer.get("reasoning_content") or "").strip():
        raise DataError(
            f"{_where(conversation)}: the student's answer is empty, so nothing was generated "
            f"to distil; drop this rollout."
        )
    return conversation


def _where(record: Record) -> str:
    return f"sample {record.sample_id} ({record.source}, row {record.row})"
