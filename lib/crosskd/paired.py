"""Whether one model's held-out bits per byte really differ from another's: a paired bootstrap
over documents.

Two models scored on the same held-out documents (:func:`crosskd.evaluate.evaluate` writes each
document's bits and bytes) differ by ``bpb_a - bpb_b``, each the ratio of summed bits to summed
bytes. Documents differ far more from one another than two models differ on one document, so
the spread of either figure over documents says little about their difference; resampling
the documents, and computing both figures on the same resample, does. With several seeds
(runs of each arm that differ in their data order or initialisation, scored on the same
documents), the statistic is the mean over seeds of the per-seed difference, and a resample
draws the same documents for every seed: documents are the unit, seeds are averaged.

The two models may have different tokenizers: each document's bytes are its own model's
(the targets' UTF-8 bytes, equal unless a tokenizer clipped the document elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from crosskd.errors import ConfigError

_CHUNK = 1024
"""Resamples drawn at once (memory: ``_CHUNK x documents`` indices)."""


@dataclass(frozen=True)
class PairedDifference:
    """``bpb_a - bpb_b`` (bits per byte) over the same documents, and how sure it is."""

    difference: float
    """The mean over seeds of ``bpb_a - bpb_b`` on all the documents (negative: ``a`` is
    better)."""
    relative: float
    """``difference`` divided by the mean of ``bpb_b`` over seeds."""
    low: float
    """Lower end of the bootstrap's central interval of the difference (``level``)."""
    high: float
    """Upper end of that interval."""
    p_value: float
    """Two-sided bootstrap p-value of "no difference": twice the share of resamples on the
    far side of zero from ``difference`` (counted as ``(n + 1) / (samples + 1)``), at most 1."""
    documents: int
    """Documents per seed."""
    seeds: int
    """Seeds averaged."""
    samples: int
    """Bootstrap resamples."""


def _seeds_by_documents(name: str, values: np.ndarray | list) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim == 1:
        array = array[None, :]
    if array.ndim != 2 or array.shape[1] == 0:
        raise ConfigError(
            f"{name} has shape {array.shape}; give one value per document, as [documents] or "
            f"[seeds, documents]."
        )
    return array


def paired_bootstrap(
    bits_a: np.ndarray | list,
    bytes_a: np.ndarray | list,
    bits_b: np.ndarray | list,
    bytes_b: np.ndarray | list,
    *,
    samples: int = 10_000,
    level: float = 0.95,
    seed: int = 0,
) -> PairedDifference:
    """The paired bootstrap (module docstring) of model ``a`` against model ``b``: each argument
    is ``[documents]`` (one seed) or ``[seeds, documents]`` of bits (float) or UTF-8 bytes (int),
    the same documents in the same order in all four; ``samples`` resamples of the documents
    (``seed`` seeds their draw), ``level`` the interval's coverage. Mismatched shapes, or a
    resample with no bytes, are a :class:`ConfigError`."""
    arrays = {
        name: _seeds_by_documents(name, values)
        for name, values in (
            ("bits_a", bits_a),
            ("bytes_a", bytes_a),
            ("bits_b", bits_b),
            ("bytes_b", bytes_b),
        )
    }
    shapes = {array.shape for array in arrays.values()}
    if len(shapes) != 1:
        raise ConfigError(
            "bits_a, bytes_a, bits_b and bytes_b have shapes "
            f"{', '.join(str(a.shape) for a in arrays.values())}; give each the same seeds and "
            f"documents in the same order."
        )
    if not 0 < level < 1 or samples < 1:
        raise ConfigError(f"level {level} and samples {samples}: give 0 < level < 1, samples >= 1.")
    if (arrays["bytes_a"] <= 0).any() or (arrays["bytes_b"] <= 0).any():
        raise ConfigError("a document has no bytes; drop empty documents before comparing.")
    (n_seeds, n_docs) = shapes.pop()
    full = _difference(arrays, np.arange(n_docs)[None, :])[0]
    rng = np.random.default_rng(seed)
    draws = []
    for start in range(0, samples, _CHUNK):
        index = rng.integers(0, n_docs, size=(min(_CHUNK, samples - start), n_docs))
        draws.append(_difference(arrays, index))
    resampled = np.concatenate(draws)
    tail = (1 - level) / 2
    low, high = np.quantile(resampled, [tail, 1 - tail])
    far = (resampled >= 0).sum() if full < 0 else (resampled <= 0).sum()
    p_value = min(1.0, 2 * (int(far) + 1) / (samples + 1))
    b_mean = float((arrays["bits_b"].sum(1) / arrays["bytes_b"].sum(1)).mean())
    return PairedDifference(
        difference=float(full),
        relative=float(full) / b_mean,
        low=float(low),
        high=float(high),
        p_value=p_value,
        documents=n_docs,
        seeds=n_seeds,
        samples=samples,
    )


def _difference(arrays: dict[str, np.ndarray], index: np.ndarray) -> np.ndarray:
    """``[R]`` mean over seeds of ``bpb_a - bpb_b`` on each row of document indices
    ``index`` ``[R, documents]``."""

    def bpb(bits: np.ndarray, n_bytes: np.ndarray) -> np.ndarray:
        return bits[:, index].sum(-1) / n_bytes[:, index].sum(-1)  # [seeds, R]

    a = bpb(arrays["bits_a"], arrays["bytes_a"])
    b = bpb(arrays["bits_b"], arrays["bytes_b"])
    return (a - b).mean(0)
