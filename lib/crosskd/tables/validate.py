"""Validating a sub-token table against the tokenizers it claims to map (spec section 3).

The validator recomputes both fingerprints from the tokenizers given (a table built for other
tokenizers, or passed in the wrong direction, is named as such), checks every id range, and
re-derives every mapped event: the concatenated bytes of each chain equal bytes(i), every role
mapping points to a dst token with that role, every ``SPECIAL_UNMAPPED`` row really has no
counterpart, and every ``UNREPRESENTABLE`` row really cannot be encoded exactly by the dst BPE.
It reports counts by flag and a chain-length histogram, and lists each kind of violation with
the first few offending ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from crosskd import ragged
from crosskd.tables.build import chains_match_bytes
from crosskd.tables.format import Flag, SubTokenTable
from crosskd.tokenization import KIND_NONE, KIND_NORMAL, KIND_SPECIAL, LoadedTokenizer

SHOW_IDS = 5


@dataclass
class ValidationReport:
    """What the validator found for one table (``direction`` like ``student->teacher``)."""

    direction: str
    source: str
    counts: dict[str, int]
    length_histogram: dict[int, int]
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when there is no violation."""
        return not self.violations


def validate_table(
    table: SubTokenTable,
    src: LoadedTokenizer,
    dst: LoadedTokenizer,
    *,
    direction: str = "source->destination",
) -> ValidationReport:
    """Check ``table`` as the map ``src -> dst``; never raises for a bad table, reports instead."""
    report = ValidationReport(
        direction=direction,
        source=table.source,
        counts=table.flag_counts(),
        length_histogram=table.length_histogram(),
    )
    problems = report.violations
    meta = table.meta
    src_side, dst_side = direction.split("->") if "->" in direction else ("source", "destination")
    distinct = src.fingerprint != dst.fingerprint
    if distinct and (meta.src_fingerprint, meta.dst_fingerprint) == (
        dst.fingerprint,
        src.fingerprint,
    ):
        problems.append(
            f"tables swapped: {table.source} maps {dst.name} -> {src.name}, but the "
            f"{direction} table must map {src.name} -> {dst.name}; pass it for the other "
            f"direction."
        )
        return report
    for side, name, have, want in (
        (src_side, src.name, meta.src_fingerprint, src.fingerprint),
        (dst_side, dst.name, meta.dst_fingerprint, dst.fingerprint),
    ):
        if have != want:
            problems.append(
                f"{side} tokenizer fingerprint mismatch: {table.source} was built for {have}, "
                f"tokenizer {name} has {want}; the tokenizer changed since the table was built. "
                f"Rebuild the table with `crosskd tables build`."
            )
    for label, have, want in (
        ("source vocab size V", meta.src_vocab_size, src.vocab_size),
        ("destination vocab size V", meta.dst_vocab_size, dst.vocab_size),
        ("source len(tokenizer)", meta.src_len, src.length),
        ("destination len(tokenizer)", meta.dst_len, dst.length),
    ):
        if have != want:
            problems.append(
                f"{label}: {table.source} records {have}, the tokenizer gives {want}; pass the "
                f"same vocab sizes as when building, or rebuild the table."
            )
    if problems:
        problems.append("semantic checks skipped: the table does not belong to these tokenizers.")
        return report
    _check_rows(table, src, dst, problems)
    return report


