"""One sample aligned for one (student, teacher) pair: what data preparation stores and the
collator batches, for plain text and chat alike."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from crosskd.alignment.core import Chunks, Tokenized, align, tokenize
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
    tokens = tokenize(tok, [text], add_special_tokens=True, with_starts=True)[0]
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
    t = render_text(teacher_tok, text)
    chunks = align(s.tokens, t.tokens, student_tok, teacher_tok)
    loss_mask = np.ones(len(s.tokens), dtype=bool)
    loss_mask[:1] = False
    return AlignedSample(
        s,
        t,
        chunks,
        np.full(len(chunks), REGION_TEXT, dtype=np.uint8),
        np.zeros(len(chunks), dtype=np.int32),
        chunks_in_mask(chunks, loss_mask),
        loss_mask,
    )


def chunks_in_mask(chunks: Chunks, loss_mask: np.ndarray) -> np.ndarray:
    """Whether all student tokens of each chunk are in ``loss_mask``; bool ``[c]``."""
    outside = np.concatenate([[0], np.cumsum(~loss_mask)])
    return outside[chunks.student[:, 1]] == outside[chunks.student[:, 0]]
