"""The parallel pieces applied to a plain Hugging Face causal LM, in one place
(:func:`parallelize`), for a :class:`~crosskd.layout.ParallelLayout`.

1. ``tp`` / ``cp`` > 1: the input embedding and the output head become vocabulary-parallel
   (:class:`VocabParallelEmbedding`, :class:`VocabParallelHead`: rank ``t`` keeps rows
   ``[t V / tp, (t + 1) V / tp)``; tied weights stay tied), and the head evaluates only this
   rank's window of ``L / cp`` positions. The decoder layers are replicated over ``cp`` and
   ``tp``; the two conjugate collectives of Megatron-LM keep their gradients whole: the
   embedding's output is all-reduced over ``tp`` in the forward pass (identity backward), the
   head's input all-reduces its gradient over ``cp x tp`` in the backward pass (identity
   forward); the head's weights sum their gradients over the ``cp`` windows. No rank ever
   holds ``rows x V`` logits. The copies of a gradient that several ``cp`` / ``tp`` ranks
   compute are equal in exact arithmetic; :meth:`ParallelStudent.sync_copies` makes them
   bitwise equal (the first copy's, broadcast) before each optimizer step, so that GPU kernels
   that add in a varying order cannot let the copies drift apart.
2. Activation checkpointing of every decoder layer (optional; transformers' own).
3. ``dp_shard`` > 1: FSDP2 (:func:`torch.distributed.fsdp.fully_shard`) on every decoder layer
   and the root over the ``(dp_replicate, dp_shard)`` mesh (HSDP when ``dp_replicate`` > 1),
   computing in ``compute_dtype`` (the trainer: bf16 on GPU) with float32 gradient reduction;
   parameters on the CPU are moved to the device a layer at a time (no rank holds the whole
   model on its device). ``dp_shard`` = 1 and
   ``dp_replicate`` > 1: DDP over the data-parallel ranks.

Both data-parallel wrappers *average* gradients over the data-parallel ranks while each rank's
loss is its share of the step's sum, so the trainer scales its share by ``dp``. Where a tensor
is, globally, is described by :class:`Placement` (for the gradient norm and the checkpoints).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from crosskd.errors import ConfigError
from crosskd.train.mesh import TrainMesh


class _ReduceForward(torch.autograd.Function):
    """All-reduce (sum) over a group in the forward pass, identity in the backward pass."""

    @staticmethod
    def forward(ctx, tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _ReduceBackward(torch.autograd.Function):
    """Identity in the forward pass, all-reduce (sum) of the gradient in the backward pass."""

    @staticmethod
    def forward(ctx, tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        out = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=ctx.group)
        return out, None


class VocabParallelEmbedding(nn.Module):
    """An input embedding holding rows ``[start, start + rows)`` of the vocabulary: ids of
    other ranks look up zeros, and the sum over the ``tp`` group is the whole embedding
    (``padding_idx``: the padding row's local index, when this slice holds it)."""

    def __init__(self, weight: nn.Parameter, start: int, group: dist.ProcessGroup,
                 padding_idx: int | None = None) -> None:  # fmt: skip
        super().__init__()
        self.weight = weight
        self.start = start
        self.group = group
        self.padding_idx = padding_idx

    def forward(self, input_ids: Tensor) -> Tensor:
        """``[B, L]`` ids -> ``[B, L, H]`` embeddings (whole, on every ``tp`` rank)."""
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(inside, local, 0), self.weight, self.padding_idx)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return _ReduceForward.apply(out, self.group)