def _check_rows(
    table: SubTokenTable, src: LoadedTokenizer, dst: LoadedTokenizer, problems: list[str]
) -> None:
    flags, lengths, offsets, chains = table.flags, table.lengths, table.offsets, table.chains

    def report(mask: np.ndarray, what: str) -> None:
        rows = np.flatnonzero(mask)
        if rows.size:
            problems.append(f"{rows.size} rows {what} (first ids: {rows[:SHOW_IDS].tolist()})")

    out_of_range = (chains < 0) | (chains >= dst.vocab_size)
    bad_row = np.zeros(len(flags), dtype=bool)
    if out_of_range.any():
        bad_row[np.searchsorted(offsets, np.flatnonzero(out_of_range), side="right") - 1] = True
        report(bad_row, f"have chain ids outside [0, {dst.vocab_size})")

    kind = src.bytes.kind
    normal_flags = (flags == Flag.NORMAL) | (flags == Flag.UNREPRESENTABLE)
    special_flags = (flags == Flag.SPECIAL_MAPPED) | (flags == Flag.SPECIAL_UNMAPPED)
    report((kind == KIND_NONE) != (flags == Flag.PADDING), "disagree on being padding rows")
    report((kind == KIND_SPECIAL) & ~special_flags, "are specials not flagged as special")
    report((kind == KIND_NORMAL) & ~normal_flags, "are normal tokens flagged otherwise")
    empty_flags = (flags == Flag.PADDING) | (flags == Flag.SPECIAL_UNMAPPED)
    report((empty_flags | (flags == Flag.UNREPRESENTABLE)) & (lengths > 0), "should be empty")
    report((flags == Flag.SPECIAL_MAPPED) & (lengths != 1), "map a special to other than 1 id")
    report((flags == Flag.NORMAL) & (lengths == 0), "are normal tokens with an empty chain")

    normal = np.flatnonzero((flags == Flag.NORMAL) & (kind == KIND_NORMAL) & (lengths > 0))
    normal = normal[~bad_row[normal]]
    row_offsets = ragged.offsets_from_lengths(lengths[normal])
    elems = ragged.select(offsets, normal)
    normal_chains = chains[elems]
    not_normal_dst = dst.bytes.kind[normal_chains] != KIND_NORMAL
    has_special = np.zeros(len(flags), dtype=bool)
    if not_normal_dst.any():
        owner = np.searchsorted(row_offsets, np.flatnonzero(not_normal_dst), side="right") - 1
        has_special[normal[owner]] = True
        report(has_special, "are normal tokens whose chain holds a dst special or padding id")
    exact = chains_match_bytes(src.bytes, normal, dst.bytes, row_offsets, normal_chains)
    mismatch = np.zeros(len(flags), dtype=bool)
    mismatch[normal[~exact]] = True
    report(mismatch & ~has_special, "have chains whose bytes differ from the token's bytes")

    _check_specials(table, src, dst, problems)
    _check_unrepresentable(table, src, dst, problems)


def _check_specials(
    table: SubTokenTable, src: LoadedTokenizer, dst: LoadedTokenizer, problems: list[str]
) -> None:
    wrong_role, missed = [], []
    for token_id in np.flatnonzero(table.flags == Flag.SPECIAL_MAPPED).tolist():
        chain = table.chain(token_id)
        role = src.roles.get(token_id)
        if len(chain) != 1 or not 0 <= chain[0] < dst.vocab_size:
            continue
        if role is None or dst.roles.get(int(chain[0])) != role:
            wrong_role.append(token_id)
    for token_id in np.flatnonzero(table.flags == Flag.SPECIAL_UNMAPPED).tolist():
        if src.roles.get(token_id) in dst.role_ids:
            missed.append(token_id)
    if wrong_role:
        problems.append(
            f"{len(wrong_role)} specials map to a dst token without their role "
            f"(first ids: {wrong_role[:SHOW_IDS]})"
        )
    if missed:
        problems.append(
            f"{len(missed)} specials are flagged unmapped but the destination has their role "
            f"(first ids: {missed[:SHOW_IDS]})"
        )


def _check_unrepresentable(
    table: SubTokenTable, src: LoadedTokenizer, dst: LoadedTokenizer, problems: list[str]
) -> None:
    rows = np.flatnonzero((table.flags == Flag.UNREPRESENTABLE) & (src.bytes.kind == KIND_NORMAL))
    if not rows.size:
        return
    encoded = dst.encode_words([src.bytes.token_bytes(i) for i in rows.tolist()])
    exact = [
        dst.bytes.concat(np.asarray(ids, dtype=np.int64)).tobytes() == src.bytes.token_bytes(i)
        for i, ids in zip(rows.tolist(), encoded, strict=True)
    ]
    wrong = rows[np.asarray(exact, dtype=bool)]
    if wrong.size:
        problems.append(
            f"{wrong.size} rows are flagged unrepresentable but the destination encodes them "
            f"exactly (first ids: {wrong[:SHOW_IDS].tolist()})"
        )


def validate_pair(
    student: LoadedTokenizer,
    teacher: LoadedTokenizer,
    student_to_teacher: SubTokenTable,
    teacher_to_student: SubTokenTable,
) -> list[ValidationReport]:
    """Validate both directions of a table pair; the pair is good when both reports are ok."""
    return [
        validate_table(student_to_teacher, student, teacher, direction="student->teacher"),
        validate_table(teacher_to_student, teacher, student, direction="teacher->student"),
    ]
