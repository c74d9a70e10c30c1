"""Training: the deterministic, resumable training loop, the recipes, and building the zoo."""

from phaselens.train.family.checkpoints import load_checkpoint
from phaselens.train.loop import TrainResult, TrainSettings, train

__all__ = ["TrainResult", "TrainSettings", "load_checkpoint", "train"]
