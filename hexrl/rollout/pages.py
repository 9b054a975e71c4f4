"""The KV page pool: fixed-size pages allocated once, handed out from a free list.

Each layer's cache is one tensor `[num_pages + 1, 2, page_size, Hkv, D]` (FlashInfer's "NHD"
layout, k at index 0 and v at index 1). A sequence owns a list of page ids (its block table);
token j of a sequence lives in page `pages[j // page_size]` at offset `j % page_size`.
The extra last page is a scratch page never handed out: padded rows of a CUDA-graph batch
write their (ignored) k/v there.
"""
from __future__ import annotations

import torch


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


def page_bytes(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one page takes across all layers (k and v)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * page_size * num_kv_heads * head_dim * elem


class PagePool:
    """KV pages for a contiguous range of layers, with O(1)-per-page alloc and free."""

    def __init__(self, layers: range, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device):
        problems = [f"{name} must be a positive integer, got {value!r}"
                    for name, value in (("num_pages", num_pages), ("page_size", page_size),
                                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim))
                    if not isinstance(value, int) or value <= 0]
        if problems:
            raise ValueError("PagePool: " + "; ".join(problems))
        self.first_layer, self.num_pages, self.page_size = layers.start, num_pages, page_size
        self.scratch_page = num_pages  # the extra page at the end
        shape = (num_pages + 1, 2, page_size, num_kv_heads, head_dim)
        self.kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() gives low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def layer(self, layer: int) -> torch.Tensor:
        """The cache tensor of a (global) layer index."""
        return self.kv[layer - self.first_layer]

    def alloc(self, n: int) -> list[int]:
        """Take `n` pages; raises MemoryError when fewer are free (callers check `num_free` first)."""
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV pages, {len(self._free)} free")
        if n <= 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        return taken[::-1]

    def free(self, pages: list[int]) -> None:
        """Give pages back."""
        self._free.extend(reversed(pages))

    def grow(self, pages: list[int], num_tokens: int) -> bool:
        """Extend a block table in place to hold `num_tokens`; False (nothing taken) if pages run out."""
        need = pages_for(num_tokens, self.page_size) - len(pages)
        if need > len(self._free):
            return False
        pages.extend(self.alloc(need))
        return True


class BlockTable:
    """The device-side page table: row r holds the pages of the sequence in slot r.

    The scheduler appends pages as it grows a sequence (`append`); `flush` writes everything
    appended since the last flush in one indexed copy, so a step never rebuilds the table from
    host lists. Entries past a sequence's length are stale and never read. The width doubles
    when a sequence outgrows it (rare: only long sequences)."""

    def __init__(self, rows: int, device: str | torch.device, width: int = 64):
        self.table = torch.zeros(rows, width, dtype=torch.int64, device=device)
        self._rows: list[int] = []
        self._cols: list[int] = []
        self._pages: list[int] = []

    def append(self, row: int, col: int, pages: list[int]) -> None:
        """Pages `pages` go to row `row` from column `col` on (applied at the next flush)."""
        n = len(pages)
        self._rows += [row] * n
        self._cols += range(col, col + n)
        self._pages += pages

    def flush(self) -> torch.Tensor:
        """Apply the pending appends; returns the table."""
        if self._pages:
            need = max(self._cols) + 1
            if need > self.table.shape[1]:
                wider = self.table.new_zeros(self.table.shape[0], max(need, 2 * self.table.shape[1]))
                wider[:, :self.table.shape[1]] = self.table
                self.table = wider
            idx = torch.tensor([self._rows, self._cols, self._pages], dtype=torch.int64)
            idx = idx.to(self.table.device, non_blocking=True)
            self.table[idx[0], idx[1]] = idx[2]
            self._rows, self._cols, self._pages = [], [], []
        return self.table
