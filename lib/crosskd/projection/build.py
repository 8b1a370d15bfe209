"""Building X-Token's projection ``W`` (student -> teacher) from a sub-token table pair.

The rules are those of X-Token's projection tool (NVIDIA NeMo RL, ``tools/x_token/``), on the
tables' byte-exact chains instead of decoded strings:

1. **Exact rows.** A student token the teacher spells as one token of the same bytes (its S->T
   chain is one id; a byte comparison, so SentencePiece's ``▁`` and byte-level BPE's ``Ġ``
   spaces are the same) maps to it with weight 1; a special token maps to the teacher's
   special of the same role (the tables' role mapping). Nothing else enters an exact row.
2. **Chains, both ways**, for every other student token ``s``:
   * forward: ``s``'s S->T chain ``t_0 .. t_{n-1}`` (the teacher's tokens that spell it): the
     first ``chain_cut`` pieces get the decaying weights ``0.9 * 0.1^i``, normalised over the
     pieces kept (:func:`chain_weights`: 2 pieces 0.909 / 0.091), so most of a student token
     goes to the teacher token it starts with;
   * reverse: each normal teacher token ``t`` whose T->S chain ``s_0 .. s_{m-1}`` holds ``s``
     adds the weight of ``s``'s place in that chain to ``(s, t)``: a student token also leans
     on the longer teacher tokens that start with it.
   Weights of the same ``(s, t)`` add up; the row is normalised, its ``top_k`` largest entries
   kept (ties: the lower teacher id) and normalised again.
3. Rows with no counterpart (a token the teacher cannot spell, a special without a role
   match, ids that are no token) stay **empty**: the student's mass there projects nowhere.

X-Token's tool also decodes tokens and matches special tokens by string similarity, and by
default sets a "scale trick" entry of weight 0.2 on the 32nd column before cutting to the top
4, which puts about a sixth of a non-exact row on an unrelated teacher id (and keeps it twice);
crosskd does neither: specials map by role, and every entry is one of the rules above.
"""

from __future__ import annotations

import logging

import numpy as np

from crosskd import ragged
from crosskd.errors import ConfigError
from crosskd.projection.format import Projection, ProjectionMeta
from crosskd.tables import Flag, SubTokenTable, TablePair

log = logging.getLogger(__name__)

TOP_K = 4
"""Entries kept per row (X-Token's runtime default)."""
CHAIN_CUT = 4
"""Chain pieces that get a weight (X-Token's ``tokens_to_cut``)."""


def chain_weights(n: int) -> np.ndarray:
    """The weights of the first ``n`` pieces of a chain: ``0.9 * 0.1^i`` normalised to sum 1,
    float64 ``[n]``."""
    raw = 0.9 * 0.1 ** np.arange(n, dtype=np.float64)
    return raw / raw.sum()


def build_projection(
    pair: TablePair, *, top_k: int = TOP_K, chain_cut: int = CHAIN_CUT
) -> Projection:
    """``W`` of the pair's student and teacher (module docstring), every student id in
    ``[0, V_S)``.

    Args:
        pair: the validated table pair (S->T and T->S).
        top_k: entries kept per non-exact row (>= 1).
        chain_cut: chain pieces that get a weight (>= 1).
    """
    for key, value in (("top_k", top_k), ("chain_cut", chain_cut)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key} is {value!r}; it must be an integer >= 1.")
    s2t, t2s = pair.student_to_teacher, pair.teacher_to_student
    v_s, v_t = s2t.meta.src_vocab_size, s2t.meta.dst_vocab_size
    exact_rows, exact_cols = _exact(s2t)
    is_exact = np.zeros(v_s, dtype=bool)
    is_exact[exact_rows] = True

    f_src, f_dst, f_w = _pieces(s2t, chain_cut)  # (student, teacher piece, weight)
    r_src, r_dst, r_w = _pieces(t2s, chain_cut)  # (teacher, student piece, weight)
    students = np.concatenate([f_src, r_dst])
    teachers = np.concatenate([f_dst, r_src])
    weights = np.concatenate([f_w, r_w])
    keep = ~is_exact[students]
    keys, inverse = np.unique(students[keep] * np.int64(v_t) + teachers[keep], return_inverse=True)
    summed = np.bincount(inverse, weights[keep], len(keys)).astype(np.float64)
    rows, cols = keys // v_t, keys % v_t
    summed /= np.bincount(rows, summed, v_s)[rows]
    order = np.lexsort((cols, -summed, rows))
    rows, cols, summed = rows[order], cols[order], summed[order]
    first = np.searchsorted(rows, rows)  # the row's first entry, in sorted order
    kept = np.arange(len(rows)) - first < top_k
    rows, cols, summed = rows[kept], cols[kept], summed[kept]
    summed /= np.bincount(rows, summed, v_s)[rows]

    rows = np.concatenate([rows, exact_rows])
    cols = np.concatenate([cols, exact_cols])
    summed = np.concatenate([summed, np.ones(len(exact_rows))])
    order = np.lexsort((cols, -summed, rows))
    meta = ProjectionMeta(
        student_name=s2t.meta.src_name,
        teacher_name=s2t.meta.dst_name,
        student_fingerprint=s2t.meta.src_fingerprint,
        teacher_fingerprint=s2t.meta.dst_fingerprint,
        student_vocab_size=v_s,
        teacher_vocab_size=v_t,
        top_k=top_k,
        chain_cut=chain_cut,
    )
    projection = Projection(
        ragged.offsets_from_lengths(np.bincount(rows, minlength=v_s)),
        cols[order].astype(np.int32),
        summed[order].astype(np.float32),
        meta,
    )
    log.info(
        "projection %s -> %s: %d exact rows, %d spread rows, %d empty",
        s2t.meta.src_name,
        s2t.meta.dst_name,
        len(exact_rows),
        int(((projection.lengths > 0) & ~is_exact).sum()),
        int((projection.lengths == 0).sum()),
    )
    return projection


def _exact(s2t: SubTokenTable) -> tuple[np.ndarray, np.ndarray]:
    """Student rows that map to one teacher id with weight 1 (a normal token spelt by one
    teacher token, a special mapped by role) and that id, int64 ``[n]`` each."""
    one = (s2t.lengths == 1) & np.isin(s2t.flags, (Flag.NORMAL, Flag.SPECIAL_MAPPED))
    rows = np.flatnonzero(one)
    return rows, s2t.chains[s2t.offsets[rows]].astype(np.int64)


def _pieces(table: SubTokenTable, chain_cut: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every weighted chain piece of the table's normal rows: ``(src id, dst id, weight)``,
    the first ``chain_cut`` pieces of each chain with :func:`chain_weights`."""
    rows = np.flatnonzero(table.flags == Flag.NORMAL)
    lengths = np.minimum(table.lengths[rows], chain_cut)
    starts = table.offsets[rows]
    place = ragged.positions(lengths)
    src = np.repeat(rows.astype(np.int64), lengths)
    dst = table.chains[np.repeat(starts, lengths) + place].astype(np.int64)
    table_of = np.zeros((chain_cut + 1, chain_cut))
    for n in range(1, chain_cut + 1):
        table_of[n, :n] = chain_weights(n)
    return src, dst, table_of[np.repeat(lengths, lengths), place]
