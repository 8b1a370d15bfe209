"""The ULD baseline (``loss.kd: uld``): hand-worked distances and pairings, a gradcheck, and
parity of the whole loss with an independent computation from the paper's definition (full
sorts in float64, positions from the loss mask and the teacher's sequence)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from loss_cases import PAIRS, TAU, loss_config, make_case, plan_rows

from crosskd.data.collate import ChunkBatch
from crosskd.data.shards import FLAG_KD, FLAG_PREDICTION
from crosskd.errors import ConfigError
from crosskd.loss import LossConfig, compute_loss
from crosskd.loss.logprobs import RowSlices
from crosskd.loss.uld import paired_positions, teacher_sorted_probs, uld_distance, uld_sum
from crosskd.teacher import TeacherSignal


def _log(p: list[float]) -> torch.Tensor:
    return torch.tensor([p], dtype=torch.float64).log()


@pytest.mark.parametrize(
    ("student", "teacher", "expected"),
    [
        # top-2 teacher [0.6, 0.1] + tail 0.3 -> [0.6, 0.3, 0.1]: |.5-.6| + |.3-.3| + |.2-.1|
        ([0.5, 0.3, 0.2], [0.6, 0.3, 0.1], 0.2),
        # a longer teacher vector: the student's padded with 0 -> .1 + 0 + 0 + .1
        ([0.5, 0.3, 0.2], [0.4, 0.3, 0.2, 0.1], 0.2),
        # a shorter teacher vector: [.7, .3, 0, 0] against [.4, .3, .2, .1] -> .3 + 0 + .2 + .1
        ([0.1, 0.4, 0.2, 0.3], [0.7, 0.3], 0.6),
        # identical distributions up to order: 0
        ([0.2, 0.5, 0.3], [0.5, 0.3, 0.2], 0.0),
    ],
)
def test_uld_distance_by_hand(student, teacher, expected):
    value = uld_distance(_log(student), torch.tensor([teacher], dtype=torch.float64), tau=1.0)
    assert value.item() == pytest.approx(expected, abs=1e-12)


def test_uld_distance_uses_the_temperature():
    logits = torch.tensor([[2.0, 0.0]], dtype=torch.float64)
    p = torch.softmax(logits / 2.0, -1)[0]  # tau = 2
    value = uld_distance(logits, torch.tensor([[1.0]], dtype=torch.float64), tau=2.0)
    assert value.item() == pytest.approx(abs(p[0].item() - 1.0) + p[1].item())


def test_uld_distance_gradcheck():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 7, dtype=torch.float64, generator=gen).requires_grad_(True)
    teacher = torch.softmax(torch.randn(4, 5, dtype=torch.float64, generator=gen), -1)
    teacher = teacher.sort(-1, descending=True).values
    assert torch.autograd.gradcheck(lambda x: uld_distance(x, teacher, tau=1.5), (logits,))


def test_teacher_vector_is_the_top_k_and_the_tail_sorted_together():
    ids = torch.tensor([[[1, 4], [0, 2]]])  # ascending ids, as the cache stores them
    probs = torch.tensor([[[0.1, 0.6], [0.2, 0.1]]])
    signal = TeacherSignal(ids, probs.log(), torch.zeros(1, 1), torch.zeros(1, 1), 1.0, 5, 2)
    out = teacher_sorted_probs(signal, np.array([0, 0]), np.array([1, 2]))
    expected = torch.tensor([[0.6, 0.3, 0.1], [0.7, 0.2, 0.1]], dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-7)  # float32 log probs


def _chunks(rows, student, teacher, flags, sample) -> ChunkBatch:
    n = len(rows)
    return ChunkBatch(
        row=torch.tensor(rows),
        student=torch.tensor(student),
        teacher=torch.tensor(teacher),
        shape=torch.zeros(n, dtype=torch.uint8),
        region=torch.zeros(n, dtype=torch.uint8),
        valid=torch.ones(n, dtype=torch.bool),
        flags=torch.tensor(flags, dtype=torch.uint8),
        sample=torch.tensor(sample),
    )


def test_pairing_is_by_index_per_sample_and_drops_the_longer_tail():
    kd, both = FLAG_KD, FLAG_KD | FLAG_PREDICTION
    chunks = _chunks(
        rows=[0, 0, 0, 0, 1, 1],
        # sample 0 (listed out of order): student tokens 1, 2, 3 (its CE targets) against
        # teacher 1, 2, 3, 4; the first chunk has no prediction (the teacher's first token is
        # dropped), the fourth is outside the KD mask. Sample 1: student 5, 6 against teacher 7.
        student=[[3, 4], [0, 1], [1, 3], [4, 6], [4, 5], [5, 7]],
        teacher=[[3, 5], [0, 2], [2, 3], [5, 6], [6, 7], [7, 8]],
        flags=[both, kd, both, 0, kd, both],
        sample=[0, 0, 0, 0, 1, 1],
    )
    loss_mask = np.ones((2, 8), dtype=bool)
    loss_mask[0, 0] = loss_mask[1, 4] = False  # the samples' first tokens (sample 1 from 4)
    loss_mask[1, :4] = False  # another sample's rows, not this batch's
    rows, s_pos, t_pos, unpaired_s, unpaired_t = paired_positions(chunks, loss_mask)
    assert rows.tolist() == [0, 0, 0, 1]
    assert s_pos.tolist() == [1, 2, 3, 5]
    assert t_pos.tolist() == [1, 2, 3, 7]
    assert (unpaired_s, unpaired_t) == (1, 1)  # teacher 4 in sample 0, student 6 in sample 1
    keep = np.array([True, True, True, True, False, False])  # sample 1 chose another teacher
    assert paired_positions(chunks, loss_mask, keep)[1].tolist() == [1, 2, 3]


def _reference(case, signal, k: int, logits: torch.Tensor, kd_weight: float) -> torch.Tensor:
    """The loss from the definition: CE over the loss mask; per sample the i-th student CE
    position paired with the i-th teacher token after its first; full float64 sorts of both
    vectors (the teacher's top K plus its tail as one entry), padded with zeros; mean L1."""
    mask = case.loss_mask
    log_s = torch.log_softmax(logits, -1)
    b, p = torch.nonzero(mask, as_tuple=True)
    ce = -log_s[b, p - 1, case.student_ids[b, p]].mean()
    l1 = []
    for row in range(mask.shape[0]):
        s_pos = torch.nonzero(mask[row]).flatten().tolist()
        t_len = int(case.chunks.teacher[case.chunks.row == row, 1].max())
        t_pos = list(range(1, t_len))
        for s, t in zip(s_pos, t_pos, strict=False):
            q = torch.softmax(logits[row, s - 1] / TAU, -1)
            lp = signal.log_probs[row, t - 1].to(torch.float64)
            tv = lp.exp() if k == 0 else torch.cat([lp.exp(), (1 - lp.exp().sum()).reshape(1)])
            n = max(len(q), len(tv))
            qs = torch.cat([q.sort(descending=True).values, q.new_zeros(n - len(q))])
            ts = torch.cat([tv.sort(descending=True).values, tv.new_zeros(n - len(tv))])
            l1.append((qs - ts).abs().sum())
    return ce + kd_weight * torch.stack(l1).mean()


@pytest.mark.parametrize("pair", PAIRS[:1], ids=lambda p: f"{p[0]}-{p[1]}")
@pytest.mark.parametrize("k", [16, 0])
def test_the_loss_matches_the_definition_values_and_gradients(zoo, built_table, pair, k):
    student, teacher, texts = pair
    case = make_case(zoo, built_table, student, teacher, texts)
    signal = case.signal(k)
    config = loss_config(k, kd="uld", kd_weight=1.5)
    plan = plan_rows(case, signal, config)
    logits = case.logits()
    out = compute_loss(logits, plan, config)
    reference_logits = case.logits()
    expected = _reference(case, signal, k, reference_logits, 1.5)
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-9)
    assert out.metrics["teacher0/uld_pairs"] == int(case.loss_mask.sum())
    out.loss.backward()
    expected.backward()
    torch.testing.assert_close(logits.grad, reference_logits.grad, rtol=1e-7, atol=1e-10)


def test_blocks_recomputed_in_backward_give_the_same_gradient(zoo, built_table):
    student, teacher, texts = PAIRS[0]
    case = make_case(zoo, built_table, student, teacher, texts)
    signal = case.signal(8)
    config = loss_config(8, kd="uld")
    plan = plan_rows(case, signal, config)
    grads = []
    for block in (3, 4096):
        logits = case.logits(torch.float32)
        flat = logits.reshape(-1, logits.shape[-1])
        term = plan.terms[0]
        whole = RowSlices(flat, logits.shape[1], logits.shape[1])
        uld_sum(whole, term, np.ones(term.n_counted, dtype=bool), TAU, block).backward()
        grads.append(logits.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-8)


def test_kd_is_checked():
    with pytest.raises(ConfigError, match=r"kd is 'ulD'; choose one of csd, uld, xtoken"):
        LossConfig(kd="ulD")
