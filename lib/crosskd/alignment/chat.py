"""Chat mode: render a conversation with each model's own chat template, locate every assistant
message's content in each rendering, and align message by message (spec section 2).

* **Rendering**: each model renders with its own template (a tokenizer without one gets
  :data:`CHATML_FALLBACK`, and :attr:`Rendered.fallback_template` says so). Content is located
  robustly: the conversation is rendered once with every content replaced by a unique sentinel,
  the sentinels are found (each exactly once), and the real content is put back verbatim. (A
  template that transforms content, such as Llama-3's ``| trim``, is applied to the sentinel
  only: the content goes in as the data has it.)
* **Tokenizing**: segment by segment: template text with its specials recognised, message
  content with ``split_special_tokens=True`` (a user who types ``<|im_end|>`` does not end the
  turn); no tokenizer-added BOS (templates write their own).
* **Reasoning**: an assistant message's ``reasoning_content``, or a leading
  ``<think>...</think>`` in its content, becomes the ``reasoning`` region; the template text
  between it and the answer (the closing marker) is the ``close`` region; the content is the
  ``answer`` region. A template that does not render ``reasoning_content`` gets it written
  into the content as ``<think>\\n{reasoning}\\n</think>\\n\\n{answer}``; reasoning that a
  template drops even then (Qwen3 drops it for turns before the last user message) is left
  out for *every* model (:func:`harmonize_reasoning`), so all models read the same text.
* **Regions** are aligned one by one: the tokens whose end offset lies in ``(start, end]`` on
  each side are sliced, their offsets rebased to the region start, and the walker runs.
  Content is tokenized as its own segment, so no token begins before its region. The
  **end-of-turn pair** is the first ``eot``-role special after the answer and before the next
  message's content on each side (none when a template writes none there, and none for an
  answer that clipping cut short).
* **Masks**: the student's CE loss mask is its tokens in the included regions of every
  assistant message plus its end-of-turn token; a chunk counts for KD (``kd_mask``) when its
  region is included, all its student tokens are in the loss mask, and it is not the first chunk
  of its message under ``drop_first_chunk``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from crosskd.alignment.core import SHAPE_SPECIAL, Chunks, Tokenized, align, tokenize
from crosskd.alignment.sample import (
    REGION_ANSWER,
    REGION_CLOSE,
    REGION_EOT,
    REGION_REASONING,
    REGIONS,
    AlignedSample,
    Rendered,
    chunks_in_mask,
)
from crosskd.errors import DataError
from crosskd.tokenization import LoadedTokenizer

CHATML_FALLBACK = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message.get('reasoning_content') %}"
    "{{ '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>\\n' }}{% endfor %}"
)
"""The template for tokenizers without one: ChatML, reasoning in ``<think>`` blocks."""

_THINK = re.compile(r"\A\s*<think>(.*?)</think>\s*(.*)\Z", re.DOTALL)


@dataclass(frozen=True)
class ChatOptions:
    """Which parts of assistant messages count.

    ``included_regions``: of ``reasoning``, ``close``, ``answer`` (``eot`` pairs always count
    with the answer). ``drop_first_chunk``: leave the first chunk of each assistant message out
    of KD (its prediction depends on template tokens that differ between models).
    """

    included_regions: tuple[str, ...] = ("reasoning", "close", "answer")
    drop_first_chunk: bool = False


def split_reasoning(messages: list[dict]) -> list[dict]:
    """Messages with a leading ``<think>...</think>`` in assistant content moved to
    ``reasoning_content`` (messages that already have one are left alone)."""
    out = []
    for message in messages:
        match = _THINK.match(message.get("content") or "")
        if message.get("role") == "assistant" and match and not message.get("reasoning_content"):
            message = {**message, "reasoning_content": match[1].strip("\n"), "content": match[2]}
        out.append(message)
    return out


def render(
    tok: LoadedTokenizer,
    messages: list[dict],
    *,
    sample_id: str,
    add_generation_prompt: bool = False,
) -> Rendered:
    """Render and tokenize ``messages`` with ``tok``'s template (reasoning split off first with
    :func:`split_reasoning`); ``add_generation_prompt``: followed by the template's opening of
    an assistant turn (the prompt a model continues).

    Raises :class:`DataError` naming the sample and message when content cannot be located.
    Reasoning the template drops even when written into the content (Qwen3's template drops it
    for turns before the last user message) is left out; :func:`harmonize_reasoning` leaves it
    out for every model first so that all models see the same text.

    The template's rendering around sentinels and its pieces' tokens depend only on the
    conversation's shape (roles, which messages have reasoning, any other keys), so they are
    kept per tokenizer (:attr:`~crosskd.tokenization.LoadedTokenizer.renderings`) and a
    conversation of a shape seen before costs the encoding of its contents alone.
    """
    return render_many(
        tok, [messages], sample_ids=[sample_id], add_generation_prompt=add_generation_prompt
    )[0]


def render_many(
    tok: LoadedTokenizer,
    conversations: list[list[dict]],
    *,
    sample_ids: list[str],
    add_generation_prompt: bool = False,
) -> list[Rendered]:
    """:func:`render` of each conversation (``sample_ids[i]`` names ``conversations[i]`` in
    errors), the contents of all of them encoded in one batch; the first conversation, in
    order, that cannot be rendered raises."""
    framed = []
    for messages, sample_id in zip(conversations, sample_ids, strict=True):
        messages = split_reasoning(messages)
        dropped = _dropped_reasoning(tok, messages)
        if dropped:
            messages = _without_reasoning(messages, dropped)
        frame = _frame(tok, messages, add_generation_prompt, sample_id)
        contents = [
            messages[index]["reasoning_content" if region == REGION_REASONING else "content"]
            for index, region in frame.order
        ]
        framed.append((frame, contents))
    flat = [content for _, contents in framed for content in contents]
    encoded = tokenize(tok, flat, with_starts=True) if flat else []
    out, at = [], 0
    for frame, contents in framed:
        out.append(_fill(frame, contents, encoded[at : at + len(contents)]))
        at += len(contents)
    return out


def harmonize_reasoning(toks: list[LoadedTokenizer], messages: list[dict]) -> list[dict]:
    """``messages`` (reasoning split off) without the reasoning any of ``toks``' templates drops,
    so that every model renders the same reasoning."""
    messages = split_reasoning(messages)
    dropped = set().union(*(_dropped_reasoning(tok, messages) for tok in toks))
    return _without_reasoning(messages, dropped) if dropped else messages


def _without_reasoning(messages: list[dict], indices: set[int]) -> list[dict]:
    return [
        {k: v for k, v in m.items() if k != "reasoning_content"} if i in indices else m
        for i, m in enumerate(messages)
    ]


def _dropped_reasoning(tok: LoadedTokenizer, messages: list[dict]) -> set[int]:
    """Indices of messages whose reasoning ``tok``'s template does not render at all."""
    if not any(m.get("reasoning_content") for m in messages):
        return set()
    rendered, marks, _ = _sentinel_rendering(tok, messages)
    return {
        i
        for (i, region), mark in marks.items()
        if region == REGION_REASONING and mark not in rendered
    }


