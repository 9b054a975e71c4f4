"""The GRPO trainer: process grid, TP/PP/DP, packing, decoupled PPO loss, checkpoints."""
from .grid import Grid, Layout, StageSpec, build_grid
from .trainer import TrainConfig, Trainer

__all__ = ["Grid", "Layout", "StageSpec", "TrainConfig", "Trainer", "build_grid"]
