"""A trajectory: one sampled completion of one prompt, as it travels from rollout to trainer."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Trajectory:
    """One completion with everything the decoupled PPO loss needs.

    `logprobs[i]` is the behaviour log-prob of `completion_ids[i]` under the distribution it was
    sampled from, and `versions[i]` the weight version that produced it (interrupts can change
    the version mid-sequence).
    """

    group_id: int  # the prompt group (n samples of one prompt share it)
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float = 0.0
    finish_reason: str = "length"  # "eos" | "stop" | "length"
    problem_id: str | int | None = None
    meta: dict = field(default_factory=dict)

    @property
    def oldest_version(self) -> int:
        return min(self.versions) if self.versions else 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)
