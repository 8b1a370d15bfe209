"""Writing prepared rows as one Parquet shard (fixed schema, whole packed rows per shard, rows
sorted by packed row, a sha256 per row group in the footer so a reader can fetch row groups
alone: :mod:`crosskd.ranges`).

One row per sample. Columns: ``sample_id``, ``source``, ``row``, ``text`` / ``messages`` (JSON),
``clipped``, ``original_lengths``, ``bin`` (packed row, numbered within the shard), ``student_ids``,
``student_loss_mask`` (CE targets), and per teacher ``k``: ``teacher{k}_ids`` and its chunks
``teacher{k}_chunk_{s0,s1,t0,t1}`` (token ranges within the sample), ``_shape``, ``_flags``
(``FLAG_*`` bits), ``_region``, ``_message``. Every teacher has the same columns. For a
same-tokenizer teacher (:mod:`crosskd.data.prepare`) ``teacher{k}_ids`` copies the student's ids,
the four range columns are null and the other chunk columns hold one entry per student token.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from crosskd.alignment import SHAPE_1_1, SHAPE_SPECIAL, AlignedSample, Rendered
from crosskd.ranges import footer_record, write_parquet

if TYPE_CHECKING:
    from crosskd.alignment.own import StudentTokens
    from crosskd.tokenization import LoadedTokenizer

FLAG_CORRECT, FLAG_PREDICTION, FLAG_KD = 1, 2, 4
"""Bits of the ``chunk_flags`` column."""
ROW_GROUP_SAMPLES = 256
"""Samples per Parquet row group: the unit a reader parses (:mod:`crosskd.data.rows`)."""


@dataclass(frozen=True, eq=False)
class SameTokenizerSample:
    """A same-tokenizer teacher's side of one sample: no chunks. ``teacher`` is the student's
    rendering (its ids are the teacher's), ``loss_mask`` the student's own CE mask, and per
    student token ``shape`` / ``flags`` / ``region`` uint8 and ``message`` int32 (what the
    shards store for it; module docstring)."""

    teacher: Rendered
    loss_mask: np.ndarray
    shape: np.ndarray
    flags: np.ndarray
    region: np.ndarray
    message: np.ndarray


def same_tokenizer_sample(
    student_tok: LoadedTokenizer, student: Rendered, own: StudentTokens
) -> SameTokenizerSample:
    """A same-tokenizer teacher's side of a sample from the student's rendering and
    :func:`crosskd.alignment.own.student_tokens` (module docstring of
    :mod:`crosskd.data.prepare`)."""
    ids = student.tokens.ids
    shape = np.where(np.isin(ids, student_tok.special_ids), SHAPE_SPECIAL, SHAPE_1_1)
    prediction = np.arange(len(ids)) > 0
    flags = FLAG_CORRECT + prediction * FLAG_PREDICTION + own.kd * FLAG_KD
    return SameTokenizerSample(
        student,
        own.loss_mask,
        shape.astype(np.uint8),
        flags.astype(np.uint8),
        own.region,
        own.message,
    )


def schema(n_teachers: int):
    """The Parquet schema of prepared shards (fixed, so shards read together as one dataset)."""
    ints, small = pa.list_(pa.int32()), pa.list_(pa.uint8())
    fields = [
        ("sample_id", pa.string()),
        ("source", pa.string()),
        ("row", pa.int64()),
        ("text", pa.string()),
        ("messages", pa.string()),
        ("clipped", pa.bool_()),
        ("original_lengths", pa.list_(pa.int64())),
        ("bin", pa.int64()),
        ("student_ids", ints),
        ("student_loss_mask", pa.list_(pa.bool_())),
    ]
    for k in range(n_teachers):
        fields += [(f"teacher{k}_ids", ints)]
        fields += [(f"teacher{k}_chunk_{x}", ints) for x in ("s0", "s1", "t0", "t1")]
        fields += [(f"teacher{k}_chunk_{x}", small) for x in ("shape", "flags", "region")]
        fields += [(f"teacher{k}_chunk_message", ints)]
    return pa.schema(fields)


def _columns(rows: list[dict], order: np.ndarray, bin_of: np.ndarray, n_teachers: int) -> dict:
    """Column name -> list of values for the rows in ``order``."""
    names = ["sample_id", "source", "row", "text", "messages", "clipped", "original_lengths"]
    names += ["bin", "student_ids", "student_loss_mask"]
    cols: dict[str, list] = {name: [] for name in names}
    for k in range(n_teachers):
        for suffix in (
            "ids",
            "chunk_s0",
            "chunk_s1",
            "chunk_t0",
            "chunk_t1",
            "chunk_shape",
            "chunk_flags",
            "chunk_region",
            "chunk_message",
        ):
            cols[f"teacher{k}_{suffix}"] = []
    for i in order.tolist():
        row = rows[i]
        record = row["record"]
        cols["sample_id"].append(record.sample_id)
        cols["source"].append(record.source)
        cols["row"].append(record.row)
        cols["text"].append(row["text"])
        cols["messages"].append(None if row["messages"] is None else json.dumps(row["messages"]))
        cols["clipped"].append(bool(row["clipped"]))
        cols["original_lengths"].append(row["original_lengths"])
        cols["bin"].append(int(bin_of[i]))
        cols["student_ids"].append(row["student"].tokens.ids.astype(np.int32))
        cols["student_loss_mask"].append(row["student_loss_mask"])
        for k, aligned in enumerate(row["aligned"]):
            _teacher_columns(cols, f"teacher{k}", aligned)
    return cols


def _teacher_columns(cols: dict, name: str, aligned: AlignedSample | SameTokenizerSample) -> None:
    if not isinstance(aligned, AlignedSample):  # same tokenizer: one entry per student token
        cols[f"{name}_ids"].append(aligned.teacher.tokens.ids.astype(np.int32))
        for suffix in ("s0", "s1", "t0", "t1"):
            cols[f"{name}_chunk_{suffix}"].append(None)
        cols[f"{name}_chunk_shape"].append(aligned.shape)
        cols[f"{name}_chunk_flags"].append(aligned.flags)
        cols[f"{name}_chunk_region"].append(aligned.region)
        cols[f"{name}_chunk_message"].append(aligned.message)
        return
    chunks = aligned.chunks
    flags = (
        chunks.is_correct * FLAG_CORRECT
        + chunks.has_prediction * FLAG_PREDICTION
        + aligned.kd_mask * FLAG_KD
    ).astype(np.uint8)
    cols[f"{name}_ids"].append(aligned.teacher.tokens.ids.astype(np.int32))
    cols[f"{name}_chunk_s0"].append(chunks.student[:, 0].astype(np.int32))
    cols[f"{name}_chunk_s1"].append(chunks.student[:, 1].astype(np.int32))
    cols[f"{name}_chunk_t0"].append(chunks.teacher[:, 0].astype(np.int32))
    cols[f"{name}_chunk_t1"].append(chunks.teacher[:, 1].astype(np.int32))
    cols[f"{name}_chunk_shape"].append(chunks.shape)
    cols[f"{name}_chunk_flags"].append(flags)
    cols[f"{name}_chunk_region"].append(aligned.chunk_region)
    cols[f"{name}_chunk_message"].append(aligned.chunk_message)


def shard_table(rows: list[dict], bins: list[np.ndarray]) -> pa.Table:
    """The shard of prepared samples ``rows`` (:func:`crosskd.data.preparation.prepare_row`) grouped
    by ``bins`` (packed rows: int arrays of sample indices in row order), as an Arrow table of
    :func:`schema`: one row per sample, in packed-row order, ``bin`` numbering the packed rows
    0.. within the shard."""
    bin_of = np.empty(len(rows), dtype=np.int64)
    for b, members in enumerate(bins):
        bin_of[members] = b
    order = np.concatenate(bins)
    n_teachers = len(rows[0]["aligned"])
    return pa.table(_columns(rows, order, bin_of, n_teachers), schema=schema(n_teachers))


def encode_shard(name: str, rows: list[dict], bins: list[np.ndarray]) -> tuple[bytes, dict]:
    """The Parquet bytes of the shard ``name`` of prepared samples ``rows`` grouped by ``bins``
    (:func:`shard_table`), and its record. The bytes depend only on the rows and bins; the
    footer records each row group's sha256 (:func:`crosskd.ranges.write_parquet`) and the least
    and greatest ``bin`` of each row group (the statistics of no other column: they would only
    grow the footer every reader fetches). The record is ``{"path", "rows", "bins", "sha256",
    "bytes", "footer"}`` (``footer``: :func:`crosskd.ranges.footer_record`)."""
    table = shard_table(rows, bins)
    payload = write_parquet(table, row_group_size=ROW_GROUP_SAMPLES, write_statistics=["bin"])
    return payload, {
        "path": name,
        "rows": table.num_rows,
        "bins": len(bins),
        "sha256": hashlib.sha256(payload).hexdigest(),
        "bytes": len(payload),
        **footer_record(payload),
    }
