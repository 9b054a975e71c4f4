"""What a paged attention backend needs to know about one engine step, and the k/v write.

The engine builds one `StepMeta` per step (on the host, once); a backend object built from it
is the model's attention callable `attn(layer, q, k, v)`: it writes the new tokens' k/v into
their pages, then attends each new token over its sequence's whole cached context.
Tokens are flattened sequence after sequence, as the model sees them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .pages import pages_for


@dataclass
class StepMeta:
    """One step's batch: for sequence b, q_lens[b] new tokens at the end of kv_lens[b] context tokens."""

    page_size: int
    q_lens: list[int]
    kv_lens: list[int]
    block_tables: list[list[int]]  # the pages holding each sequence's first kv_lens[b] tokens
    positions: torch.Tensor  # [T] int64, on the device
    slot_pages: torch.Tensor  # [T] int64: the page each new token's k/v goes to
    slot_offsets: torch.Tensor  # [T] int64: its offset in that page

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.q_lens)

    def csr(self) -> dict[str, torch.Tensor]:
        """FlashInfer's page-table arrays (host int32): qo_indptr, kv_indptr, kv_indices, kv_last_page_len."""
        qo, kvp, idx, last = [0], [0], [], []
        for q, kv, table in zip(self.q_lens, self.kv_lens, self.block_tables):
            npages = pages_for(kv, self.page_size)
            qo.append(qo[-1] + q)
            kvp.append(kvp[-1] + npages)
            idx.extend(table[:npages])
            last.append(kv - (npages - 1) * self.page_size)
        i32 = dict(dtype=torch.int32)
        return dict(qo_indptr=torch.tensor(qo, **i32), kv_indptr=torch.tensor(kvp, **i32),
                    kv_indices=torch.tensor(idx, **i32), kv_last_page_len=torch.tensor(last, **i32))


def build_meta(spans: list[tuple[list[int], int, int]], page_size: int, device: torch.device) -> StepMeta:
    """Metadata for spans `(block_table, start, n)`: each runs tokens [start, start + n) of a sequence."""
    positions, slots = [], []
    for table, start, n in spans:
        for pos in range(start, start + n):
            positions.append(pos)
            slots.append(table[pos // page_size] * page_size + pos % page_size)
    pos_t = torch.tensor(positions, dtype=torch.int64)
    slot_t = torch.tensor(slots, dtype=torch.int64)
    return StepMeta(
        page_size=page_size, q_lens=[n for _, _, n in spans], kv_lens=[s + n for _, s, n in spans],
        block_tables=[t for t, _, _ in spans], positions=pos_t.to(device, non_blocking=True),
        slot_pages=(slot_t // page_size).to(device, non_blocking=True),
        slot_offsets=(slot_t % page_size).to(device, non_blocking=True),
    )


def write_kv(cache: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store new tokens' k/v [T, Hkv, D] into `cache` [P, 2, page_size, Hkv, D] (graph-capturable)."""
    cache[pages, 0, offsets] = k.to(cache.dtype)
    cache[pages, 1, offsets] = v.to(cache.dtype)
