"""Compact storage of per-sample teacher signals (spec section 4) as Parquet tables.

One table row per sample: ``sample_id``, ``length`` (its teacher tokens ``L``), the top-K ids,
the top-K values, and the realized log probs at ``tau`` and at temperature 1 (float32, ``L - 1``
each, always exact). Two encodings of the top K:

* ``lossless``: ids ascending per row and delta-coded (the first id, then the gaps, uint32),
  values exact float32; both stored byte plane by byte plane (all first bytes, then all second
  bytes, ...), which puts the near-constant high bytes together, and compressed with zstd;
* ``lossy``: the same ids; values quantised to 8 bits per entry below each row's largest log
  prob, in steps of ``LOSSY_STEP`` nats (the row maximum kept as float32; entries more than
  ``255 * LOSSY_STEP`` nats below it are stored at that floor). The error of a log prob is at
  most ``LOSSY_STEP / 2`` nats (a relative error of at most 3.2% in probability) above the floor.

The file's footer records a sha256 per row group, so a reader can fetch the groups it needs
alone (:mod:`crosskd.ranges`). Decoding gives :class:`SampleSignal` arrays (:class:`CacheShard`:
one sample at a time, from the file's bytes or by byte ranges);
:func:`batch_signal` lays samples out as the rows of a collated batch (a
:class:`~crosskd.teacher.signal.TeacherSignal`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from crosskd.artifacts import ParquetRows
from crosskd.errors import CrosskdError
from crosskd.ranges import RangedParquet, write_parquet
from crosskd.teacher.signal import TeacherSignal

ENCODINGS = ("lossless", "lossy")
LOSSY_STEP = 1.0 / 16.0
"""Quantisation step of the lossy encoding, nats."""
ROW_GROUP_SAMPLES = 64
"""Samples per Parquet row group: the unit a reader parses (:class:`CacheShard`)."""


@dataclass(frozen=True)
class SampleSignal:
    """One sample's teacher signal: ``ids`` int32 ``[L, K]`` ascending per row, ``log_probs``
    float32 ``[L, K]`` at ``tau``, ``realized`` / ``realized_t1`` float32 ``[L - 1]``."""

    ids: np.ndarray
    log_probs: np.ndarray
    realized: np.ndarray
    realized_t1: np.ndarray

    @property
    def length(self) -> int:
        """The sample's teacher tokens ``L``."""
        return len(self.ids)


def signal_samples(signal: TeacherSignal, lengths: list[int]) -> list[SampleSignal]:
    """Split a batch signal ``[B, L_max, K]`` of right-padded samples into per-sample signals
    of the given lengths."""
    if signal.ids is None:
        raise CrosskdError("teacher signals are stored with a top K (k >= 1), not dense.")
    ids = signal.ids.to(torch.int32).cpu().numpy()
    values = signal.log_probs.float().cpu().numpy()
    realized = signal.realized.float().cpu().numpy()
    realized_t1 = signal.realized_t1.float().cpu().numpy()
    return [
        SampleSignal(
            ids[b, :n].copy(),
            values[b, :n].copy(),
            realized[b, : n - 1].copy(),
            realized_t1[b, : n - 1].copy(),
        )
        for b, n in enumerate(lengths)
    ]


def encode(sample_ids: list[str], samples: list[SampleSignal], encoding: str) -> bytes:
    """A Parquet file (bytes) of the samples in the given encoding, a sha256 per row group in
    its footer (:func:`crosskd.ranges.write_parquet`; :func:`crosskd.ranges.footer_record` is
    what a manifest entry records for ranged reads) and no column statistics (nothing reads
    them; they would only grow the footer every reader fetches)."""
    if encoding not in ENCODINGS:
        raise CrosskdError(f"encoding is {encoding!r}; choose one of {', '.join(ENCODINGS)}.")
    ids = [_planes(_delta(s.ids)) for s in samples]
    if encoding == "lossless":
        values = [_planes(s.log_probs.astype("<f4")) for s in samples]
    else:
        values = [_quantise(s.log_probs) for s in samples]
    table = pa.table(
        {
            "sample_id": pa.array(sample_ids, pa.string()),
            "length": pa.array([s.length for s in samples], pa.int32()),
            "ids": pa.array(ids, pa.binary()),
            "values": pa.array(values, pa.binary()),
            "realized": pa.array([_planes(s.realized.astype("<f4")) for s in samples], pa.binary()),
            "realized_t1": pa.array(
                [_planes(s.realized_t1.astype("<f4")) for s in samples], pa.binary()
            ),
        }
    )
    return write_parquet(
        table,
        compression="zstd",
        compression_level=9,
        use_dictionary=False,
        row_group_size=ROW_GROUP_SAMPLES,
        write_statistics=False,
    )


