"""Choose the rollout replica for the next prompt group.

Each replica has a planned share (e.g. its predicted tokens/s from the plan). The next group
goes to the live replica with the lowest in-flight / share, ties to the smallest id, so over
time each replica holds work in proportion to its share. Dead replicas get nothing.
"""
from __future__ import annotations

import math


class Dispatcher:
    """Tracks which groups are in flight on which replica."""

    def __init__(self, shares: dict[int, float]):
        bad = {r: s for r, s in shares.items() if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0)}
        if not shares or bad:
            raise ValueError(f"shares must map each replica to a positive finite number; bad: {bad or 'empty'}")
        self.shares = dict(shares)
        self.in_flight: dict[int, set[int]] = {r: set() for r in shares}  # replica -> group ids
        self.owner: dict[int, int] = {}  # group id -> replica
        self.dead: set[int] = set()

    def load(self, replica: int) -> float:
        """In-flight groups over planned share."""
        return len(self.in_flight[replica]) / self.shares[replica]

    def pick(self) -> int | None:
        """The replica that should get the next group, or None if all are dead."""
        alive = [r for r in self.shares if r not in self.dead]
        return min(alive, key=lambda r: (self.load(r), r)) if alive else None

    def assign(self, group_id: int) -> int | None:
        """Pick a replica for `group_id` and record it as in flight there; None if all are dead."""
        if group_id in self.owner:
            raise ValueError(f"group {group_id} is already in flight on replica {self.owner[group_id]}")
        replica = self.pick()
        if replica is not None:
            self.in_flight[replica].add(group_id)
            self.owner[group_id] = replica
        return replica

    def done(self, group_id: int) -> int | None:
        """The group came back (or was given up); returns the replica it was on, None if unknown."""
        replica = self.owner.pop(group_id, None)
        if replica is not None:
            self.in_flight[replica].discard(group_id)
        return replica

    def mark_dead(self, replica: int) -> list[int]:
        """Exclude `replica` from now on; returns its in-flight group ids (to abandon or resend)."""
        self.dead.add(replica)
        lost = sorted(self.in_flight[replica])
        for gid in lost:
            del self.owner[gid]
        self.in_flight[replica].clear()
        return lost
