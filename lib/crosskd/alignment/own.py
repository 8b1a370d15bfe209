"""The student's own view of one sample, with no teacher involved: which of its tokens are CE
targets, and which are KD positions for a teacher that shares its tokenizer (spec section 5,
"Same tokenizer": such a teacher is not aligned; it is compared position by position).

The chat rules are :func:`~crosskd.alignment.align_chat`'s, applied to the student alone (the
same region and end-of-turn lookups), so the positions are exactly the tokens the alignment of
the student with itself would mark for KD, except that ``drop_first_chunk`` drops one token
(the first of each assistant message) where that alignment would drop a whole first chunk
(every byte piece of a leading emoji, say).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from crosskd.alignment.chat import ChatOptions, first_with_role, token_rows
from crosskd.alignment.sample import REGION_ANSWER, REGION_EOT, REGION_TEXT, REGIONS, Rendered
from crosskd.errors import DataError
from crosskd.tokenization import LoadedTokenizer


@dataclass(frozen=True, eq=False)
class StudentTokens:
    """The student's own view of one sample, per student token (no teacher involved):
    ``loss_mask`` (CE targets), ``kd`` (KD positions of a same-tokenizer teacher), ``region``
    (index into :data:`~crosskd.alignment.REGIONS`; 0, ``text``, for plain text and outside
    the assistant messages' regions) and ``message`` (the assistant message's index; 0 for
    plain text and elsewhere)."""

    loss_mask: np.ndarray
    kd: np.ndarray
    region: np.ndarray
    message: np.ndarray


def student_tokens(
    student_tok: LoadedTokenizer,
    student: Rendered,
    messages: list[dict] | None,
    options: ChatOptions,
    *,
    sample_id: str,
    clipped_message: int | None = None,
) -> StudentTokens:
    """The student's CE mask and KD positions of one sample, from its rendering alone.

    Plain text (``messages`` None): every token is a KD position and every token but the first
    a CE target. Chat: the rules :func:`~crosskd.alignment.align_chat` applies to the student
    (a token is in a region iff its end offset lies in ``(start, end]``; the end-of-turn token
    is the first ``eot``-role special after the answer and before the next region, none for a
    message clipping cut short), with the student as its own counterpart: the CE mask is the
    included regions of every assistant message plus the end-of-turn token when ``answer`` is
    included; the KD positions are the same tokens, less the first of each assistant message
    under ``drop_first_chunk``.
    """
    n = len(student.tokens)
    region = np.full(n, REGION_TEXT, dtype=np.uint8)
    message = np.zeros(n, dtype=np.int32)
    if messages is None:
        loss_mask = np.ones(n, dtype=bool)
        loss_mask[:1] = False
        return StudentTokens(loss_mask, np.ones(n, dtype=bool), region, message)
    if not any(m.get("role") == "assistant" for m in messages):
        raise DataError(
            f"sample {sample_id}: the conversation has no assistant message, so nothing would be "
            f"distilled; drop the sample or add the assistant's answer."
        )
    included = {REGIONS.index(name) for name in options.included_regions}
    loss_mask = np.zeros(n, dtype=bool)
    for index, kind, start, end in student.regions:
        if messages[index].get("role") != "assistant":
            continue
        rows = token_rows(student, start, end)
        region[rows], message[rows] = kind, index
        if kind in included:
            loss_mask[rows] = True
        if kind == REGION_ANSWER and index != clipped_message:
            eot = first_with_role(student, student_tok, "eot", end)
            if eot is not None:
                region[eot], message[eot] = REGION_EOT, index
                if REGION_ANSWER in included:
                    loss_mask[eot] = True
    kd = loss_mask.copy()
    if options.drop_first_chunk:
        where = np.flatnonzero(kd)
        if where.size:
            owners = message[where]
            leading = np.ones(where.size, dtype=bool)
            leading[1:] = owners[1:] != owners[:-1]
            kd[where[leading]] = False
    return StudentTokens(loss_mask, kd, region, message)
