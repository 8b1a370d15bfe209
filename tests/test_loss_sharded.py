"""The sharded loss (spec section 7) in real processes (gloo on CPU): every layout gives the
single-process numbers on the same global batch, from real tokenizer pairs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from loss_cases import PAIR_IDS, PAIRS, loss_config, make_case, padded, plan_rows
from sharded_runner import assemble, run_layout

from crosskd.errors import ConfigError
from crosskd.loss import LossConfig, TeacherBatch, TeacherLossConfig, compute_loss, plan_loss
from crosskd.loss.metrics import sum_keys
from crosskd.loss.parallel import LossGroups, ParallelConfig, ShardedLogProbs, ownership
from crosskd.output_layer import OutputLayer
from crosskd.teacher import signal_from_logits

LAYOUTS = {
    "dp2": ParallelConfig(dp=2),
    "tp2": ParallelConfig(tp=2),
    "cp2": ParallelConfig(cp=2),
    "tp2xcp2": ParallelConfig(cp=2, tp=2),
    "dp2xtp2": ParallelConfig(dp=2, tp=2),
}


# Every layout on Llama-3/Qwen3; the two four-rank layouts on SmolLM2/Qwen3 too (time budget).
# SmolLM2/Qwen3 rows are padded so that a sequence window boundary falls inside a chunk whose
# tokens are priced by rows on both sides of it (the explicit exchange between windows).
COMBOS = [("llama3-qwen3", name) for name in LAYOUTS] + [
    ("smollm2-qwen3", "cp2"),
    ("smollm2-qwen3", "tp2xcp2"),
    ("smollm2-qwen3", "dp2xtp2"),
]


@pytest.fixture(scope="module")
def cases(zoo, built_table):
    """Pair id -> its case padded to a multiple of 4 positions, built on first use."""
    built = {}

    def get(pair_id: str):
        if pair_id not in built:
            student, teacher, texts = PAIRS[PAIR_IDS.index(pair_id)]
            case = make_case(zoo, built_table, student, teacher, texts)
            width = _crossing_width(case) if student == "smollm2" else None
            built[pair_id] = padded(case, 4, width)
        return built[pair_id]

    return get


def _spans(plan) -> list[tuple[int, int]]:
    """(first, last) prediction position of each counted chunk whose terms use several rows."""
    events = plan.terms[0].events
    position = events.term_row % plan.width
    chunk = events.event_chunk[events.term_event]
    spans = [(position[chunk == c].min(), position[chunk == c].max()) for c in np.unique(chunk)]
    return [(int(a), int(b)) for a, b in spans if a < b]


def _crossing_width(case) -> int:
    """The smallest even row width at least the case's whose two halves split a chunk."""
    spans = _spans(plan_rows(case, case.signal(64), _config()))
    width = case.student_ids.shape[1]
    fits = [2 * b for a, b in spans if a < b and 2 * b >= width]
    assert fits, "the case needs a multi-row chunk in the second half of a row"
    return min(fits)


def _config():
    # tau != 1 (CE and KD at two temperatures in one pass), dynamic kd_scale (pitfall 1).
    return loss_config(64, dynamic_kd_scale=True, max_kd_scale=50.0)


def _single(case, config, signal, rows=slice(None)):
    logits = case.student_logits[rows].double().requires_grad_(True)
    out = compute_loss(logits, plan_rows(case, signal, config, rows), config)
    out.loss.backward()
    return out, logits.grad


def _check_same(results, single, grad, layout, shape, assembled=None):
    """Every rank's complete metrics and kd_scale are one process's, the shares add up to its
    loss, and the gradient (``assembled``, else assembled from the ranks' slices) is its."""
    for r in results:
        assert r.kd_scale == results[0].kd_scale  # identical on every rank
        assert r.metrics.keys() == single.metrics.keys()
        for key, value in single.metrics.items():
            assert r.metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key
    assert results[0].kd_scale == pytest.approx(single.kd_scale, rel=1e-9)
    assert sum(r.share for r in results) == pytest.approx(single.loss.item(), rel=1e-6)
    got = assemble(results, layout, shape) if assembled is None else assembled
    torch.testing.assert_close(got, grad, rtol=1e-5, atol=1e-5 * grad.abs().max().item())


