"""Causal attention over packed sequences: the plain-torch backend used for training and tests.

The decoder hands every attention layer's q/k/v, flattened over tokens, to a backend object.
This one attends within each packed sequence (never across boundaries); the rollout engine
supplies a paged-KV backend with the same call signature.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for this step's tokens -> output [T, Hq, D]."""


class CausalAttention:
    """Causal self-attention inside each of the packed sequences given by their lengths."""

    def __init__(self, seq_lens: list[int]):
        self.seq_lens = [int(n) for n in seq_lens]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if len(set(self.seq_lens)) == 1:  # equal lengths: one batched call
            b, s = len(self.seq_lens), self.seq_lens[0]
            return _sdpa(*(t.view(b, s, *t.shape[1:]) for t in (q, k, v))).reshape(q.shape)
        outs, start = [], 0
        for n in self.seq_lens:
            end = start + n
            outs.append(_sdpa(q[None, start:end], k[None, start:end], v[None, start:end])[0])
            start = end
        return torch.cat(outs)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[B, S, H, D] causal attention with grouped-query heads."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    return out.transpose(1, 2)
