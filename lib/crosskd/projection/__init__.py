"""X-Token's projection matrix ``W`` (student -> teacher): build it from a sub-token table pair
with :func:`build_projection`, store it with :func:`save_projection`, read it with
:func:`load_projection` and check it against the two tokenizers with
:func:`validate_projection`. The ``xtoken`` loss (:mod:`crosskd.loss.xtoken`) compares the
student with the teacher through it."""

from crosskd.projection.build import CHAIN_CUT, TOP_K, build_projection, chain_weights
from crosskd.projection.format import (
    Projection,
    ProjectionMeta,
    load_projection,
    save_projection,
)
from crosskd.projection.validate import ProjectionReport, summarize, validate_projection

__all__ = [
    "CHAIN_CUT",
    "TOP_K",
    "Projection",
    "ProjectionMeta",
    "ProjectionReport",
    "build_projection",
    "chain_weights",
    "load_projection",
    "save_projection",
    "summarize",
    "validate_projection",
]
