"""Real-tokenizer CSD batches shared by the loss tests: real texts aligned by the real
tokenizers (real ids, chunks, loss masks and tables) with random logits over the full
vocabularies, biased so that realized tokens and candidate alternatives (common tokens, chain
prefixes) land in the teacher's top K. Not collected as tests."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch
from loss_reference import SHAPE_1_1, SHAPE_1_N, SHAPE_N_1, SHAPE_N_M, SHAPE_SPECIAL

from crosskd.alignment import align_text
from crosskd.data.collate import ChunkBatch
from crosskd.data.shards import FLAG_CORRECT, FLAG_KD, FLAG_PREDICTION
from crosskd.loss import LossConfig, TeacherBatch, TeacherLossConfig, plan_loss
from crosskd.loss.config import PROJECTED
from crosskd.tables import Flag, SubTokenTable, TableMeta, TablePair
from crosskd.teacher import signal_from_logits

TEXTS = [
    "In 2024, 東京 had 13,960,000 people 🎉 and 3.14159 pies.",
    "Hello world!\n\nNaïve café: 42 ñandúes 😀 über 7x7=49 ★",
    "The 1234th emoji 👩\u200d💻 wrote: 数据 + données = 99%",
]
# (student, teacher, texts): two rows each, at most 32 student tokens per row.
PAIRS = [("llama3", "qwen3", (0, 2)), ("smollm2", "qwen3", (1, 2))]
PAIR_IDS = [f"{s}-{t}" for s, t, _ in PAIRS]
TAU = 2.0
BIAS = 20.0  # added to teacher logits of realized tokens and candidate alternatives
DIVERGENCES = ("jsd", "forward_kl", "reverse_kl")


@dataclass
class CsdCase:
    """One batch: ids, chunks, tables and raw (biased) logits of both sides."""

    name: str
    student_ids: torch.Tensor  # [B, Ls]
    teacher_ids: torch.Tensor  # [B, Lt]
    chunks: ChunkBatch
    pair: TablePair
    student_logits: torch.Tensor  # float32 [B, Ls, V_S]
    teacher_logits: torch.Tensor  # float32 [B, Lt, V_T]
    loss_mask: torch.Tensor  # bool [B, Ls]

    def signal(self, k: int, tau: float = TAU):
        return signal_from_logits(self.teacher_logits, self.teacher_ids, k=k, tau=tau)

    def logits(self, dtype=torch.float64) -> torch.Tensor:
        return self.student_logits.to(dtype).clone().requires_grad_(True)

    def with_valid(self, valid: torch.Tensor) -> CsdCase:
        return replace(self, chunks=replace(self.chunks, valid=valid))


def hand_table(chains: list[list[int]], src: str, dst: str, v_dst: int) -> SubTokenTable:
    """A table written by hand: row ``i`` of ``src`` is spelt by the ``dst`` ids ``chains[i]``
    (every row a normal token; fingerprints ``fp-<name>``)."""
    offsets = np.concatenate([[0], np.cumsum([len(c) for c in chains])]).astype(np.int64)
    meta = TableMeta(
        src_name=src,
        dst_name=dst,
        src_fingerprint=f"fp-{src}",
        dst_fingerprint=f"fp-{dst}",
        src_len=len(chains),
        dst_len=v_dst,
        src_vocab_size=len(chains),
        dst_vocab_size=v_dst,
        src_roles="{}",
        dst_roles="{}",
    )
    return SubTokenTable(
        offsets,
        np.asarray([i for c in chains for i in c], dtype=np.int32),
        np.full(len(chains), Flag.NORMAL, dtype=np.uint8),
        meta,
    )


def reference_teacher_chunk(signal, b: int, rows: range) -> tuple[list[int], np.ndarray, float]:
    """The teacher side of one chunk as X-Token's losses take it from a top-K signal, written
    from the formulas (:mod:`crosskd.loss.xtoken`): ``S_c`` (the union of the rows' top-K ids,
    sorted), the mean over the packed row ``b``'s teacher ``rows`` of ``log p_j(v)`` for each id
    of it (an id outside a row's top K at that row's tail spread evenly over the ``V - K``
    others) and the mean log of each row's mass outside ``S_c``."""
    v_t, k = signal.vocab_size, signal.k
    support = sorted({int(i) for j in rows for i in signal.ids[b, j].tolist()})
    logs = []
    for j in rows:
        top = signal.log_probs[b, j].double().exp().tolist()
        known = dict(zip(signal.ids[b, j].tolist(), top, strict=True))
        tail = max(1.0 - sum(known.values()), 1e-30)
        p = [known.get(v, tail / (v_t - k)) for v in support]
        rest = tail * (v_t - len(support)) / (v_t - k)  # 1 - sum(p), without cancellation
        logs.append([math.log(x) for x in p] + [math.log(rest)])
    mean = np.mean(np.array(logs), axis=0)
    return support, mean[:-1], float(mean[-1])


