"""The retry environment: the model answers; a wrong answer gets a fixed short observation and
another try (up to env.max_turns, counted by the episode driver). The reward is the final
answer's exact match, times `discount` per retry."""
from __future__ import annotations

from hexrl.rewards.synthetic import exact_match_reward

from .base import Environment, Problem, Step

WRONG = "\nwrong, try again.\n"


class Retry(Environment):
    options = {"discount": 1.0}

    @classmethod
    def option_problems(cls, options: dict) -> list[str]:
        d = options.get("discount", 1.0)
        return [] if 0 < d <= 1 else [f"discount must be in (0, 1], got {d}"]

    def step(self, problem: Problem, turns: list[str]) -> Step:
        if exact_match_reward(turns[-1], problem.answer or "") == 1.0:
            return Step(done=True, reward=self.discount ** (len(turns) - 1), reason="answer")
        return Step(observation=WRONG)