def _sentinel_rendering(
    tok: LoadedTokenizer, messages: list[dict], add_generation_prompt: bool = False
) -> tuple[str, dict[tuple[int, int], str], str]:
    """The rendering with every content (and reasoning) replaced by a unique sentinel; a
    template that ignores ``reasoning_content`` gets it written into the content. Kept per
    conversation shape."""
    template = tok.hf.chat_template or CHATML_FALLBACK
    marks = {}
    stand_in = []
    for index, message in enumerate(messages):
        copy = dict(message)
        copy["content"] = marks.setdefault((index, REGION_ANSWER), _sentinel(index, "a"))
        if message.get("reasoning_content"):
            copy["reasoning_content"] = marks.setdefault(
                (index, REGION_REASONING), _sentinel(index, "r")
            )
        stand_in.append(copy)
    key = _shape_key("sentinels", stand_in, add_generation_prompt)
    if key in tok.renderings:
        return tok.renderings[key]
    options = {
        "tokenize": False,
        "chat_template": template,
        "add_generation_prompt": add_generation_prompt,
    }
    rendered = tok.hf.apply_chat_template(stand_in, **options)
    ignored = [
        i
        for (i, region), mark in marks.items()
        if region == REGION_REASONING and mark not in rendered
    ]
    if ignored:
        for index in ignored:
            reasoning = stand_in[index].pop("reasoning_content")
            stand_in[index]["content"] = (
                f"<think>\n{reasoning}\n</think>\n\n{marks[index, REGION_ANSWER]}"
            )
        rendered = tok.hf.apply_chat_template(stand_in, **options)
    return _keep(tok, key, (rendered, marks, template))


