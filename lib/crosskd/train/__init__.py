"""Student training: :class:`TrainConfig`, the :class:`Trainer` (setup, train, save), the
parallel layout (:class:`ParallelLayout`), the data order, packed attention inputs and
checkpoints without pickle."""

from crosskd.errors import NonFiniteLoss, TrainingError
from crosskd.layout import ParallelLayout
from crosskd.train.config import TrainConfig
from crosskd.train.order import DataOrder, ShardOrder, rank_micro_batches
from crosskd.train.trainer import Trainer, finished_model, lr_at

__all__ = [
    "DataOrder",
    "NonFiniteLoss",
    "ParallelLayout",
    "ShardOrder",
    "TrainConfig",
    "Trainer",
    "TrainingError",
    "finished_model",
    "lr_at",
    "rank_micro_batches",
]
