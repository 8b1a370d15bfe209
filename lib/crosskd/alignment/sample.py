"""One sample aligned for one (student, teacher) pair: what data preparation stores and the
collator batches, for plain text and chat alike."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from crosskd.alignment.core import Chunks, Tokenized, align_many, tokenize
from crosskd.tokenization import LoadedTokenizer

REGIONS = ("text", "reasoning", "close", "answer", "eot")
REGION_TEXT, REGION_REASONING, REGION_CLOSE, REGION_ANSWER, REGION_EOT = range(5)


@dataclass(frozen=True, eq=False)
class Rendered:
    """One model's view of a sample: ``text``, its tokens (``tokens.ids``, ``tokens.ends``, and
    ``starts`` int64 ``[n]``), and ``regions``: (message index, region id, char start, char
    end) of every located span, in text order."""

    text: str
    tokens: Tokenized
    starts: np.ndarray
    regions: list[tuple[int, int, int, int]]
    fallback_template: bool = False


@dataclass(frozen=True, eq=False)
class AlignedSample:
    """A sample aligned for one (student, teacher) pair.

    ``chunks`` (token indices into the two whole sequences), ``chunk_region`` uint8 ``[c]``
    (index into :data:`REGIONS`), ``chunk_message`` int32 ``[c]`` (0 for plain text),
    ``kd_mask`` bool ``[c]`` (the chunk's region counts and all its student tokens are in the
    loss mask), and the student's CE ``loss_mask`` bool ``[n_student]``.
    """

    student: Rendered
    teacher: Rendered
    chunks: Chunks
    chunk_region: np.ndarray
    chunk_message: np.ndarray
    kd_mask: np.ndarray
    loss_mask: np.ndarray


def render_text(tok: LoadedTokenizer, text: str) -> Rendered:
    """Plain text as ``tok`` reads it (with the tokenizer's own BOS/EOS, specials in the text
    kept as text)."""
    return render_texts(tok, [text])[0]


def render_texts(tok: LoadedTokenizer, texts: list[str]) -> list[Rendered]:
    """:func:`render_text` of many texts, encoded in one batch."""
    if not texts:
        return []
    tokens = tokenize(tok, texts, add_special_tokens=True, with_starts=True)
    return [rendered_text(text, t) for text, t in zip(texts, tokens, strict=True)]


def rendered_text(text: str, tokens: Tokenized) -> Rendered:
    """The :class:`Rendered` of plain ``text`` from its tokens (:func:`tokenize` with the
    tokenizer's special tokens and start offsets), as :func:`render_text` makes it."""
    return Rendered(text, tokens, tokens.starts, [(0, REGION_TEXT, 0, len(text))])


def align_text(
    student_tok: LoadedTokenizer,
    teacher_tok: LoadedTokenizer,
    text: str,
    *,
    student: Rendered | None = None,
) -> AlignedSample:
    """Align plain text: every student token with a prediction (index >= 1) is a CE target and
    every chunk is in the loss mask. ``student``: the student's rendering if already made."""
    s = student or render_text(student_tok, text)
    return align_texts(student_tok, teacher_tok, [s], [render_text(teacher_tok, text)])[0]


def align_texts(
    student_tok: LoadedTokenizer,
    teacher_tok: LoadedTokenizer,
    students: list[Rendered],
    teachers: list[Rendered],
) -> list[AlignedSample]:
    """:func:`align_text` of many plain texts (``students[i]`` and ``teachers[i]`` render the
    same text), aligned in one vectorised pass (:func:`~crosskd.alignment.align_many`)."""
    if not students:
        return []
    chunks = align_many(
        [s.tokens for s in students], [t.tokens for t in teachers], student_tok, teacher_tok
    )
    out = []
    for s, t, c in zip(students, teachers, chunks, strict=True):
        loss_mask = np.ones(len(s.tokens), dtype=bool)
        loss_mask[:1] = False
        out.append(
            AlignedSample(
                s,
                t,
                c,
                np.full(len(c), REGION_TEXT, dtype=np.uint8),
                np.zeros(len(c), dtype=np.int32),
                chunks_in_mask(c, loss_mask),
                loss_mask,
            )
        )
    return out


def chunks_in_mask(chunks: Chunks, loss_mask: np.ndarray) -> np.ndarray:
    """Whether all student tokens of each chunk are in ``loss_mask``; bool ``[c]``."""
    outside = np.concatenate([[0], np.cumsum(~loss_mask)])
    return outside[chunks.student[:, 1]] == outside[chunks.student[:, 0]]
