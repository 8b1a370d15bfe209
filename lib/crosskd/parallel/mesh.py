"""This process's place in a :class:`~crosskd.parallel.layout.ParallelLayout`: the device mesh
and the process groups that :func:`~crosskd.parallel.parallelize.parallelize` spreads a model
over (the trainer's student; the sharded teacher, ``dp_shard`` = its processes) and that the
sharded loss (:mod:`crosskd.loss.parallel`) uses."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from crosskd.loss.parallel import LossGroups, ParallelConfig
from crosskd.parallel.layout import DIMS, ParallelLayout


@dataclass(frozen=True)
class ParallelMesh:
    """This process's place in a resolved :class:`ParallelLayout`."""

    layout: ParallelLayout
    rank: int
    device: torch.device
    mesh: DeviceMesh | None
    """The ``(dp_replicate, dp_shard, cp, tp)`` device mesh (None in one process)."""
    loss: LossGroups | None
    """The sharded loss's ``(dp, cp, tp)`` groups, taken from ``mesh`` (``dp``: the
    ``dp_replicate x dp_shard`` ranks flattened), where ``cp`` or ``tp`` is > 1, else None."""

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


def build_parallel_mesh(layout: ParallelLayout, device: torch.device) -> ParallelMesh:
    """The mesh of ``layout`` over the initialised default process group (or one process);
    every rank must call it (it creates process groups)."""
    if not dist.is_initialized():
        resolved = layout.resolved(1)
        return ParallelMesh(resolved, 0, device, None, None)
    world = dist.get_world_size()
    resolved = layout.resolved(world)
    mesh = init_device_mesh(
        device.type, tuple(getattr(resolved, d) for d in DIMS), mesh_dim_names=DIMS
    )
    loss = None
    if resolved.model_parallel > 1:
        # ranks are laid out (dp_replicate, dp_shard, cp, tp) row-major, so the flattened data
        # dimensions are the loss's dp: the loss's groups are this mesh's, none made twice
        dp = mesh["dp_replicate", "dp_shard"]._flatten("dp")
        loss = LossGroups(
            ParallelConfig(resolved.dp, resolved.cp, resolved.tp),
            dp.get_local_rank(),
            mesh.get_local_rank("cp"),
            mesh.get_local_rank("tp"),
            dp.get_group(),
            mesh.get_group("cp"),
            mesh.get_group("tp"),
        )
    return ParallelMesh(resolved, dist.get_rank(), device, mesh, loss)
