"""Several teachers (spec section 6): per-sample selection by bits per byte, and the mixture of
teachers that share one tokenizer.

* ``select``: per sample, the teacher with the lowest bits per byte on the sample's predicted
  text: the teacher's negative log likelihood (temperature 1, in bits) of the realized tokens of
  the sample's chunks that have a prediction and lie inside the KD mask, divided by those
  tokens' UTF-8 bytes. Special-role pairs (chat markers) are left out of both sums: their bytes
  are markup strings that differ between tokenizers, not text. Ties go to the lower teacher
  index; a sample without predicted bytes selects no teacher (no KD). Both sums are additive
  over micro-batches and ranks.
* ``average``: dense signals on one tokenizer mixed per row, ``log sum_t w_t p_t`` with the
  weights normalised to 1 (the signals are at ``tau``, so this mixes tempered distributions).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from crosskd.data.collate import ChunkBatch
from crosskd.data.shards import FLAG_KD, FLAG_PREDICTION
from crosskd.errors import ConfigError
from crosskd.loss.events import SHAPE_SPECIAL, to_numpy
from crosskd.teacher.signal import TeacherSignal


def predicted_bits(
    signal: TeacherSignal,
    teacher_ids: np.ndarray,
    chunks: ChunkBatch,
    token_bytes: np.ndarray,
    n_samples: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Per sample: the teacher's NLL of its predicted realized tokens in bits, and their bytes.

    ``teacher_ids`` ``[B, L_t]``; ``chunks``: the teacher's
    :class:`~crosskd.data.collate.ChunkBatch`; ``token_bytes`` int ``[V_T]``: UTF-8 length of
    each teacher token. Returns float64 ``[n_samples]`` bits and int64 ``[n_samples]`` bytes.
    """
    need = FLAG_PREDICTION | FLAG_KD
    flags, shape = to_numpy(chunks.flags), to_numpy(chunks.shape)
    use = ((flags & need) == need) & (shape != SHAPE_SPECIAL)
    rows = to_numpy(chunks.row).astype(np.int64)[use]
    t0, t1 = (to_numpy(chunks.teacher).astype(np.int64)[use, i] for i in (0, 1))
    sample = to_numpy(chunks.sample).astype(np.int64)[use]
    lengths = t1 - t0
    owner = np.repeat(np.arange(len(rows)), lengths)
    position = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths - t0, lengths)
    realized = signal.realized_t1.detach().cpu().double().numpy()
    nll = -realized[rows[owner], position - 1] / math.log(2)
    n_bytes = token_bytes[teacher_ids[rows[owner], position]]
    bits = np.bincount(sample[owner], weights=nll, minlength=n_samples)
    total = np.bincount(sample[owner], weights=n_bytes, minlength=n_samples).astype(np.int64)
    return bits, total


def select_teachers(bits: np.ndarray, n_bytes: np.ndarray) -> np.ndarray:
    """Per sample the teacher with the lowest bits per byte (ties: lower index), or -1 when no
    teacher has predicted bytes. ``bits`` float ``[T, S]``, ``n_bytes`` int ``[T, S]``; int64
    ``[S]``."""
    with np.errstate(divide="ignore", invalid="ignore"):
        bpb = np.where(n_bytes > 0, bits / np.maximum(n_bytes, 1), np.inf)
    choice = np.argmin(bpb, axis=0)
    return np.where(np.isfinite(bpb).any(axis=0), choice, -1).astype(np.int64)


def mix_signals(signals: list[TeacherSignal], weights: list[float]) -> TeacherSignal:
    """The weighted mixture of dense signals of teachers sharing one tokenizer: per row
    ``log sum_t w_t p_t`` (weights normalised to sum 1) of the log probs and of both realized
    log probs."""
    first = signals[0]
    for i, signal in enumerate(signals):
        if signal.k != 0:
            raise ConfigError(
                f"teacher_mode 'average': teachers[{i}]'s signal has K = {signal.k}; average "
                f"needs dense signals (k: 0)."
            )
        if (signal.vocab_size, signal.tau) != (first.vocab_size, first.tau):
            raise ConfigError(
                f"teacher_mode 'average': teachers[{i}]'s signal has V = {signal.vocab_size}, "
                f"tau = {signal.tau}; teachers[0]'s has V = {first.vocab_size}, tau = "
                f"{first.tau}. Average needs one tokenizer and one temperature."
            )
    total = float(sum(weights))
    log_w = torch.tensor([math.log(w / total) if w > 0 else -math.inf for w in weights])

    def mix(values: list[torch.Tensor]) -> torch.Tensor:
        stacked = torch.stack([v.float() for v in values])
        shape = (-1,) + (1,) * (stacked.dim() - 1)
        return torch.logsumexp(stacked + log_w.view(shape), dim=0)

    return TeacherSignal(
        None,
        mix([s.log_probs for s in signals]),
        mix([s.realized for s in signals]),
        mix([s.realized_t1 for s in signals]),
        first.tau,
        first.vocab_size,
        0,
    )
