"""Student training: :class:`TrainConfig`, the :class:`Trainer` (setup, train, save) and
checkpoints without pickle."""

from crosskd.train.config import TrainConfig
from crosskd.train.trainer import Trainer, TrainingError, lr_at, step_rows

__all__ = ["TrainConfig", "Trainer", "TrainingError", "lr_at", "step_rows"]
