"""This process's place in a :class:`~crosskd.layout.ParallelLayout`: the device mesh and the
process groups the student (:mod:`crosskd.train.parallelize`) and the sharded loss
(:mod:`crosskd.loss.parallel`) use."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from crosskd.layout import DIMS, ParallelLayout
from crosskd.loss.parallel import Mesh, ParallelConfig, build_mesh


@dataclass(frozen=True)
class TrainMesh:
    """This process's place in a resolved :class:`ParallelLayout`."""

    layout: ParallelLayout
    rank: int
    device: torch.device
    mesh: DeviceMesh | None
    """The ``(dp_replicate, dp_shard, cp, tp)`` device mesh (None in one process)."""
    loss: Mesh | None
    """The loss's ``(dp, cp, tp)`` mesh where ``cp`` or ``tp`` is > 1, else None."""

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel shard: which slice of every step's rows it reads."""
        return self.rank // self.layout.model_parallel

    def coordinate(self, dim: str) -> int:
        """This rank's index along mesh dimension ``dim`` (0 in one process)."""
        return 0 if self.mesh is None else self.mesh.get_local_rank(dim)

    def group(self, dim: str) -> dist.ProcessGroup | None:
        """The process group along ``dim`` (None in one process)."""
        return None if self.mesh is None else self.mesh.get_group(dim)

    def dp_group(self) -> dist.ProcessGroup | None:
        """The ranks with this rank's ``cp`` and ``tp`` coordinates (its data-parallel peers)."""
        if self.mesh is None:
            return None
        if self.layout.model_parallel == 1:
            return dist.group.WORLD
        return self.loss.dp_group


def build_train_mesh(layout: ParallelLayout, device: torch.device) -> TrainMesh:
    """The mesh of ``layout`` over the initialised default process group (or one process);
    every rank must call it (it creates process groups)."""
    if not dist.is_initialized():
        resolved = layout.resolved(1)
        return TrainMesh(resolved, 0, device, None, None)
    world = dist.get_world_size()
    resolved = layout.resolved(world)
    mesh = init_device_mesh(
        device.type, tuple(getattr(resolved, d) for d in DIMS), mesh_dim_names=DIMS
    )
    loss = None
    if resolved.model_parallel > 1:
        loss = build_mesh(ParallelConfig(resolved.dp, resolved.cp, resolved.tp), device.type)
    return TrainMesh(resolved, dist.get_rank(), device, mesh, loss)
