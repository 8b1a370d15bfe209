"""The projection file: X-Token's sparse student-to-teacher matrix ``W`` in safetensors.

``W`` is ``[V_S, V_T]``: row ``s`` spreads student token ``s`` over the teacher tokens that
spell it (:mod:`crosskd.projection.build`), so a student distribution ``p [V_S]`` projects to
``p @ W [V_T]``. It is stored as CSR rows: ``offsets`` int64 ``[V_S + 1]``, ``columns`` int32
(teacher ids, by decreasing weight within a row, ties by id) and ``weights`` float32 (each
non-empty row sums to 1; a row with no teacher counterpart is empty). Metadata
(:class:`ProjectionMeta`): both tokenizers' names, fingerprints and ``V``, the build's
``top_k`` and ``chain_cut``, format and builder versions.

Files are never pickled and never unpickled (a pickle or ``torch.save`` file, which is what
X-Token's own tool writes, is refused before anything is parsed); writes go to a hidden
temporary name and are published by rename (:func:`crosskd.artifacts.write_whole`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import fsspec
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load, save

from crosskd import ragged
from crosskd.artifacts import write_whole
from crosskd.errors import TableError
from crosskd.tables.format import PICKLE_MAGIC, parse_metadata, read_metadata

if TYPE_CHECKING:
    from crosskd.tokenization import LoadedTokenizer

FORMAT_VERSION = 1
BUILDER_VERSION = "crosskd-projection-1"
ROW_SUM_TOLERANCE = 1e-5
"""How far from 1 a non-empty row's float32 weights may sum."""
REBUILD = "Rebuild it with `crosskd projection build`."


@dataclass(frozen=True)
class ProjectionMeta:
    """What every projection file records about the pair it maps and how it was built."""

    student_name: str
    teacher_name: str
    student_fingerprint: str
    teacher_fingerprint: str
    student_vocab_size: int
    teacher_vocab_size: int
    top_k: int
    chain_cut: int
    format_version: int = FORMAT_VERSION
    builder_version: str = BUILDER_VERSION

    def to_metadata(self) -> dict[str, str]:
        """The safetensors ``__metadata__`` (all values strings)."""
        return {key: str(value) for key, value in asdict(self).items()}

    @classmethod
    def from_metadata(cls, metadata: dict[str, str] | None, where: str) -> ProjectionMeta:
        """Parse and check the metadata of the file at ``where``."""
        return parse_metadata(cls, metadata, f"projection {where}", REBUILD)


