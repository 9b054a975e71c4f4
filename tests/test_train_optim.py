"""The optimizer's learning-rate schedule: linear warm-up, then an optional linear decay to a floor."""
import pytest
import torch

from hexrl.train import TrainConfig
from hexrl.train.optim import AdamW


def adamw(**kw) -> AdamW:
    p = torch.nn.Parameter(torch.zeros(3, 2))
    p.main_grad = torch.zeros(3, 2)
    return AdamW([p], 1e-3, **kw)


def test_lr_at_warm_up_decay_and_floor_by_hand():
    opt = adamw(warmup_steps=4, decay_steps=8, final_frac=0.25)
    # warm-up: (s + 1) / 4; then 1 at step 4 falling by 0.75 / 8 a step to 0.25 at step 12, and 0.25 after
    by_hand = [0.25, 0.5, 0.75, 1.0, 1.0, 0.90625, 0.8125, 0.71875, 0.625, 0.53125, 0.4375, 0.34375, 0.25, 0.25]
    assert [opt.lr_at(s) for s in range(14)] == pytest.approx([1e-3 * f for f in by_hand], rel=1e-12)
    assert opt.lr_at(10_000) == pytest.approx(2.5e-4, rel=1e-12)


def test_lr_at_without_decay_is_the_old_schedule():
    assert [adamw(warmup_steps=2).lr_at(s) for s in (0, 1, 2, 500)] == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3])
    assert [adamw().lr_at(s) for s in (0, 99)] == [1e-3, 1e-3]
    assert adamw(decay_steps=4).lr_at(4) == 0.0  # final_frac defaults to 0: decay to zero


def test_step_uses_the_schedule():
    """Adam's first update is lr * g / (|g| + eps): each element moves by the step's lr."""
    opt = adamw(decay_steps=2, final_frac=0.5)
    p = opt.params[0]
    opt.steps = 1  # as after a resume: the schedule follows the restored step count
    p.main_grad.fill_(3.0)
    assert opt.step() == pytest.approx(7.5e-4)
    assert torch.allclose(p.detach(), torch.full((3, 2), -7.5e-4), rtol=1e-5)
    assert opt.steps == 2 and opt.lr_at(opt.steps) == pytest.approx(5e-4)


def test_train_config_names_bad_decay_fields():
    problems = TrainConfig(lr_decay_steps=-1, lr_final_frac=1.5).problems()
    assert "train.lr_decay_steps: must be >= 0, got -1" in problems
    assert "train.lr_final_frac: must be in [0, 1], got 1.5" in problems
    assert not TrainConfig(lr_decay_steps=10, lr_final_frac=0.25).problems()
