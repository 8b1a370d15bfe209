"""The output layer as an input: the last hidden states and the head's weight and bias, so that
a loss or a scorer computes the logits a block of rows at a time and the ``rows x V`` logits
never exist (the fused output layer).

* :class:`OutputLayer`: hidden states ``[..., H]``, weight ``[V, H]``, bias ``[V]`` or None,
  and the dtype the head computes in (the autocast dtype where the head ran under autocast);
  :meth:`OutputLayer.logits` gives the logits of a block of rows exactly as the head would.
* :class:`OutputHead`: a linear head ``hidden @ weight.T + bias`` that, inside
  :meth:`OutputHead.capture`, hands over its input as an :class:`OutputLayer` and returns
  zero-width logits ``[..., 0]`` instead of computing them. It keeps the head's parameters
  (same objects, same names, tied weights stay tied), so checkpoints, FSDP2 and DDP see the
  model they saw. :func:`use_output_head` puts one in a model's place of its ``nn.Linear`` head.
* :func:`head_output_unchanged`: whether a model returns its head's output unchanged (a
  model that soft-caps or scales its logits after the head, as Gemma 2 does, does not; the
  fused path would then not be exact).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class OutputLayer:
    """The inputs of a linear output layer: ``hidden`` ``[..., H]``, ``weight`` ``[V, H]`` (a
    vocabulary slice ``[V / tp, H]`` under vocabulary parallelism), ``bias`` ``[V]`` or None;
    ``compute_dtype``: the dtype the head's matrix product runs in (None: the operands' own,
    as without autocast). The logits it stands for are ``[..., V]``
    (:meth:`whole_logits`)."""

    hidden: Tensor
    weight: Tensor
    bias: Tensor | None = None
    compute_dtype: torch.dtype | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the logits this layer stands for: ``hidden``'s leading shape, ``V``."""
        return (*self.hidden.shape[:-1], self.weight.shape[0])

    @property
    def device(self) -> torch.device:
        """Where the hidden states are."""
        return self.hidden.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the logits the head returns (the compute dtype, else the weight's)."""
        return self.compute_dtype or torch.promote_types(self.hidden.dtype, self.weight.dtype)

    def flatten(self) -> OutputLayer:
        """The same layer over the hidden states flattened to ``[R, H]``."""
        hidden = self.hidden.reshape(-1, self.hidden.shape[-1])
        return OutputLayer(hidden, self.weight, self.bias, self.compute_dtype)

    def operands(self) -> tuple[Tensor, Tensor | None]:
        """``weight`` and ``bias`` cast to :attr:`dtype` once (for a loop over blocks)."""
        bias = None if self.bias is None else self.bias.to(self.dtype)
        return self.weight.to(self.dtype), bias

    def whole_logits(self) -> Tensor:
        """All the logits ``[..., V]`` at once (``rows x V`` of them: for checks and small
        batches; the fused loss never calls it)."""
        weight, bias = self.operands()
        return F.linear(self.hidden.to(self.dtype), weight, bias)

    def logits(self, start: int, stop: int) -> Tensor:
        """The logits ``[stop - start, V]`` of flat rows ``[start, stop)`` (of a ``[R, H]``
        layer; :meth:`flatten` first), in :attr:`dtype`, as the head computes them."""
        weight, bias = self.operands()
        return F.linear(self.hidden[start:stop].to(self.dtype), weight, bias)


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast computes a matrix product in on ``device`` now (None: autocast off)."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


class OutputHead(nn.Module):
    """A linear output head ``[..., H]`` -> ``[..., V]`` logits, able to hand over its input
    instead (:meth:`capture`). Subclasses change what reaches the product through
    :meth:`prepare` (the vocabulary-parallel head all-reduces its input's gradient)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self._captured: list[OutputLayer] | None = None

    def prepare(self, hidden: Tensor) -> Tensor:
        """The hidden states as the product takes them (here: unchanged)."""
        return hidden

    def forward(self, hidden: Tensor) -> Tensor:
        """Logits ``[..., V]``; inside :meth:`capture`, zero-width logits ``[..., 0]`` of the
        dtype the logits would have (the input is recorded instead)."""
        hidden = self.prepare(hidden)
        if self._captured is None:
            return F.linear(hidden, self.weight, self.bias)
        layer = OutputLayer(hidden, self.weight, self.bias, autocast_dtype(hidden.device))
        self._captured.append(layer)
        return hidden[..., :0].to(layer.dtype)

    @contextlib.contextmanager
    def capture(self) -> Iterator[list[OutputLayer]]:
        """Within the block, every forward call records an :class:`OutputLayer` (with the
        parameters as they are during the call: FSDP2's gathered ones) in the yielded list
        and returns zero-width logits."""
        if self._captured is not None:
            raise RuntimeError("OutputHead.capture is not reentrant")
        self._captured = []
        try:
            yield self._captured
        finally:
            self._captured = None


def use_output_head(model: nn.Module) -> OutputHead:
    """Put an :class:`OutputHead` holding the same parameters in place of ``model``'s output
    head (transformers' ``get_output_embeddings`` / ``set_output_embeddings``); returns it.
    A head that already is one is kept. Raises :class:`TypeError` for a head that is not a
    plain ``nn.Linear``."""
    head = model.get_output_embeddings()
    if isinstance(head, OutputHead):
        return head
    if type(head) is not nn.Linear:
        raise TypeError(f"the output head is a {type(head).__name__}, not an nn.Linear")
    replacement = OutputHead(head.weight, head.bias)
    model.set_output_embeddings(replacement)
    return replacement


@torch.no_grad()
def head_output_unchanged(model: nn.Module) -> str | None:
    """None when ``model``'s forward pass returns exactly what its output head computed (so
    the loss may take the head's input instead of the logits), else why not, in words. Runs
    one forward pass of two tokens on the model's device."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return f"{type(model).__name__} has no output head (get_output_embeddings)"
    if type(head) is not nn.Linear and not isinstance(head, OutputHead):
        return f"its output head is a {type(head).__name__}, not a plain linear layer"
    seen: list[Tensor] = []
    handle = head.register_forward_hook(lambda _module, _args, out: seen.append(out))
    device = head.weight.device
    training = model.training
    model.eval()  # no dropout: the probe draws nothing from the random generators
    try:
        logits = model(input_ids=torch.tensor([[0, 1]], device=device), use_cache=False).logits
    finally:
        handle.remove()
        model.train(training)
    if len(seen) != 1 or seen[0].shape != logits.shape or not torch.equal(seen[0], logits):
        return (
            f"{type(model).__name__} changes its output head's logits before returning them "
            f"(a logit soft-cap or scale, as Gemma 2's final_logit_softcapping)"
        )
    return None
