"""A slow, obviously-correct reference of the single-teacher CSD KD term (spec section 5).

Not collected as tests: ``tests/test_loss_csd.py`` compares the vectorised loss with it.

Everything is plain Python loops over chunks and over candidate events, full ``log_softmax``
over the student vocabulary, and float64 arithmetic with textbook formulas. The table lookups
(common tokens, chain -> lowest id) are rebuilt here from the raw chains and flags of the two
tables (NORMAL rows only), independently of :class:`crosskd.tables.TablePair`'s derived lookups.

Positions (spec Notation, section 8 item 6): the student log prob of the token at position
``p`` of row ``b`` is ``log_softmax(student_logits[b, p - 1] / tau)[id]``; the teacher's realized
log prob of position ``t`` is ``signal.realized[b, t - 1]``; the teacher's top K that can price
the token at position ``t`` is the signal's row ``t - 1``.

Choices where the spec is silent (also reported to the caller):

* ``keep_realized`` applies to dense signals too (the minimum support of ``1:n``/``n:1`` is 1
  with it, whatever K).
* ``drop_unrealized_topk`` applies to every shape except special pairs.
* Two ids of one vocabulary with the same bytes (spec section 5: "the chain-to-id lookups use
  the lowest id"): a ``1:n`` alternative for the teacher path ``[t_1..t_{k-1}, c]`` is the
  lowest student id whose S->T chain is that path, and an ``n:1`` alternative for the student
  path ``[s_1..s_{k-1}, c]`` is the lowest teacher id whose T->S chain is that path (an event
  only when that id is in the top K; a higher duplicate never stands in for it). So each path
  is at most one event. (The zoo's llama3 / qwen3 / smollm2 have no such duplicates among
  normal tokens; ``tests/test_loss_chains.py`` builds tables that do.)
* The KD value is returned in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from crosskd.tables import Flag

SHAPE_1_1, SHAPE_1_N, SHAPE_N_1, SHAPE_N_M, SHAPE_SPECIAL = range(5)
MISMATCH_SHAPES = (SHAPE_1_N, SHAPE_N_1, SHAPE_N_M)
REST_FLOOR = 1e-12


@dataclass
class Event:
    """One event of a chunk: ``kind`` ("realized", "common", "prefix"), the token paths it
    stands for on each side (ids from the chunk's start), the student ``terms`` (row ``b``,
    position ``p``, token id) whose log probs sum to its student log prob ``a`` (a float here;
    the differentiable values are :attr:`ChunkEvents.a`), and its teacher log prob ``b``."""

    kind: str
    student_path: tuple[int, ...]
    teacher_path: tuple[int, ...]
    terms: list[tuple[int, int, int]]
    b: float
    a: float = math.nan


@dataclass
class ChunkEvents:
    """The reference's view of one chunk: ``events`` (E), whether it ``counts`` (valid and
    enough support), ``reason`` when it does not, and when it counts ``log_rest_s`` /
    ``log_rest_t``, the divergence ``d`` and the ``weight``."""

    index: int
    shape: int
    events: list[Event] = field(default_factory=list)
    a: torch.Tensor | None = None  # float64 [len(events)], differentiable
    counts: bool = False
    reason: str = ""
    log_rest_s: torch.Tensor | None = None
    log_rest_t: float | None = None
    d: torch.Tensor | None = None
    weight: float = 1.0


@dataclass
class Lookups:
    """Rebuilt from the raw tables, NORMAL rows only."""

    common_t2s: dict[int, int]  # teacher id -> student id of a one-to-one common pair
    chain_s2t_lowest: dict[tuple[int, ...], int]  # S->T chain -> lowest student id
    chain_t2s: dict[int, tuple[int, ...]]  # teacher id -> its T->S chain
    chain_t2s_lowest: dict[tuple[int, ...], int]  # T->S chain -> lowest teacher id


_LOOKUPS: dict[int, tuple[object, Lookups]] = {}


def _normal_chains(table) -> dict[int, tuple[int, ...]]:
    chains = {}
    for src in range(len(table.flags)):
        if int(table.flags[src]) == Flag.NORMAL:
            chains[src] = tuple(int(x) for x in table.chain(src).tolist())
    return chains


def lookups(pair) -> Lookups:
    """The reference's own lookups for ``pair`` (cached per pair object)."""
    cached = _LOOKUPS.get(id(pair))
    if cached is not None and cached[0] is pair:
        return cached[1]
    s2t = _normal_chains(pair.student_to_teacher)
    t2s = _normal_chains(pair.teacher_to_student)
    common_t2s = {}
    for i, chain in s2t.items():
        if len(chain) == 1:
            j = chain[0]
            if t2s.get(j) == (i,):
                common_t2s[j] = i
    lowest: dict[tuple[int, ...], int] = {}
    for i in sorted(s2t):
        lowest.setdefault(s2t[i], i)
    lowest_t: dict[tuple[int, ...], int] = {}
    for j in sorted(t2s):
        lowest_t.setdefault(t2s[j], j)
    made = Lookups(common_t2s, lowest, t2s, lowest_t)
    _LOOKUPS[id(pair)] = (pair, made)
    return made


