"""A trajectory: one sampled completion (or episode) of one prompt, as it travels from rollout to trainer."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Trajectory:
    """One completion with everything the decoupled PPO loss needs.

    `logprobs[i]` is the behaviour log-prob of `completion_ids[i]` under the distribution it was
    sampled from, and `versions[i]` the weight version that produced it (interrupts can change
    the version mid-sequence).

    An episode (multi-turn) interleaves the model's tokens with the environment's: `mask[j]` is 1
    where `completion_ids[j]` was sampled and 0 where an observation put it (the ids exactly as
    sampled, and each observation as tokenized once: never a re-tokenized transcript). Then
    `logprobs` and `versions` hold one value per sampled token, in order. `mask` None: every
    completion token was sampled (single-turn).

    `start_version` is the weight version the sample was started under: the trajectory's version when
    it has no sampled token (an episode whose environment failed before the model's first turn).
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
    mask: list[int] | None = None
    start_version: int = 0

    @property
    def oldest_version(self) -> int:
        """The version of the first sampled token (the oldest: versions only grow along a sequence), or
        the version the sample was started under if it has none."""
        return min(self.versions) if self.versions else self.start_version

    @property
    def num_generated(self) -> int:
        """Tokens the model sampled (the loss's tokens)."""
        return len(self.completion_ids) if self.mask is None else sum(self.mask)

    def generated_positions(self) -> list[int]:
        """Indices into `completion_ids` of the sampled tokens."""
        if self.mask is None:
            return list(range(len(self.completion_ids)))
        return [j for j, m in enumerate(self.mask) if m]

    def shape_problems(self) -> list[str]:
        """What is inconsistent among completion_ids, mask, logprobs and versions."""
        p = []
        if self.mask is not None:
            if len(self.mask) != len(self.completion_ids):
                p.append(f"mask: {len(self.mask)} values for {len(self.completion_ids)} completion tokens")
            if any(m not in (0, 1) or isinstance(m, bool) for m in self.mask):
                p.append("mask: values must be 0 (environment) or 1 (model)")
        n = self.num_generated if not p else len(self.completion_ids)
        for name in ("logprobs", "versions"):
            if len(getattr(self, name)) != n:
                p.append(f"{name}: {len(getattr(self, name))} values for {n} generated tokens")
        return p

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)