def _pad(rows: list[np.ndarray]) -> torch.Tensor:
    out = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.int64)
    for b, r in enumerate(rows):
        out[b, : len(r)] = torch.from_numpy(np.asarray(r, dtype=np.int64))
    return out


def make_case(zoo, built_table, student: str, teacher: str, texts, seed: int = 0) -> CsdCase:
    s_tok, t_tok = zoo(student), zoo(teacher)
    pair = TablePair(built_table(student, teacher), built_table(teacher, student))
    samples = [align_text(s_tok, t_tok, TEXTS[i]) for i in texts]
    student_ids = _pad([a.student.tokens.ids for a in samples])
    teacher_ids = _pad([a.teacher.tokens.ids for a in samples])
    parts = {k: [] for k in ("row", "s", "t", "shape", "valid", "flags")}
    for b, a in enumerate(samples):
        ch = a.chunks
        parts["row"].append(np.full(len(ch), b, dtype=np.int64))
        parts["s"].append(ch.student)
        parts["t"].append(ch.teacher)
        parts["shape"].append(ch.shape)
        parts["valid"].append(ch.is_correct & ch.has_prediction & a.kd_mask)
        parts["flags"].append(
            ch.is_correct * FLAG_CORRECT + ch.has_prediction * FLAG_PREDICTION + a.kd_mask * FLAG_KD
        )
    cat = {k: torch.from_numpy(np.concatenate(v)) for k, v in parts.items()}
    shape = cat["shape"].to(torch.uint8).clone()
    valid = cat["valid"].to(torch.bool)
    # The plain-text zoo batches have no role pair; relabel one valid 1:1 chunk as a special
    # pair so the special path (realized only, always in E) is exercised too.
    one_to_one = torch.nonzero(valid & (shape == SHAPE_1_1)).flatten()
    shape[one_to_one[len(one_to_one) // 2]] = SHAPE_SPECIAL
    chunks = ChunkBatch(
        row=cat["row"].long(),
        student=cat["s"].long(),
        teacher=cat["t"].long(),
        shape=shape,
        region=torch.zeros(len(shape), dtype=torch.uint8),
        valid=valid,
        flags=cat["flags"].to(torch.uint8),
        sample=cat["row"].long(),
    )

    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    n_b, l_s = student_ids.shape
    l_t = teacher_ids.shape[1]
    student_logits = 2.0 * torch.randn(n_b, l_s, s_tok.vocab_size, generator=gen)
    teacher_logits = torch.randn(n_b, l_t, t_tok.vocab_size, generator=gen)
    # Realized next tokens in the top K, except at the last row of every fourth chunk, every
    # other n:m chunk and the special pair (so keep_realized, drop_unrealized_topk and the
    # "no event" case all occur).
    for b in range(n_b):
        for r in range(l_t - 1):
            teacher_logits[b, r, teacher_ids[b, r + 1]] += BIAS
        for r in range(l_s - 1):
            student_logits[b, r, student_ids[b, r + 1]] += 4.0
    n_m_seen = 0
    for v, c in enumerate(torch.nonzero(valid).flatten().tolist()):
        b, t1 = int(chunks.row[c]), int(chunks.teacher[c, 1])
        n_m = int(shape[c]) == SHAPE_N_M
        n_m_seen += n_m
        if v % 4 == 3 or (n_m and n_m_seen % 2 == 1) or int(shape[c]) == SHAPE_SPECIAL:
            teacher_logits[b, t1 - 2, teacher_ids[b, t1 - 1]] -= BIAS

    def boost(b: int, row: int, candidates: np.ndarray, n: int) -> None:
        if len(candidates):
            pick = rng.choice(candidates, size=min(n, len(candidates)), replace=False)
            teacher_logits[b, row, torch.from_numpy(pick)] += BIAS * rng.uniform(0.8, 1.0)

    common_t = pair.common[:, 1]
    s_list, t_list = student_ids.tolist(), teacher_ids.tolist()
    for c in torch.nonzero(valid).flatten().tolist():
        b = int(chunks.row[c])
        s0, s1 = chunks.student[c].tolist()
        t0, t1 = chunks.teacher[c].tolist()
        s_path, t_path = s_list[b][s0:s1], t_list[b][t0:t1]
        if int(shape[c]) == SHAPE_1_1:
            boost(b, t0 - 1, common_t, 4)
        elif int(shape[c]) == SHAPE_1_N:
            for k in range(1, len(t_path) + 1):
                rows = pair.prefix_s2t.get(tuple(t_path[: k - 1]))
                if rows is not None:
                    boost(b, t0 + k - 2, rows[rows[:, 1] != t_path[k - 1], 1], 3)
        elif int(shape[c]) == SHAPE_N_1:
            for k in range(1, len(s_path) + 1):
                rows = pair.prefix_t2s.get(tuple(s_path[: k - 1]))
                if rows is not None:
                    boost(b, t0 - 1, rows[rows[:, 1] != s_path[k - 1], 0], 2)
    loss_mask = torch.zeros(student_ids.shape, dtype=torch.bool)
    for b, a in enumerate(samples):
        loss_mask[b, : len(a.loss_mask)] = torch.from_numpy(a.loss_mask)
    return CsdCase(
        f"{student}-{teacher}",
        student_ids,
        teacher_ids,
        chunks,
        pair,
        student_logits,
        teacher_logits,
        loss_mask,
    )


def plan_rows(case: CsdCase, signal, config, rows: slice = slice(None), projection=None):
    """The loss plan of the packed rows ``rows`` of the case (their chunks, signal rows), the
    same teacher for each of ``config.teachers``; ``projection``: the teachers' ``W``, for
    those whose algorithm reads it."""
    keep = (case.chunks.row >= (rows.start or 0)) & (case.chunks.row < (rows.stop or 1 << 30))
    shift = rows.start or 0
    chunks = ChunkBatch(
        case.chunks.row[keep] - shift,
        case.chunks.student[keep],
        case.chunks.teacher[keep],
        case.chunks.shape[keep],
        case.chunks.region[keep],
        case.chunks.valid[keep],
        case.chunks.flags[keep],
        case.chunks.sample[keep] - shift,
    )
    sig = signal if rows == slice(None) else signal_rows(signal, rows)
    batch = TeacherBatch(case.teacher_ids[rows], chunks, sig)
    n = len(config.teachers)
    return plan_loss(
        config,
        case.student_ids[rows],
        case.loss_mask[rows],
        [batch] * n,
        [case.pair] * n,
        student_vocab=case.student_logits.shape[-1],
        projections=[projection if config.algorithm(i) in PROJECTED else None for i in range(n)],
    )


def signal_rows(signal, rows: slice):
    """The signal of the rows ``rows``."""
    return replace(
        signal,
        ids=None if signal.ids is None else signal.ids[rows],
        log_probs=signal.log_probs[rows],
        realized=signal.realized[rows],
        realized_t1=signal.realized_t1[rows],
    )


def loss_config(k: int, **kw):
    """A loss config for the case's cross-tokenizer teacher at top-K ``k`` and TAU, with the
    mismatch chunks weighing 5 (the reference's default; not 1, so the weight is checked)
    unless ``kw`` says otherwise."""
    tables = {"student_to_teacher": "s2t", "teacher_to_student": "t2s"}
    kw = {"mismatch_weight": 5.0, **kw}
    return LossConfig(tau=TAU, teachers=[TeacherLossConfig(k=k, **tables)], **kw)


def padded(case: CsdCase, multiple: int, width: int | None = None) -> CsdCase:
    """The case with its student rows padded (id 0, outside the loss mask, random logits) to
    ``width`` positions or else the next multiple of ``multiple``, so sequence windows split
    them evenly."""
    n_b, current = case.student_ids.shape
    extra = (width - current) if width is not None else -current % multiple
    if not extra:
        return case
    gen = torch.Generator().manual_seed(99)
    return replace(
        case,
        student_ids=torch.nn.functional.pad(case.student_ids, (0, extra)),
        loss_mask=torch.nn.functional.pad(case.loss_mask, (0, extra)),
        student_logits=torch.cat(
            [
                case.student_logits,
                torch.randn(n_b, extra, case.student_logits.shape[-1], generator=gen),
            ],
            dim=1,
        ),
    )
