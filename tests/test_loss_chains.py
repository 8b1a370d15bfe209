"""Ids that share their bytes (spec section 5: "If two ids of one vocabulary share their bytes,
the chain-to-id lookups use the lowest id"): on hand-made tables where two student ids and two
teacher ids are duplicates, a ``1:n`` or ``n:1`` path has at most one alternative, the lowest id,
in the events, in the slow reference, and in the loss (parity).

The two toy vocabularies (bytes of each id):

* student (V_S = 6): 0 ``a``, 1 ``b``, 2 ``c``, 3 ``abc``, 4 ``ac``, 5 ``ac`` (a duplicate of 4);
* teacher (V_T = 8): 0 ``a``, 1 ``b``, 2 ``c``, 3 ``ab``, 4 ``ca``, 5 ``ca`` (a duplicate of 4),
  6 ``bc``, 7 ``cb``.

S->T chains: 0 [0], 1 [1], 2 [2], 3 [3, 2], 4 [0, 2], 5 [0, 2]. T->S chains: 0 [0], 1 [1], 2 [2],
3 [0, 1], 4 [2, 0], 5 [2, 0], 6 [1, 2], 7 [2, 1].

One sequence: student ``a | abc | c b``, teacher ``a | a b c | cb``: chunk 0 (first token, no
prediction), chunk 1 ``1:n`` (student 3 at position 1 vs teacher 0 1 2 at positions 1..3, priced
by student row 0 and teacher rows 0..2), chunk 2 ``n:1`` (student 2 1 at positions 2, 3 vs
teacher 7 at position 4, priced by student rows 1, 2 and teacher row 3).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from loss_cases import hand_table
from loss_reference import SHAPE_1_1, SHAPE_1_N, SHAPE_N_1, reference_chunks, reference_kd

from crosskd.loss import CsdOptions, build_events, csd_kd
from crosskd.tables import TablePair
from crosskd.teacher import signal_from_logits

S2T = [[0], [1], [2], [3, 2], [0, 2], [0, 2]]
T2S = [[0], [1], [2], [0, 1], [2, 0], [2, 0], [1, 2], [2, 1]]
V_S, V_T = len(S2T), len(T2S)
STUDENT_IDS = torch.tensor([[0, 3, 2, 1]])
TEACHER_IDS = torch.tensor([[0, 0, 1, 2, 7]])
TAU, K = 1.0, 3


def _pair() -> TablePair:
    return TablePair(
        hand_table(S2T, "student", "teacher", V_T), hand_table(T2S, "teacher", "student", V_S)
    )


def _chunks() -> SimpleNamespace:
    return SimpleNamespace(
        row=torch.zeros(3, dtype=torch.long),
        student=torch.tensor([[0, 1], [1, 2], [2, 4]]),
        teacher=torch.tensor([[0, 1], [1, 4], [4, 5]]),
        shape=torch.tensor([SHAPE_1_1, SHAPE_1_N, SHAPE_N_1], dtype=torch.uint8),
        valid=torch.tensor([False, True, True]),
    )


# Teacher logits per row (all other ids 0), so that the top 3 of each row is known:
# row 0 (prices t_1 = 0): top {0, 1, 2}; row 1 (t_2 = 1): top {1, 2, 3}; row 2 (t_3 = 2): top
# {0, 1, 2}; row 3 (the n:1 teacher row, t = 7): variant "both" has both duplicates 4 and 5 in
# the top 3 ({4, 5, 7}), variant "higher" only the higher one ({0, 5, 7}); row 4 prices nothing.
_ROWS = {0: {0: 3.0, 1: 2.0, 2: 1.0}, 1: {1: 3.0, 2: 2.0, 3: 1.0}, 2: {2: 3.0, 0: 2.0, 1: 1.0}}
_ROW3 = {"both": {7: 3.0, 4: 2.0, 5: 1.5}, "higher": {7: 3.0, 5: 2.0, 0: 1.5, 4: -1.0}}


def _signal(variant: str, k: int = K):
    logits = torch.zeros(1, 5, V_T)
    for row, values in {**_ROWS, 3: _ROW3[variant]}.items():
        for token, value in values.items():
            logits[0, row, token] = value
    return signal_from_logits(logits, TEACHER_IDS, k=k, tau=TAU)


def _lp(signal, row: int, token: int) -> float:
    """The teacher's log prob of ``token`` at ``row`` (dense or from its top K)."""
    if signal.ids is None:
        return float(signal.log_probs[0, row, token])
    ids = signal.ids[0, row].tolist()
    return float(signal.log_probs[0, row, ids.index(token)])