def decode(payload: bytes, encoding: str, k: int) -> list[tuple[str, SampleSignal]]:
    """The samples of a Parquet file written by :func:`encode`, in order."""
    shard = CacheShard(payload, encoding, k)
    return [(shard.sample_id(i), shard.signal(i)) for i in range(len(shard))]


class CacheShard:
    """A Parquet file written by :func:`encode`: its bytes, or a
    :class:`crosskd.ranges.RangedParquet` (only the row groups read are fetched); each sample
    decoded only when asked for (its row group parsed then, a few kept)."""

    def __init__(self, source: bytes | RangedParquet, encoding: str, k: int) -> None:
        self._rows = ParquetRows(source)
        self.encoding, self.k = encoding, k

    def __len__(self) -> int:
        return len(self._rows)

    def sample_id(self, row: int) -> str:
        """The id of the sample at ``row``."""
        return self._rows.rows(row, row + 1).column("sample_id")[0].as_py()

    def signal(self, row: int) -> SampleSignal:
        """The decoded signal of the sample at ``row``."""
        raw = self._rows.rows(row, row + 1).to_pylist()[0]
        n, k = raw["length"], self.k
        ids = _undelta(_unplanes(raw["ids"], "<u4").reshape(n, k))
        if self.encoding == "lossless":
            values = _unplanes(raw["values"], "<f4").reshape(n, k)
        else:
            values = _dequantise(raw["values"], n, k)
        return SampleSignal(
            ids, values, _unplanes(raw["realized"], "<f4"), _unplanes(raw["realized_t1"], "<f4")
        )


def _planes(values: np.ndarray) -> bytes:
    """The bytes of a 4-byte little-endian array, plane by plane."""
    return np.ascontiguousarray(values).view(np.uint8).reshape(-1, 4).T.tobytes()


def _unplanes(raw: bytes, dtype: str) -> np.ndarray:
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(4, -1)
    return np.ascontiguousarray(planes.T).view(dtype).reshape(-1).copy()


def _delta(ids: np.ndarray) -> np.ndarray:
    """Ascending ids per row as the first id and the gaps (uint32 ``[L, K]``)."""
    ids = ids.astype(np.int64)
    out = np.diff(ids, axis=1, prepend=0)
    return out.astype("<u4")


def _undelta(deltas: np.ndarray) -> np.ndarray:
    return np.cumsum(deltas.astype(np.int64), axis=1).astype(np.int32)


def _quantise(log_probs: np.ndarray) -> bytes:
    """Row maxima (float32 ``[L]``) then the 8-bit steps below them (uint8 ``[L, K]``)."""
    top = log_probs.max(axis=1) if log_probs.size else np.zeros(len(log_probs), np.float32)
    steps = np.rint((top[:, None] - log_probs) / LOSSY_STEP).clip(0, 255).astype(np.uint8)
    return top.astype("<f4").tobytes() + steps.tobytes()


def _dequantise(raw: bytes, n: int, k: int) -> np.ndarray:
    top = np.frombuffer(raw[: 4 * n], dtype="<f4")
    steps = np.frombuffer(raw[4 * n :], dtype=np.uint8).reshape(n, k)
    return (top[:, None] - steps.astype(np.float32) * np.float32(LOSSY_STEP)).astype(np.float32)


def batch_signal(
    rows: list[list[SampleSignal]], width: int, *, k: int, tau: float, vocab_size: int
) -> TeacherSignal:
    """The signal of a collated batch: each packed row is its samples' signals one after
    another, padded to ``width`` teacher positions. The realized log prob of a sample's last
    row (the next sample's first token, never a target) and of padding is 0."""
    n_b = len(rows)
    ids = np.zeros((n_b, width, k), dtype=np.int64)
    values = np.full((n_b, width, k), -1e4, dtype=np.float32)
    realized = np.zeros((n_b, max(width - 1, 0)), dtype=np.float32)
    realized_t1 = np.zeros_like(realized)
    for b, samples in enumerate(rows):
        start = 0
        for s in samples:
            stop = start + s.length
            ids[b, start:stop] = s.ids
            values[b, start:stop] = s.log_probs
            realized[b, start : stop - 1] = s.realized
            realized_t1[b, start : stop - 1] = s.realized_t1
            start = stop
    # Padding rows keep distinct ascending ids so each row is a valid top-K set.
    for b, samples in enumerate(rows):
        used = sum(s.length for s in samples)
        ids[b, used:] = np.arange(k)
    return TeacherSignal(
        torch.from_numpy(ids),
        torch.from_numpy(values),
        torch.from_numpy(realized),
        torch.from_numpy(realized_t1),
        float(tau),
        vocab_size,
        k,
    )
