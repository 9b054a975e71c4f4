"""Per-token log-probabilities log_softmax(logits / T)[target] in one pass over the vocabulary.

The forward keeps an online max / sum-exp per row in float32 registers, so no [N, V] float32
tensor is ever materialised (at V = 152k and 8k tokens that copy alone would be 5 GB). The
backward (when logits require grad) is a second Triton pass writing
grad_logits = g * (onehot(target) - softmax(logits / T)) / T in the logits' dtype, from the
per-row log-sum-exp saved by the forward. Torch references are in `kernels/reference.py`.
"""

import math

import torch
import triton
import triton.language as tl

from kernels.reference import token_logprobs_grad_torch, token_logprobs_torch, use_triton

GPU_MAX_BLOCK = 4096
CPU_MAX_BLOCK = 1024  # tests lower it to exercise several blocks per row


@triton.jit
def _logprob_fwd_kernel(x_ptr, stride, tgt_ptr, out_ptr, lse_ptr, ent_ptr, N, V, temp,
                        ROWS: tl.constexpr, BLOCK: tl.constexpr, ENTROPY: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < N
    row_ptr = x_ptr + rows.to(tl.int64)[:, None] * stride
    m = tl.full([ROWS], -3.0e38, dtype=tl.float32)  # finite so all -inf blocks give 0, not nan
    z = tl.zeros([ROWS], dtype=tl.float32)
    a = tl.zeros([ROWS], dtype=tl.float32)  # sum of e^(s - m) * (s - m), rescaled as m grows (entropy)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = rmask[:, None] & (cols < V)[None, :]
        s = tl.load(row_ptr + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32) / temp
        m_new = tl.maximum(m, tl.max(s, 1))
        scale = tl.exp(m - m_new)
        e = tl.exp(s - m_new[:, None])
        if ENTROPY:  # e^(s-m) (s-m) summed; masked entries (s = -inf, e = 0) count 0, not 0 * -inf
            a = scale * (a + (m - m_new) * z) + tl.sum(e * tl.where(mask, s - m_new[:, None], 0.0), 1)
        z = z * scale + tl.sum(e, 1)
        m = m_new
    z = tl.where(rmask, z, 1.0)  # padding rows: avoid log(0)
    lse = m + tl.log(z)
    tgt = tl.load(tgt_ptr + rows, mask=rmask, other=0)
    s_t = tl.load(x_ptr + rows.to(tl.int64) * stride + tgt, mask=rmask, other=0.0).to(tl.float32) / temp
    tl.store(out_ptr + rows, s_t - lse, mask=rmask)
    tl.store(lse_ptr + rows, lse, mask=rmask)
    if ENTROPY:  # -sum p log p = log z - sum e^(s-m) (s-m) / z
        tl.store(ent_ptr + rows, tl.log(z) - a / z, mask=rmask)


@triton.jit
def _logprob_bwd_kernel(x_ptr, stride, tgt_ptr, lse_ptr, g_ptr, dx_ptr, dstride, N, V, temp,
                        ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < N
    row_ptr = x_ptr + rows.to(tl.int64)[:, None] * stride
    drow_ptr = dx_ptr + rows.to(tl.int64)[:, None] * dstride
    lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
    tgt = tl.load(tgt_ptr + rows, mask=rmask, other=-1)
    g = tl.load(g_ptr + rows, mask=rmask, other=0.0) / temp
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = rmask[:, None] & (cols < V)[None, :]
        s = tl.load(row_ptr + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32) / temp
        p = tl.exp(s - lse[:, None])
        onehot = (cols[None, :] == tgt[:, None]).to(tl.float32)
        dx = g[:, None] * (onehot - p)
        tl.store(drow_ptr + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _launch_shape(n: int, vocab: int, on_gpu: bool) -> tuple[int, int]:
    """(ROWS, BLOCK): one row per program on GPU, many in the interpreter (cost per op there)."""
    block = min(triton.next_power_of_2(vocab), GPU_MAX_BLOCK if on_gpu else CPU_MAX_BLOCK)
    rows = 1 if on_gpu else max(1, min(triton.next_power_of_2(n), (1 << 16) // block))
    return rows, block


def _fwd_triton(x: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool = False):
    n, vocab = x.shape
    out = torch.empty(n, dtype=torch.float32, device=x.device)
    lse = torch.empty(n, dtype=torch.float32, device=x.device)
    ent = torch.empty(n, dtype=torch.float32, device=x.device) if entropy else None
    if n:
        rows, block = _launch_shape(n, vocab, x.is_cuda)
        _logprob_fwd_kernel[(triton.cdiv(n, rows),)](x, x.stride(0), targets, out, lse, ent if entropy else out, n,
                                                     vocab, temperature, ROWS=rows, BLOCK=block, ENTROPY=entropy)
    return (out, lse, ent) if entropy else (out, lse)


def _bwd_triton(x, targets, lse, grad, temperature: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    n, vocab = x.shape
    dx = torch.empty(x.shape, dtype=dtype or x.dtype, device=x.device)
    if n:
        rows, block = _launch_shape(n, vocab, x.is_cuda)
        g = grad.to(torch.float32).contiguous()
        _logprob_bwd_kernel[(triton.cdiv(n, rows),)](x, x.stride(0), targets, lse, g, dx, dx.stride(0), n, vocab,
                                                     temperature, ROWS=rows, BLOCK=block)
    return dx


class TokenLogprobs(torch.autograd.Function):
    """Differentiable token log-probs on [N, V] logits; `kernels` picks Triton or torch."""

    @staticmethod
    def forward(state, logits, targets, temperature: float, kernels: bool):
        if kernels:
            out, lse = _fwd_triton(logits, targets, temperature)
        else:
            out = token_logprobs_torch(logits, targets, temperature)
            lse = torch.logsumexp(logits.to(out.dtype) / temperature, dim=-1)
        state.save_for_backward(logits, targets, lse)
        state.temperature, state.kernels = temperature, kernels
        return out

    @staticmethod
    def backward(state, grad):
        logits, targets, lse = state.saved_tensors
        if state.kernels:
            dx = _bwd_triton(logits, targets, lse, grad, state.temperature)
        else:
            dx = token_logprobs_grad_torch(logits, targets, lse, grad, state.temperature)
        return dx, None, None, None


def _check(logits, targets, temperature, check_values: bool) -> None:
    """Raise one ValueError listing every problem with the arguments."""
    problems = []
    if not torch.is_tensor(logits) or logits.dim() < 1 or not logits.is_floating_point():
        raise ValueError(f"logits: expected a floating-point [..., V] tensor, got {getattr(logits, 'shape', logits)}")
    if not torch.is_tensor(targets) or targets.is_floating_point() or targets.dtype == torch.bool:
        problems.append("targets: expected an integer tensor")
    elif targets.shape != logits.shape[:-1]:
        problems.append(f"targets: shape {list(targets.shape)} does not match logits {list(logits.shape[:-1])}")
    elif targets.device != logits.device:
        problems.append(f"targets: on {targets.device}, logits on {logits.device}")
    elif check_values and targets.numel() and bool(((targets < 0) | (targets >= logits.shape[-1])).any()):
        problems.append(f"targets: values must be in [0, {logits.shape[-1]})")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
        problems.append(f"temperature: expected a finite number > 0, got {temperature!r}")
    if problems:
        raise ValueError("invalid token_logprobs arguments: " + "; ".join(problems))


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   check: bool = True) -> torch.Tensor:
    """log_softmax(logits / T) at `targets`: logits [..., V], targets [...] -> [...] float32
    (float64 for float64 logits). Differentiable w.r.t. logits when they require grad.

    Triton kernels on CUDA tensors and on CPU under TRITON_INTERPRET=1 (float64 always takes the
    torch path, e.g. for gradcheck); otherwise the torch reference. check=False skips the
    target range check, the only part that waits for the device.
    """
    _check(logits, targets, temperature, check)
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    x = logits.reshape(-1, vocab)
    if x.stride(-1) != 1:
        x = x.contiguous()
    tgt = targets.reshape(-1).to(torch.int64).contiguous()
    tri = use_triton(x) and x.dtype != torch.float64
    if x.requires_grad and torch.is_grad_enabled():
        out = TokenLogprobs.apply(x, tgt, float(temperature), tri)
    elif tri:
        out = _fwd_triton(x, tgt, float(temperature))[0]
    else:
        out = token_logprobs_torch(x, tgt, float(temperature))
    return out.reshape(lead)


def logprob_entropy_stats(z: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                          entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One Triton pass over float32 logits z [N, V]: (log-prob of `targets`, log-sum-exp, entropy or
    None) of softmax(z / T), all float32 [N]. No autograd: `logprob_grad_logits` is the backward."""
    if not (z.dim() == 2 and z.dtype == torch.float32 and z.stride(-1) == 1 and use_triton(z)):
        raise ValueError("logprob_entropy_stats: float32 [N, V] row-contiguous logits on a Triton device expected")
    out = _fwd_triton(z, targets.to(torch.int64).contiguous(), float(temperature), entropy)
    return out if entropy else (*out, None)


def logprob_grad_logits(z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor,
                        temperature: float = 1.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """grad * (onehot(target) - softmax(z / T)) / T from the forward's log-sum-exp, written directly
    in `dtype` (default z's: e.g. bf16 to feed the lm_head's backward GEMMs)."""
    return _bwd_triton(z, targets.to(torch.int64).contiguous(), lse, grad, float(temperature), dtype)
