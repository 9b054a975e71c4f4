"""Continuous batching: which sequences run this step, and how many of their tokens.

Every running sequence holds a slot (a row of the device-side `BlockTable` and of the engine's
per-slot sampling parameters) from admission until it finishes or is preempted. Scheduling is
O(running): no list searches. A step is a list of chunks `(seq, start, n)`: run tokens
[start, start + n) of `seq` through the model. Decode (one uncached token) and prefill (many,
chunked under the token budget) are the same thing; a sequence is sampled when its chunk
reaches its last token. Running decodes go first, then running prefills, then waiting
sequences are admitted (oldest first) while pages, the token budget and `max_running` allow.
When pages run out, the newest sequences not yet scheduled this step are preempted: their
pages are freed and they wait to be recomputed.

An episode waiting for its environment is *parked*: it gives up its slot (it takes no decode
row) but keeps its KV pages, so that when the observation is appended only the new tokens are
prefilled. Tool calls are short next to a recompute of the whole conversation, so pages stay;
when pages run short, parked sequences give theirs up first (oldest parked first), before any
running sequence is preempted, and are recomputed when they resume.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .pages import BlockTable, PagePool, pages_for
from .sequence import Sequence


@dataclass(slots=True)
class Chunk:
    seq: Sequence
    start: int  # == seq.num_cached when scheduled
    n: int

    @property
    def samples(self) -> bool:
        """Whether this chunk ends at the sequence's last token (so a new token is sampled)."""
        return self.start + self.n == len(self.seq.tokens)


