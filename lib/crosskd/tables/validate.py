"""Validating a sub-token table against the tokenizers it claims to map (spec section 3).

The validator compares the fingerprints, sizes and special-token roles recorded in the table
with those of the tokenizers given (a table built for other tokenizers, or passed in the wrong
direction, is named as such), checks the file's structure and every id range, and re-derives
every row: it re-runs the dst BPE on every normal src token, so each chain must be exactly the
dst BPE's (its concatenated bytes equal bytes(i), and it is the canonical split the common
tokens and prefix index rely on), each ``UNREPRESENTABLE`` row must really be one, every role
mapping must point to a dst token with that role, and every ``SPECIAL_UNMAPPED`` row must really
have no counterpart. It reports counts by flag and a chain-length histogram, and lists each
kind of violation with the first few offending ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from crosskd import ragged
from crosskd.errors import TableError
from crosskd.tables.build import chains_match_bytes, dst_chains
from crosskd.tables.format import Flag, SubTokenTable, check_structure, roles_json
from crosskd.tokenization import KIND_NONE, KIND_NORMAL, KIND_SPECIAL, LoadedTokenizer

SHOW_IDS = 5
FIX = "rebuild the table with `crosskd tables build`"


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
    src_side: str = "source",
    dst_side: str = "destination",
) -> ValidationReport:
    """Check ``table`` as the map ``src -> dst``; never raises for a bad table, reports instead.

    ``src_side`` / ``dst_side`` name the two sides in messages (``student``, ``teacher``).
    """
    direction = f"{src_side}->{dst_side}"
    report = ValidationReport(
        direction=direction,
        source=table.source,
        counts=table.flag_counts(),
        length_histogram=table.length_histogram(),
    )
    problems = report.violations
    meta = table.meta
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
        (f"{src_side} vocab size V", meta.src_vocab_size, src.vocab_size),
        (f"{dst_side} vocab size V", meta.dst_vocab_size, dst.vocab_size),
        (f"{src_side} len(tokenizer)", meta.src_len, src.length),
        (f"{dst_side} len(tokenizer)", meta.dst_len, dst.length),
        (f"{src_side} special-token roles", meta.src_roles, roles_json(src)),
        (f"{dst_side} special-token roles", meta.dst_roles, roles_json(dst)),
    ):
        if have != want:
            problems.append(
                f"{label}: {table.source} records {have}, the tokenizer gives {want}; pass the "
                f"same vocab sizes and role overrides as when building, or {FIX}."
            )
    if not problems:
        try:
            check_structure(table)
        except TableError as exc:
            problems.append(str(exc))
    if problems:
        problems.append("semantic checks skipped: the table does not belong to these tokenizers.")
        return report
    _check_rows(table, src, dst, problems)
    _check_specials(table, src, dst, problems)
    return report


def _check_rows(
    table: SubTokenTable, src: LoadedTokenizer, dst: LoadedTokenizer, problems: list[str]
) -> None:
    flags, lengths, offsets, chains = table.flags, table.lengths, table.offsets, table.chains

    def report(mask: np.ndarray, what: str) -> None:
        rows = np.flatnonzero(mask)
        if rows.size:
            problems.append(
                f"{rows.size} rows {what} (first ids: {rows[:SHOW_IDS].tolist()}); {FIX}"
            )

    kind = src.bytes.kind
    normal_flags = (flags == Flag.NORMAL) | (flags == Flag.UNREPRESENTABLE)
    special_flags = (flags == Flag.SPECIAL_MAPPED) | (flags == Flag.SPECIAL_UNMAPPED)
    report((kind == KIND_NONE) != (flags == Flag.PADDING), "disagree on being padding rows")
    report((kind == KIND_SPECIAL) & ~special_flags, "are specials not flagged as special")
    report((kind == KIND_NORMAL) & ~normal_flags, "are normal tokens flagged otherwise")
    empty_flags = (flags == Flag.PADDING) | (flags == Flag.SPECIAL_UNMAPPED)
    report((empty_flags | (flags == Flag.UNREPRESENTABLE)) & (lengths > 0), "should be empty")
    report((flags == Flag.SPECIAL_MAPPED) & (lengths != 1), "map a special to other than 1 id")

    rows = np.flatnonzero(kind == KIND_NORMAL)
    ref_offsets, ref_chains = dst_chains(src, dst, rows)
    ref_exact = chains_match_bytes(src.bytes, rows, dst.bytes, ref_offsets, ref_chains)
    mark = np.zeros(len(flags), dtype=bool)
    mark[rows[ref_exact & (flags[rows] == Flag.UNREPRESENTABLE)]] = True
    report(mark, "are flagged unrepresentable but the destination encodes them exactly")
    mark[:] = False
    mark[rows[~ref_exact & (flags[rows] == Flag.NORMAL)]] = True
    report(mark, "are flagged normal but the destination cannot spell their bytes exactly")

    picked = ref_exact & (flags[rows] == Flag.NORMAL)
    checked = rows[picked]
    table_offsets = ragged.offsets_from_lengths(lengths[checked])
    table_chains = chains[ragged.select(offsets, checked)]
    same_bytes = chains_match_bytes(src.bytes, checked, dst.bytes, table_offsets, table_chains)
    mark[:] = False
    mark[checked[~same_bytes]] = True
    report(mark, "have chains whose bytes differ from the token's bytes")
    ref_picked = ref_chains[ragged.select(ref_offsets, np.flatnonzero(picked))]
    canonical = ragged.segments_equal(
        table_chains,
        table_offsets,
        ref_picked,
        ragged.offsets_from_lengths(np.diff(ref_offsets)[picked]),
    )
    mark[:] = False
    mark[checked[same_bytes & ~canonical]] = True
    report(mark, "have chains with the right bytes that are not the destination BPE's split")


def _check_specials(
    table: SubTokenTable, src: LoadedTokenizer, dst: LoadedTokenizer, problems: list[str]
) -> None:
    wrong_role, missed = [], []
    for token_id in np.flatnonzero(table.flags == Flag.SPECIAL_MAPPED).tolist():
        chain = table.chain(token_id)
        role = src.roles.get(token_id)
        if len(chain) != 1:
            continue
        if role is None or dst.roles.get(int(chain[0])) != role:
            wrong_role.append(token_id)
    for token_id in np.flatnonzero(table.flags == Flag.SPECIAL_UNMAPPED).tolist():
        if src.roles.get(token_id) in dst.role_ids:
            missed.append(token_id)
    if wrong_role:
        problems.append(
            f"{len(wrong_role)} specials map to a dst token without their role "
            f"(first ids: {wrong_role[:SHOW_IDS]}); {FIX}"
        )
    if missed:
        problems.append(
            f"{len(missed)} specials are flagged unmapped but the destination has their role "
            f"(first ids: {missed[:SHOW_IDS]}); {FIX}"
        )


def validate_pair(
    student: LoadedTokenizer,
    teacher: LoadedTokenizer,
    student_to_teacher: SubTokenTable,
    teacher_to_student: SubTokenTable,
) -> list[ValidationReport]:
    """Validate both directions of a table pair; the pair is good when both reports are ok."""
    return [
        validate_table(
            student_to_teacher, student, teacher, src_side="student", dst_side="teacher"
        ),
        validate_table(
            teacher_to_student, teacher, student, src_side="teacher", dst_side="student"
        ),
    ]
