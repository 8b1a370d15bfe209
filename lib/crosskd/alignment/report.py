"""The compatibility report of a (student, teacher) tokenizer pair over some texts.

:func:`pair_report` tokenizes every text with both tokenizers (plain text:
``add_special_tokens=False``, specials in the text stay text as in :func:`tokenize`), aligns
them with the aligner's own :func:`align_many`, and counts what the KD loss will get (spec
section 5):

* in a correct ``1:1`` chunk it compares the two next-token distributions over the common
  tokens (plus the realized token): **token-to-token**;
* in a correct ``1:n`` / ``n:1`` chunk it compares the realized text with alternatives that
  leave the realized path at one token: **chunk level with alternatives**;
* in a correct ``n:m`` chunk or a special-role pair only the realized text against the rest:
  **realized text only**;
* an incorrect chunk (bytes differ, or a literal added token inside) or an unpaired token
  (after the last character end both sides share, or a special with no counterpart) gives
  **no signal**.

A chunk's token counts are its *content* tokens (a literal added token inside a content chunk's
range, which makes the chunk incorrect, is counted with its own special pair or as unpaired), so
the chunks and the unpaired tokens partition each side's tokens.

Units: counts are tokens, chunks, documents or characters (Python ``str`` length); every
``*_share`` / ``*_rate`` is a fraction in ``[0, 1]`` (printed as a percentage). The common
vocabulary is the one-to-one common tokens of the table pair (spec section 3); its share of a
vocabulary is over that tokenizer's *normal* tokens (specials and padding rows excluded).
:meth:`PairReport.to_dict` holds the counts and the derived figures (JSON-ready);
:meth:`PairReport.from_dict` reads the counts back.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from itertools import islice

import numpy as np
from tqdm.auto import tqdm

from crosskd.alignment.core import (
    SHAPE_NAMES,
    SHAPE_SPECIAL,
    Chunks,
    Tokenized,
    align_many,
    tokenize,
)
from crosskd.tables import TablePair, build_table, common_tokens
from crosskd.tokenization import KIND_NORMAL, KIND_SPECIAL, LoadedTokenizer

log = logging.getLogger(__name__)
_EMPTY = np.zeros(0, dtype=np.int64)

#: Verdict thresholds on the token-to-token share of student tokens.
GOOD_SHARE, WORKABLE_SHARE = 0.80, 0.50
#: Shares of student tokens above which the report warns (incorrect chunks, unpaired tokens).
WARN_INCORRECT, WARN_UNPAIRED = 0.01, 0.005


@dataclass(frozen=True)
class ShapeStats:
    """Counts for one chunk shape: chunks, correct chunks, tokens on each side (in all chunks
    and in correct ones), and the largest chunk's token count on each side."""

    chunks: int = 0
    correct_chunks: int = 0
    student_tokens: int = 0
    teacher_tokens: int = 0
    correct_student_tokens: int = 0
    max_student_tokens: int = 0
    max_teacher_tokens: int = 0

    @property
    def correct_rate(self) -> float:
        """Correct chunks / chunks (0 when there are none)."""
        return ratio(self.correct_chunks, self.chunks)