@dataclass(frozen=True, eq=False)
class Projection:
    """The matrix ``W`` (shapes in the module docstring) and its metadata."""

    offsets: np.ndarray
    columns: np.ndarray
    weights: np.ndarray
    meta: ProjectionMeta
    source: str = "<memory>"

    def row(self, student_id: int) -> tuple[np.ndarray, np.ndarray]:
        """Teacher ids (int32) and weights (float32) of ``student_id``'s row."""
        span = slice(self.offsets[student_id], self.offsets[student_id + 1])
        return self.columns[span], self.weights[span]

    @cached_property
    def lengths(self) -> np.ndarray:
        """Entries of every row, int64 ``[V_S]``."""
        return np.diff(self.offsets)

    @cached_property
    def by_teacher(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``W`` by columns (CSC): ``(offsets int64 [V_T + 1], student ids int64, weights
        float64)``; the student ids of teacher id ``t`` (ascending) are
        ``ids[offsets[t]:offsets[t + 1]]``."""
        rows = np.repeat(np.arange(len(self.lengths), dtype=np.int64), self.lengths)
        order = np.lexsort((rows, self.columns))
        counts = np.bincount(self.columns, minlength=self.meta.teacher_vocab_size)
        offsets = ragged.offsets_from_lengths(counts)
        return offsets, rows[order], self.weights[order].astype(np.float64)

    def check_tokenizers(self, student: LoadedTokenizer, teacher: LoadedTokenizer) -> None:
        """Refuse (with :class:`~crosskd.errors.TableError`) tokenizers other than those ``W``
        was built for, naming the file, the side and both fingerprints."""
        for side, tok, name, fingerprint in (
            ("student", student, self.meta.student_name, self.meta.student_fingerprint),
            ("teacher", teacher, self.meta.teacher_name, self.meta.teacher_fingerprint),
        ):
            if tok.fingerprint != fingerprint:
                raise TableError(
                    f"projection {self.source} was built for a {side} tokenizer with "
                    f"fingerprint {fingerprint[:12]} ({name}), but {tok.name} has "
                    f"{tok.fingerprint[:12]}; build it from this teacher's tables (`crosskd "
                    f"projection build`)."
                )

    def to_dense(self) -> np.ndarray:
        """``W`` as a dense float64 ``[V_S, V_T]`` array (small vocabularies: tests)."""
        dense = np.zeros((self.meta.student_vocab_size, self.meta.teacher_vocab_size))
        rows = np.repeat(np.arange(len(self.lengths)), self.lengths)
        dense[rows, self.columns] = self.weights
        return dense


def save_projection(projection: Projection, uri: str) -> Projection:
    """Write ``projection`` to a local path or fsspec URI whole or not at all; returns it with
    ``source`` set to ``uri``."""
    payload = save(
        {
            "offsets": projection.offsets,
            "columns": projection.columns,
            "weights": projection.weights,
        },
        metadata=projection.meta.to_metadata(),
    )
    fs, path = fsspec.core.url_to_fs(uri)
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    write_whole(fs, path, payload)
    return Projection(
        projection.offsets, projection.columns, projection.weights, projection.meta, uri
    )


def load_projection(uri: str) -> Projection:
    """Read a projection from a local path or fsspec URI and check its structure
    (:func:`check_structure`); refuses a missing, pickled, truncated or damaged file with a
    :class:`~crosskd.errors.TableError` that says what to do."""
    fs, path = fsspec.core.url_to_fs(uri)
    if not fs.exists(path):
        raise TableError(
            f"projection {uri}: no such file; build it with `crosskd projection build`."
        )
    payload = fs.cat_file(path)
    try:
        metadata = read_metadata(payload)
        tensors = load(payload)
    except (SafetensorError, ValueError) as exc:
        if payload.startswith(PICKLE_MAGIC):
            raise TableError(
                f"projection {uri}: this is a pickle or torch.save file (X-Token's own tool "
                f"writes those); crosskd never unpickles (it can run arbitrary code). {REBUILD}"
            ) from None
        raise TableError(
            f"projection {uri}: not a readable safetensors file ({exc}); it may be truncated "
            f"or another format. {REBUILD}"
        ) from exc
    meta = ProjectionMeta.from_metadata(metadata, uri)
    projection = Projection(
        tensors.get("offsets"), tensors.get("columns"), tensors.get("weights"), meta, uri
    )
    check_structure(projection)
    return projection


def check_structure(projection: Projection) -> None:
    """Tensors present with the right dtypes and shapes; offsets a CSR pointer array; teacher
    ids in range and unique within a row; weights finite and positive; every non-empty row
    summing to 1 (within :data:`ROW_SUM_TOLERANCE`)."""
    where = f"projection {projection.source}"
    expected = {"offsets": np.int64, "columns": np.int32, "weights": np.float32}
    for name, dtype in expected.items():
        value = getattr(projection, name)
        if value is None:
            raise TableError(f"{where}: tensor {name!r} is missing. {REBUILD}")
        if value.dtype != dtype or value.ndim != 1:
            raise TableError(
                f"{where}: tensor {name!r} is {value.dtype}{list(value.shape)}, expected 1-D "
                f"{np.dtype(dtype)}. {REBUILD}"
            )
    meta, offsets = projection.meta, projection.offsets
    n = len(projection.columns)
    if len(offsets) != meta.student_vocab_size + 1 or offsets[0] != 0 or offsets[-1] != n:
        raise TableError(
            f"{where}: {len(offsets)} offsets running from {offsets[:1].tolist()} to "
            f"{offsets[-1:].tolist()} for {meta.student_vocab_size} student rows and {n} "
            f"entries (expected {meta.student_vocab_size + 1} offsets from 0 to {n}). {REBUILD}"
        )
    if len(projection.weights) != n or np.any(np.diff(offsets) < 0):
        raise TableError(
            f"{where}: {len(projection.weights)} weights for {n} teacher ids, or offsets that "
            f"decrease; the file is damaged. {REBUILD}"
        )
    rows = np.repeat(np.arange(meta.student_vocab_size), np.diff(offsets))
    problems = {
        f"teacher ids outside [0, {meta.teacher_vocab_size})": rows[
            (projection.columns < 0) | (projection.columns >= meta.teacher_vocab_size)
        ],
        "weights that are not finite and > 0": rows[
            ~(np.isfinite(projection.weights) & (projection.weights > 0))
        ],
    }
    pairs = rows * np.int64(meta.teacher_vocab_size) + projection.columns
    unique, counts = np.unique(pairs, return_counts=True)
    problems["a teacher id twice"] = unique[counts > 1] // meta.teacher_vocab_size
    sums = np.bincount(rows, projection.weights.astype(np.float64), meta.student_vocab_size)
    filled = np.diff(offsets) > 0
    problems["weights that do not sum to 1"] = np.flatnonzero(
        filled & (np.abs(sums - 1.0) > ROW_SUM_TOLERANCE)
    )
    for what, bad in problems.items():
        if len(bad):
            first = np.unique(bad)[:5].tolist()
            raise TableError(
                f"{where}: {len(np.unique(bad))} student rows have {what} (first rows: "
                f"{first}). {REBUILD}"
            )
