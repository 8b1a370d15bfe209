"""The torch side of the CSD term on hand-made events: worked numbers, temperature, gradcheck."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from crosskd.loss import Events, LocalLogProbs, kd_from_events


def _events(chunks: list[list[tuple[float, list[tuple[int, int]]]]], weights=None) -> Events:
    """Events from [chunk][event] = (teacher log prob, [(flat row, id), ...])."""
    event_chunk, teacher, term_event, term_row, term_id = [], [], [], [], []
    for c, events in enumerate(chunks):
        for lp, terms in events:
            for row, token in terms:
                term_event.append(len(teacher))
                term_row.append(row)
                term_id.append(token)
            event_chunk.append(c)
            teacher.append(lp)
    as64 = lambda xs: np.asarray(xs, dtype=np.int64)  # noqa: E731
    return Events(
        as64(event_chunk),
        np.asarray(teacher, dtype=np.float64),
        as64(term_event),
        as64(term_row),
        as64(term_id),
        np.asarray(weights or [1.0] * len(chunks), dtype=np.float64),
        as64(range(len(chunks))),
    )


def test_worked_forward_kl():
    # Student row 0 has p = (.1, .4, .2, .3). Events: student token 1 vs teacher .5, token 2 vs
    # teacher .3. S = (.4, .2 | REST .4), T = (.5, .3 | REST .2).
    # KL(T||S) = .5 ln(.5/.4) + .3 ln(.3/.2) + .2 ln(.2/.4)
    #          = .1115718 + .1216395 - .1386294 = .0945819 (nats).
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]], dtype=torch.float64))
    events = _events([[(math.log(0.5), [(0, 1)]), (math.log(0.3), [(0, 2)])]])
    term = kd_from_events(events, LocalLogProbs(logits), tau=1.0, kind="forward_kl")
    kd = term.value
    assert term.n_chunks == 1
    assert term.n_events.tolist() == [2]
    assert term.log_rest_student.exp().item() == pytest.approx(0.4)
    assert term.log_rest_teacher.exp().item() == pytest.approx(0.2)
    assert term.divergence.item() == pytest.approx(0.0945819, abs=1e-7)
    assert kd.item() == pytest.approx(0.0945819, abs=1e-7)


def test_multi_term_event_weight_and_normalisation():
    # One event whose student value is the product of two rows: p(1|row 0) * p(3|row 1)
    # = .4 * .5 = .2; teacher .25. S = (.2 | .8), T = (.25 | .75).
    # KL(S||T) = .2 ln(.2/.25) + .8 ln(.8/.75) = -.0446287 + .0516308 = .0070021.
    # Weight 5 (a mismatch chunk) and N = 2 (another chunk counted elsewhere): 5 * D / 2.
    logits = torch.log(
        torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.2, 0.1, 0.2, 0.5]], dtype=torch.float64)
    )
    events = _events([[(math.log(0.25), [(0, 1), (1, 3)])]], weights=[5.0])
    kd = kd_from_events(events, LocalLogProbs(logits), tau=1.0, kind="reverse_kl", n_total=2).value
    assert kd.item() == pytest.approx(5 * 0.0070021 / 2, abs=1e-7)


def test_temperature_scales_logits_and_the_result():
    # tau = 2: student p = softmax(logits / 2). Logits 2 ln(p) give back p = (.1, .4, .2, .3);
    # the result is tau^2 = 4 times the tau = 1 value of the first worked example.
    logits = 2 * torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]], dtype=torch.float64))
    events = _events([[(math.log(0.5), [(0, 1)]), (math.log(0.3), [(0, 2)])]])
    kd = kd_from_events(events, LocalLogProbs(logits, tau=2.0), tau=2.0, kind="forward_kl").value
    assert kd.item() == pytest.approx(4 * 0.0945819, abs=1e-6)


@pytest.mark.parametrize("kind", ["jsd", "forward_kl", "reverse_kl"])
def test_gradcheck(kind):
    torch.manual_seed(0)
    logits = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    events = _events(
        [
            [
                (math.log(0.3), [(0, 1)]),
                (math.log(0.2), [(0, 4), (1, 2)]),
                (math.log(0.1), [(0, 6)]),
            ],
            [(math.log(0.6), [(2, 3)])],
        ],
        weights=[1.0, 5.0],
    )
    assert torch.autograd.gradcheck(
        lambda x: kd_from_events(events, LocalLogProbs(x, tau=1.5), tau=1.5, kind=kind).value,
        (logits,),
    )


def test_no_counted_chunk_is_zero_with_zero_gradient():
    logits = torch.randn(2, 5, requires_grad=True)
    term = kd_from_events(_events([]), LocalLogProbs(logits), tau=1.0)
    kd, n = term.value, term.n_chunks
    kd.backward()
    assert n == 0 and kd.item() == 0.0 and torch.equal(logits.grad, torch.zeros(2, 5))


def test_signal_of_another_tau_or_vocabulary_is_refused(zoo, built_table):
    """csd_kd checks the signal against the loss tau and the tables' teacher V."""
    from types import SimpleNamespace

    from crosskd.loss import csd_kd
    from crosskd.tables import TablePair
    from crosskd.teacher import SignalError, signal_from_logits

    pair = TablePair(built_table("llama3", "qwen3"), built_table("qwen3", "llama3"))
    ids = torch.zeros(1, 4, dtype=torch.long)
    chunks = SimpleNamespace(
        row=np.zeros(0, int),
        student=np.zeros((0, 2), int),
        teacher=np.zeros((0, 2), int),
        shape=np.zeros(0, np.uint8),
        valid=np.zeros(0, bool),
    )
    logits = torch.zeros(1, 4, 128256)
    good = signal_from_logits(torch.zeros(1, 4, 151936), ids, k=4, tau=2.0)
    with pytest.raises(SignalError, match=r"tau is 2\.0, the config asks for 1\.0"):
        csd_kd(logits, ids, ids, good, chunks, pair, tau=1.0)
    small = signal_from_logits(torch.zeros(1, 4, 1000), ids, k=4, tau=1.0)
    with pytest.raises(SignalError, match="vocab_size is 1000, the config asks for 151936"):
        csd_kd(logits, ids, ids, small, chunks, pair, tau=1.0)
    assert csd_kd(logits, ids, ids, good, chunks, pair, tau=2.0).n_chunks == 0
