"""The GRPO trainer: process grid, TP/PP/DP, packing, decoupled PPO loss, checkpoints."""
from .grid import Grid, build_grid
from .trainer import TrainConfig, Trainer

__all__ = ["Grid", "TrainConfig", "Trainer", "build_grid"]
