"""Aligning two tokenizations of the same text into chunks (spec section 2): the walker
(:mod:`~crosskd.alignment.core`), plain-text and chat samples (:mod:`~crosskd.alignment.sample`,
:mod:`~crosskd.alignment.chat`)."""

from crosskd.alignment.chat import (
    CHATML_FALLBACK,
    ChatOptions,
    align_chat,
    harmonize_reasoning,
    render,
    split_reasoning,
)
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
    align_many,
    tokenize,
)
from crosskd.alignment.sample import (
    REGIONS,
    AlignedSample,
    Rendered,
    align_text,
    align_texts,
    render_text,
    render_texts,
    rendered_text,
)

__all__ = [
    "CHATML_FALLBACK",
    "REGIONS",
    "SHAPE_1_1",
    "SHAPE_1_N",
    "SHAPE_NAMES",
    "SHAPE_N_1",
    "SHAPE_N_M",
    "SHAPE_SPECIAL",
    "AlignedSample",
    "ChatOptions",
    "Chunks",
    "Rendered",
    "Tokenized",
    "align",
    "align_chat",
    "align_many",
    "align_text",
    "align_texts",
    "harmonize_reasoning",
    "render",
    "render_text",
    "render_texts",
    "rendered_text",
    "split_reasoning",
    "tokenize",
]
