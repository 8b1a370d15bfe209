"""Aligning two tokenizations of the same text by character offsets (spec section 2).

Input: each side's token ids and character *end* offsets (start offsets are never trusted:
ByteLevel ``trim_offsets`` leaves a leading space outside the span, NFC can leave a combining
mark uncovered, some tokenizers drop control characters).

1. Specials (every added token, :data:`~crosskd.tokenization.KIND_SPECIAL`) are set aside and
   paired by role: within one gap between content chunks, the k-th special of a role on one side
   pairs with the k-th of that role on the other; ``pad`` and specials without a role never
   pair. A role pair is a chunk of its own (shape ``special``), placed after the content chunk
   before it.
2. Content tokens form **clusters**: a token whose end does not pass the running maximum end of
   the tokens before it joins the previous cluster (byte pieces of one character). A cluster's
   end is that running maximum, so cluster ends are strictly increasing.
3. The strict end walker (take the next cluster from the side whose end is smaller; cut where
   both ends meet) cuts exactly at the end values both sides share, so it is computed as the
   intersection of the two sorted cluster-end lists, in numpy. Clusters after the last shared
   end stay unpaired.
4. ``is_correct``: the chunk's student bytes equal its teacher bytes (raw bytes), and no special
   of either side sits inside the chunk's token range (a literal added token such as
   DeepSeek's ``<think>`` in user text makes the chunk around it incorrect).
5. Shape: ``1:1``, ``1:n``, ``n:1``, ``n:m`` by token counts; ``special`` for role pairs.
6. ``has_prediction`` is false when the chunk starts at token 0 on either side (no row before
   it prices it); chat mode passes the message's offset so "token 0" means the conversation's.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from crosskd import ragged
from crosskd.tokenization import KIND_SPECIAL, LoadedTokenizer

SHAPE_1_1, SHAPE_1_N, SHAPE_N_1, SHAPE_N_M, SHAPE_SPECIAL = range(5)
SHAPE_NAMES = ("1:1", "1:n", "n:1", "n:m", "special")


@dataclass(frozen=True, eq=False)
class Tokenized:
    """One model's tokenization of one text: ``ids`` int64 ``[n]`` and the character ``ends``
    int64 ``[n]`` of every token (exclusive end offsets into the text); ``starts`` (int64
    ``[n]``) when asked for (the walker never uses them)."""

    ids: np.ndarray
    ends: np.ndarray
    starts: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True, eq=False)
class Chunks:
    """Aligned chunks, in text order.

    ``student`` / ``teacher`` int64 ``[c, 2]``: half-open token index ranges ``[s0, s1)`` and
    ``[t0, t1)``; ``shape`` uint8 ``[c]`` (index into :data:`SHAPE_NAMES`); ``is_correct`` and
    ``has_prediction`` bool ``[c]``.
    """

    student: np.ndarray
    teacher: np.ndarray
    shape: np.ndarray
    is_correct: np.ndarray
    has_prediction: np.ndarray

    def __len__(self) -> int:
        return len(self.shape)

    @classmethod
    def empty(cls) -> Chunks:
        """No chunks."""
        ranges = np.zeros((0, 2), dtype=np.int64)
        flags = np.zeros(0, dtype=bool)
        return cls(ranges, ranges, np.zeros(0, dtype=np.uint8), flags, flags)

    @classmethod
    def concatenate(cls, parts: list[Chunks]) -> Chunks:
        """Chunks of several parts one after another (ranges already in one index space)."""
        if not parts:
            return cls.empty()
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in _FIELDS))

    def shifted(self, student_offset: int, teacher_offset: int) -> Chunks:
        """The same chunks with token indices moved by the given offsets."""
        return Chunks(
            self.student + student_offset,
            self.teacher + teacher_offset,
            self.shape,
            self.is_correct,
            self.has_prediction,
        )

    def select(self, mask: np.ndarray) -> Chunks:
        """The chunks where ``mask`` (bool ``[c]``) is true."""
        return Chunks(*(getattr(self, f)[mask] for f in _FIELDS))


_FIELDS = ("student", "teacher", "shape", "is_correct", "has_prediction")


def tokenize(
    tok: LoadedTokenizer,
    texts: list[str],
    *,
    add_special_tokens: bool = False,
    with_starts: bool = False,
    split_special_tokens: bool = True,
) -> list[Tokenized]:
    """Tokenize user text with character offsets; specials in the text stay text
    (``split_special_tokens``), except added tokens the tokenizer matches anyway; with
    ``split_special_tokens`` false (template text) specials in the text are specials.

    What ``tok.hf(texts, split_special_tokens=..., return_offsets_mapping=True)`` returns,
    read from the Rust tokenizer's encodings directly (no padding, no truncation), without
    transformers' per-text dictionaries: the encoding is most of what data preparation costs."""
    if not texts:
        return []
    backend = tok.backend
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    before = backend.encode_special_tokens
    backend.encode_special_tokens = split_special_tokens
    out = []
    try:
        for first in range(0, len(texts), _ENCODE_BATCH):
            batch = texts[first : first + _ENCODE_BATCH]
            for encoding in backend.encode_batch(batch, add_special_tokens=add_special_tokens):
                spans = np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2)
                starts = spans[:, 0].copy() if with_starts else None
                ids = np.array(encoding.ids, dtype=np.int64)
                out.append(Tokenized(ids, spans[:, 1].copy(), starts))
    finally:
        backend.encode_special_tokens = before
    return out


