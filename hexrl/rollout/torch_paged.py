"""Paged attention in plain torch: the CPU backend and the ground truth for FlashInfer.

Each sequence's context is gathered from its pages into a padded [B, max_kv] batch; new
tokens form a padded [B, max_q] batch; one masked SDPA call attends them. New token i of a
sequence with q new tokens and kv context tokens sits at position kv - q + i and sees keys
0 .. kv - q + i (causal, aligned to the end of the context).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import StepMeta, write_kv
from .pages import PagePool


class TorchPagedAttention:
    """The model's attention callable for one step, over `pool`'s pages."""

    def __init__(self, pool: PagePool, meta: StepMeta):
        self.pool, self.meta = pool, meta
        dev, ps = meta.positions.device, meta.page_size
        b, max_q, max_kv = len(meta.q_lens), max(meta.q_lens), max(meta.kv_lens)
        q_lens = torch.tensor(meta.q_lens)
        kv_lens = torch.tensor(meta.kv_lens)
        j = torch.arange(max_kv)
        self.kv_pages = meta.block_table.gather(1, (j // ps).to(dev).expand(b, -1))  # [B, max_kv]
        self.kv_offsets = (j % ps).expand(b, -1).to(dev)
        i = torch.arange(max_q)
        self.q_valid = (i[None, :] < q_lens[:, None]).to(dev)  # [B, max_q]
        starts = torch.cumsum(q_lens, 0) - q_lens
        self.q_rows = (starts[:, None] + i[None, :]).clamp(max=max(meta.num_tokens - 1, 0)).to(dev)
        qpos = (kv_lens - q_lens)[:, None] + i[None, :]  # [B, max_q] position of each new token
        allowed = (j[None, None, :] <= qpos[:, :, None]) & (j[None, None, :] < kv_lens[:, None, None])
        self.mask = allowed[:, None].to(dev)  # [B, 1, max_q, max_kv]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.pool.layer(layer)
        write_kv(cache, self.meta.slot_pages, self.meta.slot_offsets, k, v)
        keys = cache[self.kv_pages, 0, self.kv_offsets].to(q.dtype)  # [B, max_kv, Hkv, D]
        values = cache[self.kv_pages, 1, self.kv_offsets].to(q.dtype)
        out = F.scaled_dot_product_attention(
            q[self.q_rows].transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=self.mask, enable_gqa=True,
        )
        return out.transpose(1, 2)[self.q_valid]  # back to [T, Hq, D], sequence after sequence


class TorchPagedBackend:
    """The backend object the engine holds when attention is plain torch: `begin(meta)` per step."""

    name = "torch"

    def __init__(self, pool: PagePool):
        self.pool = pool

    def begin(self, meta: StepMeta) -> TorchPagedAttention:
        return TorchPagedAttention(self.pool, meta)
