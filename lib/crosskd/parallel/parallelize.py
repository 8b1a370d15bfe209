"""The parallel pieces applied to a plain Hugging Face causal LM, in one place
(:func:`parallelize`), for a :class:`~crosskd.parallel.layout.ParallelLayout`.

1. ``tp`` > 1: the input embedding and the output head become vocabulary-parallel
   (:class:`VocabParallelEmbedding`, :class:`VocabParallelHead`: rank ``t`` keeps rows
   ``[t V / tp, (t + 1) V / tp)``; tied weights stay tied). The decoder layers are replicated
   over ``tp``; the two conjugate collectives of Megatron-LM keep their gradients whole: the
   embedding's output is all-reduced over ``tp`` in the forward pass (identity backward), the
   head's input all-reduces its gradient over ``tp`` in the backward pass (identity forward).
   No rank ever holds ``rows x V`` logits.
2. ``cp`` > 1: each ``cp`` rank runs the model on its window of ``L / cp`` positions of every
   row, attention gathering the row's keys and values
   (:mod:`crosskd.parallel.context`); its weights' gradients are its window's share.
3. Activation checkpointing of every decoder layer (optional; transformers' own).
4. ``dp_shard`` > 1: FSDP2 (:func:`torch.distributed.fsdp.fully_shard`) on every decoder layer
   and the root over the ``(dp_replicate, dp_shard)`` mesh (HSDP when ``dp_replicate`` > 1),
   computing in ``compute_dtype`` (the trainer: bf16 on GPU) with float32 gradient reduction;
   parameters on the CPU are moved to the device a layer at a time (no rank holds the whole
   model on its device). ``dp_shard`` = 1 and ``dp_replicate`` > 1: DDP over the
   data-parallel ranks.

Both data-parallel wrappers *average* gradients over the data-parallel ranks while each rank's
loss is its share of the step's sum, so the trainer scales its share by ``dp``; before the
optimizer step :meth:`ParallelStudent.sync_copies` sums the ``cp`` windows' shares and makes
the ``tp`` ranks' copies of the replicated gradients bitwise equal (the first copy's,
broadcast: equal in exact arithmetic, but GPU kernels that add in a varying order must not let
the copies drift apart). Where a tensor is, globally, is described by :class:`Placement` (for
the gradient norm and the checkpoints).
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
from crosskd.output_layer import OutputHead
from crosskd.parallel.context import enable_context_parallel
from crosskd.parallel.mesh import ParallelMesh


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

    def __init__(
        self,
        weight: nn.Parameter,
        start: int,
        group: dist.ProcessGroup,
        padding_idx: int | None = None,
    ) -> None:
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


class VocabParallelHead(OutputHead):
    """An output head holding vocabulary rows ``[start, start + rows)``: ``[B, L, H]`` hidden
    states -> ``[B, L, rows]`` logits; the gradient of the hidden states is summed over
    ``group`` (the ``tp`` ranks). Inside :meth:`~crosskd.output_layer.OutputHead.capture` it
    hands over its slice as an :class:`~crosskd.output_layer.OutputLayer` instead."""

    def __init__(
        self, weight: nn.Parameter, bias: nn.Parameter | None, start: int, group: dist.ProcessGroup
    ) -> None:
        super().__init__(weight, bias)
        self.start = start
        self.group = group

    def prepare(self, hidden: Tensor) -> Tensor:
        """The hidden states, their gradient summed over the ``tp`` ranks in the backward
        pass."""
        return _ReduceBackward.apply(hidden, self.group)


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
    """A student spread over a :class:`ParallelMesh` by :func:`parallelize`."""

    model: nn.Module
    """The student (FSDP2-sharded parameters are DTensors, vocabulary slices plain tensors)."""
    wrapped: nn.Module
    """What the forward pass is called on (the DDP wrapper, else ``model``)."""
    mesh: ParallelMesh
    sliced: frozenset[str]
    """Names of the parameters split over ``tp`` on dimension 0 (the vocabulary)."""
    vocab: int | None
    """The whole vocabulary ``V`` of the output head (None: a model without one)."""
    gradient_peak: int = 0
    """The most gradient bytes this rank held after any micro-batch's backward pass so far
    (:func:`gradient_bytes`, read at the end of each :meth:`gradient_sync` block)."""

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

    @contextlib.contextmanager
    def gradient_sync(self, sync: bool) -> Iterator[None]:
        """The context of a micro-batch's backward pass: the last one of a step (``sync``)
        reduces the gradients over every data-parallel rank. Before it, DDP only accumulates
        (its gradients are whole replicas either way), while FSDP2 still reduce-scatters every
        micro-batch, so each rank accumulates only its shard: no unsharded gradient (the whole
        model's size) is kept from one micro-batch to the next. Under HSDP the all-reduce of the
        shards over ``dp_replicate`` waits for the last micro-batch. ``gradient_peak`` is
        updated after the block."""
        if sync:
            reduction = contextlib.nullcontext()
        elif hasattr(self.wrapped, "no_sync"):
            reduction = self.wrapped.no_sync()
        elif hasattr(self.model, "set_requires_all_reduce"):
            reduction = _fsdp_deferred_all_reduce(self.model)
        else:
            reduction = contextlib.nullcontext()
        with reduction:
            yield
        self.gradient_peak = max(self.gradient_peak, gradient_bytes(self.model))

    def sync_copies(self, bucket_bytes: int = 2**28) -> None:
        """Sum every gradient over the ``cp`` ranks (each holds its window's share), then make
        the ``tp`` ranks' copies of each replicated gradient bitwise equal (the first copy's,
        the one checkpoints write, broadcast); in buckets of about ``bucket_bytes`` (module
        docstring). Nothing to do without ``cp`` or ``tp``."""
        layout = self.mesh.layout
        grads = {
            name: local_part(param.grad)
            for name, param in self.named_parameters()
            if param.grad is not None
        }
        if layout.cp > 1:
            _in_buckets(
                list(grads.values()),
                bucket_bytes,
                lambda flat: dist.all_reduce(flat, group=self.mesh.group("cp")),
            )
        if layout.tp > 1:
            whole = [grad for name, grad in grads.items() if name not in self.sliced]
            _in_buckets(
                whole,
                bucket_bytes,
                lambda flat: dist.broadcast(flat, group=self.mesh.group("tp"), group_src=0),
            )

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


def _in_buckets(tensors: list[Tensor], bucket_bytes: int, collective) -> None:
    """Run the in-place ``collective(flat)`` on ``tensors`` flattened into buckets of one dtype
    and about ``bucket_bytes`` bytes (one collective per bucket), and copy the results back."""
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
        collective(flat)
        for t, part in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
            t.copy_(part.view_as(t))


@contextlib.contextmanager
def _fsdp_deferred_all_reduce(model: nn.Module):
    model.set_requires_all_reduce(False)
    try:
        yield
    finally:
        model.set_requires_all_reduce(True)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: the modules whose classes it lists as never to be split
    (transformers' ``_no_split_modules``)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ConfigError(
            f"{type(model).__name__} names no decoder layer class (_no_split_modules), so it "
            f"cannot be split per layer (FSDP2 or context parallelism); train it with "
            f"parallel.dp_shard=1 and parallel.cp=1."
        )
    return layers


def parallelize(
    model: nn.Module,
    mesh: ParallelMesh,
    *,
    activation_checkpointing: bool = False,
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
    if layout.tp > 1:
        sliced = _vocab_parallel(model, mesh, vocab)
    if layout.cp > 1:
        enable_context_parallel(model, decoder_layers(model), mesh.group("cp"))
    if activation_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    wrapped = model
    if layout.dp_shard > 1:
        # lazy: torch.distributed.fsdp costs ~0.5 s; every pipeline step imports crosskd.steps,
        # which imports this module (through the trainer), and only dp_shard > 1 shards
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        fsdp_mesh = mesh.mesh["dp_replicate", "dp_shard"]
        policy = (
            MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
            if compute_dtype is not None
            else MixedPrecisionPolicy()
        )
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=fsdp_mesh, mp_policy=policy)
        fully_shard(model, mesh=fsdp_mesh, mp_policy=policy)
    elif layout.dp_replicate > 1:
        wrapped = nn.parallel.DistributedDataParallel(
            model,
            process_group=mesh.dp_group(),
            device_ids=[mesh.device] if mesh.device.type == "cuda" else None,
        )
    return ParallelStudent(model, wrapped, mesh, frozenset(sliced), vocab)


def _vocab_parallel(model: nn.Module, mesh: ParallelMesh, vocab: int | None) -> set[str]:
    """Replace the embedding and head by their ``tp`` vocabulary slices; returns the sliced
    parameters' names."""
    tp = mesh.layout.tp
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if type(head) not in (nn.Linear, OutputHead) or type(embedding) is not nn.Embedding:
        raise ConfigError(
            f"parallel.tp replaces the student's input embedding and output head by vocabulary "
            f"slices, which needs a plain nn.Embedding and nn.Linear head; "
            f"{type(model).__name__} has {type(embedding).__name__} and {type(head).__name__} "
            f"(they may scale or transform what they compute). Train it with parallel.tp=1."
        )
    if vocab % tp:
        raise ConfigError(
            f"the student's vocabulary has {vocab} entries, which parallel.tp = {tp} does not "
            f"divide; choose a tp that divides it (or pad the model's vocabulary)."
        )
    rows = vocab // tp
    start = mesh.coordinate("tp") * rows

    def part(param: nn.Parameter) -> nn.Parameter:
        """This rank's rows of ``param``, frozen if it is (``trainable``)."""
        with torch.no_grad():
            return nn.Parameter(param[start : start + rows].clone(), param.requires_grad)

    head_weight = part(head.weight)
    bias = part(head.bias) if head.bias is not None else None
    tied = embedding.weight is head.weight
    embed_weight = head_weight if tied else part(embedding.weight)
    sliced = {id(p) for p in (head_weight, bias, embed_weight) if p is not None}
    pad = embedding.padding_idx
    pad = pad - start if pad is not None and start <= pad < start + rows else None
    group = mesh.group("tp")
    model.set_input_embeddings(VocabParallelEmbedding(embed_weight, start, group, pad))
    model.set_output_embeddings(VocabParallelHead(head_weight, bias, start, group))
    return {name for name, param in model.named_parameters() if id(param) in sliced}


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of gradients this rank holds for ``model`` now: the local part of each parameter's
    ``grad``, plus the unsharded gradients FSDP2 keeps between backward passes when it does
    not reduce-scatter (its ``FSDPParam``'s unsharded ``grad`` and
    ``unsharded_accumulated_grad``, private attributes read only to measure). Sizes only: no
    device synchronisation."""
    # lazy: torch.distributed.fsdp costs ~0.5 s; every pipeline step imports crosskd.steps, which
    # imports this module (through the trainer), and only a measurement of the gradients needs it
    from torch.distributed.fsdp import FSDPModule

    def size(tensor: Tensor | None) -> int:
        part = None if tensor is None else local_part(tensor)
        return 0 if part is None else part.numel() * part.element_size()

    total = sum(size(p.grad) for p in model.parameters())
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            for param in group.fsdp_params if group is not None else ():
                unsharded = getattr(param, "_unsharded_param", None)
                total += size(None if unsharded is None else unsharded.grad)
                total += size(param.unsharded_accumulated_grad)
    return total


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
        "optimizer": sum(
            size(v)
            for p in params
            for v in optimizer.state.get(p, {}).values()
            if isinstance(v, Tensor)
        ),
    }
