"""The staleness gate (AReaL): how many prompt groups may be in flight for a trainer version.

With trainer version v, B prompt groups per step and bound eta:
    capacity(v) = (eta + v + 1) * B - (accepted + running)
`running` groups were handed out and are still generating; `accepted` groups completed and
went into the replay buffer (ever, trained or not). A group that ends without being trained
(filtered, lost, stale) gives its slot back. eta = 0 is synchronous RL: exactly B groups per
version. eta = None means no bound on staleness; `max_concurrent_rollouts` (the job's rl field)
still bounds how many groups generate at once (without it, eta = None would hand the whole dataset
to the rollout at once). With rl.eta = "auto" (hexrl/control/auto_eta.py) the controller moves
`eta` between steps and `max_lag` (rl.eta_max) stays the lag past which consumed data is dropped,
so lowering eta does not throw away groups already generated within the user's bound.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class StalenessGate:
    """Counts prompt groups against the capacity formula; one instance lives in the controller."""

    batch_size: int
    eta: int | None
    max_concurrent_rollouts: int | None = None  # groups generating at once; None = only the formula
    running: int = 0
    accepted: int = 0
    released: Counter = field(default_factory=Counter)  # reason -> groups that gave their slot back
    too_stale: int = 0  # consumed groups found more than eta (max_lag if set) versions behind the trainer
    max_lag: int | None = None  # drop consumed data past this lag; None = eta

    def __post_init__(self):
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {self.batch_size!r}")
        if self.eta is not None and (not isinstance(self.eta, int) or self.eta < 0):
            raise ValueError(f"eta must be a non-negative int or None (unbounded), got {self.eta!r}")
        limit = self.max_concurrent_rollouts
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ValueError(f"max_concurrent_rollouts must be a positive int or None, got {limit!r}")
        if self.max_lag is not None and (not isinstance(self.max_lag, int) or self.max_lag < 0):
            raise ValueError(f"max_lag must be a non-negative int or None, got {self.max_lag!r}")

    def capacity(self, version: int) -> float:
        """How many more groups may be handed out at trainer `version` (math.inf if unbounded)."""
        cap = math.inf
        if self.eta is not None:
            cap = (self.eta + version + 1) * self.batch_size - (self.accepted + self.running)
        return cap if self.max_concurrent_rollouts is None else min(cap, self.max_concurrent_rollouts - self.running)

    def try_acquire(self, version: int) -> bool:
        """Take a slot for one new prompt group if capacity allows; True if taken."""
        if self.capacity(version) <= 0:
            return False
        self.running += 1
        return True

    def on_accepted(self, n: int = 1) -> None:
        """`n` running groups completed and entered the replay buffer."""
        self._take("running", n)
        self.accepted += n

    def on_dropped(self, reason: str, n: int = 1, was_accepted: bool = False) -> None:
        """`n` groups will never be trained (filtered, lost, stale): give their slots back.

        was_accepted: they had already been counted by on_accepted (e.g. dropped as stale at
        consumption); otherwise they were still running.
        """
        self._take("accepted" if was_accepted else "running", n)
        self.released[reason] += n

    def is_too_stale(self, oldest_version: int, trainer_version: int) -> bool:
        """True (and counted) if data from `oldest_version` is more than eta (max_lag) versions old."""
        bound = self.eta if self.max_lag is None else self.max_lag
        stale = bound is not None and trainer_version - oldest_version > bound
        self.too_stale += stale
        return stale

    def _take(self, counter: str, n: int) -> None:
        have = getattr(self, counter)
        if n < 0 or n > have:
            raise ValueError(f"cannot move {n} groups out of {counter} = {have}")
        setattr(self, counter, have - n)
