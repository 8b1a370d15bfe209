"""Reading prepared data back and turning packed rows into model batches.

:func:`load_prepared` checks the manifest (kind, format version, the fingerprints the caller
expects) and each shard's sha256 before use. :func:`collate` turns a list of packed rows (each a
list of samples, as prepared) into per-model ``input_ids`` / ``position_ids`` / ``segment_ids``
(padded to the longest row of the batch), the student's CE ``loss_mask``, and per teacher the
chunk tensors the loss needs, flat over the batch: each chunk carries its packed row index and
its token ranges *within that packed row* on both sides.

A same-tokenizer teacher (prepared without chunks, :mod:`crosskd.data.prepare`) gets a
:class:`ChunkBatch` of **positions** instead (``same_tokenizer`` true): one entry per student
token of every sample, ``student = teacher = [p, p + 1)``, with the flags prepared for it
(``FLAG_PREDICTION`` off at each sample's first token, ``FLAG_KD`` on at its KD positions) and
``FLAG_CORRECT`` only where the teacher's id equals the student's. Format versions 1 and 2 are
read (version 1 stored such a teacher as chunks of the student aligned with itself; those
batches are ordinary chunk batches, turned into positions by the loss:
:func:`crosskd.loss.tokens.token_positions`).
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq
import torch

from crosskd.artifacts import read_checked, read_manifest
from crosskd.data.prepare import KIND
from crosskd.data.shards import FLAG_CORRECT, FLAG_KD, FLAG_PREDICTION
from crosskd.errors import DataError

FORMAT_VERSIONS = (1, 2)


@dataclass(frozen=True)
class PreparedData:
    """A prepared-data folder: ``uri`` and its parsed ``manifest``."""

    uri: str
    manifest: dict

    @property
    def model_names(self) -> list[str]:
        """``["student", "teacher0", ...]``."""
        return [m["name"] for m in self.manifest["models"]]

    def shard_samples(self, index: int) -> list[dict]:
        """The samples of shard ``index`` in order (column name -> value), after checking the
        shard's sha256 against the manifest."""
        payload = read_checked(
            self.uri,
            self.manifest["shards"][index],
            what="prepared data",
            error=DataError,
            rebuild="Run `crosskd prepare` again.",
        )
        return pq.read_table(io.BytesIO(payload)).to_pylist()

    def packed_rows(self) -> Iterator[list[dict]]:
        """Every packed row in order, as its list of samples (column name -> value)."""
        for index in range(len(self.manifest["shards"])):
            rows = self.shard_samples(index)
            start = 0
            while start < len(rows):
                stop = start
                while stop < len(rows) and rows[stop]["bin"] == rows[start]["bin"]:
                    stop += 1
                yield rows[start:stop]
                start = stop


def load_prepared(uri: str, *, fingerprints: dict[str, str] | None = None) -> PreparedData:
    """Open prepared data, refusing a missing or foreign manifest, an unknown format version,
    or a model whose fingerprint differs from ``fingerprints`` (model name -> fingerprint)."""
    manifest = read_manifest(
        uri,
        what="prepared data",
        kind=KIND,
        versions=FORMAT_VERSIONS,
        error=DataError,
        rebuild="`crosskd prepare`",
    )
    recorded = {m["name"]: m["fingerprint"] for m in manifest["models"]}
    for name, want in (fingerprints or {}).items():
        if recorded.get(name) != want:
            raise DataError(
                f"prepared data {uri}: {name} tokenizer fingerprint is {recorded.get(name)}, "
                f"expected {want}; the data was prepared for another tokenizer. Prepare it "
                f"again."
            )
    return PreparedData(uri, manifest)