_ENCODE_BATCH = 256
"""Texts per call of the Rust tokenizer: enough for its threads, few enough that its encodings
(each with its token strings) stay a small part of memory before they become arrays."""


def align(
    student: Tokenized,
    teacher: Tokenized,
    student_tok: LoadedTokenizer,
    teacher_tok: LoadedTokenizer,
    *,
    student_start: int = 0,
    teacher_start: int = 0,
) -> Chunks:
    """Chunks of two tokenizations of one text (module docstring for the rules).

    ``student_start`` / ``teacher_start``: index of these tokens' first token in the whole
    sequence, for ``has_prediction`` and the returned ranges (chat mode aligns a slice).
    """
    chunks = align_many([student], [teacher], student_tok, teacher_tok)[0]
    chunks = chunks.shifted(student_start, teacher_start)
    first = (chunks.student[:, 0] == 0) | (chunks.teacher[:, 0] == 0)
    return Chunks(chunks.student, chunks.teacher, chunks.shape, chunks.is_correct, ~first)


def align_many(
    students: list[Tokenized],
    teachers: list[Tokenized],
    student_tok: LoadedTokenizer,
    teacher_tok: LoadedTokenizer,
) -> list[Chunks]:
    """:func:`align` for many documents at once, in one vectorised pass.

    Each document's character offsets are shifted past the previous document's (on both sides
    alike), so clusters never span documents; a cut belongs to the document its end lies in and
    a chunk starts at the previous cut of the same document (or the document's first content
    token), so tails after a document's last shared end stay unpaired, as in :func:`align`.
    """
    s_doc, t_doc = _doc_offsets(students), _doc_offsets(teachers)
    widths = [
        max(int(s.ends.max(initial=0)), int(t.ends.max(initial=0))) + 1
        for s, t in zip(students, teachers, strict=True)
    ]
    char_base = ragged.offsets_from_lengths(np.asarray(widths, dtype=np.int64))
    s = _joined(students, char_base)
    t = _joined(teachers, char_base)
    s_special = student_tok.bytes.kind[s.ids] == KIND_SPECIAL
    t_special = teacher_tok.bytes.kind[t.ids] == KIND_SPECIAL
    s_pos, t_pos = np.flatnonzero(~s_special), np.flatnonzero(~t_special)
    s_starts, s_cuts = _cuts(s.ends[s_pos])
    t_starts, t_cuts = _cuts(t.ends[t_pos])
    at = np.minimum(np.searchsorted(t_cuts, s_cuts), max(len(t_cuts) - 1, 0))
    s_k = np.flatnonzero(t_cuts[at] == s_cuts) if len(t_cuts) else _EMPTY
    t_k = at[s_k]
    doc = np.searchsorted(char_base, s_cuts[s_k], side="right") - 1
    s_end = _cluster_stop(s_starts, s_k, len(s_pos))
    t_end = _cluster_stop(t_starts, t_k, len(t_pos))
    s_begin = _chunk_begin(s_end, doc, np.searchsorted(s_pos, s_doc[:-1]))
    t_begin = _chunk_begin(t_end, doc, np.searchsorted(t_pos, t_doc[:-1]))

    student_ranges = np.stack([s_pos[s_begin], s_pos[s_end - 1] + 1], axis=1) if len(doc) else _NONE
    teacher_ranges = np.stack([t_pos[t_begin], t_pos[t_end - 1] + 1], axis=1) if len(doc) else _NONE
    s_count, t_count = s_end - s_begin, t_end - t_begin
    clean = (student_ranges[:, 1] - student_ranges[:, 0] == s_count) & (
        teacher_ranges[:, 1] - teacher_ranges[:, 0] == t_count
    )
    same = ragged.segments_equal(
        *_chunk_bytes(student_tok, s.ids[s_pos], s_begin, s_end),
        *_chunk_bytes(teacher_tok, t.ids[t_pos], t_begin, t_end),
    )
    shape = ((s_count > 1).astype(np.uint8) << 1) | (t_count > 1).astype(np.uint8)
    content = Chunks(
        student_ranges,
        teacher_ranges,
        _SHAPE_OF_CODE[shape],
        same & clean,
        np.ones(len(doc), dtype=bool),
    )
    pairs = _pair_specials(
        s,
        t,
        student_tok,
        teacher_tok,
        s_special,
        t_special,
        student_ranges,
        teacher_ranges,
        s_doc,
        t_doc,
    )
    merged, merged_doc = _merge(content, doc, pairs)
    return _split(merged, merged_doc, s_doc, t_doc)


