"""What changes with the optimizer step: the learning rate of each parameter group and the KD
term's weight.

* :func:`lr_at`: linear warmup over ``warmup_steps``, then cosine from ``lr`` down to
  ``lr * min_lr_ratio`` at ``steps``.
* :func:`group_lrs`: with ``first_trainable`` (two parameter groups,
  :func:`crosskd.train.trainable.first_groups`), the parameters it names follow :func:`lr_at`
  from the first step; the others have a learning rate of 0 for ``first_steps`` steps (the
  trainer also drops their gradients then: no update, no optimizer state, no part in the
  clipping or the reported norm), then join with a warmup of their own: :func:`lr_at` times
  ``min(1, (s - first_steps + 1) / warmup_steps)`` at step ``s`` (so a pretrained body is not
  hit at the peak rate by the gradients of the embeddings' first steps).
* :func:`kd_weight_at`: ``loss.kd_weight * min(1, (s + 1) / kd_warmup_steps)`` (the KD term
  fades in over ``kd_warmup_steps`` steps; a dynamic ``kd_scale`` is scaled by the same
  factor); :func:`step_loss` is the loss config of a step with it.

Steps are 0-based optimizer steps: a resumed run computes what an uninterrupted one did.
"""

from __future__ import annotations

import math
from dataclasses import replace

from crosskd.loss import LossConfig
from crosskd.train.config import TrainConfig


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup over
    ``warmup_steps``, then cosine from ``lr`` down to ``lr * min_lr_ratio`` at ``steps``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(config.steps - config.warmup_steps, 1)
    progress = min((step - config.warmup_steps) / span, 1.0)
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def group_lrs(step: int, config: TrainConfig, groups: int) -> list[float]:
    """The learning rate of each of the optimizer's ``groups`` parameter groups (1: every
    trained parameter; 2: ``first_trainable``'s, then the others) at step ``step`` (module
    docstring)."""
    lr = lr_at(step, config)
    if groups == 1:
        return [lr]
    joined = step - config.first_steps
    if joined < 0:
        return [lr, 0.0]
    return [lr, lr * min(1.0, (joined + 1) / max(config.warmup_steps, 1))]


def kd_weight_at(step: int, config: TrainConfig) -> float:
    """The KD term's weight at step ``step``: ``loss.kd_weight`` times ``min(1, (step + 1) /
    kd_warmup_steps)`` (the full weight when ``kd_warmup_steps`` is 0)."""
    weight = config.loss.kd_weight
    if config.kd_warmup_steps == 0:
        return weight
    return weight * min(1.0, (step + 1) / config.kd_warmup_steps)


def step_loss(step: int, config: TrainConfig) -> LossConfig:
    """The loss config of step ``step``: ``config.loss`` with :func:`kd_weight_at`'s weight
    (the same object once the KD warmup is over)."""
    weight = kd_weight_at(step, config)
    if weight == config.loss.kd_weight:
        return config.loss
    return replace(config.loss, kd_weight=weight)
