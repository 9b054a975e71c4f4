"""Liveness: a rank that has not been heard from for `timeout_s` counts as dead.

Deadlines use this process's monotonic clock at receipt, never the sender's timestamp, so
clock skew between nodes cannot kill (or revive) anyone. `dead()` runs on every controller loop
pass, so it keeps a lower bound on the oldest last-heard time and looks at every rank only when
that one may be overdue (about once per timeout), not on each call.
"""
from __future__ import annotations

import math
import time
from typing import Callable


class Heartbeats:
    """Last-heard times per rank."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self.clock = clock
        self.last: dict[int, float] = {}
        self.oldest = math.inf  # no rank was last heard before this (the exact oldest after a scan)

    def expect(self, rank: int, now: float | None = None) -> None:
        """Start the clock for a rank that has not beaten yet (dead if silent for timeout_s)."""
        t = self.last.setdefault(rank, self.clock() if now is None else now)
        self.oldest = min(self.oldest, t)

    def beat(self, rank: int, now: float | None = None) -> None:
        """`rank` was heard from (any message counts)."""
        t = self.last[rank] = self.clock() if now is None else now
        self.oldest = min(self.oldest, t)

    def dead(self, now: float | None = None) -> list[int]:
        """Ranks silent for more than timeout_s, sorted."""
        now = self.clock() if now is None else now
        if now - self.oldest <= self.timeout_s:  # every rank was heard from since: nothing to scan
            return []
        self.oldest = min(self.last.values(), default=math.inf)
        return sorted(r for r, t in self.last.items() if now - t > self.timeout_s)

    def forget(self, rank: int) -> None:
        """Stop tracking `rank` (it stopped cleanly or was already handled as dead)."""
        self.last.pop(rank, None)