_NONE = np.zeros((0, 2), dtype=np.int64)
_EMPTY = np.zeros(0, dtype=np.int64)
_SHAPE_OF_CODE = np.array([SHAPE_1_1, SHAPE_1_N, SHAPE_N_1, SHAPE_N_M], dtype=np.uint8)
"""Shape by code ``2 * (student tokens > 1) + (teacher tokens > 1)``."""


def _doc_offsets(docs: list[Tokenized]) -> np.ndarray:
    """Token offsets of each document in the joined sequence, int64 ``[D + 1]``."""
    return ragged.offsets_from_lengths(np.fromiter(map(len, docs), np.int64, count=len(docs)))


def _joined(docs: list[Tokenized], char_base: np.ndarray) -> Tokenized:
    """All documents one after another, ends shifted by each document's character base."""
    if not docs:
        return Tokenized(_EMPTY, _EMPTY)
    ends = np.concatenate(
        [d.ends + base for d, base in zip(docs, char_base[:-1].tolist(), strict=True)]
    )
    return Tokenized(np.concatenate([d.ids for d in docs]).astype(np.int64), ends)


def _chunk_begin(stops: np.ndarray, doc: np.ndarray, doc_first: np.ndarray) -> np.ndarray:
    """Start position of each chunk: the previous chunk's stop in the same document, else the
    document's first content position."""
    begin = doc_first[doc] if len(doc) else _EMPTY
    if len(doc) > 1:
        same_doc = doc[1:] == doc[:-1]
        begin[1:][same_doc] = stops[:-1][same_doc]
    return begin


