"""The loss under data (DP), vocabulary (tensor, TP) and sequence (context, CP) parallelism
(spec section 7), any combination, with the same numbers as one process.

Layout: the ranks form a ``(dp, cp, tp)`` :class:`~torch.distributed.device_mesh.DeviceMesh`
(``tp`` varies fastest). A data-parallel shard holds whole packed rows; inside it, a CP rank
holds a window of ``L / cp`` positions of every row and a TP rank a slice of ``V / tp``
vocabulary ids, so each rank has student logits ``[B_dp, L / cp, V / tp]``.

* Every rank of a DP shard makes the same :class:`~crosskd.loss.objective.LossPlan` from the
  shard's rows (data only); :func:`reduce_counts` sums the step's counts over DP, once per step.
* :class:`ShardedLogProbs` implements :class:`~crosskd.loss.logprobs.StudentLogProbs`: each rank
  computes the log-normaliser pieces of its own rows over its vocabulary slice; the
  log-normaliser is the all-reduced max plus the log of the all-reduced sum of exponentials
  (TP), the logit of an id comes from the rank that owns it (zeros elsewhere, then a TP sum),
  and the log probs of rows in other windows are exchanged explicitly (a CP sum of
  zero-filled vectors). Communication per call is ``O(rows + pairs)`` numbers, never
  ``O(rows x V)``: the full vocabulary is never gathered.
* Every CE target and chunk is evaluated by exactly one rank (:func:`ownership`): the CP rank
  that owns its first prediction row, and among the TP ranks the one its index picks
  round-robin. Each rank's loss is its share; the shares of all ranks sum to the micro-batch's
  loss. The collectives are differentiable (:func:`all_reduce_sum`, whose backward sums the
  gradients over the group, as ``torch.distributed.nn.functional.all_reduce`` does; that module
  is deprecated in torch 2.13 and its successor lives in a private module), so calling
  ``backward`` on every rank's share gives each rank exactly its slice of the gradient of the
  whole loss. (Under DDP, which *averages* gradients over DP, multiply the share by the DP
  size.)
* ``kd_scale`` and every reported value come from the complete terms: a float64 vector
  all-reduced over all ranks, so they are identical on every rank and equal to one process
  with the same micro-batch partition (spec 8.1). A rank with only padding contributes zeros
  and takes part in every collective (spec 8.2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh

from crosskd.config import require_positive_ints
from crosskd.errors import ConfigError
from crosskd.loss.config import LossConfig
from crosskd.loss.kernels import EAGER, BlockKernels
from crosskd.loss.logprobs import Request, Requests, RowSlices, row_pieces
from crosskd.loss.objective import (
    LossOutput,
    LossPlan,
    Ownership,
    StepCounts,
    loss_from_logprobs,
)
from crosskd.output_layer import OutputLayer
from crosskd.transfer import to_device


@dataclass
class ParallelConfig:
    """The parallel layout of the student's logits: ``dp * cp * tp`` must equal the number of
    ranks."""

    dp: int = 1
    """Data-parallel shards (whole packed rows)."""
    cp: int = 1
    """Sequence (context) windows of each row."""
    tp: int = 1
    """Vocabulary slices of the output layer."""

    def check(self, world_size: int) -> None:
        """Refuse sizes that are not positive integers or do not multiply to ``world_size``."""
        require_positive_ints(self, ("dp", "cp", "tp"))
        if self.dp * self.cp * self.tp != world_size:
            raise ConfigError(
                f"dp * cp * tp = {self.dp} * {self.cp} * {self.tp} = "
                f"{self.dp * self.cp * self.tp}, but there are {world_size} ranks; make the "
                f"product equal the number of processes."
            )


@dataclass(frozen=True)
class LossGroups:
    """This rank's place in the loss's ``(dp, cp, tp)`` layout: its coordinates and the three
    process groups. Not a mesh of its own: the trainer and the sharded teacher take them from
    their one device mesh (:class:`crosskd.parallel.mesh.ParallelMesh`, ``dp`` being its
    ``dp_replicate x dp_shard`` ranks); :func:`build_loss_groups` makes them for the loss
    alone."""

    config: ParallelConfig
    dp_rank: int
    cp_rank: int
    tp_rank: int
    dp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup

    def reduce_all(self, values: Tensor) -> Tensor:
        """``values`` summed over every rank (not differentiable)."""
        out = values.detach().clone()
        dist.all_reduce(out)
        return out


def build_loss_groups(config: ParallelConfig, device_type: str = "cpu") -> LossGroups:
    """The loss's groups over every rank of the initialised default process group
    (``torch.distributed``), for the sharded loss used on its own (a ``(dp, cp, tp)`` device
    mesh of ``config``)."""
    config.check(dist.get_world_size())
    mesh = init_device_mesh(
        device_type, (config.dp, config.cp, config.tp), mesh_dim_names=("dp", "cp", "tp")
    )
    return LossGroups(
        config,
        mesh.get_local_rank("dp"),
        mesh.get_local_rank("cp"),
        mesh.get_local_rank("tp"),
        mesh.get_group("dp"),
        mesh.get_group("cp"),
        mesh.get_group("tp"),
    )


def all_reduce_sum(tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The sum of ``tensor`` over ``group``, differentiable: the gradient of each rank's input
    is the sum of the gradients of every rank's output (the loss is the sum of the ranks'
    shares)."""
    return _AllReduceSum.apply(tensor, group)


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        out = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=ctx.group)
        return out, None