class VocabParallelHead(nn.Module):
    """An output head holding vocabulary rows ``[start, start + rows)`` that evaluates window
    ``window`` of ``windows`` equal windows of positions: ``[B, L, H]`` hidden states ->
    ``[B, L / windows, rows]`` logits. ``group``: the ranks whose gradients of the hidden
    states add up (``cp x tp``); ``window_group``: the ranks whose gradients of the head's own
    weights add up (the ``cp`` windows; the embedding's share of a tied weight is whole on
    every rank and is not summed)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, start: int,
                 window: int, windows: int, group: dist.ProcessGroup,
                 window_group: dist.ProcessGroup | None) -> None:  # fmt: skip
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.start = start
        self.window = window
        self.windows = windows
        self.group = group
        self.window_group = window_group

    def forward(self, hidden: Tensor) -> Tensor:
        hidden = _ReduceBackward.apply(hidden, self.group)
        weight, bias = self.weight, self.bias
        if self.windows > 1:
            width = hidden.shape[1] // self.windows
            hidden = hidden[:, self.window * width : (self.window + 1) * width]
            weight = _ReduceBackward.apply(weight, self.window_group)
            if bias is not None:
                bias = _ReduceBackward.apply(bias, self.window_group)
        return F.linear(hidden, weight, bias)


@dataclass(frozen=True)
class Placement:
    """Where this rank's part of a tensor lies in the whole tensor."""

    shape: tuple[int, ...]
    """The whole tensor's shape."""
    offset: tuple[int, ...]
    """The index of this rank's part's first element in the whole tensor."""
    copies: int
    """How many ranks hold this same part (the data-parallel replicas, and the ``cp`` / ``tp``
    ranks of a tensor those do not split)."""
    writer: bool
    """Whether this rank is the first of those copies (the one that writes it)."""


def local_part(tensor: Tensor) -> Tensor:
    """This rank's part of ``tensor`` (the local shard of a DTensor, else itself)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@dataclass
class ParallelStudent:
    """A student spread over a :class:`TrainMesh` by :func:`parallelize`."""

    model: nn.Module
    """The student (FSDP2-sharded parameters are DTensors, vocabulary slices plain tensors)."""
    wrapped: nn.Module
    """What the forward pass is called on (the DDP wrapper, else ``model``)."""
    mesh: TrainMesh
    sliced: frozenset[str]
    """Names of the parameters split over ``tp`` on dimension 0 (the vocabulary)."""
    vocab: int | None
    """The whole vocabulary ``V`` of the output head (None: a model without one)."""

    def placement(self, name: str, tensor: Tensor) -> Placement:
        """Where this rank's part of parameter ``name`` (or of optimizer state laid out like it:
        ``tensor``) lies. Dimension 0 is split over ``tp`` for a vocabulary slice, and within
        that over ``dp_shard`` in ``torch.chunk`` pieces for an FSDP2 DTensor."""
        layout, mesh = self.mesh.layout, self.mesh
        local = local_part(tensor)
        shape = list(tensor.shape)
        offset = [0] * len(shape)
        copies = layout.dp_replicate * layout.cp
        first = mesh.coordinate("dp_replicate") == 0 and mesh.coordinate("cp") == 0
        if name in self.sliced:
            offset[0] = mesh.coordinate("tp") * shape[0]
            shape[0] *= layout.tp
        else:
            copies *= layout.tp
            first = first and mesh.coordinate("tp") == 0
        if local is not tensor and shape:  # an FSDP2 shard of dimension 0
            chunk = math.ceil(tensor.shape[0] / layout.dp_shard)
            offset[0] += min(mesh.coordinate("dp_shard") * chunk, tensor.shape[0])
        elif local is tensor:
            copies *= layout.dp_shard
            first = first and mesh.coordinate("dp_shard") == 0
        return Placement(tuple(shape), tuple(offset), copies, first)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The student's parameters by name (each shared parameter once)."""
        return self.model.named_parameters()

    def gradient_sync(self, sync: bool):
        """A context in which backward passes reduce gradients over the data-parallel ranks
        (``sync``) or only accumulate them (every micro-batch but the last)."""
        if sync:
            return contextlib.nullcontext()
        if hasattr(self.wrapped, "no_sync"):
            return self.wrapped.no_sync()
        if hasattr(self.model, "set_requires_gradient_sync"):
            return _fsdp_no_sync(self.model)
        return contextlib.nullcontext()

    def sync_copies(self, bucket_bytes: int = 2**28) -> None:
        """Make every gradient's copies on the ``cp`` / ``tp`` ranks bitwise equal: the first
        copy's (the one checkpoints write) is broadcast over the ranks holding it, in buckets
        of about ``bucket_bytes`` (module docstring). Nothing to do without ``cp`` or ``tp``."""
        layout = self.mesh.layout
        if layout.model_parallel == 1:
            return
        groups: dict[str, list[Tensor]] = {"whole": [], "sliced": []}
        for name, param in self.named_parameters():
            if param.grad is not None:
                groups["sliced" if name in self.sliced else "whole"].append(
                    local_part(param.grad))
        targets = {"whole": self.mesh.model_group,
                   "sliced": self.mesh.group("cp") if layout.cp > 1 else None}  # fmt: skip
        for kind, grads in groups.items():
            if targets[kind] is not None:
                _broadcast_buckets(grads, targets[kind], bucket_bytes)

    def clip_gradients(self, max_norm: float) -> float:
        """Scale the gradients so that their global L2 norm is at most ``max_norm`` (as
        :func:`torch.nn.utils.clip_grad_norm_`: by ``max_norm / (norm + 1e-6)`` when that is
        below 1; an infinite ``max_norm`` only measures); returns the norm before clipping,
        the same on every rank (each part counted once, in float64; summed on the device, one
        synchronisation per step). A non-finite norm scales nothing (the trainer stops)."""
        grads, total = [], torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        for name, param in self.named_parameters():
            if param.grad is None:
                continue
            grads.append(param.grad)
            part = local_part(param.grad).detach()
            norm = torch.linalg.vector_norm(part, dtype=torch.float64)
            total += norm.square() / self.placement(name, param).copies
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)
        norm = float(total.sqrt())
        coef = min(max_norm / (norm + 1e-6), 1.0)
        if coef < 1.0:
            for grad in grads:
                grad.mul_(coef)
        return norm


