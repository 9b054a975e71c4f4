"""Causal attention over packed sequences: the plain-torch backend used for training and tests.

The decoder hands every attention layer's q/k/v, flattened over tokens, to a backend object.
This one attends within each packed sequence (never across boundaries); the rollout engine
supplies a paged-KV backend with the same call signature.
"""
from __future__ import annotations

import inspect
from functools import lru_cache
from itertools import accumulate
from typing import Callable, Protocol

import torch
import torch.nn.functional as F


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for this step's tokens -> output [T, Hq, D]."""


class CausalAttention:
    """Causal self-attention inside each of the packed sequences given by their lengths.

    Equal lengths: one batched SDPA call. Unequal lengths on CUDA in fp16/bf16: one variable-length
    flash-attention call (`torch.nn.attention.varlen.varlen_attn` when this torch has it, else
    FlashAttention's `flash_attn_varlen_func` when installed). Otherwise (the CPU path) one SDPA
    call over the sequences right-padded to the longest.
    """

    def __init__(self, seq_lens: list[int]):
        self.seq_lens = [int(n) for n in seq_lens]
        self._cu: torch.Tensor | None = None  # cumulative lengths on the device, made once per batch
        self._padded: torch.Tensor | None = None  # each token's row in the padded layout, made once per batch

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if len(set(self.seq_lens)) == 1:  # equal lengths: one batched call
            b, s = len(self.seq_lens), self.seq_lens[0]
            return _sdpa(*(t.view(b, s, *t.shape[1:]) for t in (q, k, v))).reshape(q.shape)
        varlen = varlen_function() if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) else None
        if varlen is not None:
            if self._cu is None:
                cu = [0, *accumulate(self.seq_lens)]
                self._cu = torch.tensor(cu, dtype=torch.int32).to(q.device, non_blocking=True)
            return varlen(q, k, v, self._cu, max(self.seq_lens))
        if self._padded is None:
            self._padded = padded_rows(self.seq_lens, q.device)
        return padded_attention(self.seq_lens, self._padded, q, k, v)


def padded_rows(seq_lens: list[int], device: torch.device) -> torch.Tensor:
    """Row of each packed token in a [len(seq_lens) * max(seq_lens)] right-padded layout."""
    lens = torch.tensor(seq_lens)
    starts = torch.arange(len(seq_lens)) * max(seq_lens) - (torch.cumsum(lens, 0) - lens)  # row minus packed offset
    return (torch.arange(int(lens.sum())) + starts.repeat_interleave(lens)).to(device)


def padded_attention(seq_lens: list[int], rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> torch.Tensor:
    """Causal attention within each packed sequence as one SDPA call over the sequences right-padded
    to the longest (rows from `padded_rows`). A real token attends only to keys at or before it, so
    padding, which always follows the last real token, is never attended; one call instead of one
    per sequence is what keeps thousands of short sequences cheap on CPU."""
    b, s = len(seq_lens), max(seq_lens)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return t.new_zeros(b * s, *t.shape[1:]).index_copy(0, rows, t).view(b, s, *t.shape[1:])

    return _sdpa(pad(q), pad(k), pad(v)).reshape(b * s, *q.shape[1:]).index_select(0, rows)


@lru_cache(maxsize=None)
def varlen_function() -> Callable | None:
    """`f(q, k, v, cu_seqlens, max_len)` -> causal varlen attention over packed [T, H, D] tensors
    (GQA allowed), or None when neither torch's varlen_attn nor FlashAttention is available."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    if varlen_attn is not None:
        return torch_varlen(varlen_attn)
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return lambda q, k, v, cu, n: flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=True)


def torch_varlen(varlen_attn: Callable) -> Callable:
    """Adapt torch's varlen_attn (its causal and GQA arguments changed across torch versions)."""
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    gqa = "enable_gqa" in params

    def run(q, k, v, cu, n):
        if gqa:
            return varlen_attn(q, k, v, cu, cu, n, n, enable_gqa=True, **causal)
        group = q.shape[1] // k.shape[1]  # no GQA support: repeat the k/v heads
        return varlen_attn(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), cu, cu, n, n, **causal)

    return run


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[B, S, H, D] causal attention with grouped-query heads."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    return out.transpose(1, 2)