@dataclass(frozen=True)
class PairReport:
    """Compatibility of a tokenizer pair over a corpus (module docstring for the terms).

    ``shapes`` maps every name of :data:`SHAPE_NAMES` to its :class:`ShapeStats`;
    ``*_vocabulary`` are normal-token counts; ``*_tokens_common`` count the corpus tokens whose
    id is a common token.
    """

    student: str
    teacher: str
    student_fingerprint: str
    teacher_fingerprint: str
    documents: int
    characters: int
    student_tokens: int
    teacher_tokens: int
    shapes: dict[str, ShapeStats]
    unpaired_student_tokens: int
    unpaired_teacher_tokens: int
    documents_with_unpaired: int
    chunks_without_prediction: int
    common_vocabulary: int
    student_vocabulary: int
    teacher_vocabulary: int
    student_tokens_common: int
    teacher_tokens_common: int

    @property
    def chunks(self) -> int:
        """All chunks (content and special pairs)."""
        return sum(s.chunks for s in self.shapes.values())

    @property
    def correct_rate(self) -> float:
        """Correct chunks / chunks."""
        return ratio(sum(s.correct_chunks for s in self.shapes.values()), self.chunks)

    @property
    def student_tokens_per_char(self) -> float:
        """Student tokens per character."""
        return ratio(self.student_tokens, self.characters)

    @property
    def teacher_tokens_per_char(self) -> float:
        """Teacher tokens per character."""
        return ratio(self.teacher_tokens, self.characters)

    @property
    def one_to_one_student_share(self) -> float:
        """Share of student tokens in ``1:1`` chunks (correct or not)."""
        return ratio(self.shapes["1:1"].student_tokens, self.student_tokens)

    @property
    def one_to_one_teacher_share(self) -> float:
        """Share of teacher tokens in ``1:1`` chunks (correct or not)."""
        return ratio(self.shapes["1:1"].teacher_tokens, self.teacher_tokens)

    @property
    def incorrect_student_share(self) -> float:
        """Share of student tokens in chunks that are not correct."""
        wrong = sum(s.student_tokens - s.correct_student_tokens for s in self.shapes.values())
        return ratio(wrong, self.student_tokens)

    @property
    def signal_shares(self) -> dict[str, float]:
        """Share of student tokens by the KD signal they get: ``token``, ``chunk``,
        ``realized``, ``none`` (module docstring); the four sum to 1."""
        correct = {name: s.correct_student_tokens for name, s in self.shapes.items()}
        token = ratio(correct["1:1"], self.student_tokens)
        chunk = ratio(correct["1:n"] + correct["n:1"], self.student_tokens)
        realized = ratio(correct["n:m"] + correct["special"], self.student_tokens)
        none = self.incorrect_student_share + ratio(
            self.unpaired_student_tokens, self.student_tokens
        )
        return {"token": token, "chunk": chunk, "realized": realized, "none": none}

    @property
    def common_student_share(self) -> float:
        """Common tokens / the student's normal tokens."""
        return ratio(self.common_vocabulary, self.student_vocabulary)

    @property
    def common_teacher_share(self) -> float:
        """Common tokens / the teacher's normal tokens."""
        return ratio(self.common_vocabulary, self.teacher_vocabulary)

    @property
    def verdict(self) -> str:
        """One line a user can act on: a grade from the token-to-token share
        (:data:`GOOD_SHARE`, :data:`WORKABLE_SHARE`), the signal split, and a warning when
        many tokens sit in incorrect chunks or stay unpaired."""
        shares = self.signal_shares
        if self.student_tokens == 0:
            return "NO DATA: the texts hold no tokens; run the report on representative text."
        grade = next(
            name
            for name, floor in (("GOOD", GOOD_SHARE), ("WORKABLE", WORKABLE_SHARE), ("WEAK", 0))
            if shares["token"] >= floor
        )
        line = (
            f"{grade}: {shares['token']:.1%} of student tokens are distilled token-to-token, "
            f"{shares['chunk'] + shares['realized']:.1%} only at chunk level, "
            f"{shares['none']:.1%} get no signal; the common vocabulary is "
            f"{self.common_student_share:.1%} of the student's."
        )
        if self.incorrect_student_share > WARN_INCORRECT:
            line += " Check text normalisation (NFC): many chunks differ in bytes."
        elif ratio(self.unpaired_student_tokens, self.student_tokens) > WARN_UNPAIRED:
            line += " Check the text: a tokenizer drops characters (unpaired tokens)."
        return line

    def to_dict(self) -> dict:
        """The counts plus the derived figures, JSON-ready (``derived`` is ignored by
        :meth:`from_dict`)."""
        out = asdict(self)
        out["derived"] = {
            "chunks": self.chunks,
            "student_tokens_per_char": self.student_tokens_per_char,
            "teacher_tokens_per_char": self.teacher_tokens_per_char,
            "one_to_one_student_share": self.one_to_one_student_share,
            "one_to_one_teacher_share": self.one_to_one_teacher_share,
            "correct_rate": self.correct_rate,
            "correct_rate_by_shape": {n: s.correct_rate for n, s in self.shapes.items()},
            "incorrect_student_share": self.incorrect_student_share,
            "signal_shares": self.signal_shares,
            "common_student_share": self.common_student_share,
            "common_teacher_share": self.common_teacher_share,
            "verdict": self.verdict,
        }
        return out

    @classmethod
    def from_dict(cls, data: dict) -> PairReport:
        """The report from :meth:`to_dict` output (derived figures are recomputed)."""
        values = {f.name: data[f.name] for f in fields(cls)}
        values["shapes"] = {name: ShapeStats(**data["shapes"][name]) for name in SHAPE_NAMES}
        return cls(**values)


