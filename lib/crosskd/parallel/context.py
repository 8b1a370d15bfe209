"""Context parallelism of the decoder (``parallel.cp``): each of the ``cp`` ranks of a
data-parallel shard runs every decoder layer on its own window of ``L / cp`` positions of each
row, and attention sees the whole row by all-gathering the keys and values.

Everything in a decoder layer but attention works position by position, so a window's hidden
states need nothing from the other windows; attention needs every earlier key and value of the
row. Each attention layer therefore all-gathers its keys and values (after the rotary
embedding, which each rank applied at its own positions) over the ``cp`` group and attends its
window's queries to the whole row through the packed-row mask's rows of the window
(:func:`crosskd.parallel.attention.packed_inputs` with ``window``). In the backward pass the
gradient of the gathered keys and values is summed over the ranks and each keeps its window's
part. This is the all-gather form of context parallelism (as in Llama 3's training): exact, and
the same on gloo and NCCL; each rank holds a row's keys and values for one layer at a time.
The gradients of the weights are then partial on each ``cp`` rank (its window's share), and
:meth:`crosskd.parallel.parallelize.ParallelStudent.sync_copies` sums them over the ``cp`` ranks.

The attention is hooked in through transformers' attention registry (the ``crosskd_cp``
implementation), so it applies to any model that dispatches attention through it (Llama, Qwen,
Mistral, Gemma, ...); over the gathered keys it computes with the model's own implementation
(``sdpa``, or the model's ``eager_attention_forward``) and each layer's own mask (a sliding
window's band included). Refused: models with mixers that carry state along the positions (a
window would start from an empty state: :func:`crosskd.parallel.attention.refuse_state_mixers`),
rotary embeddings whose frequencies depend on the longest position a forward pass sees
(``dynamic``, ``longrope``: each window would rotate with other frequencies), and a call
without the window's 4D mask (transformers would then make one for the window's own keys only).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import Tensor, nn

from crosskd.errors import ConfigError
from crosskd.parallel.attention import refuse_state_mixers

IMPLEMENTATION = "crosskd_cp"
"""The name of the context-parallel attention in transformers' attention registry."""
POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")
"""Rotary embedding types whose frequencies depend on the positions of the forward pass."""


class _GatherPositions(torch.autograd.Function):
    """All-gather along the positions (dimension 2 of ``[B, H, L / cp, D]``) over a group;
    backward: the gradient summed over the group, this rank's window of it."""

    @staticmethod
    def forward(ctx, tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        ctx.width = tensor.shape[2]
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        total = grad.contiguous()
        dist.all_reduce(total, group=ctx.group)  # gloo has no reduce-scatter
        start = ctx.rank * ctx.width
        return total[:, :, start : start + ctx.width], None


def context_parallel_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """Attention of this window's ``query`` ``[B, H, L / cp, D]`` to the whole row: ``key`` and
    ``value`` ``[B, H_kv, L / cp, D]`` gathered over ``module.context_group``, then
    ``module.context_attention`` (the model's own implementation); ``attention_mask``: the
    window's rows of the packed mask ``[B, 1, L / cp, L]``."""
    key = _GatherPositions.apply(key, module.context_group)
    value = _GatherPositions.apply(value, module.context_group)
    if (
        attention_mask is None
        or attention_mask.dim() != 4
        or (attention_mask.shape[-1] != key.shape[2])
    ):
        shape = None if attention_mask is None else tuple(attention_mask.shape)
        raise ValueError(
            f"context-parallel attention got the mask {shape}; it needs the window's rows of "
            f"the whole row's mask, [B, 1, L / cp, {key.shape[2]}] "
            f"(crosskd.parallel.attention.packed_inputs with window)."
        )
    return module.context_attention(module, query, key, value, attention_mask, **kwargs)


def enable_context_parallel(
    model: nn.Module, layers: list[nn.Module], group: dist.ProcessGroup
) -> None:
    """Make the attention of each decoder layer of ``layers`` (its submodules whose class name
    ends in ``Attention``, transformers' convention) context-parallel over ``group`` (module
    docstring). The model must then be called on a window of positions with the window's rows
    of the packed mask."""
    # lazy: transformers' attention registry costs ~2 s over torch; every pipeline step imports
    # crosskd.steps, which imports this module (through the trainer), and only cp > 1 needs it
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    name = type(model).__name__
    rope = (
        getattr(model.config, "rope_parameters", None)
        or getattr(model.config, "rope_scaling", None)
        or {}
    )
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in POSITION_DEPENDENT_ROPE:
        raise ConfigError(
            f"{name} uses {rope_type!r} rotary embeddings, whose frequencies depend on the "
            f"longest position of a forward pass, so windows of a row would rotate differently; "
            f"train it with parallel.cp=1."
        )
    refuse_state_mixers(
        model,
        "the windows of parallel.cp (each would start from an empty state)",
        "train it with parallel.cp=1",
    )
    base = model.config._attn_implementation
    if base not in ("sdpa", "eager"):
        raise ConfigError(
            f"parallel.cp runs {name}'s attention over gathered keys with its sdpa or eager "
            f"attention; it has {base!r} (flash attention runs a micro-batch as one row). Set "
            f"attn_implementation to sdpa or eager."
        )
    for layer in layers:
        attention = [m for m in layer.modules() if type(m).__name__.endswith("Attention")]
        if not attention:
            raise ConfigError(
                f"{name}'s decoder layer {type(layer).__name__} has no attention module (a "
                f"class named *Attention), so it cannot be split over positions; train it with "
                f"parallel.cp=1."
            )
        for module in attention:
            function = (
                sdpa_attention_forward
                if base == "sdpa"
                else getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
            )
            if function is None:
                raise ConfigError(
                    f"{type(module).__name__}'s module has no eager_attention_forward to run "
                    f"over gathered keys under parallel.cp; set attn_implementation to sdpa."
                )
            module.context_group = group
            module.context_attention = function
    AttentionInterface.register(IMPLEMENTATION, context_parallel_attention)
    model.config._attn_implementation = IMPLEMENTATION
