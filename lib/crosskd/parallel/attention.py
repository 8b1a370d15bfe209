"""Attention inputs of packed rows, one kind per attention implementation and per kind of layer.

A packed row holds several samples; each token may attend only to earlier tokens of its own
sample, and the forward of a packed row must give what each sample alone would. The
implementations of transformers read the mask differently, so each gets what it expects:

* ``eager`` *adds* the mask to the attention scores: an additive float mask ``[B, 1, L, L]`` in
  the model's dtype (0 where allowed, the dtype's minimum elsewhere; a boolean mask would be
  added as 1/0, and a packed row would differ from its samples alone);
* ``sdpa`` takes a boolean mask ``[B, 1, L, L]`` (True where allowed);
* ``flash_attention_2`` / ``flash_attention_3``: no mask; the batch is flattened to ``[1, B *
  L]`` (padding tokens sit at position 0: each is a sequence of its own) and the samples are
  delimited by ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32 ``[S + 1]``, the offsets of the
  ``S`` sequences, read from ``position_ids`` restarting at 0) and ``max_length_q`` /
  ``max_length_k`` (the longest, an int), computed here once per micro-batch on the host from
  the collator's CPU tensors: transformers would otherwise find them in ``position_ids`` in
  every layer, with a device synchronisation each time (its mask builder still looks at
  ``position_ids`` once per forward pass). The varlen kernels apply each layer's
  own sliding window. Every forward passes ``use_cache=False``; the caller reshapes the logits
  back to ``[B, L, V]``.

Sliding-window layers (Mistral, Gemma 2/3, Qwen2 with a window, Phi-3): transformers passes a
prepared 4D mask through unchanged to every layer, so such a layer would see its whole sample.
:func:`layer_windows` reads from the model's config the window of each layer type (a query
sees the ``window`` latest positions of its sample, itself included, as transformers'
``sliding_window_overlay``) and :func:`packed_inputs` gives each its own banded mask: a single
mask when every layer has the same window (Mistral: all sliding), else a dict keyed by layer
type, which models with mixed layers (``config.layer_types``) take in place of the masks they
would build.

Models with mixers that carry state along the positions (a causal convolution or a state-space
or linear-attention recurrence: LFM2, Falcon-H1, Jamba, Zamba, Granite-4-H, Qwen3-Next) ignore
any mask, so a packed row's second sample would start from the first one's state and a
context-parallel window from an empty one: :func:`state_mixers` names them and
:func:`refuse_state_mixers` refuses such a model for packed rows or ``parallel.cp`` > 1. Rows
of one sample each (data prepared with ``pack=false``) are exact for them: the right padding
comes after the sample, and such rows get the 2D padding mask, from which the model builds
each of its layer types' own masks (``packed=False``).

Padding (``segment_ids`` -1) attends to itself only, so no row of a mask is empty; its logits
are never read.

Under context parallelism (``window``) the inputs are a window of positions ``[start, stop)``
of each row and the mask holds that window's rows over the whole row, ``[B, 1, stop - start,
L]`` (:mod:`crosskd.parallel.context`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from crosskd.errors import ConfigError
from crosskd.transfer import to_device

FLASH = ("flash_attention_2", "flash_attention_3")
ATTENTION_LAYERS = ("full_attention", "sliding_attention")
"""The layer types (``config.layer_types``) whose masks :func:`packed_inputs` builds."""
STATE_LAYERS = ("linear_attention",)
"""Layer types named like attention that are recurrences (:func:`state_mixers`)."""
EVERY_LAYER = ""
"""The key of :func:`layer_windows` for a config without ``layer_types`` (one kind of layer)."""


def layer_windows(config) -> dict[str, int | None]:
    """The sliding window (positions a query sees, itself included) of each layer type of a
    transformers model ``config``, None for full causal attention: ``{"full_attention": None,
    "sliding_attention": config.sliding_window}`` for models with ``layer_types``, and
    ``{EVERY_LAYER: config.sliding_window}`` otherwise (every layer of Mistral or Phi-3 slides
    when ``sliding_window`` is set). Layer types that are not attention are left out (they are
    refused for packed rows by :func:`refuse_state_mixers`)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not types:
        return {EVERY_LAYER: window}
    unknown = sorted(
        {t for t in types if t.endswith("attention")} - set(ATTENTION_LAYERS) - set(STATE_LAYERS)
    )
    if unknown:
        raise ConfigError(
            f"{config.model_type} has layers of type {', '.join(unknown)}, whose attention "
            f"pattern the masks of packed rows and context-parallel windows do not reproduce "
            f"(exact: {', '.join(ATTENTION_LAYERS)}); train it on data prepared with "
            f"pack=false (one sample per row) and parallel.cp=1."
        )
    return {
        t: window if t == "sliding_attention" else None
        for t in dict.fromkeys(types)
        if t in ATTENTION_LAYERS
    }


def state_mixers(model: nn.Module) -> list[str]:
    """What in ``model`` carries state along the positions past any attention mask: its layer
    types that are not attention (``config.layer_types``: ``conv``, ``linear_attention``,
    ``mamba``, ``hybrid``, ...) and its causal convolutions (the ``nn.Conv1d`` over positions of
    short-convolution, Mamba and gated-delta-net mixers); empty for attention-only models."""
    types = getattr(model.config, "layer_types", None) or []
    found = [
        f"layer type {t!r}"
        for t in dict.fromkeys(types)
        if t in STATE_LAYERS or not t.endswith("attention")
    ]
    mixers = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if any(isinstance(c, nn.Conv1d) for c in m.children())
        }
    )
    if mixers:
        found.append(f"causal convolutions in {', '.join(mixers)}")
    return found