def _cuts(ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cluster starts (positions, int64 ``[k]``) and cluster ends (characters, strictly
    increasing) of content tokens with the given end offsets."""
    if len(ends) == 0:
        return _EMPTY, _EMPTY
    running = np.maximum.accumulate(ends)
    new = np.ones(len(ends), dtype=bool)
    new[1:] = ends[1:] > running[:-1]
    starts = np.flatnonzero(new)
    last = np.append(starts[1:], len(ends)) - 1
    return starts, running[last]


def _chunk_bytes(
    tok: LoadedTokenizer, content_ids: np.ndarray, begins: np.ndarray, stops: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Bytes of the chunks' content tokens, chunk after chunk, and each chunk's byte offsets."""
    ranges = ragged.offsets_from_lengths(stops - begins)
    positions = np.arange(int(ranges[-1]), dtype=np.int64) + np.repeat(
        begins - ranges[:-1], stops - begins
    )
    ids = content_ids[positions]
    token_offsets = ragged.offsets_from_lengths(tok.bytes.lengths[ids])
    return tok.bytes.concat(ids), token_offsets[ranges]


def _cluster_stop(starts: np.ndarray, clusters: np.ndarray, count: int) -> np.ndarray:
    """Exclusive end position (in the content list) of each of ``clusters``."""
    following = clusters + 1
    stop = np.full(len(clusters), count, dtype=np.int64)
    inside = following < len(starts)
    stop[inside] = starts[following[inside]]
    return stop


def _pair_specials(
    student: Tokenized,
    teacher: Tokenized,
    student_tok: LoadedTokenizer,
    teacher_tok: LoadedTokenizer,
    s_special: np.ndarray,
    t_special: np.ndarray,
    s_ranges: np.ndarray,
    t_ranges: np.ndarray,
    s_doc: np.ndarray,
    t_doc: np.ndarray,
) -> list[tuple[int, int, int, int]]:
    """Role pairs as (document, gap, student index, teacher index), in order; the k-th special
    of a role on one side pairs with the k-th on the other within one document and gap. A
    special inside a content chunk's token range (an added token matched in the middle of
    text) takes part in no pair: that chunk is already incorrect."""

    def pairable(seq: Tokenized, tok: LoadedTokenizer, special: np.ndarray, ranges, docs):
        for index in np.flatnonzero(special).tolist():
            role = tok.roles.get(int(seq.ids[index]))
            gap = int(np.searchsorted(ranges[:, 1], index, side="right"))
            inside = gap < len(ranges) and ranges[gap, 0] < index
            if role is not None and role != "pad" and not inside:
                yield int(np.searchsorted(docs, index, side="right")) - 1, gap, role, index

    queues: dict[tuple[int, int, str], list[int]] = defaultdict(list)
    for doc, gap, role, index in pairable(teacher, teacher_tok, t_special, t_ranges, t_doc):
        queues[doc, gap, role].append(index)
    pairs = []
    taken: dict[tuple[int, int, str], int] = defaultdict(int)
    for doc, gap, role, index in pairable(student, student_tok, s_special, s_ranges, s_doc):
        key = (doc, gap, role)
        if taken[key] < len(queues[key]):
            pairs.append((doc, gap, index, queues[key][taken[key]]))
            taken[key] += 1
    return pairs


def _merge(
    content: Chunks, doc: np.ndarray, pairs: list[tuple[int, int, int, int]]
) -> tuple[Chunks, np.ndarray]:
    """Content chunks and role pairs in one list (a pair in gap g follows content chunk g - 1),
    and the document of each."""
    if not pairs:
        return content, doc
    pair_doc, gaps, s_index, t_index = np.array(pairs, dtype=np.int64).T
    k = len(pairs)
    special = Chunks(
        np.stack([s_index, s_index + 1], axis=1),
        np.stack([t_index, t_index + 1], axis=1),
        np.full(k, SHAPE_SPECIAL, dtype=np.uint8),
        np.ones(k, dtype=bool),
        np.ones(k, dtype=bool),
    )
    keys = np.concatenate([2 * np.arange(len(content)) + 1, 2 * gaps])
    order = np.lexsort((np.concatenate([content.student[:, 0], s_index]), keys))
    both = Chunks.concatenate([content, special])
    return Chunks(*(getattr(both, f)[order] for f in _FIELDS)), np.concatenate([doc, pair_doc])[
        order
    ]


def _split(chunks: Chunks, doc: np.ndarray, s_doc: np.ndarray, t_doc: np.ndarray) -> list[Chunks]:
    """Per-document chunks with document-local token indices and ``has_prediction``."""
    n_docs = len(s_doc) - 1
    student = chunks.student - s_doc[doc][:, None]
    teacher = chunks.teacher - t_doc[doc][:, None]
    has_prediction = (student[:, 0] > 0) & (teacher[:, 0] > 0)
    bounds = ragged.offsets_from_lengths(np.bincount(doc, minlength=n_docs))
    out = []
    for d in range(n_docs):
        part = slice(int(bounds[d]), int(bounds[d + 1]))
        out.append(
            Chunks(
                student[part],
                teacher[part],
                chunks.shape[part],
                chunks.is_correct[part],
                has_prediction[part],
            )
        )
    return out
