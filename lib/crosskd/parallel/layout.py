"""The parallel layout of a training run (``parallel:``): how the student is spread over the
processes. Read by the trainer (:mod:`crosskd.parallel.mesh`) and by the job renderer, without
torch.

The ranks form one :class:`~torch.distributed.device_mesh.DeviceMesh` of shape
``(dp_replicate, dp_shard, cp, tp)`` (``tp`` varies fastest, so the tensor-parallel ranks of a
data-parallel shard are neighbours, on one node's fast links when ``tp`` divides the GPUs per
node):

* ``dp_replicate`` x ``dp_shard`` data-parallel shards each read their own packed rows. The
  student's parameters, gradients and optimizer state are sharded over ``dp_shard`` (FSDP2) and
  replicated over ``dp_replicate`` (DDP alone when ``dp_shard`` is 1; HSDP when both are > 1).
* ``tp`` ranks of a shard each hold ``V / tp`` rows of the input embedding and the output head
  (vocabulary-parallel): their logits stay ``[B, L, V / tp]`` and go straight into the sharded
  loss (:mod:`crosskd.loss.parallel`).
* ``cp`` ranks of a shard each run the model and the loss on a window of ``L / cp`` positions
  of every row, attention gathering the row's keys and values
  (:mod:`crosskd.parallel.context`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from crosskd.config import require_positive_ints
from crosskd.errors import ConfigError

DIMS = ("dp_replicate", "dp_shard", "cp", "tp")
"""The mesh dimensions, outermost first."""


@dataclass
class ParallelLayout:
    """``parallel:`` of a training config. ``dp_replicate * dp_shard * cp * tp`` must equal the
    number of processes."""

    dp_replicate: int | None = None
    """Data-parallel replicas of the whole (or ``dp_shard``-sharded) student. None: the number
    of processes divided by the other three (plain DDP when those are all 1)."""
    dp_shard: int = 1
    """Data-parallel ranks that shard the parameters, gradients and AdamW state (FSDP2, per
    decoder layer and the root): each holds ~1/``dp_shard`` of them."""
    tp: int = 1
    """Vocabulary slices of the input embedding and output head (the vocabulary size must be a
    multiple of it); the loss runs on the sliced logits."""
    cp: int = 1
    """Windows of positions over which each row is split (context parallelism: each ``cp`` rank
    runs the model on its window, attention gathering the row's keys and values; the rows are
    padded to a multiple of it; :mod:`crosskd.parallel.context`)."""

    @classmethod
    def from_mapping(cls, values: Any) -> ParallelLayout:
        """A layout from the mapping of a config's ``parallel:``, refusing unknown keys by
        name (``parallel.KEY``)."""
        if not isinstance(values, dict):
            raise ConfigError(f"parallel is {values!r}; it must be a mapping of {', '.join(DIMS)}.")
        unknown = sorted(set(values) - set(DIMS))
        if unknown:
            raise ConfigError(
                f"parallel: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(DIMS)}."
            )
        return cls(**values)

    def check(self) -> None:
        """Refuse sizes that are not positive integers, naming the key."""
        require_positive_ints(self, ("dp_shard", "tp", "cp"), prefix="parallel.")
        if self.dp_replicate is not None:
            require_positive_ints(self, ("dp_replicate",), prefix="parallel.")

    def resolved(self, world: int) -> ParallelLayout:
        """This layout for ``world`` processes (``dp_replicate`` filled in), refusing sizes that
        are not positive integers or do not multiply to ``world``, naming the keys."""
        self.check()
        others = self.dp_shard * self.cp * self.tp
        if self.dp_replicate is None:
            if world % others:
                raise ConfigError(
                    f"parallel.dp_shard * parallel.cp * parallel.tp = {self.dp_shard} * "
                    f"{self.cp} * {self.tp} = {others} does not divide the {world} processes; "
                    f"choose sizes whose product divides the number of processes."
                )
            return replace(self, dp_replicate=world // others)
        if self.dp_replicate * others != world:
            raise ConfigError(
                f"parallel.dp_replicate * parallel.dp_shard * parallel.cp * parallel.tp = "
                f"{self.dp_replicate} * "
                f"{self.dp_shard} * {self.cp} * {self.tp} = {self.dp_replicate * others}, but "
                f"there are {world} processes; make the product equal the number of processes "
                f"(or leave dp_replicate unset)."
            )
        return self

    @property
    def dp(self) -> int:
        """Data-parallel shards of the data (``dp_replicate * dp_shard``)."""
        return (self.dp_replicate or 1) * self.dp_shard

    @property
    def model_parallel(self) -> int:
        """Ranks that share one data-parallel shard's rows (``cp * tp``)."""
        return self.cp * self.tp

    def to_json(self) -> dict[str, int | None]:
        """The four sizes, as written into the config and the checkpoints."""
        return {dim: getattr(self, dim) for dim in DIMS}
