"""The rollout's fused small kernels: FlashInfer on the no-grad CUDA path, the same math in torch elsewhere.

The fused (inference) layout of the decoder (`Decoder.fuse`) and the paged-KV backends call these. Each
op picks per call: FlashInfer when the tensor is CUDA fp16/bf16, autograd is off, flashinfer imports and
the shape is one its kernels dispatch (`HEAD_DIMS`, 16-byte rows for SiLU); plain torch otherwise (CPU,
fp32, anything differentiated, a head dim FlashInfer raises on). The torch versions compute what
the split training path computes, and the GPU tests hold the kernels to them. Per decode layer that is
two fused add+RMSNorm, one in-place RoPE, one SiLU-and-mul and one KV append instead of ~17 kernels.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .rotary import Rotary

FLASHINFER = True  # False: torch everywhere (to compare the two paths side by side)
_DTYPES = (torch.float16, torch.bfloat16)
# FlashInfer 0.5.3's RoPE and KV append go through DISPATCH_HEAD_DIM (include/flashinfer/utils.cuh), which
# takes 64/128/256/512 and raises otherwise; 512 is left out as no attention module of ours is built or tested
# for it. The one rule for every call site, the attention backend's included (`head_dim_problem`).
HEAD_DIMS = (64, 128, 256)


@functools.cache
def _flashinfer():
    try:
        import flashinfer
    except Exception:  # ImportError, or a broken install failing at import
        return None
    return flashinfer


def head_dim_problem(head_dim: int) -> str | None:
    """Why FlashInfer's per-head kernels (RoPE, KV append, paged attention) cannot take `head_dim` (None: they can)."""
    if head_dim in HEAD_DIMS:
        return None
    return f"head_dim {head_dim} is not one FlashInfer dispatches ({', '.join(map(str, HEAD_DIMS))})"


def kernel_tensor(x: torch.Tensor) -> bool:
    """Whether FlashInfer's kernels can take `x` at all (CUDA fp16/bf16, no autograd, flashinfer present)."""
    return (FLASHINFER and x.is_cuda and x.dtype in _DTYPES and not torch.is_grad_enabled()
            and _flashinfer() is not None)


def use_flashinfer(x: torch.Tensor, head_dim: int | None = None) -> bool:
    """Whether an op runs FlashInfer's kernel on `x`: `kernel_tensor(x)` and, for the per-head kernels,
    a `head_dim` FlashInfer dispatches."""
    return (head_dim is None or head_dim_problem(head_dim) is None) and kernel_tensor(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of [T, H] rows."""
    if use_flashinfer(x):
        return _flashinfer().rmsnorm(x, weight, eps)
    return torch_rms_norm(x, weight, eps)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in torch (the training path and the reference for FlashInfer's kernels)."""
    h = x.float()  # statistics in fp32, as HF does, so bf16 runs match
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): a layer's residual add and the next norm. FlashInfer
    works in place (x becomes the normed rows, residual the sum), so x must be a fresh activation."""
    if use_flashinfer(x):
        _flashinfer().fused_add_rmsnorm(x, residual, weight, eps)
        return x, residual
    residual = residual + x
    return torch_rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up, as the fused gate_up projection stacks them) -> silu(gate) * up, [T, I]."""
    # FlashInfer's kernel loads 16-byte vectors from both halves: each half's row must be a multiple of 16 bytes
    if use_flashinfer(x) and x.shape[-1] // 2 * x.element_size() % 16 == 0:
        return _flashinfer().silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary: Rotary,
         head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q [T, Hq*D] and k [T, Hkv*D] (views of the fused qkv output) -> [T, H, D].
    FlashInfer rotates in place from `rotary.cos_sin_cache` (fp32 cos/sin of every position, the same
    numbers the torch path computes); torch returns new tensors (`rotary(x, positions)`)."""
    t = q.shape[0]
    if use_flashinfer(q, head_dim):
        _flashinfer().apply_rope_with_cos_sin_cache_inplace(
            positions, q, k, head_dim, rotary.cos_sin_cache(q.device), is_neox=True)
        return q.view(t, -1, head_dim), k.view(t, -1, head_dim)
    return rotary(q.view(t, -1, head_dim), positions), rotary(k.view(t, -1, head_dim), positions)


@dataclass
class KVSlots:
    """Where a step's T new tokens' k/v go: page `pages[i]`, offset `offsets[i]` (int32, on the device).
    FlashInfer's append sees token i as a request of one page: batch i, page `indptr[i]`, position
    `offsets[i]` (its kernel writes page indices[indptr[b] + pos // page_size] at pos % page_size)."""

    pages: torch.Tensor
    offsets: torch.Tensor
    indptr: torch.Tensor  # arange(T + 1): token i's "request" starts at page list entry i
    last_page_len: torch.Tensor  # [T]: not read by the append, but its length is the batch size

    @classmethod
    def of(cls, pages: torch.Tensor, offsets: torch.Tensor) -> "KVSlots":
        """The slots of tokens going to `pages` [T] at `offsets` [T], with FlashInfer's index tensors."""
        i32 = dict(dtype=torch.int32, device=pages.device)
        t = len(pages)
        return cls(pages.to(torch.int32), offsets.to(torch.int32), torch.arange(t + 1, **i32),
                   torch.ones(t, **i32))


def write_kv(cache: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store new tokens' k/v [T, Hkv, D] into `cache` [P, 2, page_size, Hkv, D] (graph-capturable)."""
    cache[pages, 0, offsets] = k.to(cache.dtype)
    cache[pages, 1, offsets] = v.to(cache.dtype)


def append_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: KVSlots) -> None:
    """`write_kv` into the slots: one FlashInfer `append_paged_kv_cache` (k/v may be strided views)."""
    if use_flashinfer(k, k.shape[-1]) and k.dtype == cache.dtype:
        _flashinfer().append_paged_kv_cache(k, v, slots.indptr[:-1], slots.offsets, cache, slots.pages,
                                            slots.indptr, slots.last_page_len, kv_layout="NHD")
        return
    write_kv(cache, slots.pages, slots.offsets, k, v)