@pytest.mark.parametrize(("pair", "name"), COMBOS, ids=[f"{p}-{n}" for p, n in COMBOS])
def test_every_layout_equals_one_process(cases, pair, name, tmp_path):
    case, layout = cases(pair), LAYOUTS[name]
    config = _config()
    signal = case.signal(64)
    single, grad = _single(case, config, signal)
    assert single.kd.item() > 0 and 1 < single.kd_scale < 50
    if pair == "smollm2-qwen3" and layout.cp == 2:
        half = case.student_ids.shape[1] // 2
        assert any(a < half <= b for a, b in _spans(plan_rows(case, signal, config)))
    rows = case.student_ids.shape[0] // layout.dp
    plans = [
        plan_rows(case, signal, config, slice(d * rows, (d + 1) * rows)) for d in range(layout.dp)
    ]
    logits = case.student_logits.double()
    results = run_layout(layout, logits, plans, config, tmp_path)
    _check_same(results, single, grad, layout, logits.shape)
    normalizers = torch.logsumexp(logits, dim=-1)
    for r in results:
        want = normalizers[r.dp * rows : (r.dp + 1) * rows].flatten()
        torch.testing.assert_close(torch.tensor(r.normalizers, dtype=torch.float64), want)


@pytest.mark.parametrize("name", ["tp2xcp2", "dp2xtp2"])
def test_fused_layouts_equal_one_process_on_the_logits(cases, name, tmp_path):
    """The loss fused with the output layer on four ranks (each its rows, window and
    vocabulary slice of the head) against one process on the head's whole logits: the same
    metrics, loss shares and normalisers, and the gradients of the hidden states (summed over
    the vocabulary slices, as the head's all-reduce does), the weight and the bias (summed over
    the rows and windows)."""
    case, layout = cases("llama3-qwen3"), LAYOUTS[name]
    config, signal = _config(), cases("llama3-qwen3").signal(64)
    n_b, width, vocab = case.student_logits.shape
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(n_b, width, 8, dtype=torch.float64, generator=gen)
    weight = torch.randn(vocab, 8, dtype=torch.float64, generator=gen)
    bias = torch.randn(vocab, dtype=torch.float64, generator=gen)
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    single = compute_loss(
        torch.nn.functional.linear(*leaves), plan_rows(case, signal, config), config
    )
    single.loss.backward()
    rows = n_b // layout.dp
    plans = [
        plan_rows(case, signal, config, slice(d * rows, (d + 1) * rows)) for d in range(layout.dp)
    ]
    head = OutputLayer(hidden, weight, bias)
    results = run_layout(layout, case.student_logits, plans, config, tmp_path, head=head)
    got = {"hidden": torch.zeros_like(hidden), "weight": torch.zeros_like(weight)}
    got["bias"] = torch.zeros_like(bias)
    window, part = width // layout.cp, vocab // layout.tp
    for r in results:
        got["hidden"][r.dp * rows : (r.dp + 1) * rows, r.cp * window : (r.cp + 1) * window] += (
            r.grad
        )
        for key in ("weight", "bias"):
            got[key][r.tp * part : (r.tp + 1) * part] += r.head_grads[key]
    _check_same(results, single, leaves[0].grad, ParallelConfig(), None, assembled=got["hidden"])
    for key, leaf in zip(("weight", "bias"), leaves[1:], strict=True):
        want = leaf.grad
        torch.testing.assert_close(got[key], want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    normalizers = torch.logsumexp(torch.nn.functional.linear(hidden, weight, bias), dim=-1)
    for r in results:
        want = normalizers[r.dp * rows : (r.dp + 1) * rows].flatten()
        torch.testing.assert_close(torch.tensor(r.normalizers, dtype=torch.float64), want)


def test_a_padding_rank_gives_zero_and_leaves_the_others_unaffected(tmp_path, cases):
    """Pitfall 2: DP2 where the second shard's row is all padding."""
    case = cases("llama3-qwen3")
    config = _config()
    signal = case.signal(64)
    pad = case.student_ids.clone()
    pad[1] = 0
    mask = case.loss_mask.clone()
    mask[1] = False
    valid = case.chunks.valid & (case.chunks.row == 0)
    flags = case.chunks.flags * (case.chunks.row == 0)
    empty = replace(
        case, student_ids=pad, loss_mask=mask, chunks=replace(case.chunks, valid=valid, flags=flags)
    )
    single, grad = _single(case, config, signal, slice(0, 1))
    plans = [plan_rows(empty, signal, config, slice(d, d + 1)) for d in (0, 1)]
    assert plans[1].counts.tokens == 0 and plans[1].counts.chunks == (0,)
    logits = case.student_logits.double()
    results = run_layout(ParallelConfig(dp=2), logits, plans, config, tmp_path)
    padding = next(r for r in results if r.dp == 1)
    assert padding.share == 0 and torch.count_nonzero(padding.grad) == 0
    worker = next(r for r in results if r.dp == 0)
    torch.testing.assert_close(worker.grad, grad, rtol=1e-5, atol=1e-5 * grad.abs().max().item())
    assert worker.kd_scale == padding.kd_scale == pytest.approx(single.kd_scale, rel=1e-9)
    # The complete values are those of row 0 alone.
    for key in ("loss", "ce", "kd", "teacher0/1:1/valid", "teacher0/1:1/mean_divergence"):
        assert worker.metrics[key] == pytest.approx(single.metrics[key], rel=1e-6)


def _token_batch(rows: int, width: int, vocab: int, k: int):
    """A same-tokenizer batch: random ids, every position from 1 a target and a KD position."""
    from test_loss_objective import token_chunks

    gen = torch.Generator().manual_seed(rows * width)
    ids = torch.randint(0, vocab, (rows, width), generator=gen)
    mask = torch.ones(rows, width, dtype=torch.bool)
    mask[:, 0] = False
    teacher = torch.randn(rows, width, vocab, generator=gen)
    signal = signal_from_logits(teacher, ids, k=k, tau=1.0)
    config = LossConfig(teachers=[TeacherLossConfig(k=k)])
    plan = plan_loss(
        config,
        ids,
        mask,
        [TeacherBatch(ids, token_chunks([width] * rows), signal)],
        [None],
        student_vocab=vocab,
    )
    logits = torch.randn(rows, width, vocab, generator=gen)
    return logits, plan, config


def test_bytes_moved_grow_with_positions_and_events_not_with_the_vocabulary(tmp_path):
    """TP2: the collectives move O(rows + pairs) numbers; a 4x vocabulary moves the same bytes,
    twice the positions (and so twice the events) about twice as many."""
    layout = ParallelConfig(cp=1, tp=2)
    moved, bound = {}, {}
    for name, (width, vocab) in {
        "base": (16, 1000),
        "vocab_x4": (16, 4000),
        "positions_x2": (32, 1000),
    }.items():
        logits, plan, config = _token_batch(2, width, vocab, k=8)
        (tmp_path / name).mkdir()
        results = run_layout(layout, logits, [plan], config, tmp_path / name)
        single = compute_loss(logits, plan, config)
        assert results[0].metrics["loss"] == pytest.approx(single.loss.item(), rel=1e-5)
        moved[name] = max(r.bytes for r in results)
        # Per step, forward and backward: float32 max and sum of exponentials per row (sum
        # twice), the picked logit per (row, id) pair twice, the int64 counts, and the float64
        # vector of totals and metric sums.
        pairs = len(plan.ce_rows) + len(plan.terms[0].events.term_row)
        n_keys = 3 + len(sum_keys([t.name for t in plan.terms], 1))
        bound[name] = 4 * (3 * 2 * width + 2 * pairs) + 8 * 2 + 8 * n_keys
        assert moved[name] <= bound[name] < 2 * width * vocab * 4 // 8
    assert moved["vocab_x4"] == moved["base"]
    assert 1.6 * moved["base"] < moved["positions_x2"] < 2.4 * moved["base"]


def test_layout_sizes_are_checked():
    with pytest.raises(ConfigError, match=r"dp \* cp \* tp = 2 \* 1 \* 2 = 4, but there are 2"):
        ParallelConfig(dp=2, tp=2).check(2)
    with pytest.raises(ConfigError, match=r"tp is 0; it must be an integer >= 1"):
        ParallelConfig(tp=0).check(1)


def _mesh(layout: ParallelConfig, cp_rank: int, tp_rank: int) -> LossGroups:
    """A mesh's coordinates without process groups (ownership needs none)."""
    return LossGroups(layout, 0, cp_rank, tp_rank, None, None, None)


@pytest.mark.parametrize("name", ["cp2", "tp2xcp2", "tp2"])
def test_ownership_counts_every_target_and_chunk_exactly_once(cases, name):
    case, layout = cases("llama3-qwen3"), LAYOUTS[name]
    plan = plan_rows(case, case.signal(64), _config())
    owners = [
        ownership(plan, _mesh(layout, c, t)) for c in range(layout.cp) for t in range(layout.tp)
    ]
    ce = np.sum([o.ce for o in owners], axis=0)
    assert (ce == 1).all() and len(ce) == len(plan.ce_rows)
    chunks = np.sum([o.chunks[0] for o in owners], axis=0)
    assert (chunks == 1).all() and len(chunks) == len(plan.terms[0].chunk_shape)
    assert sum(o.leader for o in owners) == 1
    # Each rank's chunks start in its window.
    window = plan.width // layout.cp
    for c in range(layout.cp):
        mine = owners[c * layout.tp].chunks[0]
        first = plan.terms[0].chunk_first_row[mine] % plan.width
        assert ((first >= c * window) & (first < (c + 1) * window)).all()


def test_sharded_log_probs_refuse_uneven_windows():
    with pytest.raises(
        ConfigError,
        match=r"logits hold 5 positions per rank and cp = 2, but the "
        r"rows are 12 long",
    ):
        ShardedLogProbs(torch.zeros(1, 5, 8), _mesh(LAYOUTS["cp2"], 0, 0), width=12)


def test_sharded_log_probs_refuse_uneven_vocabulary_slices():
    with pytest.raises(
        ConfigError,
        match=r"logits hold 3 vocabulary rows per rank and tp = 2, "
        r"but the student has V = 7",
    ):
        ShardedLogProbs(torch.zeros(1, 4, 3), _mesh(LAYOUTS["tp2"], 0, 1), width=4, vocab_size=7)


def test_xtoken_and_csd_teachers_in_a_sharded_layout_equal_one_process(cases, tmp_path):
    """X-Token's projected KL asks for (row, id) log probabilities like CSD: a CSD teacher and
    an X-Token teacher (the same signal, weight 2) on vocabulary- and sequence-split logits
    (tp 2 x cp 2, 4 gloo ranks) give the one-process values and gradient."""
    from crosskd.projection import build_projection

    case, layout = cases("llama3-qwen3"), LAYOUTS["tp2xcp2"]
    csd = _config()
    xtoken = replace(csd.teachers[0], algorithm="xtoken", projection="w", weight=2.0)
    config = replace(csd, teachers=[csd.teachers[0], xtoken])
    signal = case.signal(64)
    batch = TeacherBatch(case.teacher_ids, case.chunks, signal)
    plan = plan_loss(
        config,
        case.student_ids,
        case.loss_mask,
        [batch, batch],
        [case.pair, case.pair],
        student_vocab=case.student_logits.shape[-1],
        projections=[None, build_projection(case.pair)],
    )
    logits = case.student_logits.double().requires_grad_(True)
    single = compute_loss(logits, plan, config)
    single.loss.backward()
    assert single.totals["kd/teacher1"] > 0
    results = run_layout(layout, case.student_logits.double(), [plan], config, tmp_path)
    _check_same(results, single, logits.grad, layout, logits.shape)


@pytest.mark.parametrize("name", ["tp2", "cp2", "tp2xcp2", "dp2xtp2"])
def test_whole_row_teachers_over_split_logits_equal_one_process(cases, name, tmp_path):
    """Gold, H-KL and ULD read whole rows: over a vocabulary split in two, each slice's parts
    and its largest entries are summed and merged; over two sequence windows, a gold chunk whose
    rows lie in both (the case is padded so that one does) has its mean summed over the
    windows. Each layout (2 or 4 gloo ranks) gives the one-process values and gradient, beside
    a CSD teacher."""
    from crosskd.projection import build_projection

    case, layout = cases("smollm2-qwen3"), LAYOUTS[name]
    csd = _config()
    gold = replace(csd.teachers[0], algorithm="gold", projection="w", weight=2.0)
    hkl = replace(csd.teachers[0], algorithm="hkl", projection="w", weight=0.5)
    uld = replace(csd.teachers[0], algorithm="uld", weight=1.5)
    config = replace(csd, teachers=[csd.teachers[0], gold, hkl, uld])
    signal, projection = case.signal(64), build_projection(case.pair)
    logits = case.student_logits.double().requires_grad_(True)
    single = compute_loss(logits, plan_rows(case, signal, config, projection=projection), config)
    single.loss.backward()
    assert all(single.totals[f"kd/teacher{i}"] > 0 for i in (1, 2, 3))
    if layout.cp == 2:
        half = case.student_ids.shape[1] // 2
        assert any(a < half <= b for a, b in _spans(plan_rows(case, signal, _config())))
    rows = case.student_ids.shape[0] // layout.dp
    plans = [
        plan_rows(case, signal, config, slice(d * rows, (d + 1) * rows), projection)
        for d in range(layout.dp)
    ]
    results = run_layout(layout, case.student_logits.double(), plans, config, tmp_path)
    _check_same(results, single, logits.grad, layout, logits.shape)