def _sentinel(index: int, kind: str) -> str:
    return f"\ue000{kind}{index}\ue001"


@dataclass(frozen=True, eq=False)
class _Frame:
    """A conversation shape as one template renders it: the located contents ``order``
    ((message index, region) in text order), the template ``pieces`` around them (one more
    than ``order``), each tokenized with its specials recognised (``tokens``, with starts), and
    whether the template is the fallback."""

    order: list[tuple[int, int]]
    pieces: list[str]
    tokens: list[Tokenized]
    fallback_template: bool


def _frame(
    tok: LoadedTokenizer, messages: list[dict], add_generation_prompt: bool, sample_id: str
) -> _Frame:
    """The frame of ``messages``' shape (kept per shape once located; a shape whose content
    cannot be located raises :class:`DataError` for every sample of it)."""
    rendered, marks, template = _sentinel_rendering(tok, messages, add_generation_prompt)
    key = ("frame", rendered)
    if key in tok.renderings:
        return tok.renderings[key]
    located = []
    for (index, region), mark in marks.items():
        where = rendered.find(mark)
        if where < 0 or rendered.find(mark, where + 1) >= 0:
            raise DataError(
                f"sample {sample_id}: message {index} ({messages[index].get('role')}) cannot be "
                f"located in the rendering by {tok.name}'s chat template (it "
                f"{'drops' if where < 0 else 'repeats'} the message's "
                f"{REGIONS[region]}); use a template that renders every message once."
            )
        located.append((where, index, region, mark))
    located.sort()
    pieces = []
    cursor = 0
    for where, _, _, mark in located:
        pieces.append(rendered[cursor:where])
        cursor = where + len(mark)
    pieces.append(rendered[cursor:])
    tokens = tokenize(tok, pieces, with_starts=True, split_special_tokens=False)
    order = [(index, region) for _, index, region, _ in located]
    return _keep(tok, key, _Frame(order, pieces, tokens, template is CHATML_FALLBACK))


def _fill(frame: _Frame, contents: list[str], encoded: list[Tokenized]) -> Rendered:
    """A conversation rendered in ``frame``: its ``contents`` (in the frame's order), each
    tokenized on its own with specials kept as text (``encoded``, with starts), between the
    frame's template pieces."""
    ids, starts, ends, text_parts, layout = [], [], [], [], []
    base = 0
    for k, piece in enumerate(frame.pieces):
        parts = [(frame.tokens[k], piece)]
        if k < len(contents):
            index, region = frame.order[k]
            layout.append((index, region, base + len(piece), base + len(piece) + len(contents[k])))
            parts.append((encoded[k], contents[k]))
        for tokens, text in parts:
            ids.append(tokens.ids)
            starts.append(tokens.starts + base)
            ends.append(tokens.ends + base)
            text_parts.append(text)
            base += len(text)
    starts_array = np.concatenate(starts)
    return Rendered(
        text="".join(text_parts),
        tokens=Tokenized(np.concatenate(ids), np.concatenate(ends), starts_array),
        starts=starts_array,
        regions=_with_close_regions(layout),
        fallback_template=frame.fallback_template,
    )