def pair_report(
    student: LoadedTokenizer,
    teacher: LoadedTokenizer,
    texts: Iterable[str],
    *,
    tables: TablePair | None = None,
    batch_size: int = 64,
    progress: bool = True,
) -> PairReport:
    """The compatibility report of ``student`` and ``teacher`` over ``texts``.

    ``tables``: a prebuilt table pair for the common vocabulary (checked against both
    fingerprints); when None both directions are built here (about 1 s for large
    vocabularies). ``batch_size``: texts per tokenizer call. ``progress``: a progress bar over
    documents.
    """
    common = _common_pairs(student, teacher, tables, progress)
    totals = _Totals(student, teacher, common)
    total = len(texts) if hasattr(texts, "__len__") else None
    with tqdm(total=total, desc="pair report", unit="doc", disable=not progress) as bar:
        for batch in _batches(texts, batch_size):
            s_tokens, t_tokens = tokenize(student, batch), tokenize(teacher, batch)
            pairs = list(zip(s_tokens, t_tokens, strict=True))
            totals.add(batch, pairs, align_many(s_tokens, t_tokens, student, teacher))
            bar.update(len(batch))
    report = totals.report()
    log.info("pair report %s vs %s: %s", student.name, teacher.name, report.verdict)
    return report


def _common_pairs(
    student: LoadedTokenizer, teacher: LoadedTokenizer, tables: TablePair | None, progress: bool
) -> np.ndarray:
    """One-to-one common tokens, int64 ``[n, 2]`` (student id, teacher id)."""
    if tables is not None:
        tables.check_tokenizers(student, teacher)
        return tables.common
    log.info("building both sub-token tables of %s and %s", student.name, teacher.name)
    s2t = build_table(student, teacher, progress=progress)
    t2s = build_table(teacher, student, progress=progress)
    return common_tokens(s2t, t2s)


def _batches(texts: Iterable[str], size: int) -> Iterator[list[str]]:
    if size < 1:
        raise ValueError(f"batch_size must be at least 1, got {size}")
    iterator = iter(texts)
    while batch := list(islice(iterator, size)):
        yield batch


_COUNTED = (
    "documents",
    "characters",
    "student_tokens",
    "teacher_tokens",
    "unpaired_student_tokens",
    "unpaired_teacher_tokens",
    "documents_with_unpaired",
    "chunks_without_prediction",
    "student_tokens_common",
    "teacher_tokens_common",
)