def refuse_state_mixers(model: nn.Module, why: str, way_out: str) -> None:
    """Raise a one-line :class:`ConfigError` when ``model`` has :func:`state_mixers`:
    ``why`` says what needs attention-only layers (packed rows, ``parallel.cp``), ``way_out``
    what to do instead."""
    found = state_mixers(model)
    if found:
        raise ConfigError(
            f"{model.config.model_type} ({type(model).__name__}) mixes positions outside "
            f"attention ({'; '.join(found)}), whose state would cross {why}; {way_out}."
        )


def _allowed(segment_ids: torch.Tensor, start: int, stop: int, window: int | None) -> torch.Tensor:
    """Bool ``[B, stop - start, L]``: query ``q`` of ``[start, stop)`` may see key ``k``."""
    width = segment_ids.shape[1]
    query = torch.arange(start, stop, device=segment_ids.device)[:, None]
    keys = torch.arange(width, device=segment_ids.device)[None, :]
    queries = segment_ids[:, start:stop]
    visible = keys <= query
    if window is not None and window < width:
        visible &= keys > query - window
    allowed = (queries[:, :, None] == segment_ids[:, None, :]) & visible
    allowed &= (segment_ids >= 0)[:, None, :]
    return allowed | (keys == query)


def _mask(implementation: str, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if implementation == "sdpa":
        return allowed[:, None]
    if implementation == "eager":
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[:, None]
    raise ConfigError(
        f"attn_implementation {implementation!r}: packed rows are exact only with eager, "
        f"sdpa, {', '.join(FLASH)}; set attn_implementation to one of them."
    )


def varlen_bounds(position_ids: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """The flash-attention varlen keywords of ``position_ids`` (int64 ``[B, L]`` on the host,
    restarting at 0 at each sample and at each padding token) flattened to one row:
    ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32 ``[S + 1]``, on the host) and
    ``max_length_q`` / ``max_length_k`` (int)."""
    flat = position_ids.reshape(-1).numpy()
    cuts = np.append(np.flatnonzero(flat == 0), flat.size).astype(np.int32)
    cu = torch.from_numpy(cuts)
    longest = int(np.diff(cuts).max(initial=0))
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }


def packed_inputs(
    implementation: str,
    input_ids: torch.Tensor,
    segment_ids: torch.Tensor,
    position_ids: torch.Tensor,
    dtype: torch.dtype,
    window: tuple[int, int] | None = None,
    windows: Mapping[str, int | None] | None = None,
    device: torch.device | str | None = None,
    *,
    packed: bool = True,
) -> dict[str, object]:
    """The keyword arguments of the forward pass of a packed batch for the attention
    ``implementation``: ``input_ids``, ``attention_mask``, ``position_ids`` (and the varlen
    bounds under flash attention). ``input_ids``, ``segment_ids`` (sample index within the row,
    -1 in padding) and ``position_ids`` (position within the sample) are int64 ``[B, L]`` on
    the host, ``dtype`` the model's parameter dtype (for the additive mask), ``windows`` the
    model's :func:`layer_windows` (default: full attention everywhere), ``device`` where the
    tensors go (default: where ``input_ids`` is; copied without a host synchronisation). The
    logits of the forward have ``B * L`` rows in order: reshape them to ``[B, L, V]``.
    ``window``: only positions ``[start, stop)`` as queries (module docstring; not with flash
    attention). ``packed`` false (rows of one sample each, right-padded) and no ``window``: the
    2D padding mask, from which the model builds every layer type's own mask (exact for any
    model, state-carrying mixers included)."""
    device = input_ids.device if device is None else device
    if not packed and window is None:
        return {
            "input_ids": to_device(input_ids, device),
            "attention_mask": to_device((segment_ids >= 0).long(), device),
        }
    if implementation in FLASH:
        if window is not None:
            raise ConfigError(
                f"attn_implementation {implementation!r} runs a micro-batch as "
                f"one row; windows of positions need eager or sdpa attention."
            )
        bounds = varlen_bounds(position_ids.cpu())
        for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            bounds[key] = to_device(bounds[key], device)
        flat = {
            "input_ids": to_device(input_ids.reshape(1, -1), device),
            "position_ids": to_device(position_ids.reshape(1, -1), device),
        }
        return flat | {"attention_mask": None} | bounds
    windows = {EVERY_LAYER: None} if windows is None else windows
    segment_ids = to_device(segment_ids, device)
    start, stop = window if window is not None else (0, segment_ids.shape[1])
    masks: dict[int | None, torch.Tensor] = {}
    for size in windows.values():
        if size not in masks:
            masks[size] = _mask(implementation, _allowed(segment_ids, start, stop, size), dtype)
    if len(masks) == 1:
        mask: torch.Tensor | dict[str, torch.Tensor] = next(iter(masks.values()))
    else:
        mask = {kind: masks[size] for kind, size in windows.items()}
    return {
        "input_ids": to_device(input_ids[:, start:stop], device),
        "attention_mask": mask,
        "position_ids": to_device(position_ids[:, start:stop], device),
    }
