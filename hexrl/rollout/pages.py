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
    """The device-side page table: row r holds the pages of the sequence in slot r, as int32.

    Fixed width (`max_pages_per_seq`), allocated once: its address never changes, so the page-index
    gathers of a step are device ops over it. The scheduler appends pages as it grows a sequence
    (`append`); the model runner sends the pending entries with the step's other inputs in its one
    host-to-device copy (`take` -> flat indices and pages) and scatters them in (`apply`). Freed
    pages need no clearing: entries past a sequence's length are stale and never read."""

    def __init__(self, rows: int, device: str | torch.device, width: int, pad_page: int | None = None):
        """`pad_page`: add one more row (index `rows`), all `pad_page`: the pages of CUDA-graph padding rows."""
        if not isinstance(width, int) or width < 1:
            raise ValueError(f"BlockTable: width must be a positive integer, got {width!r}")
        self.width = width
        self.table = torch.zeros(rows + (pad_page is not None), width, dtype=torch.int32, device=device)
        if pad_page is not None:
            self.table[rows] = pad_page
        self._index: list[int] = []  # flat positions row * width + col
        self._pages: list[int] = []

    def append(self, row: int, col: int, pages: list[int]) -> None:
        """Pages `pages` go to row `row` from column `col` on (applied with the next step's inputs)."""
        if col + len(pages) > self.width:
            raise ValueError(f"BlockTable: row {row} needs {col + len(pages)} pages, the table holds {self.width}")
        start = row * self.width + col
        self._index += range(start, start + len(pages))
        self._pages += pages

    def take(self) -> list[int]:
        """The pending entries as one host list `[flat indices..., pages...]` (cleared here); its
        device copy goes to `apply`."""
        out = self._index + self._pages
        self._index, self._pages = [], []
        return out

    def apply(self, entries: torch.Tensor) -> torch.Tensor:
        """Scatter `take()`'s entries (on the table's device, any int dtype) into the table; returns it."""
        if len(entries):
            index, pages = entries.view(2, -1)
            self.table.view(-1)[index] = pages.to(torch.int32)
        return self.table

    def flush(self) -> torch.Tensor:
        """Apply the pending entries with a copy of their own (for callers outside the model runner)."""
        return self.apply(torch.tensor(self.take(), dtype=torch.int64).to(self.table.device))
