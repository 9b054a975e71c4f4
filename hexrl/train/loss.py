"""GRPO advantages and the decoupled PPO objective of AReaL (Fu et al., 2025: "Decoupled PPO Objective").

Per completion token, with current log-prob θ, proximal p and behaviour b:
    ratio = exp(θ − p),  pg = max(−A·ratio, −A·clip(ratio, 1−ε_low, 1+ε_high)),  w = exp(p − b),
tokens with w > cap are masked, and the loss is Σ w·pg·mask / Σ original_mask. The naive-PPO
ablation sets p = b (so w = 1 and nothing is capped). An optional KL penalty to a frozen
reference uses the k3 estimator exp(r − θ) − (r − θ) − 1 over every completion token.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch


def group_advantages(rewards: list[float], group_ids: list, eps: float = 1e-6) -> list[float]:
    """A_i = (r_i − mean_group) / (std_group + eps), std unbiased (0 for a group of one).

    Finite for any finite rewards: each group is computed in units of its largest |r| (the same
    formula, eps in those units too), so no sum or square overflows. A group holding a non-finite
    reward carries no signal (0), like a group of equal rewards."""
    groups = defaultdict(list)
    for i, g in enumerate(group_ids):
        groups[g].append(i)
    adv = [0.0] * len(rewards)
    for members in groups.values():
        r = [float(rewards[i]) for i in members]
        scale = max(map(abs, r))
        if not (scale > 0 and all(map(math.isfinite, r))):  # all zero (equal), or not a number
            continue
        r = [x / scale for x in r]
        mean = sum(r) / len(r)
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (len(r) - 1)) if len(r) > 1 else 0.0
        for i, x in zip(members, r):
            adv[i] = (x - mean) / (std + eps / scale) if std > 0 else 0.0  # equal rewards: x == mean
    return adv


def equal_reward_groups(rewards: list[float], group_ids: list) -> set:
    """Group ids whose rewards are all equal (no learning signal)."""
    seen = defaultdict(set)
    for r, g in zip(rewards, group_ids):
        seen[g].add(float(r))
    return {g for g, vals in seen.items() if len(vals) == 1}


@dataclass
class LossTerms:
    """Per-token pieces of the objective; sum `loss` and divide by the original token count."""

    loss: torch.Tensor  # w·pg·mask + kl_coef·k3
    clipped: torch.Tensor  # bool: the clipped branch is the larger one (no gradient)
    capped: torch.Tensor  # bool: masked because w > cap
    w: torch.Tensor  # behaviour importance weight exp(p − b) (1 for naive PPO)
    kl: torch.Tensor  # k3 estimate (0 without a reference)


def lag_weights(lag: torch.Tensor, scale: float) -> torch.Tensor:
    """Each token's share of its advantage when older data should take a smaller step (rl.lr_lag_scale):
    1 / (1 + scale * lag), lag = versions between the weights that sampled it and the trainer's."""
    return 1.0 / (1.0 + scale * lag.clamp(min=0).to(torch.float32))


def ppo_terms(logp: torch.Tensor, prox: torch.Tensor | None, behav: torch.Tensor, adv: torch.Tensor,
              clip_low: float = 0.2, clip_high: float = 0.2, behav_cap: float | None = 5.0,
              decoupled: bool = True, ref: torch.Tensor | None = None, kl_coef: float = 0.0) -> LossTerms:
    """The per-token objective. `prox` is ignored (taken as `behav`) when not decoupled;
    `behav_cap=None` disables capping."""
    p = prox if decoupled else behav
    ratio = torch.exp(logp - p)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    pg = torch.maximum(unclipped, clipped)
    if decoupled:
        w = torch.exp(p - behav)
        capped = w > behav_cap if behav_cap is not None else torch.zeros_like(w, dtype=torch.bool)
    else:
        w, capped = torch.ones_like(ratio), torch.zeros_like(ratio, dtype=torch.bool)
    loss = torch.where(capped, 0.0, w * pg)
    kl = torch.zeros_like(loss)
    if ref is not None and kl_coef:
        d = ref - logp
        kl = torch.exp(d) - d - 1
        loss = loss + kl_coef * kl
    return LossTerms(loss, clipped > unclipped, capped, w.detach(), kl.detach())
