"""The lm_head and the log-prob of the sampled tokens in one pass over row chunks (Liger-style).

A micro-batch of N completion tokens would need an [N, V] float32 logits tensor (3.7 GB at
N = 6,144 and V = 152k); here only one [chunk_rows, V/tp] chunk exists at a time. The forward keeps
each row's log-sum-exp (and, optionally, the entropy, which has no gradient); the backward
recomputes the logits from the saved hidden states and weight in vocabulary chunks of the same size
(all rows x some columns, so each lm_head gradient row is written once by one GEMM), turns them into
grad * (onehot - softmax) / T with the saved log-sum-exp, and feeds both GEMMs (weights' dtype, fp32
accumulation, as `hexrl.model.fp32_linear`). Under TP each chunk's row max, sum-exp and target logit are
all-reduced across the group (`softmax_stats`), and the hidden-state gradient is all-reduced by
`copy_to_tp`, as for the column-parallel lm_head. At TP = 1 on a GPU (and on CPU under
TRITON_INTERPRET=1) `kernels.logprob` does each chunk in one Triton pass each way: log-prob,
log-sum-exp and entropy online, and the logits' gradient written straight in the weights' dtype (the
backward's kernel needs no collective under TP either: the log-sum-exp is already global).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hexrl.model.fp32_linear import mm_fp32
from hexrl.model.parallel import TPGroup, copy_to_tp

from .vocab_parallel import softmax_grad_, softmax_stats

try:  # one Triton pass per chunk each way at TP = 1 (the kernels package is optional on odd installs)
    from kernels.logprob import logprob_entropy_stats, logprob_grad_logits
    from kernels.reference import use_triton
except ImportError:
    use_triton = None

CHUNK_ROWS = 1024


def _fused(z: torch.Tensor, group) -> bool:
    """The Triton kernels take float32 logits of the whole vocabulary (TP = 1) on a Triton device."""
    return group is None and use_triton is not None and z.dtype == torch.float32 and use_triton(z)


def _chunk_stats(h, weight, targets, temperature: float, group, entropy: bool):
    """(logp, lse, entropy or None) of one chunk of rows."""
    z = mm_fp32(h, weight.t())
    if _fused(z, group):
        return logprob_entropy_stats(z, targets, temperature, entropy)
    return softmax_stats(z.div_(temperature) if temperature != 1.0 else z, targets, group, entropy)[:3]


def _cols_grad_logits(hidden, weight, targets, lse, grad, temperature: float) -> torch.Tensor:
    """d(sum grad * logp) / d logits for all rows and the vocab slice `weight` [cols, H], recomputed from
    `hidden` and the forward's global log-sum-exp, in the weights' dtype. `targets` are relative to the
    slice's first column (outside [0, cols): no one-hot here); no collective is needed."""
    z = mm_fp32(hidden, weight.t())
    if _fused(z, None):
        return logprob_grad_logits(z, targets, lse, grad, temperature, weight.dtype)
    probs = (z.div_(temperature) if temperature != 1.0 else z).sub_(lse[:, None]).exp_()
    return softmax_grad_(probs, targets, grad, temperature, None).to(weight.dtype)


def vocab_cols(n: int, vocab: int, chunk_rows: int) -> int:
    """Vocab columns per backward chunk: [n, cols] logits hold at most the forward's chunk_rows * vocab."""
    return max(1, min(vocab, chunk_rows * vocab // max(n, 1)))


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(state, hidden, weight, targets, temperature: float, group, entropy: bool, chunk_rows: int):
        n = hidden.shape[0]
        dtype = torch.promote_types(weight.dtype, torch.float32)
        logp, lse = hidden.new_empty(n, dtype=dtype), hidden.new_empty(n, dtype=dtype)
        ent = hidden.new_empty(n, dtype=dtype) if entropy else None
        for s in range(0, n, chunk_rows):
            rows = slice(s, s + chunk_rows)
            lp, lse[rows], e = _chunk_stats(hidden[rows], weight, targets[rows], temperature, group, entropy)
            logp[rows] = lp
            if entropy:
                ent[rows] = e
        state.save_for_backward(hidden, weight, targets, lse)
        state.temperature, state.group, state.chunk_rows = temperature, group, chunk_rows
        if ent is not None:
            state.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(state, grad, _grad_entropy):
        """Chunked over the vocabulary, not the rows: each weight-gradient row is one GEMM's output, written
        once (row chunks would each write a fresh fp32 [V, H] partial and add it in: 0.93 GB per chunk at
        1.5B), and the hidden-state gradient, [N, H], is what accumulates."""
        hidden, weight, targets, lse = state.saved_tensors
        want_h, want_w = state.needs_input_grad[:2]
        n, vocab = hidden.shape[0], weight.shape[0]
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_h = hidden.new_zeros(hidden.shape, dtype=acc) if want_h else None
        grad_w = torch.empty_like(weight) if want_w else None
        first = dist.get_rank(state.group) * vocab if state.group is not None else 0  # this shard's first id
        cols = vocab_cols(n, vocab, state.chunk_rows)
        for c in range(0, vocab, cols):
            w = weight[c:c + cols]
            dz = _cols_grad_logits(hidden, w, targets - (first + c), lse, grad, state.temperature)
            if want_h:
                grad_h.add_(mm_fp32(dz, w))
            if want_w:
                grad_w[c:c + cols] = mm_fp32(dz.t(), hidden)
        return (grad_h.to(hidden.dtype) if want_h else None), grad_w, None, None, None, None, None


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, tp: TPGroup | None = None,
                    temperature: float = 1.0, entropy: bool = True, chunk_rows: int = CHUNK_ROWS):
    """Log-prob of `targets` [N] (global vocab ids) and entropy [N] (no gradient; None unless asked)
    under softmax(hidden @ weight^T / T), for normed hidden states [N, H] and this rank's lm_head
    slice `weight` [V/tp, H], without materialising more than [chunk_rows, V/tp] logits.
    float32 results (float64 for float64 weights); differentiable w.r.t. hidden and weight."""
    shapes_ok = hidden.dim() == weight.dim() == 2 and hidden.shape[1] == weight.shape[1]
    if not shapes_ok or targets.shape != hidden.shape[:1]:
        raise ValueError(f"linear_logprobs: hidden [N, H], weight [V, H], targets [N] expected; got "
                         f"{list(hidden.shape)}, {list(weight.shape)}, {list(targets.shape)}")
    if chunk_rows < 1:
        raise ValueError(f"linear_logprobs: chunk_rows must be >= 1, got {chunk_rows}")
    group = tp.group if tp is not None and tp.size > 1 else None
    x = copy_to_tp(hidden, tp)  # the hidden-state gradient is summed over the vocab shards
    return _LinearLogprobs.apply(x, weight, targets, float(temperature), group, entropy, int(chunk_rows))