@dataclass(frozen=True)
class ModelBatch:
    """One model's side of a batch, all int64 ``[B, L]`` (L = longest packed row of the batch):
    ``input_ids`` (0 in padding), ``position_ids`` (restarting at 0 per sample) and
    ``segment_ids`` (sample index within the row, -1 in padding; attention stays within a
    segment)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segment_ids: torch.Tensor


@dataclass(frozen=True)
class ChunkBatch:
    """One teacher's chunks over the batch, flat: ``row`` int64 ``[C]`` (packed row), ``student``
    and ``teacher`` int64 ``[C, 2]`` (token ranges within the packed row), ``shape`` / ``region``
    uint8 ``[C]``, ``valid`` bool ``[C]`` (correct, has a prediction, and in the KD mask),
    ``flags`` uint8 ``[C]`` (``FLAG_*`` of :mod:`crosskd.data.shards`, for the skip reasons) and
    ``sample`` int64 ``[C]`` (the chunk's sample, numbered over the batch in row order).

    ``same_tokenizer``: the entries are the positions of a same-tokenizer teacher (one per
    student token, ``student == teacher == [p, p + 1)``; module docstring), not chunks."""

    row: torch.Tensor
    student: torch.Tensor
    teacher: torch.Tensor
    shape: torch.Tensor
    region: torch.Tensor
    valid: torch.Tensor
    flags: torch.Tensor
    sample: torch.Tensor
    same_tokenizer: bool = False


@dataclass(frozen=True)
class Batch:
    """``models``: model name -> :class:`ModelBatch`; ``loss_mask`` bool ``[B, L_student]``
    (CE targets); ``chunks``: one :class:`ChunkBatch` per teacher; ``sample_ids`` per row."""

    models: dict[str, ModelBatch]
    loss_mask: torch.Tensor
    chunks: list[ChunkBatch]
    sample_ids: list[list[str]]


def collate(rows: list[list[dict]], n_teachers: int, student_multiple: int = 1) -> Batch:
    """Batch packed rows (each a list of prepared samples) for the student and every teacher;
    the student's rows padded to a multiple of ``student_multiple`` positions (equal windows of
    positions for sequence-parallel ranks)."""
    names = ["student", *(f"teacher{k}" for k in range(n_teachers))]
    models = {
        name: _model_batch(
            [[s[f"{name}_ids"] for s in row] for row in rows],
            student_multiple if name == "student" else 1,
        )
        for name in names
    }
    width = models["student"].input_ids.shape[1]
    loss_mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, row in enumerate(rows):
        mask = np.concatenate([np.asarray(s["student_loss_mask"], dtype=bool) for s in row])
        loss_mask[r, : len(mask)] = torch.from_numpy(mask)
    chunks = [_chunk_batch(rows, f"teacher{k}") for k in range(n_teachers)]
    return Batch(models, loss_mask, chunks, [[s["sample_id"] for s in row] for row in rows])


def _model_batch(rows: list[list[list[int]]], multiple: int = 1) -> ModelBatch:
    width = -(-max(sum(len(ids) for ids in row) for row in rows) // multiple) * multiple
    shape = (len(rows), width)
    input_ids = np.zeros(shape, dtype=np.int64)
    positions = np.zeros(shape, dtype=np.int64)
    segments = np.full(shape, -1, dtype=np.int64)
    for r, row in enumerate(rows):
        cursor = 0
        for k, ids in enumerate(row):
            n = len(ids)
            input_ids[r, cursor : cursor + n] = ids
            positions[r, cursor : cursor + n] = np.arange(n)
            segments[r, cursor : cursor + n] = k
            cursor += n
    return ModelBatch(*(torch.from_numpy(a) for a in (input_ids, positions, segments)))


def _chunk_batch(rows: list[list[dict]], name: str) -> ChunkBatch:
    keys = ("row", "s", "t", "shape", "region", "flags", "sample")
    parts: dict[str, list[np.ndarray]] = {k: [] for k in keys}
    kinds: set[bool] = set()
    n_samples = 0
    for r, row in enumerate(rows):
        s_base = t_base = 0
        for sample in row:
            student_ids = np.asarray(sample["student_ids"], dtype=np.int64)
            teacher_ids = np.asarray(sample[f"{name}_ids"], dtype=np.int64)
            same = sample[f"{name}_chunk_s0"] is None
            kinds.add(same)
            if same:
                if len(teacher_ids) != len(student_ids):
                    raise DataError(
                        f"sample {sample['sample_id']}: {name} is stored as a same-tokenizer "
                        f"teacher but has {len(teacher_ids)} tokens, the student "
                        f"{len(student_ids)}; the prepared data is damaged. Prepare it again."
                    )
                s = np.arange(len(student_ids), dtype=np.int64)
                s0, s1, t0, t1 = s + s_base, s + s_base + 1, s + t_base, s + t_base + 1
                flags = np.asarray(sample[f"{name}_chunk_flags"], dtype=np.uint8)
                flags = np.where(teacher_ids == student_ids, flags, flags & (0xFF ^ FLAG_CORRECT))
            else:
                s0 = np.asarray(sample[f"{name}_chunk_s0"], dtype=np.int64) + s_base
                s1 = np.asarray(sample[f"{name}_chunk_s1"], dtype=np.int64) + s_base
                t0 = np.asarray(sample[f"{name}_chunk_t0"], dtype=np.int64) + t_base
                t1 = np.asarray(sample[f"{name}_chunk_t1"], dtype=np.int64) + t_base
                flags = np.asarray(sample[f"{name}_chunk_flags"], dtype=np.uint8)
            parts["row"].append(np.full(len(s0), r, dtype=np.int64))
            parts["s"].append(np.stack([s0, s1], axis=1))
            parts["t"].append(np.stack([t0, t1], axis=1))
            parts["shape"].append(np.asarray(sample[f"{name}_chunk_shape"], dtype=np.uint8))
            parts["region"].append(np.asarray(sample[f"{name}_chunk_region"], dtype=np.uint8))
            parts["flags"].append(flags.astype(np.uint8))
            parts["sample"].append(np.full(len(s0), n_samples, dtype=np.int64))
            n_samples += 1
            s_base += len(student_ids)
            t_base += len(teacher_ids)
    if len(kinds) > 1:
        raise DataError(
            f"the batch mixes samples prepared with {name} as a same-tokenizer teacher and as an "
            f"aligned one; batch rows of one prepared dataset (one set of tokenizers)."
        )

    def cat(key: str, empty_shape: tuple[int, ...], dtype) -> torch.Tensor:
        arrays = parts[key]
        return torch.from_numpy(np.concatenate(arrays) if arrays else np.zeros(empty_shape, dtype))

    flags = cat("flags", (0,), np.uint8)
    need = FLAG_CORRECT | FLAG_PREDICTION | FLAG_KD
    return ChunkBatch(
        cat("row", (0,), np.int64),
        cat("s", (0, 2), np.int64),
        cat("t", (0, 2), np.int64),
        cat("shape", (0,), np.uint8),
        cat("region", (0,), np.uint8),
        (flags & need) == need,
        flags,
        cat("sample", (0,), np.int64),
        same_tokenizer=kinds == {True},
    )
