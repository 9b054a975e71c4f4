"""What a paged attention backend needs to know about one engine step (the k/v write is `hexrl.model.ops`).

The engine builds one `StepMeta` per step; a backend object built from it is the model's
attention callable `attn(layer, q, k, v)`: it writes the new tokens' k/v into their pages, then
attends each new token over its sequence's whole cached context. Tokens are flattened sequence
after sequence, as the model sees them. The lengths live on the host (FlashInfer plans from
them); the page table and per-token tensors live on the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

import torch

from .pages import pages_for


@dataclass
class StepMeta:
    """One step's batch: for sequence b, q_lens[b] new tokens at the end of kv_lens[b] context tokens."""

    page_size: int
    q_lens: list[int]
    kv_lens: list[int]
    table: torch.Tensor  # [R, W] int32 page table on the device: row rows[b] starts with sequence b's pages
    rows: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [T] int64, on the device
    seq_lens: torch.Tensor  # [B] int64: kv_lens on the device
    token_rows: torch.Tensor  # [T] int64: each token's row of the table

    @cached_property
    def slot_pages(self) -> torch.Tensor:
        """[T] int32: the page each new token's k/v goes to (gathered when first asked: a graph decode
        step's prologue gathers its own)."""
        return self.table[self.token_rows, self.positions // self.page_size]

    @cached_property
    def slot_offsets(self) -> torch.Tensor:
        """[T] int64: each new token's offset in its page."""
        return self.positions % self.page_size

    @property
    def block_table(self) -> torch.Tensor:
        """[B, W] the step's sequences' rows of the page table (W covers the longest)."""
        return self.table[self.rows, :pages_for(max(self.kv_lens), self.page_size)]

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    @property
    def is_decode(self) -> bool:
        return len(self.positions) == len(self.q_lens)

    def num_pages(self) -> list[int]:
        """Pages each sequence's context spans (host)."""
        return [pages_for(kv, self.page_size) for kv in self.kv_lens]

    def page_indices(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every sequence's context pages, one after the other (int32, FlashInfer's kv_indices): a
        gather over the device table from the device lengths; the host supplies only their total."""
        total = sum(self.num_pages())
        counts = (self.seq_lens + self.page_size - 1) // self.page_size
        starts = torch.cumsum(counts, 0) - counts
        flat = torch.repeat_interleave(self.rows * self.table.shape[1] - starts, counts, output_size=total)
        flat += torch.arange(total, device=flat.device)  # row * W + (i - start of its sequence)
        return torch.index_select(self.table.view(-1), 0, flat, out=out)

    def csr(self, indices_buf: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """FlashInfer's page-table arrays: qo_indptr, kv_indptr, kv_last_page_len (host int32: its plan
        reads them there) and kv_indices (int32, gathered on the table's device; into the start of
        `indices_buf` if given)."""
        npages = self.num_pages()
        i32 = dict(dtype=torch.int32)
        out = None if indices_buf is None else indices_buf[:sum(npages)]
        return dict(qo_indptr=torch.tensor([0, *accumulate(self.q_lens)], **i32),
                    kv_indptr=torch.tensor([0, *accumulate(npages)], **i32), kv_indices=self.page_indices(out),
                    kv_last_page_len=torch.tensor([kv - (n - 1) * self.page_size
                                                   for kv, n in zip(self.kv_lens, npages)], **i32))


def step_meta(page_size: int, q_lens: list[int], kv_lens: list[int], table: torch.Tensor, rows: torch.Tensor,
              positions: torch.Tensor, token_rows: torch.Tensor | None = None,
              seq_lens: torch.Tensor | None = None) -> StepMeta:
    """StepMeta from device tensors: the page `table`, each sequence's row of it `rows` [B], token
    `positions` [T], `token_rows` [T] each token's table row (None: one token per sequence) and
    `seq_lens` [B] kv_lens on the device (None: copied over from the host list)."""
    token_rows = rows if token_rows is None else token_rows
    if seq_lens is None:
        seq_lens = torch.tensor(kv_lens, dtype=torch.int64).to(positions.device)
    return StepMeta(page_size, q_lens, kv_lens, table, rows, positions, seq_lens, token_rows)


def decode_slots(table: torch.Tensor, rows: torch.Tensor, kv_lens: torch.Tensor, page_size: int,
                 positions: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor) -> None:
    """A decode step's positions and k/v slots written in place from the device table, the rows and their
    lengths (graph-capturable: the CUDA-graph prologue runs it)."""
    positions.copy_(kv_lens - 1)
    pages.copy_(table[rows, positions // page_size])
    offsets.copy_(positions % page_size)


def build_meta(spans: list[tuple[list[int], int, int]], page_size: int, device: torch.device) -> StepMeta:
    """Metadata for spans `(block_table, start, n)` given as host lists: each runs tokens
    [start, start + n) of a sequence (tests, CUDA-graph capture; the engine uses its device table)."""
    kv_lens = [s + n for _, s, n in spans]
    width = max([pages_for(kv, page_size) for kv in kv_lens] + [1])
    table = torch.zeros(len(spans), width, dtype=torch.int32)
    for row, (pages, start, n) in enumerate(spans):
        k = pages_for(start + n, page_size)
        table[row, :k] = torch.tensor(pages[:k], dtype=torch.int32)
    positions = torch.tensor([p for _, s, n in spans for p in range(s, s + n)], dtype=torch.int64)
    rows = torch.arange(len(spans))
    token_rows = torch.repeat_interleave(rows, torch.tensor([n for *_, n in spans]))
    return step_meta(page_size, [n for *_, n in spans], kv_lens, table.to(device), rows.to(device),
                     positions.to(device), token_rows.to(device))
