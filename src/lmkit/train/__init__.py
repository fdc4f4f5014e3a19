"""Training: the loop, optimizer groups and schedule, checkpoints, metrics and the objective registry."""
from lmkit.train.config import TrainConfig
from lmkit.train.trainer import Trainer, train

__all__ = ["TrainConfig", "Trainer", "train"]
