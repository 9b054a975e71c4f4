"""Softmax statistics of target tokens from vocab-sharded logits, never building the full vocabulary.

Each TP rank holds logits for its contiguous vocabulary slice. Two all-reduces give the global row
max, then the global sum of exponentials, the target's logit (only its owner holds it) and the
entropy term; the gradient is local: `g * (onehot - softmax) / T` on this rank's slice, without
host syncs. `hexrl.train.linear_logprobs` calls these per row chunk (the lm_head's column-parallel
input all-reduces the hidden-state gradient, so nothing more is needed here).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _slice_targets(targets: torch.Tensor, width: int,
                   group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(column of each target in this rank's vocab slice, clamped; whether this rank owns it)."""
    local = targets - (dist.get_rank(group) * width if group is not None else 0)
    mine = (local >= 0) & (local < width)
    return local.clamp(0, width - 1), mine


def softmax_stats(z: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup | None, entropy: bool):
    """Log-prob of `targets` and entropy (None unless asked) over the global vocabulary, from this
    rank's slice `z` [n, V/tp] of logits / T (float32 or float64), which becomes the slice's softmax
    in place. Two all-reduces over `group` (None: one rank). Returns (logp, lse, entropy, probs)."""
    n, width = z.shape
    local, mine = _slice_targets(targets, width, group)
    target_z = torch.where(mine, z.gather(1, local[:, None])[:, 0], 0.0)
    zmax = z.max(dim=1).values if width else z.new_full((n,), -torch.inf)
    if group is not None:
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
    e = z.sub_(zmax[:, None]).exp_()  # z is not needed again: exp(z - max) in its buffer
    # sum_j e_j * (z_j - max) = sum_j e_j * log(e_j), in row chunks so no second [n, V/tp] buffer exists
    ez = torch.cat([torch.special.xlogy(c, c).sum(1) for c in e.split(1024)]) if entropy and n else e.new_zeros(n)
    stats = torch.stack([e.sum(dim=1), target_z, ez])
    if group is not None:
        dist.all_reduce(stats, group=group)
    sumexp, target_z, ez = stats
    lse = zmax + torch.log(sumexp)
    ent = (lse - zmax - ez / sumexp) if entropy else None
    return target_z - lse, lse, ent, e.div_(sumexp[:, None])


def softmax_grad_(probs: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor, temperature: float,
                  group: dist.ProcessGroup | None) -> torch.Tensor:
    """d(sum grad * logp) / d logits on this rank's slice, in `probs`' buffer:
    grad * (onehot - softmax) / T, with no host sync."""
    local, mine = _slice_targets(targets, probs.shape[1], group)
    grad_z = probs.mul_(-grad[:, None])
    grad_z.scatter_add_(1, local[:, None], torch.where(mine, grad, 0.0)[:, None])
    return grad_z.div_(temperature) if temperature != 1.0 else grad_z
