"""Aligning two tokenizations of the same text into chunks (spec section 2)."""

from crosskd.alignment.core import (
    SHAPE_1_1,
    SHAPE_1_N,
    SHAPE_N_1,
    SHAPE_N_M,
    SHAPE_NAMES,
    SHAPE_SPECIAL,
    Chunks,
    Tokenized,
    align,
    tokenize,
)

__all__ = [
    "SHAPE_1_1", "SHAPE_1_N", "SHAPE_NAMES", "SHAPE_N_1", "SHAPE_N_M", "SHAPE_SPECIAL", "Chunks",
    "Tokenized", "align", "tokenize",
]  # fmt: skip
