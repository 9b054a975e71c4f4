"""Choose the rollout replica for the next prompt group.

Each replica has a planned share (e.g. its predicted tokens/s from the plan). The next group
goes to the live replica with the lowest in-flight / share, ties to the smallest id, so over
time each replica holds work in proportion to its share. Dead replicas get nothing.

The replicas sit in a heap of (load, id) entries, one pushed whenever a replica's load changes;
an entry whose load is no longer its replica's (or whose replica died) is dropped when it
reaches the top. Picking costs O(log R) (amortized) instead of a scan of all R replicas, and
picks exactly what the scan would: the smallest (load, id) over the live replicas.
"""
from __future__ import annotations

import heapq
import math


class Dispatcher:
    """Tracks which groups are in flight on which replica (change them only through assign, done
    and mark_dead: the heap follows those)."""

    def __init__(self, shares: dict[int, float]):
        bad = {r: s for r, s in shares.items() if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0)}
        if not shares or bad:
            raise ValueError(f"shares must map each replica to a positive finite number; bad: {bad or 'empty'}")
        self.shares = dict(shares)
        self.in_flight: dict[int, set[int]] = {r: set() for r in shares}  # replica -> group ids
        self.owner: dict[int, int] = {}  # group id -> replica
        self.dead: set[int] = set()
        self._heap: list[tuple[float, int]] = []  # (load, replica), some entries outdated
        self._rebuild()

    def load(self, replica: int) -> float:
        """In-flight groups over planned share."""
        return len(self.in_flight[replica]) / self.shares[replica]

    def pick(self) -> int | None:
        """The replica that should get the next group, or None if all are dead."""
        heap = self._heap
        while heap:
            load, replica = heap[0]
            if replica not in self.dead and load == self.load(replica):
                return replica
            heapq.heappop(heap)  # dead, or outdated: its replica has a newer entry with its current load
        return None

    def assign(self, group_id: int) -> int | None:
        """Pick a replica for `group_id` and record it as in flight there; None if all are dead."""
        if group_id in self.owner:
            raise ValueError(f"group {group_id} is already in flight on replica {self.owner[group_id]}")
        replica = self.pick()
        if replica is not None:
            self.in_flight[replica].add(group_id)
            self.owner[group_id] = replica
            self._moved(replica)
        return replica

    def done(self, group_id: int) -> int | None:
        """The group came back (or was given up); returns the replica it was on, None if unknown."""
        replica = self.owner.pop(group_id, None)
        if replica is not None:
            self.in_flight[replica].discard(group_id)
            self._moved(replica)
        return replica

    def mark_dead(self, replica: int) -> list[int]:
        """Exclude `replica` from now on; returns its in-flight group ids (to abandon or resend)."""
        self.dead.add(replica)
        lost = sorted(self.in_flight[replica])
        for gid in lost:
            del self.owner[gid]
        self.in_flight[replica].clear()
        return lost

    def _moved(self, replica: int) -> None:
        """`replica`'s load changed: give it an entry with the new load (the old one is now outdated)."""
        heapq.heappush(self._heap, (self.load(replica), replica))
        if len(self._heap) > 2 * len(self.shares) + 64:  # outdated entries pile up below the top
            self._rebuild()

    def _rebuild(self) -> None:
        """One entry per live replica (O(R), so at most once every R changes)."""
        self._heap = [(self.load(r), r) for r in self.shares if r not in self.dead]
        heapq.heapify(self._heap)