class Lockstep:
    """Keeps the forward passes of processes sharing an FSDP2 model aligned (each pass is a
    collective, and each process may have another number of batches): call it before every
    real forward pass, and :meth:`finish` when this process has no more."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device

    def _others_busy(self, busy: bool) -> bool:
        flag = torch.tensor([int(busy)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def __call__(self) -> None:
        self._others_busy(True)

    @torch.no_grad()
    def finish(self) -> int:
        """Join the other processes' forward passes with a one-token batch until every
        process is done; returns how many it joined."""
        joined = 0
        one = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        while self._others_busy(False):
            self.model(input_ids=one, attention_mask=torch.ones_like(one))
            joined += 1
        return joined


def _broadcast_buckets(tensors: list[Tensor], group: dist.ProcessGroup, bucket_bytes: int) -> None:
    """Broadcast ``tensors`` in place from the first rank of ``group``, flattened into buckets
    of one dtype and about ``bucket_bytes`` bytes (one collective per bucket)."""
    buckets: list[list[Tensor]] = []
    sizes: dict[torch.dtype, int] = {}
    open_bucket: dict[torch.dtype, list[Tensor]] = {}
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if tensor.dtype not in open_bucket or sizes[tensor.dtype] + size > bucket_bytes:
            open_bucket[tensor.dtype] = []
            buckets.append(open_bucket[tensor.dtype])
            sizes[tensor.dtype] = 0
        open_bucket[tensor.dtype].append(tensor)
        sizes[tensor.dtype] += size
    for bucket in buckets:
        flat = torch.cat([t.reshape(-1) for t in bucket])
        dist.broadcast(flat, group=group, group_src=0)
        for t, part in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
            t.copy_(part.view_as(t))


@contextlib.contextmanager
def _fsdp_no_sync(model: nn.Module):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: the modules whose classes it lists as never to be split
    (transformers' ``_no_split_modules``)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ConfigError(
            f"{type(model).__name__} names no decoder layer class (_no_split_modules), so it "
            f"cannot be sharded per layer; train it with parallel.dp_shard=1."
        )
    return layers


def parallelize(
    model: nn.Module, mesh: TrainMesh, *, activation_checkpointing: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> ParallelStudent:
    """Spread ``model`` (every rank holding the same weights; on ``mesh.device``, or on the
    CPU where ``dp_shard`` > 1) over ``mesh``'s layout; see the module docstring.
    ``compute_dtype``: what FSDP2 casts the parameters to for the forward and backward passes
    (None: their own dtype)."""
    layout = mesh.layout
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    vocab = None if head is None else int(head.weight.shape[0])
    sliced: set[str] = set()
    if layout.model_parallel > 1:
        sliced = _vocab_parallel(model, mesh, vocab)
    if activation_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    wrapped = model
    if layout.dp_shard > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        fsdp_mesh = mesh.mesh["dp_replicate", "dp_shard"]
        policy = MixedPrecisionPolicy(
            param_dtype=compute_dtype, reduce_dtype=torch.float32
        ) if compute_dtype is not None else MixedPrecisionPolicy()  # fmt: skip
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=fsdp_mesh, mp_policy=policy)
        fully_shard(model, mesh=fsdp_mesh, mp_policy=policy)
    elif layout.dp_replicate > 1:
        wrapped = nn.parallel.DistributedDataParallel(
            model, process_group=mesh.dp_group(),
            device_ids=[mesh.device] if mesh.device.type == "cuda" else None,
        )  # fmt: skip
    return ParallelStudent(model, wrapped, mesh, frozenset(sliced), vocab)


def _vocab_parallel(model: nn.Module, mesh: TrainMesh, vocab: int) -> set[str]:
    """Replace the embedding and head by their vocabulary slices; returns the sliced
    parameters' names."""
    layout = mesh.layout
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    plain = type(head) is nn.Linear and (layout.tp == 1 or type(embedding) is nn.Embedding)
    if not plain:
        raise ConfigError(
            f"parallel.tp / parallel.cp replace the student's output head (and with tp its "
            f"input embedding) by vocabulary slices, which needs a plain nn.Linear head and "
            f"nn.Embedding; {type(model).__name__} has {type(head).__name__} and "
            f"{type(embedding).__name__} (they may scale or transform what they compute). "
            f"Train it with parallel.tp=1 and parallel.cp=1."
        )
    if vocab % layout.tp:
        raise ConfigError(
            f"the student's vocabulary has {vocab} entries, which parallel.tp = {layout.tp} does "
            f"not divide; choose a tp that divides it (or pad the model's vocabulary)."
        )
    rows = vocab // layout.tp
    start = mesh.coordinate("tp") * rows

    def part(param: nn.Parameter) -> nn.Parameter:
        if layout.tp == 1:
            return param
        with torch.no_grad():
            return nn.Parameter(param[start : start + rows].clone())

    head_weight = part(head.weight)
    bias = part(head.bias) if getattr(head, "bias", None) is not None else None
    sliced = {id(p) for p in (head_weight, bias) if p is not None}
    if layout.tp > 1:
        tied = embedding.weight is head.weight
        embed_weight = head_weight if tied else part(embedding.weight)
        sliced.add(id(embed_weight))
        pad = getattr(embedding, "padding_idx", None)
        pad = pad - start if pad is not None and start <= pad < start + rows else None
        model.set_input_embeddings(
            VocabParallelEmbedding(embed_weight, start, mesh.group("tp"), pad)
        )  # fmt: skip
    model.set_output_embeddings(VocabParallelHead(
        head_weight, bias, start, mesh.coordinate("cp"), layout.cp, mesh.model_group,
        mesh.group("cp"),
    ))  # fmt: skip
    if layout.tp == 1:
        return set()
    return {name for name, param in model.named_parameters() if id(param) in sliced}


def state_bytes(student: ParallelStudent, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of the student's ``parameters``, their ``gradients`` (those not
    freed) and the ``optimizer`` state (the measure of what a layout shards)."""

    def size(tensor: Tensor) -> int:
        part = local_part(tensor)
        return part.numel() * part.element_size()

    params = [p for _, p in student.named_parameters()]
    return {
        "parameters": sum(size(p) for p in params),
        "gradients": sum(size(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(size(v) for p in params for v in optimizer.state.get(p, {}).values()
                         if isinstance(v, Tensor)),
    }  # fmt: skip