def _by_chunk(events) -> dict[int, list[tuple[float, list[tuple[int, int]]]]]:
    """Counted chunk (batch index) -> its events as (teacher log prob, [(student row, id)])."""
    out: dict[int, list] = {}
    for e, chunk in enumerate(events.event_chunk.tolist()):
        terms = [
            (int(r), int(i))
            for r, i, te in zip(events.term_row, events.term_id, events.term_event, strict=True)
            if te == e
        ]
        out.setdefault(int(events.chunk_index[chunk]), []).append(
            (float(events.teacher_lp[e]), terms)
        )
    return out


def test_prefix_index_holds_the_lowest_id_of_each_chain():
    pair = _pair()
    assert {k: v.tolist() for k, v in pair.prefix_s2t.items()} == {
        (): [[0, 0], [1, 1], [2, 2]],
        (3,): [[3, 2]],
        (0,): [[4, 2]],  # not also [5, 2]
    }
    assert {k: v.tolist() for k, v in pair.prefix_t2s.items()} == {
        (): [[0, 0], [1, 1], [2, 2]],
        (0,): [[3, 1]],
        (2,): [[4, 0], [7, 1]],
        (1,): [[6, 2]],
    }  # (2,): not also [5, 0]
    assert pair.chain_s2t[(0, 2)] == 4 and pair.chain_t2s[(2, 0)] == 4
    assert pair.common.tolist() == [[0, 0], [1, 1], [2, 2]]


@pytest.mark.parametrize("k", [K, 0])
def test_1_n_path_shared_by_two_student_ids_is_one_event(k):
    """Chunk 1 (student 3 vs teacher 0 1 2): E = the realized event; students 1 and 2 (chains [1],
    [2]: they leave the path at t_1); student 4 only (chain [0, 2], leaving at t_2 with c = 2),
    not also its duplicate 5. (Student 0's chain [0] is the path's own t_1; 3 is realized.)"""
    signal = _signal("both", k)
    events = _by_chunk(
        build_events(
            STUDENT_IDS.numpy(),
            TEACHER_IDS.numpy(),
            signal,
            _chunks(),
            _pair(),
            CsdOptions(),
        )
    )
    realized = sum(float(signal.realized[0, r]) for r in range(3))
    expected = [
        (realized, [(0, 3)]),
        (_lp(signal, 0, 1), [(0, 1)]),
        (_lp(signal, 0, 2), [(0, 2)]),
        (float(signal.realized[0, 0]) + _lp(signal, 1, 2), [(0, 4)]),
    ]
    # (Dense, the same: no other student id has a chain [c] or [0, c].)
    got = sorted(events[1], key=lambda e: e[1])
    expected.sort(key=lambda e: e[1])
    assert [terms for _, terms in got] == [terms for _, terms in expected]
    for (lp, _), (want, _) in zip(got, expected, strict=True):
        assert lp == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize(
    ("variant", "k", "alternative"),
    [
        ("both", K, 4),  # 4 and 5 in the top K: the event is 4's, once
        ("higher", K, 0),  # only 5 in the top K: the lookup gives 4, not in the top K: no event;
        # teacher 0 (chain [0], leaving at s_1) is in the top K instead
        ("both", 0, 4),  # dense: 4 (and teacher 0, 1, whose chains [0], [1] leave at s_1)
    ],
)
def test_n_1_path_shared_by_two_teacher_ids_is_one_event(variant, k, alternative):
    """Chunk 2 (student 2 1 vs teacher 7): the student path [2, 0] (chain of teachers 4 and 5)
    is one event, teacher 4's: student terms c at row 1 then a at row 2, teacher lp_T(4)."""
    signal = _signal(variant, k)
    events = _by_chunk(
        build_events(
            STUDENT_IDS.numpy(),
            TEACHER_IDS.numpy(),
            signal,
            _chunks(),
            _pair(),
            CsdOptions(),
        )
    )
    expected = {(float(signal.realized[0, 3]), ((1, 2), (2, 1)))}
    if alternative == 4 or k == 0:
        expected.add((_lp(signal, 3, 4), ((1, 2), (2, 0))))
    if alternative == 0 or k == 0:
        expected.add((_lp(signal, 3, 0), ((1, 0),)))
    if k == 0:
        expected.add((_lp(signal, 3, 1), ((1, 1),)))
    got = {(lp, tuple(terms)) for lp, terms in events[2]}
    assert len(events[2]) == len(expected)
    assert {t for _, t in got} == {t for _, t in expected}
    for lp, terms in got:
        want = next(w for w, t in expected if t == terms)
        assert lp == pytest.approx(want, abs=1e-12)
    # Teacher 5's log prob (its logit differs from 4's) is never an event's.
    assert all(lp != pytest.approx(_lp(signal, 3, 5), abs=1e-9) for lp, _ in got)


