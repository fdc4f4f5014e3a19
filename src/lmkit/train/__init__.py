"""Training: the one loop every job runs through, pre-training, optimizer groups and schedules, checkpoints,
metrics and the objective registry."""
from lmkit.train.config import TrainConfig
from lmkit.train.job import Job, Objective
from lmkit.train.loop import LoopSettings, TrainLoop
from lmkit.train.trainer import Trainer, train

__all__ = ["Job", "LoopSettings", "Objective", "TrainConfig", "TrainLoop", "Trainer", "train"]