def _all_reduce_max(tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The elementwise maximum of ``tensor`` over ``group``, in place (not differentiated)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def reduce_counts(
    counts: StepCounts, mesh: LossGroups, device: torch.device | str = "cpu"
) -> StepCounts:
    """The step's counts summed over the data-parallel shards (call once per step with the sum
    of this shard's micro-batch counts); ``device``: where the collective runs (a CUDA device
    under NCCL)."""
    values = torch.tensor([counts.tokens, *counts.chunks], dtype=torch.int64, device=device)
    dist.all_reduce(values, group=mesh.dp_group)
    tokens, *chunks = values.tolist()
    return StepCounts(tokens, tuple(chunks))


@dataclass
class ShardedLogProbs:
    """:class:`~crosskd.loss.logprobs.StudentLogProbs` over this rank's logits ``[B, L / cp,
    V / tp]`` (or its :class:`~crosskd.output_layer.OutputLayer`: hidden states ``[B, L / cp,
    H]`` and the head's vocabulary slice, fused). Rows are the flat rows ``b * L + position``
    of the whole rows (``width`` = L); every rank of the model-parallel group must ask for the
    same pairs, and every rank gets all of them back."""

    logits: Tensor | OutputLayer
    mesh: LossGroups
    width: int
    tau: float = 1.0
    block_rows: int = 1024
    vocab_size: int | None = None
    """The whole vocabulary ``V`` (checked against ``tp`` equal slices when given)."""
    kernels: BlockKernels = EAGER
    """How each block's elementwise work runs (:mod:`crosskd.loss.kernels`)."""

    def __post_init__(self) -> None:
        _, window, vocab = self.logits.shape
        if window * self.mesh.config.cp != self.width:
            raise ConfigError(
                f"logits hold {window} positions per rank and cp = {self.mesh.config.cp}, but "
                f"the rows are {self.width} long; pad the rows to a multiple of cp and give "
                f"each rank an equal window."
            )
        if self.vocab_size is not None and vocab * self.mesh.config.tp != self.vocab_size:
            raise ConfigError(
                f"logits hold {vocab} vocabulary rows per rank and tp = {self.mesh.config.tp}, "
                f"but the student has V = {self.vocab_size}; split the vocabulary into equal "
                f"slices (pad the output layer to a multiple of tp)."
            )
        self.window = window
        self.vocab_start = self.mesh.tp_rank * vocab
        self.flat = (
            self.logits.flatten()
            if isinstance(self.logits, OutputLayer)
            else self.logits.reshape(-1, vocab)
        )
        tp_group, cp_group = self.mesh.tp_group, self.mesh.cp_group
        self.slices = RowSlices(
            self.flat,
            self.width,
            window,
            self.vocab_start,
            self.mesh.cp_rank,
            self.mesh.config.tp,
            self.mesh.tp_rank,
            tp_sum=lambda x: all_reduce_sum(x, group=tp_group),
            tp_max=lambda x: _all_reduce_max(x, tp_group),
            cp_sum=lambda x: all_reduce_sum(x, group=cp_group),
        )

    def row_slices(self, width: int) -> RowSlices:
        """This rank's logits as :class:`~crosskd.loss.logprobs.RowSlices`; the fused output
        layer has none (a ValueError)."""
        if isinstance(self.logits, OutputLayer):
            raise ValueError("the fused output layer holds no logits")
        if width != self.width:
            raise ValueError(f"rows of {width} positions asked of logits of rows {self.width} long")
        return self.slices

    def _exchange(self, here: np.ndarray, values: Tensor) -> Tensor:
        """``values`` of every pair, kept where the pair's row lies in this window (``here``,
        numpy) and summed over the CP windows (each pair's row lies in exactly one window)."""
        out = torch.where(to_device(here, values.device), values, 0.0)
        if self.mesh.config.cp == 1:
            return out
        return all_reduce_sum(out, group=self.mesh.cp_group)

    def log_prob(self, rows: np.ndarray, ids: np.ndarray) -> Tensor:
        """Log probabilities of ``ids`` at ``rows`` (int64 ``[M]``, numpy) at temperature
        ``tau``, for all pairs."""
        return self.log_probs_at([(rows, ids, self.tau)])[0]

    def log_probs_at(self, requests: Sequence[Request]) -> list[Tensor]:
        """Log probabilities of each request ``(rows, ids, tau)`` at its temperature, for all
        pairs, in one pass over this rank's logits."""
        pairs = Requests.of(requests)
        here, local_rows = self.slices.local(pairs.rows)
        local_ids = pairs.ids - self.vocab_start
        owned = here & (local_ids >= 0) & (local_ids < self.flat.shape[1])
        local = replace(pairs, rows=local_rows, ids=local_ids)
        normalizer, picked = row_pieces(self.flat, local, owned, self.block_rows, self.kernels)
        if self.mesh.config.tp > 1:
            picked = all_reduce_sum(picked, group=self.mesh.tp_group)
        where = (to_device(pairs.which, picked.device), to_device(local_rows, picked.device))
        values = picked - self.slices.normalizer(normalizer)[where]
        return list(self._exchange(here, values).split(pairs.sizes))

    def log_normalizer(self, rows: np.ndarray) -> Tensor:
        """``logsumexp(logits[row] / tau)`` over the whole vocabulary, for all ``rows`` (int64
        ``[M]``, numpy)."""
        here, local_rows = self.slices.local(rows)
        empty = np.zeros(0, dtype=np.int64)
        none = Requests.of([(empty, empty, self.tau)])
        normalizer, _ = row_pieces(
            self.flat, none, empty.astype(bool), self.block_rows, self.kernels
        )
        local = self.slices.normalizer(normalizer)[0, to_device(local_rows, normalizer.device)]
        return self._exchange(here, local)


def ownership(plan: LossPlan, mesh: LossGroups) -> Ownership:
    """Which CE targets and chunks this rank evaluates: those whose first prediction row lies
    in its CP window, split round-robin over the TP ranks by index."""
    window = plan.width // mesh.config.cp
    tp, tp_rank = mesh.config.tp, mesh.tp_rank

    def mine(first_rows: np.ndarray) -> np.ndarray:
        in_window = first_rows % plan.width // window == mesh.cp_rank
        return in_window & (np.arange(len(first_rows)) % tp == tp_rank)

    return Ownership(
        mine(plan.ce_rows),
        [mine(t.chunk_first_row) for t in plan.terms],
        leader=mesh.cp_rank == 0 and tp_rank == 0,
        reduce=mesh.reduce_all,
    )


def sharded_loss(
    logits: Tensor | OutputLayer,
    plan: LossPlan,
    config: LossConfig,
    counts: StepCounts,
    mesh: LossGroups,
) -> LossOutput:
    """One micro-batch's loss on this rank from its logits ``[B, L / cp, V / tp]`` or its
    :class:`~crosskd.output_layer.OutputLayer` (fused: the logits never exist; the plan
    of its DP shard, ``counts`` from :func:`reduce_counts`). ``backward`` on every rank's
    ``loss``; the reported values are complete and identical on every rank."""
    student = ShardedLogProbs(
        logits,
        mesh,
        plan.width,
        vocab_size=plan.vocab,
        kernels=BlockKernels.named(config.kernels),
    )
    return loss_from_logprobs(
        student,
        plan,
        config,
        counts,
        device=logits.device,
        ownership=ownership(plan, mesh),
    )
