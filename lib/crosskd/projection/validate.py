"""Validating a projection against the two tokenizers it claims to map.

Besides the structure :func:`~crosskd.projection.format.load_projection` checks (ids in range,
each non-empty row summing to 1), the validator checks that the file was built for these
tokenizers (fingerprints and ``V`` of both sides, so a projection of another pair, or of the
pair the other way round, is named as such) and what every row means: each entry of a normal
student token's row must be a normal teacher token that shares bytes with it (one's bytes
inside the other's: a piece of its spelling, or a longer token it starts or sits in), a normal
student token whose bytes a normal teacher token has must map to that token with weight 1
(X-Token's exact rows), a special token's row must be empty or weight 1 on the teacher special
of the same role, and an id that is no token must have an empty row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from crosskd.projection.format import Projection
from crosskd.tokenization import KIND_NORMAL, KIND_SPECIAL, LoadedTokenizer

SHOW_IDS = 5


@dataclass
class ProjectionReport:
    """What the validator found: row ``counts`` (``exact``, ``spread``, ``empty``), the
    ``entries`` histogram (entries per non-empty row -> rows) and the ``violations``."""

    source: str
    counts: dict[str, int]
    entries: dict[int, int]
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when there is no violation."""
        return not self.violations


def summarize(projection: Projection) -> tuple[dict[str, int], dict[int, int]]:
    """Row counts by kind (``exact``: one teacher id of weight 1; ``spread``: several;
    ``empty``) and the histogram of entries per non-empty row."""
    lengths = projection.lengths
    counts = {
        "exact": int((lengths == 1).sum()),
        "spread": int((lengths > 1).sum()),
        "empty": int((lengths == 0).sum()),
    }
    values, numbers = np.unique(lengths[lengths > 0], return_counts=True)
    return counts, {int(v): int(n) for v, n in zip(values, numbers, strict=True)}


def validate_projection(
    projection: Projection, student: LoadedTokenizer, teacher: LoadedTokenizer
) -> ProjectionReport:
    """Check ``projection`` as ``W`` of ``student -> teacher`` (module docstring); reports,
    never raises for a bad projection."""
    counts, entries = summarize(projection)
    report = ProjectionReport(projection.source, counts, entries)
    meta = projection.meta
    for side, tok, fingerprint, vocab in (
        ("student", student, meta.student_fingerprint, meta.student_vocab_size),
        ("teacher", teacher, meta.teacher_fingerprint, meta.teacher_vocab_size),
    ):
        if tok.fingerprint != fingerprint or tok.vocab_size != vocab:
            swapped = (
                meta.student_fingerprint == teacher.fingerprint
                and meta.teacher_fingerprint == student.fingerprint
            )
            hint = " (it maps the pair the other way round)" if swapped else ""
            report.violations.append(
                f"built for a {side} tokenizer with fingerprint {fingerprint[:12]} and V = "
                f"{vocab}, but {tok.name} has {tok.fingerprint[:12]} and V = {tok.vocab_size}"
                f"{hint}; build the projection for these tokenizers"
            )
    if report.violations:
        return report
    shares, exact, special, normal = (
        "entries that share no bytes with the student token",
        "no weight-1 entry on the teacher token of the same bytes",
        "a special token mapped other than to the teacher special of its role",
        "an entry on a teacher token that is no normal token",
    )
    bad: dict[str, list[int]] = {shares: [], exact: [], special: [], normal: []}
    s_kind, t_kind = student.bytes.kind, teacher.bytes.kind
    teacher_of: dict[bytes, int] = {}
    for t in np.flatnonzero(t_kind == KIND_NORMAL).tolist():
        teacher_of.setdefault(teacher.bytes.token_bytes(t), t)
    for s in range(meta.student_vocab_size):
        columns, _ = projection.row(s)
        if s_kind[s] == KIND_SPECIAL:
            want = teacher.role_ids.get(student.roles.get(s, ""), -1)
            if len(columns) and (len(columns) != 1 or int(columns[0]) != want):
                bad[special].append(s)
            continue
        if s_kind[s] != KIND_NORMAL:
            if len(columns):
                bad[normal].append(s)
            continue
        mine = student.bytes.token_bytes(s)
        pieces = [teacher.bytes.token_bytes(int(t)) for t in columns]
        if np.any(t_kind[columns] != KIND_NORMAL):
            bad[normal].append(s)
        elif not all(p in mine or mine in p for p in pieces):
            bad[shares].append(s)
        elif mine in teacher_of and pieces != [mine]:
            bad[exact].append(s)
    for what, rows in bad.items():
        if rows:
            report.violations.append(
                f"{len(rows)} student rows have {what} (first ids: {rows[:SHOW_IDS]})"
            )
    return report
