"""Liveness: a rank that has not been heard from for `timeout_s` counts as dead.

Deadlines use this process's monotonic clock at receipt, never the sender's timestamp, so
clock skew between nodes cannot kill (or revive) anyone.
"""
from __future__ import annotations

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

    def expect(self, rank: int, now: float | None = None) -> None:
        """Start the clock for a rank that has not beaten yet (dead if silent for timeout_s)."""
        self.last.setdefault(rank, self.clock() if now is None else now)

    def beat(self, rank: int, now: float | None = None) -> None:
        """`rank` was heard from (any message counts)."""
        self.last[rank] = self.clock() if now is None else now

    def dead(self, now: float | None = None) -> list[int]:
        """Ranks silent for more than timeout_s, sorted."""
        now = self.clock() if now is None else now
        return sorted(r for r, t in self.last.items() if now - t > self.timeout_s)

    def forget(self, rank: int) -> None:
        """Stop tracking `rank` (it stopped cleanly or was already handled as dead)."""
        self.last.pop(rank, None)
