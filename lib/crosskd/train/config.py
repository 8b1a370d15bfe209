"""The training configuration (``crosskd train``; the ``train`` part of ``crosskd distill``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from crosskd.errors import ConfigError
from crosskd.loss import LossConfig


@dataclass
class TrainConfig:
    """One student training run. Step counts are optimizer steps."""

    student: str
    """The student: a Hugging Face folder (safetensors weights and its tokenizer)."""
    data: str
    """Prepared data (``crosskd prepare`` output), any fsspec URI."""
    output: str
    """Run folder or URI: ``checkpoints/``, ``metrics-rank0.jsonl``, the final model under
    ``final/``."""
    teachers: list[str] = field(default_factory=list)
    """Per teacher, in teacher order: a teacher cache URI (``crosskd score`` output), or
    ``online:REF`` to compute the signal here from the teacher model ``REF``."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The loss (a mapping of :class:`crosskd.loss.LossConfig` keys; each ``loss.teachers[i]``
    names the tables of teacher ``i``)."""
    steps: int = 100
    micro_batch_rows: int = 4
    """Packed rows per micro-batch per process."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    lr: float = 3e-4
    weight_decay: float = 0.01
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    """The cosine schedule ends at ``lr * min_lr_ratio``."""
    clip_norm: float = 1.0
    """Gradient norm clipping (0: off)."""
    seed: int = 0
    checkpoint_every: int = 0
    """Steps between checkpoints (0: only at the end)."""
    metrics_port: int | None = None
    """Serve Prometheus ``/metrics`` on this port (rank r on ``port + r``; 0: any free port);
    None: off."""
    metrics_host: str = "0.0.0.0"
    """The address the metrics endpoint binds to (all interfaces, for a PodMonitor)."""
    job: str = "crosskd"
    """The ``job`` label of the metrics."""

    def __post_init__(self) -> None:
        if isinstance(self.loss, dict):
            self.loss = loss_from_mapping(self.loss)
        self.check()

    def check(self) -> None:
        """Refuse bad values naming the key."""
        for key in ("steps", "micro_batch_rows", "grad_accum"):
            _int(key, getattr(self, key), 1)
        for key in ("warmup_steps", "checkpoint_every", "seed"):
            _int(key, getattr(self, key), 0)
        for key in ("lr", "weight_decay", "clip_norm", "min_lr_ratio"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
                value
            ) or value < 0:  # fmt: skip
                raise ConfigError(f"{key} is {value!r}; it must be a finite number >= 0.")
        if self.lr <= 0:
            raise ConfigError(f"lr is {self.lr!r}; it must be > 0.")
        if self.loss.teacher_mode == "average":
            raise ConfigError(
                "loss.teacher_mode is 'average', which needs dense teacher signals; teacher "
                "caches hold top-K signals, so training uses 'sum' or 'select'."
            )
        if len(self.teachers) != len(self.loss.teachers):
            raise ConfigError(
                f"teachers lists {len(self.teachers)} source(s) but loss.teachers has "
                f"{len(self.loss.teachers)} entr(y/ies); give one of each per teacher."
            )


def loss_from_mapping(values: dict[str, Any]) -> LossConfig:
    """A :class:`LossConfig` from a mapping, refusing unknown keys by name (as ``loss.KEY``)."""
    known = set(LossConfig.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(
            f"loss: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(known))}."
        )
    return LossConfig(**values)


def _int(key: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key} is {value!r}; it must be an integer >= {minimum}.")
