"""Paged attention in plain torch: the CPU backend and the ground truth for FlashInfer.

Each sequence's context is gathered from its pages (whole pages, one index_select per k and v:
far cheaper on CPU than a per-token gather) into a padded [B, pages x page_size] batch; new
tokens form a padded [B, max_q] batch; one masked SDPA call attends them. New token i of a
sequence with q new tokens and kv context tokens sits at position kv - q + i and sees keys
0 .. kv - q + i (causal, aligned to the end of the context). A decode step (one new token per
sequence) skips the query padding, and the mask too when all contexts have one length; a step
of fresh prefills (no cached context) is plain causal attention over the new tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hexrl.model.attention import CausalAttention
from hexrl.model.ops import write_kv

from .attention_meta import StepMeta
from .pages import PagePool


class TorchPagedAttention:
    """The model's attention callable for one step, over `pool`'s pages."""

    def __init__(self, pool: PagePool, meta: StepMeta):
        self.pool, self.meta = pool, meta
        self.fresh = meta.q_lens == meta.kv_lens  # no cached context: plain causal attention over the new tokens
        if self.fresh:
            self.causal = CausalAttention(meta.q_lens)  # one per step: its index is shared by every layer
            return
        dev, ps = meta.positions.device, meta.page_size
        table = meta.block_table  # [B, W]
        b, width = table.shape
        span, max_q = width * ps, max(meta.q_lens)
        self.page_ids, self.shape, self.decode = table.reshape(-1), (b, span), max_q == 1
        self.keep, self.mask = span, None  # context columns SDPA sees, and its mask
        if self.decode and len(set(meta.kv_lens)) == 1:  # equal contexts: slice off the padding, no mask
            self.keep = meta.kv_lens[0]
            return
        if self.decode:  # each row sees its context: a mask from the device lengths, no host copy
            self.mask = (torch.arange(span, device=dev) < meta.seq_lens[:, None])[:, None, None, :]
            return
        q_lens, kv_lens = torch.tensor(meta.q_lens), torch.tensor(meta.kv_lens)
        j, i = torch.arange(span), torch.arange(max_q)
        qpos = (kv_lens - q_lens)[:, None] + i[None, :]  # [B, max_q] position of each new token
        allowed = (j[None, None, :] <= qpos[:, :, None]) & (j[None, None, :] < kv_lens[:, None, None])
        self.mask = allowed[:, None].to(dev)  # [B, 1, max_q, span]
        if not self.decode:
            self.q_valid = (i[None, :] < q_lens[:, None]).to(dev)  # [B, max_q]
            starts = torch.cumsum(q_lens, 0) - q_lens
            self.q_rows = (starts[:, None] + i[None, :]).clamp(max=max(meta.num_tokens - 1, 0)).to(dev)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.pool.layer(layer)
        write_kv(cache, self.meta.slot_pages, self.meta.slot_offsets, k, v)
        if self.fresh:
            return self.causal(layer, q, k.to(cache.dtype).to(q.dtype), v.to(cache.dtype).to(q.dtype))
        keys, values = (self.gather(cache, i).to(q.dtype).transpose(1, 2) for i in (0, 1))  # [B, Hkv, S, D]
        if self.decode:  # the query heads sharing a kv head act as its query rows: no GQA expansion
            b, hkv = keys.shape[:2]
            out = F.scaled_dot_product_attention(q.view(b, hkv, -1, q.shape[-1]), keys, values, attn_mask=self.mask)
            return out.reshape(q.shape)
        out = F.scaled_dot_product_attention(q[self.q_rows].transpose(1, 2), keys, values, attn_mask=self.mask,
                                             enable_gqa=True).transpose(1, 2)
        return out[self.q_valid]  # back to [T, Hq, D], sequence after sequence

    def gather(self, cache: torch.Tensor, kv: int) -> torch.Tensor:
        """k (kv=0) or v (kv=1) of every sequence's pages, [B, keep, Hkv, D]. The pool viewed as 2-D rows
        of one page each: index_select copies a strided 2-D source at memcpy speed, a 5-D one at half."""
        b, span = self.shape
        rows = cache.view(cache.shape[0], 2, -1)[:, kv].index_select(0, self.page_ids)
        return rows.view(b, span, *cache.shape[-2:])[:, :self.keep]


class TorchPagedBackend:
    """The backend object the engine holds when attention is plain torch: `begin(meta)` per step."""

    name = "torch"

    def __init__(self, pool: PagePool):
        self.pool = pool

    def begin(self, meta: StepMeta) -> TorchPagedAttention:
        return TorchPagedAttention(self.pool, meta)