class _Totals:
    """Running sums over batches of documents: ``by_shape`` int64 ``[fields of ShapeStats,
    shapes]`` and the counted fields of :class:`PairReport`."""

    def __init__(self, student: LoadedTokenizer, teacher: LoadedTokenizer, common: np.ndarray):
        self.student, self.teacher, self.common = student, teacher, len(common)
        self.is_common_s = np.zeros(len(student.bytes), dtype=bool)
        self.is_common_t = np.zeros(len(teacher.bytes), dtype=bool)
        self.is_common_s[common[:, 0]] = True
        self.is_common_t[common[:, 1]] = True
        self.by_shape = np.zeros((len(fields(ShapeStats)), len(SHAPE_NAMES)), dtype=np.int64)
        self.counts: Counter[str] = Counter()

    def add(
        self, texts: list[str], pairs: list[tuple[Tokenized, Tokenized]], chunks: list[Chunks]
    ) -> None:
        """Add a batch: the texts, each text's (student, teacher) tokens, and its chunks."""
        n = len(SHAPE_NAMES)
        every = Chunks.concatenate(chunks)
        lengths = [self._chunk_sizes(s, t, c) for (s, t), c in zip(pairs, chunks, strict=True)]
        s_sizes = [s for s, _ in lengths]
        t_sizes = [t for _, t in lengths]
        s_len, t_len = np.concatenate([_EMPTY, *s_sizes]), np.concatenate([_EMPTY, *t_sizes])
        shape, ok = every.shape, every.is_correct
        self.by_shape[:5] += np.stack(
            [
                np.bincount(shape, minlength=n),
                np.bincount(shape[ok], minlength=n),
                np.bincount(shape, weights=s_len, minlength=n),
                np.bincount(shape, weights=t_len, minlength=n),
                np.bincount(shape[ok], weights=s_len[ok], minlength=n),
            ]
        ).astype(np.int64)
        np.maximum.at(self.by_shape[5], shape, s_len)
        np.maximum.at(self.by_shape[6], shape, t_len)
        n_s = np.array([len(s) for s, _ in pairs], dtype=np.int64)
        n_t = np.array([len(t) for _, t in pairs], dtype=np.int64)
        unpaired_s = n_s - np.array([int(x.sum()) for x in s_sizes], dtype=np.int64)
        unpaired_t = n_t - np.array([int(x.sum()) for x in t_sizes], dtype=np.int64)
        self.counts.update(
            documents=len(texts),
            characters=sum(len(text) for text in texts),
            student_tokens=int(n_s.sum()),
            teacher_tokens=int(n_t.sum()),
            unpaired_student_tokens=int(unpaired_s.sum()),
            unpaired_teacher_tokens=int(unpaired_t.sum()),
            documents_with_unpaired=int(((unpaired_s > 0) | (unpaired_t > 0)).sum()),
            chunks_without_prediction=int((~every.has_prediction).sum()),
            student_tokens_common=sum(int(self.is_common_s[s.ids].sum()) for s, _ in pairs),
            teacher_tokens_common=sum(int(self.is_common_t[t.ids].sum()) for _, t in pairs),
        )

    def _chunk_sizes(
        self, s: Tokenized, t: Tokenized, chunks: Chunks
    ) -> tuple[np.ndarray, np.ndarray]:
        """Tokens of each chunk, student and teacher: a content chunk counts its content
        tokens only (a literal added token inside its range is counted with its own special
        pair, or as unpaired), so the chunks partition the paired tokens."""
        content = chunks.shape != SHAPE_SPECIAL
        sizes = []
        for ids, ranges, kind in (
            (s.ids, chunks.student, self.student.bytes.kind),
            (t.ids, chunks.teacher, self.teacher.bytes.kind),
        ):
            specials = np.concatenate([[0], np.cumsum(kind[ids] == KIND_SPECIAL)])
            inside = specials[ranges[:, 1]] - specials[ranges[:, 0]]
            sizes.append(ranges[:, 1] - ranges[:, 0] - np.where(content, inside, 0))
        return sizes[0], sizes[1]

    def report(self) -> PairReport:
        """The report of everything added."""
        names = [f.name for f in fields(ShapeStats)]
        shapes = {
            shape: ShapeStats(**dict(zip(names, self.by_shape[:, k].tolist(), strict=True)))
            for k, shape in enumerate(SHAPE_NAMES)
        }
        return PairReport(
            student=self.student.name,
            teacher=self.teacher.name,
            student_fingerprint=self.student.fingerprint,
            teacher_fingerprint=self.teacher.fingerprint,
            shapes=shapes,
            common_vocabulary=self.common,
            student_vocabulary=int((self.student.bytes.kind == KIND_NORMAL).sum()),
            teacher_vocabulary=int((self.teacher.bytes.kind == KIND_NORMAL).sum()),
            **{name: int(self.counts[name]) for name in _COUNTED},
        )


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``, 0 when the denominator is 0."""
    return float(numerator) / denominator if denominator else 0.0


__all__ = ["PairReport", "ShapeStats", "pair_report"]