def _shape_key(kind: str, stand_in: list[dict], add_generation_prompt: bool) -> tuple | None:
    """The key of a conversation shape (its messages with sentinels for content), or None for
    messages whose values JSON cannot write (then nothing is kept)."""
    try:
        return (kind, json.dumps([stand_in, add_generation_prompt], sort_keys=True))
    except (TypeError, ValueError):
        return None


def _keep(tok: LoadedTokenizer, key: tuple | None, value: object):
    """Keep ``value`` under ``key`` in ``tok``'s renderings (the oldest dropped beyond
    :data:`_KEPT` shapes) and return it."""
    if key is not None:
        if len(tok.renderings) >= _KEPT:
            del tok.renderings[next(iter(tok.renderings))]
        tok.renderings[key] = value
    return value


_KEPT = 4096
"""Renderings kept per tokenizer: conversations of a data set come in a few shapes; messages
that carry per-sample values beside their content (tool calls) make a shape each."""


def _with_close_regions(layout: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """Add the ``close`` region between each message's reasoning and its answer."""
    out = []
    reasoning_end: dict[int, int] = {}
    for index, region, start, end in layout:
        if region == REGION_REASONING:
            reasoning_end[index] = end
        elif index in reasoning_end:
            out.append((index, REGION_CLOSE, reasoning_end.pop(index), start))
        out.append((index, region, start, end))
    return sorted(out, key=lambda r: (r[2], r[3]))


def align_chat(
    student_tok: LoadedTokenizer,
    teacher_tok: LoadedTokenizer,
    messages: list[dict],
    *,
    sample_id: str,
    options: ChatOptions | None = None,
    student: Rendered | None = None,
    teacher: Rendered | None = None,
    clipped_message: int | None = None,
) -> AlignedSample:
    """Align the assistant messages of a conversation (module docstring for the rules).

    ``student``: the student's rendering when already made (shared across teachers; render it
    from :func:`harmonize_reasoning` output); ``teacher`` likewise the teacher's (data
    preparation renders every model once to measure the conversation). ``clipped_message``: the
    index of an assistant
    message whose answer was cut by clipping: its end-of-turn pair is left out (the model must
    not learn to stop there).
    """
    options = options or ChatOptions()
    unknown = set(options.included_regions) - {"reasoning", "close", "answer"}
    if unknown:
        raise DataError(
            f"included_regions: {sorted(unknown)} are not regions; choose from reasoning, close, "
            f"answer."
        )
    messages = harmonize_reasoning([student_tok, teacher_tok], messages)
    if not any(m.get("role") == "assistant" for m in messages):
        raise DataError(
            f"sample {sample_id}: the conversation has no assistant message, so nothing would be "
            f"distilled; drop the sample or add the assistant's answer."
        )
    s = student or render(student_tok, messages, sample_id=sample_id)
    t = teacher or render(teacher_tok, messages, sample_id=sample_id)
    t_regions = {(m, r): (a, b) for m, r, a, b in t.regions}
    included = {REGIONS.index(name) for name in options.included_regions}
    parts, regions, owners = [], [], []
    loss_mask = np.zeros(len(s.tokens), dtype=bool)
    for message, region, a, b in s.regions:
        if messages[message].get("role") != "assistant":
            continue
        t_start, t_end = t_regions[message, region]
        s_rows, t_rows = token_rows(s, a, b), token_rows(t, t_start, t_end)
        if region in included:
            loss_mask[s_rows] = True
        if len(s_rows) and len(t_rows):
            chunks = align(
                _rebased(s.tokens, s_rows, a),
                _rebased(t.tokens, t_rows, t_start),
                student_tok,
                teacher_tok,
                student_start=int(s_rows[0]),
                teacher_start=int(t_rows[0]),
            )
            _add(parts, regions, owners, chunks, region, message)
        if region == REGION_ANSWER and message != clipped_message:
            pair = _eot_pair(s, t, student_tok, teacher_tok, b, t_end)
            if pair is not None:
                _add(parts, regions, owners, pair, REGION_EOT, message)
                if REGION_ANSWER in included:
                    loss_mask[pair.student[0, 0]] = True
    chunks = Chunks.concatenate(parts)
    chunk_region = np.concatenate(regions) if regions else np.zeros(0, dtype=np.uint8)
    chunk_message = np.concatenate(owners) if owners else np.zeros(0, dtype=np.int32)
    counted = included | ({REGION_EOT} if REGION_ANSWER in included else set())
    kd_mask = np.isin(chunk_region, list(counted)) & chunks_in_mask(chunks, loss_mask)
    if options.drop_first_chunk:
        kd_mask &= ~_first_per_message(chunk_message, kd_mask)
    return AlignedSample(s, t, chunks, chunk_region, chunk_message, kd_mask, loss_mask)


def _add(parts: list, regions: list, owners: list, chunks: Chunks, region: int, message: int):
    parts.append(chunks)
    regions.append(np.full(len(chunks), region, dtype=np.uint8))
    owners.append(np.full(len(chunks), message, dtype=np.int32))


def _first_per_message(chunk_message: np.ndarray, counted: np.ndarray) -> np.ndarray:
    """The first counted chunk of each message, bool ``[c]``."""
    first = np.zeros(len(chunk_message), dtype=bool)
    candidates = np.flatnonzero(counted)
    if candidates.size:
        owners = chunk_message[candidates]
        leading = np.ones(candidates.size, dtype=bool)
        leading[1:] = owners[1:] != owners[:-1]
        first[candidates[leading]] = True
    return first


def token_rows(rendered: Rendered, start: int, end: int) -> np.ndarray:
    """Token indices whose end offset lies in ``(start, end]``."""
    ends = rendered.tokens.ends
    return np.flatnonzero((ends > start) & (ends <= end))


def _rebased(tokens: Tokenized, rows: np.ndarray, start: int) -> Tokenized:
    return Tokenized(tokens.ids[rows], tokens.ends[rows] - start)


def _eot_pair(
    s: Rendered,
    t: Rendered,
    student_tok: LoadedTokenizer,
    teacher_tok: LoadedTokenizer,
    s_answer_end: int,
    t_answer_end: int,
) -> Chunks | None:
    """The first eot-role special after the answer (which ends at these characters) and before
    the next located region on each side, as one special chunk; None if either side has none."""
    s_eot = first_with_role(s, student_tok, "eot", s_answer_end)
    t_eot = first_with_role(t, teacher_tok, "eot", t_answer_end)
    if s_eot is None or t_eot is None:
        return None
    return Chunks(
        np.array([[s_eot, s_eot + 1]]),
        np.array([[t_eot, t_eot + 1]]),
        np.array([SHAPE_SPECIAL], dtype=np.uint8),
        np.ones(1, dtype=bool),
        np.ones(1, dtype=bool),
    )


def first_with_role(rendered: Rendered, tok: LoadedTokenizer, role: str, after: int) -> int | None:
    """Index of the first ``role`` token that ends after character ``after`` and before the
    next located region begins."""
    target = tok.role_ids.get(role)
    if target is None:
        return None
    ends = rendered.tokens.ends
    later = [a for _, _, a, _ in rendered.regions if a > after]
    limit = min(later) if later else None
    window = ends > after
    if limit is not None:
        window &= ends <= limit
    hits = np.flatnonzero(window & (rendered.tokens.ids == target))
    return int(hits[0]) if hits.size else None
