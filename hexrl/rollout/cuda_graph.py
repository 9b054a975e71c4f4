"""CUDA graphs of the decode forward pass (embeddings -> layers -> lm_head), one per batch size.

A decode step of B sequences replays the graph of the smallest captured size >= B; the extra
rows are padding that attends to (and writes into) the pool's scratch page. Inputs are copied
into static tensors and the FlashInfer decode wrapper is re-planned into static buffers before
each replay. Weights must be updated in place (the graphs hold their addresses).
"""
from __future__ import annotations

import torch

from .attention import build_meta
from .flashinfer_backend import GraphDecodeAttention
from .pages import PagePool


def default_batch_sizes(max_running: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_running (and max_running itself)."""
    sizes = {s for s in (1, 2, 4) if s <= max_running} | set(range(8, max_running + 1, 8)) | {max_running}
    return sorted(sizes)


class DecodeGraphs:
    """Captured decode graphs for a whole (TP-sharded) model over one page pool."""

    def __init__(self, model: torch.nn.Module, pool: PagePool, heads: tuple[int, int, int],
                 workspace: torch.Tensor, batch_sizes: list[int]):
        self.model, self.pool, self.heads, self.workspace = model, pool, heads, workspace
        self.batch_sizes = sorted(set(batch_sizes))
        self.mempool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, tuple] = {}
        for bs in reversed(self.batch_sizes):  # largest first: the smaller ones reuse its memory
            self.graphs[bs] = self._capture(bs)

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    def _pad(self, spans: list[tuple[list[int], int, int]], bs: int) -> list[tuple[list[int], int, int]]:
        return spans + [([self.pool.scratch_page], 0, 1)] * (bs - len(spans))

    def _capture(self, bs: int) -> tuple:
        dev = self.pool.kv[0].device
        ids = torch.zeros(bs, dtype=torch.int64, device=dev)
        positions = torch.zeros(bs, dtype=torch.int64, device=dev)
        attn = GraphDecodeAttention(self.pool, *self.heads, self.workspace, bs)
        attn.plan(build_meta(self._pad([], bs), self.pool.page_size, dev))

        def forward() -> torch.Tensor:
            return self.model.logits(self.model.stage(ids, positions, attn))

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph: lazy init, cuBLAS workspaces
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            out = forward()
        return graph, ids, positions, attn, out

    def run(self, spans: list[tuple[list[int], int, int]], ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, V_local] for B one-token spans `(block_table, start, 1)` with token ids `ids` [B]."""
        b = len(spans)
        bs = next(s for s in self.batch_sizes if s >= b)
        graph, static_ids, static_pos, attn, out = self.graphs[bs]
        meta = build_meta(self._pad(spans, bs), self.pool.page_size, static_ids.device)
        static_ids[:b].copy_(ids)
        static_ids[b:].zero_()
        static_pos.copy_(meta.positions)
        attn.plan(meta)
        graph.replay()
        return out[:b]
