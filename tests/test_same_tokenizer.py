"""A same-tokenizer teacher (spec section 5, "Same tokenizer"): data preparation stores no
chunks for it, the collator gives it one entry per student position, and the loss compares
every valid position (a prediction, inside the KD mask, equal ids) with the teacher's top K
(+ the realized token under ``keep_realized``) and REST.

The Llama-3 cases split emoji and CJK into byte pieces, which the alignment of a tokenization
with itself makes into multi-token chunks (the defect this pins down: such a teacher was
refused as "does not tokenize like the student")."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from crosskd.alignment import ChatOptions, align_chat, harmonize_reasoning, render
from crosskd.alignment.own import student_tokens
from crosskd.data.collate import ChunkBatch, collate, load_prepared
from crosskd.data.prepare import PrepareConfig, prepare
from crosskd.data.shards import FLAG_CORRECT, FLAG_KD, FLAG_PREDICTION
from crosskd.errors import ConfigError
from crosskd.loss import LossConfig, TeacherBatch, TeacherLossConfig, compute_loss, plan_loss
from crosskd.loss.tokens import token_positions
from crosskd.tables import TablePair
from crosskd.teacher import signal_from_logits

ALL = FLAG_CORRECT | FLAG_PREDICTION | FLAG_KD
TEXTS = [
    "🎉",
    "Party 🎉🎊 time, 日本語のテキスト and 中文字符.",
    "emoji 👍🏽 with a skin tone, then 한국어.",
    "plain ascii",
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hi in Japanese 🎌"},
    {"role": "assistant", "content": "Hi! こんにちは 🎉"},
    {"role": "user", "content": "And with reasoning?"},
    {"role": "assistant", "content": "<think>Think 🤔 first.</think>Okay: 你好."},
]


@pytest.fixture
def zoo_env(zoo_cache, monkeypatch):
    monkeypatch.setenv("CROSSKD_CACHE_DIR", str(zoo_cache))


def _prepare(tmp_path: Path, rows: list[dict], teachers: list[str], **kw) -> str:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
    config = PrepareConfig(
        data=str(data),
        student_tokenizer="zoo:llama3",
        teacher_tokenizers=teachers,
        output=str(tmp_path / "out"),
        max_length=256,
        **kw,
    )
    prepare(config, progress=False)
    return config.output


def _signal(ids: torch.Tensor, vocab: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return signal_from_logits(torch.randn(*ids.shape, vocab, generator=gen), ids, k=k, tau=1.0)


def test_prepare_and_plan_emoji_and_cjk_with_llama3_as_its_own_teacher(
    tmp_path, zoo_env, zoo, built_table
):
    rows = [{"id": f"t{i}", "text": t} for i, t in enumerate(TEXTS)]
    out = _prepare(tmp_path, rows, ["zoo:llama3", "zoo:qwen3"])
    data = load_prepared(out)
    models = data.manifest["models"]
    assert [m.get("same_tokenizer") for m in models] == [None, True, False]
    assert list(data.manifest["chunk_shapes"]) == ["teacher1"]  # no chunks for teacher0
    packed = list(data.packed_rows())
    assert max(len(row) for row in packed) >= 2  # packed rows hold several samples
    samples = [s for row in packed for s in row]
    for s in samples:
        assert s["teacher0_ids"] == s["student_ids"]
        assert all(s[f"teacher0_chunk_{x}"] is None for x in ("s0", "s1", "t0", "t1"))
        flags = np.asarray(s["teacher0_chunk_flags"])
        assert len(flags) == len(s["student_ids"])
        assert flags[0] == FLAG_CORRECT | FLAG_KD and (flags[1:] == ALL).all()

    batch = collate(packed, n_teachers=2)
    positions = batch.chunks[0]
    assert positions.same_tokenizer and not batch.chunks[1].same_tokenizer
    ids = batch.models["student"].input_ids
    vocab = zoo("llama3").vocab_size
    cross = TeacherLossConfig(k=4, student_to_teacher="s2t", teacher_to_student="t2s")
    config = LossConfig(teachers=[TeacherLossConfig(k=4), cross])
    pair = TablePair(built_table("llama3", "qwen3"), built_table("qwen3", "llama3"))
    teachers = [
        TeacherBatch(batch.models["teacher0"].input_ids, positions, _signal(ids, vocab, 4)),
        TeacherBatch(
            batch.models["teacher1"].input_ids,
            batch.chunks[1],
            _signal(batch.models["teacher1"].input_ids, zoo("qwen3").vocab_size, 4),
        ),
    ]
    plan = plan_loss(config, ids, batch.loss_mask, teachers, [None, pair], student_vocab=vocab)
    # Independent count: every token of every sample but the sample's first.
    n_tokens = sum(len(s["student_ids"]) for s in samples)
    want = n_tokens - len(samples)
    assert plan.counts.chunks[0] == want == int(batch.loss_mask.sum())
    # The counted positions are priced from the row before each non-first token.
    starts = {
        (r, p)
        for r, row in enumerate(packed)
        for p in np.cumsum([0, *(len(s["student_ids"]) for s in row)])[:-1].tolist()
    }
    width = ids.shape[1]
    counted = {
        (int(r), int(p))
        for r, p in zip(
            positions.row[plan.terms[0].events.chunk_index].tolist(),
            positions.student[plan.terms[0].events.chunk_index, 0].tolist(),
            strict=True,
        )
    }
    every = {
        (r, p)
        for r, row in enumerate(packed)
        for p in range(sum(len(s["student_ids"]) for s in row))
    }
    assert counted == every - starts
    rows_used = set(plan.terms[0].events.term_row.tolist())
    assert rows_used == {r * width + p - 1 for r, p in counted}

    logits = torch.randn(*ids.shape, vocab)
    metrics = compute_loss(logits, plan, config).metrics
    assert metrics["teacher0/token/chunks"] == n_tokens
    assert metrics["teacher0/token/valid"] == want
    assert metrics["teacher0/token/skipped_no_prediction"] == len(samples)
    assert "teacher0/1:1/chunks" not in metrics and metrics["teacher1/1:1/valid"] > 0


def test_the_emoji_repro_plans_one_position_per_byte_piece(tmp_path, zoo_env, zoo):
    """Llama-3 as student and teacher, text "🎉": BOS + three byte pieces, three positions."""
    out = _prepare(tmp_path, [{"id": "e", "text": "🎉"}], ["zoo:llama3"])
    batch = collate(list(load_prepared(out).packed_rows()), n_teachers=1)
    ids = batch.models["student"].input_ids
    assert ids.shape == (1, 4)
    vocab = zoo("llama3").vocab_size
    config = LossConfig(teachers=[TeacherLossConfig(k=4)])
    teacher = TeacherBatch(
        batch.models["teacher0"].input_ids, batch.chunks[0], _signal(ids, vocab, 4)
    )
    plan = plan_loss(config, ids, batch.loss_mask, [teacher], [None], student_vocab=vocab)
    assert plan.counts.chunks == (3,) and plan.counts.tokens == 3


@pytest.mark.parametrize("drop_first_chunk", [False, True])
def test_chat_kd_positions_are_the_students_own_masks(tmp_path, zoo_env, zoo, drop_first_chunk):
    """Chat: KD positions are the tokens of the student's CE loss mask (what the alignment of
    the student with itself marks FLAG_KD, token by token), less the first of each assistant
    message under drop_first_chunk."""
    llama = zoo("llama3")
    options = ChatOptions(("reasoning", "close", "answer"), drop_first_chunk)
    messages = harmonize_reasoning([llama], CHAT)
    view = render(llama, messages, sample_id="c")
    own = student_tokens(llama, view, messages, options, sample_id="c")
    self_aligned = align_chat(llama, llama, messages, sample_id="c", options=options)
    assert own.loss_mask.tolist() == self_aligned.loss_mask.tolist()
    # FLAG_KD of the self-alignment's chunks, spread over their tokens.
    spread = np.zeros(len(view.tokens), dtype=bool)
    for (s0, s1), kd in zip(self_aligned.chunks.student, self_aligned.kd_mask, strict=True):
        spread[s0:s1] = kd
    # Both assistant answers start with one-token chunks ("Hi", "Think"), so the two agree.
    assert own.kd.tolist() == spread.tolist()
    assert own.kd.sum() == own.loss_mask.sum() - (2 if drop_first_chunk else 0)

    out = _prepare(
        tmp_path, [{"id": "c", "messages": CHAT}], ["zoo:llama3"], drop_first_chunk=drop_first_chunk
    )
    rows = list(load_prepared(out).packed_rows())
    (sample,) = rows[0]
    assert sample["student_loss_mask"] == own.loss_mask.tolist()
    batch = collate(rows, n_teachers=1)
    ids = batch.models["student"].input_ids
    config = LossConfig(teachers=[TeacherLossConfig(k=4)])
    teacher = TeacherBatch(
        batch.models["teacher0"].input_ids, batch.chunks[0], _signal(ids, llama.vocab_size, 4)
    )
    plan = plan_loss(
        config, ids, batch.loss_mask, [teacher], [None], student_vocab=llama.vocab_size
    )
    assert plan.counts.chunks == (int(own.kd.sum()),)
    assert plan.counts.tokens == int(own.loss_mask.sum())


# --- the loss on a tiny hand-made batch ---------------------------------------------------------

V_S, V_T, K = 7, 8, 3
"""Student rows 7, teacher rows 8 (id 7 a padding row the student cannot price), top 3."""


def _sample(sid: str, ids: list[int], kd: list[bool] | None = None) -> dict:
    """A prepared sample with a same-tokenizer teacher0 (the columns the collator reads)."""
    kd = [True] * len(ids) if kd is None else kd
    flags = [
        FLAG_CORRECT | (FLAG_PREDICTION if p else 0) | (FLAG_KD if k else 0)
        for p, k in enumerate(kd)
    ]
    mask = [bool(p) for p in range(len(ids))]
    return {
        "sample_id": sid,
        "student_ids": ids,
        "student_loss_mask": mask,
        "teacher0_ids": ids,
        **{f"teacher0_chunk_{x}": None for x in ("s0", "s1", "t0", "t1")},
        "teacher0_chunk_shape": [0] * len(ids),
        "teacher0_chunk_flags": flags,
        "teacher0_chunk_region": [0] * len(ids),
        "teacher0_chunk_message": [0] * len(ids),
    }


def _tiny():
    """Two packed rows: [a (4 tokens), b (3 tokens)] and [c (5 tokens, the last outside KD)]."""
    rows = [
        [_sample("a", [1, 5, 2, 6]), _sample("b", [3, 3, 0])],
        [_sample("c", [4, 6, 1, 2, 5], kd=[True] * 4 + [False])],
    ]
    valid = [(0, 1), (0, 2), (0, 3), (0, 5), (0, 6), (1, 1), (1, 2), (1, 3)]
    return rows, valid


def _direct_kd(student, teacher_logits, ids, valid, tau, divergence, keep_realized, beta=0.5):
    """tau^2 * mean over the valid positions of D(T, S) over E = the teacher's top K (ids the
    student can price, + the realized id under keep_realized) and REST, written out."""
    total = 0.0
    for r, p in valid:
        log_t = torch.log_softmax(teacher_logits[r, p - 1].double() / tau, -1)
        log_s = torch.log_softmax(student[r, p - 1].double() / tau, -1)
        top = torch.topk(log_t, K).indices.tolist()
        events = [i for i in top if i < V_S]
        realized = int(ids[r, p])
        if keep_realized and realized not in top:
            events.append(realized)
        t = [log_t[i].exp().item() for i in events]
        s = [log_s[i].exp().item() for i in events]
        t.append(max(1.0 - sum(t), 1e-12))
        s.append(max(1.0 - sum(s), 1e-12))
        t, s = np.array(t), np.array(s)
        if divergence == "forward_kl":
            d = float((t * np.log(t / s)).sum())
        else:
            m = beta * t + (1 - beta) * s
            d = float(beta * (t * np.log(t / m)).sum() + (1 - beta) * (s * np.log(s / m)).sum())
        total += d
    return tau**2 * total / len(valid)


@pytest.mark.parametrize("keep_realized", [False, True])
@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_kd_equals_a_direct_top_k_plus_rest_computation(keep_realized, divergence):
    rows, valid = _tiny()
    batch = collate(rows, n_teachers=1)
    ids = batch.models["student"].input_ids
    gen = torch.Generator().manual_seed(5)
    tau = 1.5
    teacher_logits = 2 * torch.randn(*ids.shape, V_T, generator=gen)
    teacher_logits[..., 7] += 3.0  # the padding row is often in the top K: left to REST
    student = torch.randn(*ids.shape, V_S, generator=gen, dtype=torch.float64)
    signal = signal_from_logits(teacher_logits, ids, k=K, tau=tau)
    config = LossConfig(
        divergence=divergence,
        tau=tau,
        keep_realized=keep_realized,
        teachers=[TeacherLossConfig(k=K)],
    )
    plan = plan_loss(
        config,
        ids,
        batch.loss_mask,
        [TeacherBatch(ids, batch.chunks[0], signal)],
        [None],
        student_vocab=V_S,
    )
    assert plan.counts.chunks == (len(valid),)
    out = compute_loss(student, plan, config)
    want = _direct_kd(student, teacher_logits, ids, valid, tau, divergence, keep_realized)
    assert out.kd.item() == pytest.approx(want, rel=1e-5)
    metrics = out.metrics
    assert metrics["teacher0/token/chunks"] == 12
    assert metrics["teacher0/token/skipped_no_prediction"] == 3  # a, b and c's first tokens
    assert metrics["teacher0/token/skipped_masked"] == 1
    assert metrics["teacher0/token/valid"] == len(valid)


def test_packed_samples_first_positions_have_no_prediction():
    """The first token of the second sample of a packed row has a row before it (the first
    sample's last token) but no prediction: it is never counted, nor its row used."""
    rows, valid = _tiny()
    batch = collate(rows, n_teachers=1)
    positions = batch.chunks[0]
    assert positions.same_tokenizer and len(positions.row) == 12
    starts = [(0, 0), (0, 4), (1, 0)]
    for r, p in starts:
        (c,) = np.flatnonzero((positions.row.numpy() == r) & (positions.student[:, 0].numpy() == p))
        assert not positions.flags[c] & FLAG_PREDICTION and not positions.valid[c]
    assert positions.sample.tolist() == [0] * 4 + [1] * 3 + [2] * 5
    ids = batch.models["student"].input_ids
    config = LossConfig(teachers=[TeacherLossConfig(k=K)])
    signal = signal_from_logits(torch.randn(*ids.shape, V_T), ids, k=K, tau=1.0)
    plan = plan_loss(
        config,
        ids,
        batch.loss_mask,
        [TeacherBatch(ids, positions, signal)],
        [None],
        student_vocab=V_S,
    )
    width = ids.shape[1]
    assert set(plan.terms[0].events.term_row.tolist()) == {r * width + p - 1 for r, p in valid}


def test_select_mode_bits_of_a_same_tokenizer_teacher_cover_its_kd_positions():
    rows, valid = _tiny()
    batch = collate(rows, n_teachers=1)
    ids = batch.models["student"].input_ids
    signal = signal_from_logits(torch.randn(*ids.shape, V_T), ids, k=K, tau=1.0)
    config = LossConfig(teacher_mode="select", teachers=[TeacherLossConfig(k=K)])
    plan = plan_loss(
        config,
        ids,
        batch.loss_mask,
        [TeacherBatch(ids, batch.chunks[0], signal)],
        [None],
        student_vocab=V_S,
        teacher_bytes=[np.ones(V_T, dtype=np.int64)],
    )
    want = -sum(signal.realized_t1[r, p - 1].item() for r, p in valid) / math.log(2)
    assert plan.sums["teacher0/bits"] == pytest.approx(want, rel=1e-6)
    assert plan.sums["teacher0/bytes"] == len(valid)
    assert plan.counts.chunks == (len(valid),)


def test_positions_where_the_ids_differ_are_not_compared():
    rows, valid = _tiny()
    rows[0][0]["teacher0_ids"] = [1, 5, 0, 6]  # position (0, 2) differs
    batch = collate(rows, n_teachers=1)
    ids = batch.models["student"].input_ids
    t_ids = batch.models["teacher0"].input_ids
    signal = signal_from_logits(torch.randn(*ids.shape, V_T), t_ids, k=K, tau=1.0)
    config = LossConfig(teachers=[TeacherLossConfig(k=K)])
    plan = plan_loss(
        config,
        ids,
        batch.loss_mask,
        [TeacherBatch(t_ids, batch.chunks[0], signal)],
        [None],
        student_vocab=V_S,
    )
    assert plan.counts.chunks == (len(valid) - 1,)
    out = compute_loss(torch.randn(*ids.shape, V_S), plan, config)
    assert out.metrics["teacher0/token/skipped_incorrect"] == 1


def test_chunks_of_the_student_aligned_with_itself_become_positions():
    """Format-1 data (and hand-made batches) give a same-tokenizer teacher chunks: an ``n:n``
    chunk of identical ids (an emoji's byte pieces) is split into its positions; the chunk at
    a sequence's start loses only its first token."""
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    # Chunks [0, 2) (no prediction: starts the sequence), [2, 5) (3:3), [5, 6) outside KD.
    student = torch.tensor([[0, 2], [2, 5], [5, 6]])
    flags = torch.tensor(
        [FLAG_CORRECT | FLAG_KD, ALL, FLAG_CORRECT | FLAG_PREDICTION], dtype=torch.uint8
    )
    zeros = torch.zeros(3, dtype=torch.int64)
    chunks = ChunkBatch(
        zeros,
        student,
        student.clone(),
        torch.tensor([3, 3, 0], dtype=torch.uint8),
        zeros.to(torch.uint8),
        (flags & ALL) == ALL,
        flags,
        zeros,
    )
    positions = token_positions(chunks, ids.numpy(), ids.numpy())
    assert positions.same_tokenizer
    assert positions.student[:, 0].tolist() == [0, 1, 2, 3, 4, 5]
    assert positions.valid.tolist() == [False, True, True, True, True, False]
    signal = signal_from_logits(torch.randn(1, 6, V_S), ids, k=K, tau=1.0)
    config = LossConfig(teachers=[TeacherLossConfig(k=K)])
    mask = torch.tensor([[False, True, True, True, True, False]])
    plan = plan_loss(
        config, ids, mask, [TeacherBatch(ids, chunks, signal)], [None], student_vocab=V_S
    )
    assert plan.counts.chunks == (4,)


def test_tables_for_a_teacher_prepared_as_same_tokenizer_are_refused():
    rows, _ = _tiny()
    batch = collate(rows, n_teachers=1)
    ids = batch.models["student"].input_ids
    signal = signal_from_logits(torch.randn(*ids.shape, V_T), ids, k=K, tau=1.0)
    config = LossConfig(
        teachers=[TeacherLossConfig(k=K, student_to_teacher="s2t.st", teacher_to_student="t2s.st")]
    )
    with pytest.raises(ConfigError, match=r"teachers\[0\] has tables.*same-tokenizer teacher"):
        plan_loss(
            config,
            ids,
            batch.loss_mask,
            [TeacherBatch(ids, batch.chunks[0], signal)],
            [object()],
            student_vocab=V_S,
        )