class Scheduler:
    """Waiting queue + running set over one page pool."""

    def __init__(self, pool: PagePool, max_batch_tokens: int, max_running: int, max_seq_len: int | None = None):
        """`max_seq_len` (tokens a sequence may reach; None: the whole pool) sizes the page table's width."""
        self.pool, self.max_batch_tokens = pool, max_batch_tokens
        self.max_running = min(max_running, max_batch_tokens)  # so every running sequence decodes each step
        self.waiting: deque[Sequence] = deque()
        self.running: dict[Sequence, None] = {}  # an ordered set, in admission order: the newest last
        self.holding: dict[Sequence, None] = {}  # pages but no slot (parked or resumed): evicted first
        width = pool.num_pages if max_seq_len is None else min(pool.num_pages, pages_for(max_seq_len, pool.page_size))
        self.tables = BlockTable(self.max_running, pool.kv[0].device, width, pad_page=pool.scratch_page)
        self.admitted: list[Sequence] = []  # sequences given a slot by the last schedule()
        self._all_decoding = True  # after the last step, every running sequence has one uncached token
        self.preemptions = 0
        self.evictions = 0  # parked sequences whose pages were taken (they recompute on resuming)
        self._arrivals = 0
        self._free_slots = list(range(self.max_running - 1, -1, -1))

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Chunk]:
        """Pick this step's chunks and give their sequences the pages they need."""
        decodes = self.decode_only()
        if decodes is not None:
            return [Chunk(s, s.num_cached, 1) for s in decodes]
        chunks: list[Chunk] = []
        self.admitted = []
        decodes = [s for s in self.running if len(s.tokens) - s.num_cached == 1]  # decodes go first
        preempted = self._schedule_running(decodes, chunks, self.max_batch_tokens)
        if not preempted:  # admitting now would only evict someone next step
            self._admit(chunks, self.max_batch_tokens - sum(c.n for c in chunks))
        self._all_decoding = len(chunks) == len(self.running) and all(c.samples for c in chunks)
        return chunks

    def decode_only(self) -> list[Sequence] | None:
        """The common step, in O(running) with no per-step objects: every running sequence decodes one
        token, nobody can be admitted, pages suffice. Returns the running sequences (pages grown), or
        None when the general schedule() is needed."""
        if not self._all_decoding or (self.waiting and len(self.running) < self.max_running):
            return None
        ps = self.pool.page_size
        growing = [s for s in self.running if s.num_cached >= len(s.pages) * ps]  # starting a new page
        if len(growing) > self.pool.num_free:
            return None
        for s in growing:
            self._grow(s, s.num_cached + 1)
        self.admitted = []
        return list(self.running)

    def _schedule_running(self, decodes: list[Sequence], chunks: list[Chunk], budget: int) -> bool:
        """Running sequences in order (decodes, then prefills), preempting the newest unscheduled
        ones when pages run out; returns whether anyone was preempted."""
        scheduled: set[Sequence] = set()
        preempted, ps = False, self.pool.page_size
        for seq in decodes + [s for s in self.running if len(s.tokens) - s.num_cached > 1]:
            if budget == 0:
                break
            if seq.slot < 0:  # preempted just now
                continue
            n = min(len(seq.tokens) - seq.num_cached, budget)
            end = seq.num_cached + n
            if end > len(seq.pages) * ps:
                if not self._grow(seq, end):
                    self._evict_holding(pages_for(end, ps) - len(seq.pages))
                while not self._grow(seq, end):
                    victim = next(s for s in reversed(self.running) if s not in scheduled)
                    self.preempt(victim)
                    preempted = True
                    if victim is seq:
                        break
                if seq.slot < 0:
                    continue
            chunks.append(Chunk(seq, seq.num_cached, n))
            scheduled.add(seq)
            budget -= n
        return preempted

    def _admit(self, chunks: list[Chunk], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            n = min(seq.num_uncached, budget)
            need = pages_for(seq.num_cached + n, self.pool.page_size) - len(seq.pages)
            if need + len(self.running) > self.pool.num_free:  # keep a page of growth per running seq
                self._evict_holding(need + len(self.running), keep=seq)
                n = min(seq.num_uncached, budget)  # it may have been evicted itself
                need = pages_for(seq.num_cached + n, self.pool.page_size) - len(seq.pages)
                if need + len(self.running) > self.pool.num_free:
                    break
            self.waiting.popleft()
            seq.slot = self._free_slots.pop()
            self.holding.pop(seq, None)
            if seq.pages:  # a resumed episode: its kept pages go into its new slot's row
                self.tables.append(seq.slot, 0, seq.pages)
            self._grow(seq, seq.num_cached + n)
            seq.arrival, self._arrivals = self._arrivals, self._arrivals + 1
            self.running[seq] = None
            self.admitted.append(seq)
            chunks.append(Chunk(seq, seq.num_cached, n))
            budget -= n

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` pages for `num_tokens` tokens, mirrored into the device table; False if none left."""
        old = len(seq.pages)
        if not self.pool.grow(seq.pages, num_tokens):
            return False
        if len(seq.pages) > old:
            self.tables.append(seq.slot, old, seq.pages[old:])
        return True

    def _evict_holding(self, free_pages: int, keep: Sequence | None = None) -> None:
        """Free the pages of sequences holding pages without a slot, oldest first, until `free_pages`
        are free (they are recomputed when they run again); `keep` is evicted last."""
        for seq in sorted(self.holding, key=lambda s: s is keep):
            if self.pool.num_free >= free_pages:
                return
            self.holding.pop(seq)
            self._drop_kv(seq)
            self.evictions += 1

    def park(self, seq: Sequence) -> None:
        """An episode's turn ended: release its slot, keep its pages (see the module doc). A second
        call, or one on a sequence that was preempted meanwhile, only makes sure it is not queued."""
        if seq in self.running:
            del self.running[seq]
            if seq.slot >= 0:
                self._free_slots.append(seq.slot)
            seq.slot = -1
            if seq.pages:
                self.holding[seq] = None
        elif seq in self.waiting:  # preempted while its last token was in flight: no pages
            self.waiting.remove(seq)

    def resume(self, seq: Sequence) -> None:
        """A parked episode has new tokens: queue it (its kept pages make only those uncached)."""
        self.waiting.append(seq)

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's pages and put it first in line for recompute."""
        del self.running[seq]
        self._drop_kv(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Release a finished sequence's pages and slot, wherever it is (running, or waiting after a
        preemption while its last token was in flight); a second call does nothing."""
        if seq.done:
            return
        seq.done = True
        if seq in self.running:
            del self.running[seq]
        elif seq in self.waiting:  # rare: preempted while its last token was in flight (or a resumed episode)
            self.waiting.remove(seq)
        self.holding.pop(seq, None)
        self._drop_kv(seq)

    def drop_all_kv(self) -> None:
        """Weights changed: every cached k/v is stale. Re-queue all running sequences, in order,
        ahead of the waiting ones, as prefills of everything they hold so far."""
        running = list(self.running)
        for seq in running + list(self.holding):
            self._drop_kv(seq)
        self.holding = {}
        self.waiting.extendleft(reversed(running))
        self.running = {}
        self._all_decoding = False

    def _drop_kv(self, seq: Sequence) -> None:
        self.pool.free(seq.pages)
        if seq.slot >= 0:
            self._free_slots.append(seq.slot)
        seq.pages, seq.num_cached, seq.slot = [], 0, -1
