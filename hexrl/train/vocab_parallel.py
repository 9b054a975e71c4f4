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


class _VocabParallelLogprob(torch.autograd.Function):
    """One float32 [N, V/tp] buffer: z = logits / T, turned in place into exp(z - max), then into the
    softmax that backward needs. The entropy (optional) is reduced from it in row chunks."""

    @staticmethod
    def forward(state, logits, targets, temperature: float, group, entropy: bool):
        dtype = torch.promote_types(logits.dtype, torch.float32)  # f64 stays f64
        z = logits.to(dtype, copy=True).div_(temperature)
        n, width = z.shape
        start = dist.get_rank(group) * width
        local = targets - start
        mine = (local >= 0) & (local < width)
        target_z = torch.where(mine, z.gather(1, local.clamp(0, width - 1)[:, None])[:, 0], 0.0)
        zmax = z.max(dim=1).values
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
        e = z.sub_(zmax[:, None]).exp_()  # z is not needed again: exp(z - max) in its buffer
        # sum_j e_j * (z_j - max) = sum_j e_j * log(e_j), in chunks so no second [N, V/tp] buffer exists
        ez = torch.cat([torch.special.xlogy(c, c).sum(1) for c in e.split(1024)]) if entropy and n \
            else e.new_zeros(n)
        stats = torch.stack([e.sum(dim=1), target_z, ez])
        dist.all_reduce(stats, group=group)
        sumexp, target_z, ez = stats
        lse = zmax + torch.log(sumexp)
        ent = (lse - zmax - ez / sumexp) if entropy else None
        probs = e.div_(sumexp[:, None])  # softmax of this slice, for backward
        state.save_for_backward(probs, local.clamp(0, width - 1), mine)
        state.temperature, state.dtype = temperature, logits.dtype
        if ent is not None:
            state.mark_non_differentiable(ent)
        return target_z - lse, ent

    @staticmethod
    def backward(state, grad, _grad_entropy):
        probs, local, mine = state.saved_tensors
        grad_z = probs.mul_(-grad[:, None])  # the saved buffer is not needed again
        grad_z.scatter_add_(1, local[:, None], torch.where(mine, grad, 0.0)[:, None])  # no host sync
        return grad_z.div_(state.temperature).to(state.dtype), None, None, None, None


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
