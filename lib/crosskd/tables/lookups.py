"""A loaded table pair and the lookups CSD derives from it (spec section 3).

* **common tokens**: pairs ``(i, j)`` of *normal* tokens with ``chain_S->T(i) == [j]`` and
  ``chain_T->S(j) == [i]`` (one-to-one; pad, unk and specials are never common).
* per direction, a **prefix index** ``chain[:-1] -> [(src id, chain[-1])]`` over normal tokens
  only (specials are never alternatives), rows sorted by src id. Each whole chain appears once,
  with the lowest src id that has it: two src ids that share their bytes share their chain, and
  the spec's chain-to-id lookups use the lowest id, so a dst path has at most one ``1:n`` /
  ``n:1`` alternative (a higher duplicate's mass is left to REST).
* per direction, a **chain index** ``chain -> src id`` over normal tokens, holding the same
  lowest id per chain.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from crosskd.errors import TableError
from crosskd.tables.format import Flag, SubTokenTable, load_table
from crosskd.tokenization import LoadedTokenizer


@dataclass(frozen=True, eq=False)
class TablePair:
    """Both directions between a student S and a teacher T, with the derived lookups.

    ``common`` int64 ``[n, 2]``: columns (student id, teacher id), sorted by student id.
    ``prefix_s2t`` / ``prefix_t2s``: chain prefix (tuple of dst ids) -> int64 ``[k, 2]`` rows of
    (src id, last chain id), one row per whole chain (its lowest src id), ascending src ids.
    ``chain_s2t`` / ``chain_t2s``: whole chain -> lowest src id.
    """

    student_to_teacher: SubTokenTable
    teacher_to_student: SubTokenTable
    common: np.ndarray = field(init=False)
    prefix_s2t: dict[tuple[int, ...], np.ndarray] = field(init=False, repr=False)
    prefix_t2s: dict[tuple[int, ...], np.ndarray] = field(init=False, repr=False)
    chain_s2t: dict[tuple[int, ...], int] = field(init=False, repr=False)
    chain_t2s: dict[tuple[int, ...], int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        check_directions(self.student_to_teacher, self.teacher_to_student)
        object.__setattr__(
            self, "common", common_tokens(self.student_to_teacher, self.teacher_to_student)
        )
        directions = (("s2t", self.student_to_teacher), ("t2s", self.teacher_to_student))
        for direction, table in directions:
            prefixes, chains = chain_indices(table)
            object.__setattr__(self, f"prefix_{direction}", prefixes)
            object.__setattr__(self, f"chain_{direction}", chains)

    def check_tokenizers(self, student: LoadedTokenizer, teacher: LoadedTokenizer) -> None:
        """Refuse (with :class:`TableError`) tokenizers other than those the pair was built for,
        naming the table, the side and both fingerprints."""
        meta = self.student_to_teacher.meta
        for side, tok, recorded in (
            ("student", student, meta.src_fingerprint),
            ("teacher", teacher, meta.dst_fingerprint),
        ):
            if tok.fingerprint != recorded:
                raise TableError(
                    f"table {self.student_to_teacher.source} was built for a {side} tokenizer "
                    f"with fingerprint {recorded}, but {tok.name} has {tok.fingerprint}; rebuild "
                    f"the tables with `crosskd tables build` for these tokenizers."
                )


def load_table_pair(student_to_teacher: str, teacher_to_student: str) -> TablePair:
    """Load both directions (paths or fsspec URIs) and derive the lookups."""
    return TablePair(load_table(student_to_teacher), load_table(teacher_to_student))


def check_directions(s2t: SubTokenTable, t2s: SubTokenTable) -> None:
    """The two tables must map the same two tokenizers in opposite directions."""
    a, b = s2t.meta, t2s.meta
    if (a.src_fingerprint, a.dst_fingerprint) != (b.dst_fingerprint, b.src_fingerprint):
        raise TableError(
            f"tables {s2t.source} and {t2s.source} are not the two directions of one pair: the "
            f"first maps {a.src_fingerprint[:12]} -> {a.dst_fingerprint[:12]}, the second "
            f"{b.src_fingerprint[:12]} -> {b.dst_fingerprint[:12]}. Build both with the same "
            f"two tokenizers, swapping --source-tokenizer and --destination-tokenizer."
        )
    if (a.src_vocab_size, a.dst_vocab_size) != (b.dst_vocab_size, b.src_vocab_size):
        raise TableError(
            f"tables {s2t.source} and {t2s.source} disagree on vocab sizes "
            f"({a.src_vocab_size}, {a.dst_vocab_size}) vs ({b.dst_vocab_size}, "
            f"{b.src_vocab_size}); rebuild both with the same --*-vocab-size values."
        )


def _single(table: SubTokenTable) -> np.ndarray:
    """dst id of each src row whose chain is exactly one id and whose flag is NORMAL, else -1."""
    out = np.full(len(table.flags), -1, dtype=np.int64)
    rows = np.flatnonzero((table.flags == Flag.NORMAL) & (table.lengths == 1))
    out[rows] = table.chains[table.offsets[rows]]
    return out


def common_tokens(s2t: SubTokenTable, t2s: SubTokenTable) -> np.ndarray:
    """One-to-one pairs of normal tokens (int64 ``[n, 2]``: student id, teacher id)."""
    s_to_t, t_to_s = _single(s2t), _single(t2s)
    students = np.flatnonzero(s_to_t >= 0)
    teachers = s_to_t[students]
    back = t_to_s[teachers]
    keep = back == students
    return np.stack([students[keep], teachers[keep]], axis=1)


def chain_indices(
    table: SubTokenTable,
) -> tuple[dict[tuple[int, ...], np.ndarray], dict[tuple[int, ...], int]]:
    """The prefix index ``chain[:-1] -> rows of (src id, chain[-1])`` (empty prefix included)
    and the chain index ``chain -> src id``, over NORMAL rows, both holding only the lowest src
    id of each whole chain (spec section 5: two ids with the same bytes have the same chain, and
    the chain-to-id lookups use the lowest id; a higher duplicate in the prefix index would make
    a second alternative for the same dst path, counting one event twice)."""
    grouped: dict[tuple[int, ...], list[tuple[int, int]]] = defaultdict(list)
    whole: dict[tuple[int, ...], int] = {}
    chains, offsets = table.chains.tolist(), table.offsets.tolist()
    for src_id in np.flatnonzero(table.flags == Flag.NORMAL).tolist():
        chain = tuple(chains[offsets[src_id] : offsets[src_id + 1]])
        if chain in whole:  # ascending ids: the lowest id with this chain is already in
            continue
        whole[chain] = src_id
        grouped[chain[:-1]].append((src_id, chain[-1]))
    prefixes = {key: np.asarray(rows, dtype=np.int64) for key, rows in grouped.items()}
    return prefixes, whole
