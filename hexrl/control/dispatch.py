"""Choose the rollout replica for the next prompt group.

Each replica has a planned share (e.g. its predicted tokens/s from the plan). The next group
goes to the live replica with the lowest in-flight / share, ties to the smallest id, so over
time each replica holds work in proportion to its share. Dead replicas get nothing.

With a long-tail class (replicas marked long_tail in the plan), the replicas form two pools: a
group predicted long goes to the long-tail replica with the lowest in-flight / share, any other
group to the regular replica with the lowest. A pool with no live replica left hands its groups to
the other. Without long-tail replicas there is one pool and every pick is as above.

The replicas of each pool sit in a heap of (load, id) entries, one pushed whenever a replica's
load changes; an entry whose load is no longer its replica's (or whose replica died) is dropped
when it reaches the top. Picking costs O(log R) (amortized) instead of a scan of all R replicas,
and picks exactly what the scan would: the smallest (load, id) over the pool's live replicas.
"""
from __future__ import annotations

import heapq
import math


class Dispatcher:
    """Tracks which groups are in flight on which replica (change them only through assign, done
    and mark_dead: the heap follows those)."""

    def __init__(self, shares: dict[int, float], long_tail: frozenset[int] = frozenset()):
        """`long_tail`: the replicas that serve the groups predicted long (empty: one pool)."""
        bad = {r: s for r, s in shares.items() if not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0)}
        if not shares or bad:
            raise ValueError(f"shares must map each replica to a positive finite number; bad: {bad or 'empty'}")
        if not set(long_tail) <= set(shares):
            raise ValueError(f"long-tail replicas {sorted(set(long_tail) - set(shares))} have no share")
        self.shares = dict(shares)
        self.long_tail = frozenset(long_tail)
        self.in_flight: dict[int, set[int]] = {r: set() for r in shares}  # replica -> group ids
        self.owner: dict[int, int] = {}  # group id -> replica
        self.dead: set[int] = set()
        self._heaps: dict[bool, list[tuple[float, int]]] = {False: [], True: []}  # long? -> (load, replica) entries
        for pool in self._heaps:
            self._rebuild(pool)

    def load(self, replica: int) -> float:
        """In-flight groups over planned share."""
        return len(self.in_flight[replica]) / self.shares[replica]

    def pick(self, long: bool = False) -> int | None:
        """The replica that should get the next group (predicted `long` or not), or None if all are dead."""
        first = self._top(long)
        return first if first is not None else self._top(not long)

    def has_live(self, long: bool) -> bool:
        """Whether pool `long` (the long-tail replicas, or the regular ones) has a live replica."""
        return self._top(long) is not None

    def assign(self, group_id: int, long: bool = False) -> int | None:
        """Pick a replica for `group_id` (predicted `long` or not) and record it as in flight there;
        None if all are dead."""
        if group_id in self.owner:
            raise ValueError(f"group {group_id} is already in flight on replica {self.owner[group_id]}")
        replica = self.pick(long)
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

    def _top(self, long: bool) -> int | None:
        """The live replica of pool `long` with the smallest (load, id), or None if it has none."""
        heap = self._heaps[long]
        while heap:
            load, replica = heap[0]
            if replica not in self.dead and load == self.load(replica):
                return replica
            heapq.heappop(heap)  # dead, or outdated: its replica has a newer entry with its current load
        return None

    def _moved(self, replica: int) -> None:
        """`replica`'s load changed: give it an entry with the new load (the old one is now outdated)."""
        pool = replica in self.long_tail
        heapq.heappush(self._heaps[pool], (self.load(replica), replica))
        if len(self._heaps[pool]) > 2 * len(self.shares) + 64:  # outdated entries pile up below the top
            self._rebuild(pool)

    def _rebuild(self, pool: bool) -> None:
        """One entry per live replica of `pool` (O(R), so at most once every R changes)."""
        live = (r for r in self.shares if r not in self.dead and (r in self.long_tail) == pool)
        self._heaps[pool] = [(self.load(r), r) for r in live]
        heapq.heapify(self._heaps[pool])
