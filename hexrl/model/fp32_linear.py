"""float32 logits from low-precision weights: x @ W^T with fp32 accumulation and fp32 output.

The GEMMs run in the weights' dtype (bf16 on a GPU) and keep the fp32 accumulator: on CUDA that
is cuBLAS `out_dtype=torch.float32`; on CPU the operands are upcast (CPU only: the CPU has no
mixed-dtype GEMM, and the weight matrix is never upcast on a GPU). One autograd Function serves
both devices, so the CPU suite checks the backward the GPU runs.
"""
from __future__ import annotations

import torch

# torch >= 2.9 has mm(..., out_dtype=) on CUDA (cuBLAS writes its fp32 accumulator directly)
MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [m, k] @ b [k, n] in the operands' (common) dtype with a float32 result (float64 stays
    float64). Low-precision CUDA operands keep their dtype; CPU ones are upcast."""
    if a.dtype != b.dtype:
        raise ValueError(f"mm_fp32: operands of one dtype expected, got {a.dtype} and {b.dtype}")
    if a.dtype in (torch.float32, torch.float64):
        return torch.mm(a, b)
    if a.is_cuda:
        if MM_OUT_DTYPE:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.mm(a, b).float()  # old torch: the output is rounded to the operands' dtype first
    return torch.mm(a.float(), b.float())


class Fp32Linear(torch.autograd.Function):
    """y = x @ W^T as float32; backward: both GEMMs in W's dtype with fp32 accumulation, gradients
    returned in the inputs' dtypes (the grad of y is rounded to W's dtype to feed them)."""

    @staticmethod
    def forward(state, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        state.save_for_backward(x, weight)
        return mm_fp32(x.reshape(-1, x.shape[-1]), weight.t()).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(state, grad: torch.Tensor):
        x, weight = state.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).to(weight.dtype)
        grad_x = grad_w = None
        if state.needs_input_grad[0]:
            grad_x = mm_fp32(g, weight).to(x.dtype).view(x.shape)
        if state.needs_input_grad[1]:
            grad_w = mm_fp32(g.t(), x.reshape(-1, x.shape[-1])).to(weight.dtype)
        return grad_x, grad_w


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight[out, in]^T -> float32 [..., out] (float64 for float64), differentiable."""
    return Fp32Linear.apply(x, weight)
