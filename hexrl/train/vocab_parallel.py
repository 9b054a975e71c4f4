"""Log-probabilities of target tokens from vocab-sharded logits, never building the full vocabulary.

Each TP rank holds logits for its contiguous vocabulary slice. Three all-reduces give the
global row max, the global sum of exponentials and the target's logit (only its owner holds
it); the backward is local: `g * (onehot - softmax) / T` on this rank's slice. The lm_head's
column-parallel input all-reduces the hidden-state gradient, so nothing more is needed here.
With TP = 1 the `kernels.logprob` kernel does the work in one pass.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hexrl.model.parallel import TPGroup


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature: float, group):
        z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # f64 stays f64
        start = dist.get_rank(group) * z.shape[1]
        zmax = z.max(dim=1).values
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(z - zmax[:, None])
        sumexp = e.sum(dim=1)
        local = targets - start
        mine = (local >= 0) & (local < z.shape[1])
        target_z = torch.where(mine, z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None])[:, 0], 0.0)
        ez = (e * z).sum(dim=1)  # for the entropy: sum_j exp(z_j - max) * z_j
        stats = torch.stack([sumexp, target_z, ez])
        dist.all_reduce(stats, group=group)
        sumexp, target_z, ez = stats
        lse = zmax + torch.log(sumexp)
        entropy = lse - ez / sumexp
        probs = e.div_(sumexp[:, None])  # reuse the buffer: softmax of this slice, for backward
        ctx.save_for_backward(probs, local, mine)
        ctx.temperature, ctx.dtype = temperature, logits.dtype
        ctx.mark_non_differentiable(entropy)
        return target_z - lse, entropy

    @staticmethod
    def backward(ctx, grad, _grad_entropy):
        probs, local, mine = ctx.saved_tensors
        grad_z = probs.mul_(-grad[:, None])  # the saved buffer is not needed again
        rows = torch.nonzero(mine)[:, 0]
        grad_z[rows, local[rows]] += grad[rows]
        return (grad_z / ctx.temperature).to(ctx.dtype), None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, tp: TPGroup | None,
                            temperature: float = 1.0, entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of `targets` [N] (global vocab ids) and the entropy [N] (no gradient) under
    softmax(logits / T), from this rank's vocab slice `logits` [N, V/tp]. float32 results
    (float64 for float64 logits). `entropy=False` may skip the entropy (None) where it costs a pass."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [N, V_local] and targets [N]; got {list(logits.shape)}, {list(targets.shape)}")
    group = tp.group if tp is not None and tp.size > 1 else None
    if group is None:
        return _single_logprobs(logits, targets, temperature, entropy)
    return _VocabParallelLogprob.apply(logits, targets, float(temperature), group)


def _single_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool):
    """TP = 1: the kernel for the log-prob; the entropy from a no-grad pass."""
    try:
        from kernels.logprob import token_logprobs
    except ImportError:  # the kernels package is optional on odd installs; same maths in torch
        token_logprobs = _torch_logprobs
    logp = token_logprobs(logits, targets, temperature)
    if not entropy:
        return logp, None
    with torch.no_grad():  # in row chunks: a full float32 copy of big-vocab logits is gigabytes
        ent = torch.cat([_entropy(c.float() / temperature) for c in logits.split(1024)]) if len(logits) \
            else logits.new_zeros(0, dtype=torch.float32)
    return logp, ent


def _entropy(z: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)


def _torch_logprobs(logits, targets, temperature=1.0):
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, targets[:, None])[:, 0]
