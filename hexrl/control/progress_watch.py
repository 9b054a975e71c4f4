"""A run that makes no progress says so.

Two faults make a run generate without training, and nothing else would tell: groups whose
rewards all come out equal (a model that never, or always, earns the reward), which
rl.filter_equal_groups filters and replaces with new prompts without end; and an environment that
times out, which ends each episode with reward 0 and replaces its worker. The controller tells
`ProgressWatch` of every trajectory and every completed group; past a threshold (a step's worth of
groups filtered in a row; at least half of the recent episodes timed out) `warnings()` names the
likely cause with the numbers, each kind at most once per WARN_EVERY_S.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

WARN_EVERY_S = 60.0  # one warning of each kind a minute at most: a stalled run must not flood its log
TIMEOUT_SHARE = 0.5  # the share of recent episodes ending in env_timeout past which the environment is named


@dataclass
class ProgressWatch:
    """Counts filtered-for-equal-rewards groups and environment timeouts (one lives in the controller)."""

    batch_size: int  # groups per step: that many filtered in a row is a step's worth
    group_size: int  # samples per group: the timeout rate is read once a group's worth of episodes ended
    env: object = None  # the job's EnvSpec (named in the timeout warning), None for single-turn
    clock: Callable[[], float] = time.monotonic
    equal_in_a_row: int = 0  # groups filtered for equal rewards since the last group kept
    equal_groups: int = 0
    kept_groups: int = 0
    env_timeouts: int = 0  # trajectories that ended in env_timeout
    recent: deque = field(init=False)  # the last step's worth of trajectories: True where it timed out
    recent_timeouts: int = 0  # how many of `recent` timed out (kept as they come: a step may hold 10^5)
    warned_at: dict[str, float] = field(default_factory=dict)  # kind -> clock() of its last warning

    def __post_init__(self):
        self.recent = deque(maxlen=self.batch_size * self.group_size)

    def on_trajectory(self, finish_reason: str) -> None:
        """A trajectory arrived; `finish_reason` is how its sample (or episode) ended."""
        timed_out = finish_reason == "env_timeout"
        if len(self.recent) == self.recent.maxlen:
            self.recent_timeouts -= self.recent[0]
        self.recent.append(timed_out)
        self.recent_timeouts += timed_out
        self.env_timeouts += timed_out

    def on_group(self, equal: bool) -> None:
        """A group completed: filtered for equal rewards (`equal`), or kept for training."""
        if equal:
            self.equal_in_a_row += 1
            self.equal_groups += 1
        else:
            self.equal_in_a_row = 0
            self.kept_groups += 1

    def warnings(self) -> list[str]:
        """The warnings due now (each kind at most once per WARN_EVERY_S)."""
        out = []
        if self.equal_in_a_row >= self.batch_size and self._due("equal_rewards"):
            out.append(self._equal_rewards())
        read = len(self.recent) >= self.group_size
        if read and self.recent_timeouts >= TIMEOUT_SHARE * len(self.recent) and self._due("env_timeout"):
            out.append(self._env_timeouts())
        return out

    def _due(self, kind: str) -> bool:
        """True (and remembered) if no warning of `kind` was given in the last WARN_EVERY_S."""
        now = self.clock()
        if kind in self.warned_at and now - self.warned_at[kind] < WARN_EVERY_S:
            return False
        self.warned_at[kind] = now
        return True

    def _equal_rewards(self) -> str:
        return (f"[hexrl] warning: no progress: the last {self.equal_in_a_row:,} prompt groups in a row had equal "
                f"rewards and were filtered and generated again (a step needs {self.batch_size}; "
                f"{self.equal_groups:,} filtered and {self.kept_groups:,} kept since the start). Likely cause: the "
                "model never (or always) earns the reward on this data: check that reward.name (or the environment) "
                "fits the data's answers and that the prompt asks for the answer format it reads, or use easier data")

    def _env_timeouts(self) -> str:
        env = self.env
        limits = f"; env.timeout_s = {env.timeout_s:g} s, env.workers = {env.workers}" if env is not None else ""
        return (f"[hexrl] warning: the environment timed out on {self.recent_timeouts} of the last "
                f"{len(self.recent)} episodes ({self.env_timeouts:,} since the start{limits}). Likely cause: its "
                "calls take longer than env.timeout_s, or hang, and every timeout also replaces a worker: raise "
                "env.timeout_s or fix the environment")
