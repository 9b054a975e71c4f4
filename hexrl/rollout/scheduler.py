"""Continuous batching: which sequences run this step, and how many of their tokens.

A step is a list of chunks `(seq, start, n)`: run tokens [start, start + n) of `seq` through the
model. Decode (one uncached token) and prefill (many, chunked under the token budget) are the
same thing; a sequence is sampled when its chunk reaches its last token. Running decodes go
first, then running prefills, then waiting sequences are admitted (oldest first) while pages,
the token budget and `max_running` allow. When pages run out, the newest sequences not yet
scheduled this step are preempted: their pages are freed and they wait to be recomputed.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .pages import PagePool, pages_for
from .sequence import Sequence


@dataclass
class Chunk:
    seq: Sequence
    start: int  # == seq.num_cached when scheduled
    n: int

    @property
    def samples(self) -> bool:
        """Whether this chunk ends at the sequence's last token (so a new token is sampled)."""
        return self.start + self.n == len(self.seq.tokens)


class Scheduler:
    """Waiting queue + running list over one page pool."""

    def __init__(self, pool: PagePool, max_batch_tokens: int, max_running: int):
        self.pool, self.max_batch_tokens = pool, max_batch_tokens
        self.max_running = min(max_running, max_batch_tokens)  # so every running sequence decodes each step
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the newest last
        self.preemptions = 0
        self._arrivals = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Chunk]:
        """Pick this step's chunks and give their sequences the pages they need."""
        chunks: list[Chunk] = []
        scheduled: set[int] = set()
        budget, preempted = self.max_batch_tokens, False
        decodes = [s for s in self.running if s.num_uncached == 1]
        for seq in decodes + [s for s in self.running if s.num_uncached > 1]:
            if budget == 0 or seq not in self.running:  # out of tokens, or preempted just now
                continue
            n = min(seq.num_uncached, budget)
            while not self.pool.grow(seq.pages, seq.num_cached + n):
                victim = next(s for s in reversed(self.running) if id(s) not in scheduled)
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                chunks.append(Chunk(seq, seq.num_cached, n))
                scheduled.add(id(seq))
                budget -= n
        if not preempted:  # admitting now would only evict someone next step
            budget = self._admit(chunks, budget)
        return chunks

    def _admit(self, chunks: list[Chunk], budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            n = min(seq.num_uncached, budget)
            need = pages_for(seq.num_cached + n, self.pool.page_size) - len(seq.pages)
            if need + len(self.running) > self.pool.num_free:  # keep a page of growth per running seq
                break
            self.pool.grow(seq.pages, seq.num_cached + n)
            self.waiting.popleft()
            seq.arrival, self._arrivals = self._arrivals, self._arrivals + 1
            self.running.append(seq)
            chunks.append(Chunk(seq, seq.num_cached, n))
            budget -= n
        return budget

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's pages and put it first in line for recompute."""
        self.running.remove(seq)
        self._drop_kv(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._drop_kv(seq)

    def drop_all_kv(self) -> None:
        """Weights changed: every cached k/v is stale. Re-queue all running sequences, in order,
        ahead of the waiting ones, as prefills of everything they hold so far."""
        for seq in self.running:
            self._drop_kv(seq)
        self.waiting.extendleft(reversed(self.running))
        self.running = []

    def _drop_kv(self, seq: Sequence) -> None:
        self.pool.free(seq.pages)
        seq.pages, seq.num_cached = [], 0
