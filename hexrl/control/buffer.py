"""Replay buffer of prompt groups, with group filtering and an account of every trajectory.

Life of a group: `expect(group_id, n)` when its prompt is handed out; `add(traj)` for each of
its n samples; when the n-th arrives the group is either filtered (e.g. all rewards equal: no
GRPO signal) or ready; `pop_batch(B)` hands B ready groups, oldest first, to the trainer.
Every trajectory ever added ends up trained, filtered or dropped, each with a reason, or is
still pending; `accounting()` adds it up. With a StalenessGate attached, the buffer tells it
about every group that completes or dies, so the controller cannot forget to.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property

from hexrl.control.gate import StalenessGate
from hexrl.trajectory import Trajectory


@dataclass
class Group:
    """The n samples of one prompt."""

    group_id: int
    n: int
    problem_id: object = None
    trajectories: list[Trajectory] = field(default_factory=list)
    seq: int = -1  # completion order, breaks ties between equally old groups

    @property
    def complete(self) -> bool:
        return len(self.trajectories) == self.n

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @cached_property
    def oldest_version(self) -> int:
        """Weight version of the group's oldest token; read only once complete (then cached, since
        the buffer sorts thousands of ready groups by it when eta is large)."""
        return min(t.oldest_version for t in self.trajectories)


class ReplayBuffer:
    """Collects trajectories into groups; see the module docstring for the life of a group."""

    def __init__(self, gate: StalenessGate | None = None, filter_equal_rewards: bool = True,
                 equal_tol: float = 1e-9):
        self.gate = gate
        self.filter_equal_rewards = filter_equal_rewards
        self.equal_tol = equal_tol
        self.open: dict[int, Group] = {}  # handed out, not all samples back
        self.ready: list[Group] = []  # complete and kept, not yet trained
        self.closed: dict[int, str] = {}  # group_id -> reason, for groups abandoned while open
        self.handed_out: set[int] = set()  # every group id ever expected (ids are never reused)
        self.produced = self.accepted = self.trained = 0  # trajectories
        self.filtered: Counter[str] = Counter()  # reason -> trajectories
        self.dropped: Counter[str] = Counter()  # reason -> trajectories
        self._seq = 0

    def expect(self, group_id: int, n: int, problem_id=None) -> None:
        """Register a prompt group that was just handed out (n samples will come back)."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"group {group_id}: n must be a positive int, got {n!r}")
        if group_id in self.handed_out:  # a set: with eta large, `ready` holds tens of thousands of groups
            raise ValueError(f"group {group_id} was already handed out")
        self.handed_out.add(group_id)
        self.open[group_id] = Group(group_id, n, problem_id)

    def add(self, traj: Trajectory) -> str:
        """File one trajectory; returns "pending", "accepted", "filtered" or "dropped"."""
        self.produced += 1
        group = self.open.get(traj.group_id)
        if group is None:
            self.dropped[self.closed.get(traj.group_id, "unknown_group")] += 1
            return "dropped"
        if traj.shape_problems():
            group.trajectories.append(traj)  # the group cannot complete: drop all of it
            self.abandon(traj.group_id, "malformed")
            return "dropped"
        group.trajectories.append(traj)
        if not group.complete:
            return "pending"
        del self.open[traj.group_id]
        reason = self._filter_reason(group)
        if reason is not None:
            self.filtered[reason] += group.n
            if self.gate:
                self.gate.on_dropped(reason)
            return "filtered"
        group.seq, self._seq = self._seq, self._seq + 1
        self.ready.append(group)
        self.accepted += group.n
        if self.gate:
            self.gate.on_accepted()
        return "accepted"

    def _filter_reason(self, group: Group) -> str | None:
        """Why a complete group carries no training signal, or None to keep it."""
        rewards = group.rewards
        if self.filter_equal_rewards and max(rewards) - min(rewards) <= self.equal_tol:
            return "equal_rewards"
        return None

    def drop_stale(self, trainer_version: int) -> list[int]:
        """Drop (as "stale", counted by the gate) ready groups more than eta versions behind
        `trainer_version`; returns their group ids. A no-op without a gate."""
        if self.gate is None:
            return []
        stale = [g for g in self.ready if self.gate.is_too_stale(g.oldest_version, trainer_version)]
        for g in stale:
            self._drop_ready(g, "stale")
        return [g.group_id for g in stale]

    def pop_batch(self, batch_size: int, trainer_version: int | None = None) -> list[Group] | None:
        """B ready groups, oldest (by oldest token version, then completion) first; None if fewer.

        With a gate and `trainer_version`, stale groups are dropped first (see `drop_stale`),
        never returned.
        """
        if trainer_version is not None:
            self.drop_stale(trainer_version)
        if len(self.ready) < batch_size:
            return None
        self.ready.sort(key=lambda g: (g.oldest_version, g.seq))
        batch, self.ready = self.ready[:batch_size], self.ready[batch_size:]
        self.trained += sum(g.n for g in batch)
        return batch

    def abandon(self, group_id: int, reason: str) -> int:
        """Give up on an open group (its replica died, a sample was malformed, ...).

        Its trajectories so far are dropped with `reason`, later ones will be too; returns
        how many were dropped now.
        """
        group = self.open.pop(group_id)
        self.closed[group_id] = reason
        self.dropped[reason] += len(group.trajectories)
        if self.gate:
            self.gate.on_dropped(reason)
        return len(group.trajectories)

    def drain(self, reason: str = "shutdown") -> int:
        """Drop everything pending (open and ready groups); returns the trajectories dropped."""
        count = sum(self.abandon(gid, reason) for gid in list(self.open))
        for g in list(self.ready):
            count += self._drop_ready(g, reason)
        return count

    def _drop_ready(self, group: Group, reason: str) -> int:
        self.ready.remove(group)
        self.dropped[reason] += group.n
        if self.gate:
            self.gate.on_dropped(reason, was_accepted=True)
        return group.n

    @property
    def pending(self) -> int:
        """Trajectories held: in open groups plus in ready groups."""
        return sum(len(g.trajectories) for g in self.open.values()) + sum(g.n for g in self.ready)

    def counters(self) -> dict:
        """Cumulative counts without the work still held (open and ready groups), for a
        checkpoint: a resume redoes that work, so it will be produced and accepted again."""
        ready = sum(g.n for g in self.ready)
        return {"produced": self.produced - self.pending, "accepted": self.accepted - ready,
                "trained": self.trained, "filtered": dict(self.filtered), "dropped": dict(self.dropped)}

    def load_counters(self, c: dict) -> None:
        """Continue the counts saved by `counters()` (missing keys count from zero)."""
        self.produced, self.accepted = c.get("produced", 0), c.get("accepted", 0)
        self.trained = c.get("trained", 0)
        self.filtered.update(c.get("filtered", {}))
        self.dropped.update(c.get("dropped", {}))

    def accounting(self) -> dict:
        """Trajectory counts; `balanced` says produced == trained + filtered + dropped + pending."""
        acc = {"produced": self.produced, "accepted": self.accepted, "trained": self.trained,
               "filtered": dict(self.filtered), "dropped": dict(self.dropped), "pending": self.pending}
        acc["balanced"] = self.produced == (self.trained + sum(self.filtered.values())
                                            + sum(self.dropped.values()) + self.pending)
        return acc

    def assert_balanced(self, allow_pending: bool = True) -> None:
        """Raise AssertionError if a trajectory is unaccounted for (or pending, if not allowed)."""
        acc = self.accounting()
        if not acc["balanced"] or (not allow_pending and acc["pending"]):
            raise AssertionError(f"trajectory accounting does not add up: {acc}")
