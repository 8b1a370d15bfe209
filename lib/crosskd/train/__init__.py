"""Student training: :class:`TrainConfig`, the :class:`Trainer` (setup, train, save), the data
order, checkpoints without pickle, the training pod's entry point and the export of the
finished model. The parallelism it uses is :mod:`crosskd.parallel`'s."""

from crosskd.errors import NonFiniteLoss, TrainingError
from crosskd.train.config import TrainConfig
from crosskd.train.order import DataOrder, ShardOrder, rank_micro_batches
from crosskd.train.schedule import lr_at
from crosskd.train.trainer import Trainer, finished_model

__all__ = [
    "DataOrder",
    "NonFiniteLoss",
    "ShardOrder",
    "TrainConfig",
    "Trainer",
    "TrainingError",
    "finished_model",
    "lr_at",
    "rank_micro_batches",
]
