"""Reward for reasoning-gym problems: the task's own scorer (`pip install -e .[gym]`).

It runs where every reward runs, in the reward pool's worker processes (a per-call timeout; a
worker that crashes or hangs is replaced). It is not the code sandbox: a task whose scorer parses
the model's text (sympy, for some algebra tasks) does so in that worker.
"""
from __future__ import annotations

import json
from functools import lru_cache

from hexrl.rewards.synthetic import first_line

INSTALL = "reasoning-gym is not installed: pip install -e .[gym]"


def import_gym():
    """The reasoning_gym module, or ImportError saying how to install it."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(f"{INSTALL} ({e})") from None
    return reasoning_gym


@lru_cache(maxsize=None)
def scorer(task: str, config: str):
    """The task's `score_answer(answer, entry)`, of a dataset built with the problem's config (JSON)."""
    return import_gym().create_dataset(task, size=1, seed=0, **json.loads(config)).score_answer


def extract(completion: str) -> str:
    """The completion's answer: inside its last <answer>...</answer> (reasoning-gym's own format) when
    it has one, else its first line (a short model's bare answer)."""
    if "<answer>" in completion:
        from reasoning_gym.utils import extract_answer

        found = extract_answer(completion)
        if found is not None:
            return found
    return first_line(completion)


def gym_reward(completion: str, answer: str) -> float:
    """The task's score (0..1; some tasks give partial credit) of `completion`; `answer` is the problem's
    reasoning-gym entry as JSON (hexrl.data.gym_problems), naming its task and config."""
    if not isinstance(completion, str) or not isinstance(answer, str):
        return 0.0
    entry = json.loads(answer)
    score = scorer(entry["task"], json.dumps(entry["config"], sort_keys=True))
    return float(score(answer=extract(completion), entry=entry))
