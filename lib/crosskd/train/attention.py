"""Attention inputs of packed rows, one kind per attention implementation.

A packed row holds several samples; each token may attend only to earlier tokens of its own
sample, and the forward of a packed row must give what each sample alone would. The
implementations of transformers read the mask differently, so each gets what it expects:

* ``eager`` *adds* the mask to the attention scores: an additive float mask ``[B, 1, L, L]`` in
  the model's dtype (0 where allowed, the dtype's minimum elsewhere; a boolean mask would be
  added as 1/0, and a packed row would differ from its samples alone);
* ``sdpa`` takes a boolean mask ``[B, 1, L, L]`` (True where allowed);
* ``flash_attention_2`` / ``flash_attention_3``: no mask; the samples are delimited by
  ``position_ids`` restarting at 0 (the varlen kernels), which also avoids the ``O(L^2)`` mask.
  transformers derives the sample boundaries from ``position_ids`` only for a batch of one row,
  with no mask and no cache, so the batch is flattened to ``[1, B * L]`` (padding tokens sit at
  position 0: each is a sequence of its own) and every forward passes ``use_cache=False``; the
  caller reshapes the logits back to ``[B, L, V]``.

Padding (``segment_ids`` -1) attends to itself only, so no row of a mask is empty; its logits
are never read.

Under context parallelism (``window``) the inputs are a window of positions ``[start, stop)``
of each row and the mask holds that window's rows over the whole row, ``[B, 1, stop - start,
L]`` (:mod:`crosskd.train.context_parallel`).
"""

from __future__ import annotations

import torch

from crosskd.errors import ConfigError

FLASH = ("flash_attention_2", "flash_attention_3")


def packed_inputs(
    implementation: str, input_ids: torch.Tensor, segment_ids: torch.Tensor,
    position_ids: torch.Tensor, dtype: torch.dtype, window: tuple[int, int] | None = None,
) -> dict[str, torch.Tensor | None]:  # fmt: skip
    """The ``input_ids`` / ``attention_mask`` / ``position_ids`` keyword arguments of a packed
    batch for the attention ``implementation``; ``input_ids``, ``segment_ids`` (sample index
    within the row, -1 in padding) and ``position_ids`` (position within the sample) are int64
    ``[B, L]``, ``dtype`` the model's parameter dtype (for the additive mask). The logits of
    the forward have ``B * L`` rows in order: reshape them to ``[B, L, V]``. ``window``: only
    positions ``[start, stop)`` as queries (module docstring; not with flash attention)."""
    if implementation in FLASH:
        if window is not None:
            raise ConfigError(f"attn_implementation {implementation!r} runs a micro-batch as "
                              f"one row; windows of positions need eager or sdpa attention.")
        return {"input_ids": input_ids.reshape(1, -1), "attention_mask": None,
                "position_ids": position_ids.reshape(1, -1)}  # fmt: skip
    width = segment_ids.shape[1]
    start, stop = window if window is not None else (0, width)
    device = segment_ids.device
    query = torch.arange(start, stop, device=device)[:, None]
    keys = torch.arange(width, device=device)[None, :]
    queries = segment_ids[:, start:stop]
    allowed = (queries[:, :, None] == segment_ids[:, None, :]) & (keys <= query)
    allowed &= (segment_ids >= 0)[:, None, :]
    allowed |= keys == query
    input_ids, position_ids = input_ids[:, start:stop], position_ids[:, start:stop]
    if implementation == "sdpa":
        mask = allowed[:, None]
    elif implementation == "eager":
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        mask = mask[:, None]
    else:
        raise ConfigError(
            f"attn_implementation {implementation!r}: packed rows are exact only with eager, "
            f"sdpa, {', '.join(FLASH)}; set attn_implementation to one of them."
        )
    return {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids}