@pytest.mark.parametrize(("variant", "k"), [("both", K), ("higher", K), ("both", 0)])
def test_reference_uses_the_lowest_id_too(variant, k):
    """The slow reference builds the same events: one per path, the lowest id."""
    signal = _signal(variant, k)
    logits = torch.zeros(1, 4, V_S, dtype=torch.float64)
    infos = reference_chunks(
        logits,
        STUDENT_IDS,
        TEACHER_IDS,
        signal,
        _chunks(),
        _pair(),
        tau=TAU,
    )
    one_n = {e.student_path for e in infos[1].events if e.kind == "prefix"}
    assert one_n == {(1,), (2,), (4,)}
    n_one = {e.teacher_path for e in infos[2].events if e.kind == "prefix"}
    if k == 0:
        assert n_one == {(0,), (1,), (4,)}
    else:
        assert n_one == ({(4,)} if variant == "both" else {(0,)})
    paths = [e.student_path for e in infos[2].events]
    assert len(paths) == len(set(paths))


@pytest.mark.parametrize(("variant", "k"), [("both", K), ("higher", K), ("both", 0)])
@pytest.mark.parametrize("divergence", ["jsd", "forward_kl"])
def test_loss_matches_the_reference_with_duplicate_ids(variant, k, divergence):
    signal = _signal(variant, k)
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(1, 4, V_S, generator=gen, dtype=torch.float64)
    ref_logits, impl_logits = base.clone().requires_grad_(), base.clone().requires_grad_()
    inputs = (STUDENT_IDS, TEACHER_IDS, signal, _chunks(), _pair())
    ref, n_ref = reference_kd(ref_logits, *inputs, tau=TAU, divergence=divergence)
    # mismatch_weight 5, the reference's default (not the library's 1: the weight is checked)
    options = CsdOptions(mismatch_weight=5.0)
    got = csd_kd(impl_logits, *inputs, tau=TAU, kind=divergence, options=options)
    assert got.n_chunks == n_ref == 2
    assert got.value.item() == pytest.approx(ref.item(), rel=1e-9)
    assert math.isfinite(ref.item()) and ref.item() > 0
    ref.backward()
    got.value.backward()
    torch.testing.assert_close(impl_logits.grad, ref_logits.grad, rtol=1e-7, atol=1e-10)
