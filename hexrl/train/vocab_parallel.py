"""Log-probabilities of target tokens from vocab-sharded logits, never building the full vocabulary.

Each TP rank holds logits for its contiguous vocabulary slice. Three all-reduces give the
global row max, the global sum of exponentials and the target's logit (only its owner holds
it); the backward is local: `g * (onehot - softmax) / T` on this rank's slice, without host syncs. The lm_head's
column-parallel input all-reduces the hidden-state gradient, so nothing more is needed here.
With TP = 1 the `kernels.logprob` kernel does the work in one pass.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hexrl.model.parallel import TPGroup


def _slice_targets(targets: torch.Tensor, width: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(column of each target in this rank's vocab slice, clamped; whether this rank owns it)."""
    local = targets - (dist.get_rank(group) * width if group is not None else 0)
    mine = (local >= 0) & (local < width)
    return local.clamp(0, width - 1), mine


def softmax_stats(z: torch.Tensor, targets: torch.Tensor, group, entropy: bool):
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
                  group) -> torch.Tensor:
    """d(sum grad * logp) / d logits on this rank's slice, in `probs`' buffer:
    grad * (onehot - softmax) / T, with no host sync."""
    local, mine = _slice_targets(targets, probs.shape[1], group)
    grad_z = probs.mul_(-grad[:, None])
    grad_z.scatter_add_(1, local[:, None], torch.where(mine, grad, 0.0)[:, None])
    return grad_z.div_(temperature) if temperature != 1.0 else grad_z


class _VocabParallelLogprob(torch.autograd.Function):
    """One float32 [N, V/tp] buffer: z = logits / T, turned in place into the softmax that backward needs."""

    @staticmethod
    def forward(state, logits, targets, temperature: float, group, entropy: bool):
        dtype = torch.promote_types(logits.dtype, torch.float32)  # f64 stays f64
        z = logits.to(dtype, copy=True).div_(temperature)
        logp, _, ent, probs = softmax_stats(z, targets, group, entropy)
        state.save_for_backward(probs, targets)
        state.temperature, state.dtype, state.group = temperature, logits.dtype, group
        if ent is not None:
            state.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(state, grad, _grad_entropy):
        probs, targets = state.saved_tensors  # the saved buffer is not needed again
        grad_z = softmax_grad_(probs, targets, grad, state.temperature, state.group)
        return grad_z.to(state.dtype), None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, tp: TPGroup | None,
                            temperature: float = 1.0, entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of `targets` [N] (global vocab ids) and the entropy [N] (no gradient) under
    softmax(logits / T), from this rank's vocab slice `logits` [N, V/tp]. float32 results
    (float64 for float64 logits). `entropy=False` may skip the entropy (None) where it costs a pass."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [N, V_local] and targets [N]; "
                         f"got {list(logits.shape)}, {list(targets.shape)}")
    group = tp.group if tp is not None and tp.size > 1 else None
    if group is None:
        return _single_logprobs(logits, targets, temperature, entropy)
    return _VocabParallelLogprob.apply(logits, targets, float(temperature), group, entropy)


def _single_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool):
    """TP = 1: the kernel for the log-prob; the entropy from a no-grad pass."""
    try:
        from kernels.logprob import token_logprobs
    except ImportError:  # the kernels package is optional on odd installs; same maths in torch
        token_logprobs = _torch_logprobs
    logp = token_logprobs(logits, targets, temperature, check=False)  # ids were checked with the batch
    if not entropy:
        return logp, None
    with torch.no_grad():  # in row chunks: a full float32 copy of big-vocab logits is gigabytes
        ent = torch.cat([_entropy(c.float() / temperature) for c in logits.split(1024)]) if len(logits) \
            else logits.new_zeros(0, dtype=torch.float32)
    return logp, ent


def _entropy(z: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)


def _torch_logprobs(logits, targets, temperature=1.0, check=False):
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, targets[:, None])[:, 0]