class _Teacher:
    """The teacher signal of one batch, read row by row."""

    def __init__(self, signal):
        self.signal = signal
        self.dense = signal.ids is None
        self._rows: dict[tuple[int, int], dict[int, float]] = {}

    def top(self, b: int, q: int) -> dict[int, float]:
        """Top-K ids at row ``q`` (ascending) -> log prob; dense: every id."""
        key = (b, q)
        if key not in self._rows:
            lp = self.signal.log_probs[b, q].double().tolist()
            if self.dense:
                self._rows[key] = dict(enumerate(lp))
            else:
                ids = self.signal.ids[b, q].tolist()
                self._rows[key] = dict(sorted(zip(ids, lp, strict=True)))
        return self._rows[key]

    def realized(self, b: int, t: int) -> float:
        """Log prob of the teacher token at position ``t`` (from row ``t - 1``)."""
        return float(self.signal.realized[b, t - 1].double())


def reference_chunks(
    student_logits: torch.Tensor,
    student_ids: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_signal,
    chunks,
    pair,
    *,
    tau: float,
    divergence: str = "jsd",
    beta: float = 0.5,
    keep_realized: bool = False,
    min_mismatch_support: int = 2,
    mismatch_weight: float = 5.0,
    realized_only_mismatch: bool = False,
    drop_unrealized_topk: bool = False,
) -> list[ChunkEvents]:
    """Per chunk: its events, whether it counts, and (if it does) REST, D and weight."""
    if teacher_signal.tau != tau:
        raise ValueError(f"signal tau {teacher_signal.tau} != {tau}")
    look = lookups(pair)
    teacher = _Teacher(teacher_signal)
    s_ids = student_ids.tolist()
    t_ids = teacher_ids.tolist()

    out = []
    for c in range(len(chunks.shape)):
        shape = int(chunks.shape[c])
        info = ChunkEvents(index=c, shape=shape)
        out.append(info)
        b = int(chunks.row[c])
        s0, s1 = (int(x) for x in chunks.student[c])
        t0, t1 = (int(x) for x in chunks.teacher[c])
        if not bool(chunks.valid[c]):
            info.reason = "invalid"
            continue
        assert s0 >= 1 and t0 >= 1, "a valid chunk must have a prediction"
        s_path = tuple(s_ids[b][s0:s1])
        t_path = tuple(t_ids[b][t0:t1])

        # The realized event: student tokens at their positions, teacher realized log probs.
        real_terms = [(b, p, s_ids[b][p]) for p in range(s0, s1)]
        b_real = 0.0
        for t in range(t0, t1):
            b_real += teacher.realized(b, t)
        last_in_top = t_path[-1] in teacher.top(b, t1 - 2)  # last token's row is t1 - 2
        events = []
        if shape == SHAPE_SPECIAL or last_in_top or keep_realized:
            events.append(Event("realized", s_path, t_path, real_terms, b_real))

        only_realized = shape in (SHAPE_N_M, SHAPE_SPECIAL) or (
            realized_only_mismatch and shape in (SHAPE_1_N, SHAPE_N_1)
        )
        if shape == SHAPE_1_1 and not only_realized:
            s, t = s_path[0], t_path[0]
            for j, b_j in teacher.top(b, t0 - 1).items():
                i = look.common_t2s.get(j)
                if i is None or i == s or j == t:
                    continue
                events.append(Event("common", (i,), (j,), [(b, s0, i)], b_j))
        elif shape == SHAPE_1_N and not only_realized:
            s = s_path[0]
            prefix_lp = 0.0  # sum of realized teacher log probs of t_1..t_{k-1}
            for k in range(1, len(t_path) + 1):
                row = t0 + k - 2  # the k-th teacher row (prices position t0 + k - 1)
                for cid, b_c in teacher.top(b, row).items():
                    if cid == t_path[k - 1]:
                        continue
                    chain = (*t_path[: k - 1], cid)
                    i = look.chain_s2t_lowest.get(chain)
                    if i is None or i == s:
                        continue
                    events.append(Event("prefix", (i,), chain, [(b, s0, i)], prefix_lp + b_c))
                prefix_lp += teacher.realized(b, t0 + k - 1)
        elif shape == SHAPE_N_1 and not only_realized:
            t = t_path[0]
            for j, b_j in teacher.top(b, t0 - 1).items():
                if j == t or j not in look.chain_t2s:
                    continue
                chain = look.chain_t2s[j]
                k = len(chain)
                if not 1 <= k <= len(s_path):
                    continue
                if chain[:-1] != s_path[: k - 1] or chain[-1] == s_path[k - 1]:
                    continue
                if look.chain_t2s_lowest[chain] != j:  # a higher id with the same bytes
                    continue
                # s_1..s_{k-1} at their positions, then c at the k-th student position.
                terms = [(b, s0 + l - 1, s_path[l - 1]) for l in range(1, k)]  # noqa: E741
                terms.append((b, s0 + k - 1, chain[-1]))
                events.append(Event("prefix", chain, (j,), terms, b_j))
        info.events = events

        # Validity; a chunk skipped for both reasons reports the first in the spec's order.
        if shape in (SHAPE_1_N, SHAPE_N_1) and not only_realized:
            need = 1 if keep_realized else min_mismatch_support
        else:
            need = 1
        if len(events) < need:
            info.reason = "unsupported"
            continue
        if drop_unrealized_topk and shape != SHAPE_SPECIAL and not last_in_top:
            info.reason = "dropped-unrealized"
            continue
        info.counts = True
        info.weight = mismatch_weight if shape in MISMATCH_SHAPES else 1.0

    # Student log probs: full log_softmax at tau; the token at position p is priced by row
    # p - 1. One gather for every term of every event (scalar indexing per event would make
    # the backward pass allocate a full [B, Ls, V] gradient per event).
    student_lp = torch.log_softmax(student_logits.double() / tau, dim=-1)  # [B, Ls, V_S]
    term_b, term_row, term_id, term_event = [], [], [], []
    for info in out:
        for e, event in enumerate(info.events):
            for b, p, token in event.terms:
                term_b.append(b)
                term_row.append(p - 1)
                term_id.append(token)
                term_event.append(e)
    values = student_lp[term_b, term_row, term_id]  # float64 [all terms]
    cursor = 0
    for info in out:
        n_terms = sum(len(event.terms) for event in info.events)
        local = torch.tensor(term_event[cursor : cursor + n_terms], dtype=torch.int64)
        chunk_values = values[cursor : cursor + n_terms]
        cursor += n_terms
        info.a = torch.zeros(len(info.events), dtype=torch.float64).index_add(
            0, local, chunk_values
        )
        for event, a in zip(info.events, info.a.tolist(), strict=True):
            event.a = a
        if not info.counts:
            continue

        # Distributions over E + REST and the divergence.
        a_vec = info.a
        b_vec = torch.tensor([e.b for e in info.events], dtype=torch.float64)
        rest_s = (-torch.expm1(torch.logsumexp(a_vec, 0))).clamp(min=REST_FLOOR)
        log_rest_s = torch.log(rest_s)
        rest_t = -math.expm1(float(torch.logsumexp(b_vec, 0)))
        log_rest_t = math.log(max(rest_t, REST_FLOOR))
        log_s = torch.cat([a_vec, log_rest_s.reshape(1)])
        log_t = torch.cat([b_vec, torch.tensor([log_rest_t], dtype=torch.float64)])
        info.log_rest_s, info.log_rest_t = log_rest_s, log_rest_t
        info.d = _divergence(log_s, log_t, divergence, beta)
    return out


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) = sum P (log P - log Q), terms with P == 0 being 0."""
    p = log_p.exp()
    terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))
    return terms.sum()


def _divergence(log_s: torch.Tensor, log_t: torch.Tensor, kind: str, beta: float) -> torch.Tensor:
    if kind == "forward_kl":
        return _kl(log_t, log_s)
    if kind == "reverse_kl":
        return _kl(log_s, log_t)
    if kind == "jsd":
        m = beta * log_t.exp() + (1 - beta) * log_s.exp()
        log_m = m.log()
        return beta * _kl(log_t, log_m) + (1 - beta) * _kl(log_s, log_m)
    raise ValueError(f"unknown divergence {kind!r}")


def reference_kd(
    student_logits: torch.Tensor,
    student_ids: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_signal,
    chunks,
    pair,
    *,
    tau: float,
    divergence: str = "jsd",
    beta: float = 0.5,
    keep_realized: bool = False,
    min_mismatch_support: int = 2,
    mismatch_weight: float = 5.0,
    realized_only_mismatch: bool = False,
    drop_unrealized_topk: bool = False,
) -> tuple[torch.Tensor, int]:
    """``(KD, N)``: ``KD = tau^2 * sum_c w_c D_c / N`` (float64 scalar, differentiable in
    ``student_logits``) and ``N`` = the number of counted chunks; ``N = 0`` gives
    ``0 * student_logits.sum()`` (so a graph exists and every gradient is 0)."""
    infos = reference_chunks(
        student_logits,
        student_ids,
        teacher_ids,
        teacher_signal,
        chunks,
        pair,
        tau=tau,
        divergence=divergence,
        beta=beta,
        keep_realized=keep_realized,
        min_mismatch_support=min_mismatch_support,
        mismatch_weight=mismatch_weight,
        realized_only_mismatch=realized_only_mismatch,
        drop_unrealized_topk=drop_unrealized_topk,
    )
    counted = [info for info in infos if info.counts]
    if not counted:
        return (0.0 * student_logits.sum()).double(), 0
    total = sum(info.weight * info.d for info in counted)
    return tau**2 * total / len(counted), len(counted)
