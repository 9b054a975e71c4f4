"""Environment calls in worker processes (the reward pool's mechanism: hexrl/rewards/worker_pool.py).

The engine never waits on an environment: the episode driver submits a call and decodes on.
Whatever the environment does, the reply is a valid `Step`: a call that raises or whose worker
dies ends the episode ("env_error"), one that outlasts `timeout_s` too ("env_timeout", its
worker is replaced), a reply that is not a Step or whose observation is not text
("bad_observation") or longer than MAX_OBSERVATION_CHARS ("observation_too_long") as well;
each with reward 0.
"""
from __future__ import annotations

import math
from functools import partial

from hexrl.rewards.worker_pool import WorkerPool

from .base import Environment, Problem, Step

MAX_OBSERVATION_CHARS = 1 << 16  # a megabyte observation never crosses the pipe or meets the tokenizer

_ENVS: dict[tuple, Environment] = {}  # per worker process: one instance per (name, options)


def make_env(name: str, options: dict) -> Environment:
    from . import environment_class

    return environment_class(name)(**options)


def cached_env(name: str, options: dict) -> Environment:
    """This worker's instance of the environment (made, and its module imported, on first use)."""
    key = (name, tuple(sorted(options.items())))
    if key not in _ENVS:
        _ENVS[key] = make_env(name, options)
    return _ENVS[key]


def call_env(name: str, options: dict, method: str, problem: Problem, turns: list[str]) -> Step:
    """Run `start` or `step` of the named environment (in a worker); always returns a checked Step."""
    env = cached_env(name, options)
    if method == "start":
        out = env.start(problem)
        out = Step(observation=out) if isinstance(out, str) else out
    else:
        out = env.step(problem, list(turns))
    return checked(out)


def checked(out) -> Step:
    """`out` as a plain Step (copied field by field), or a done Step naming what is wrong with it."""
    if not isinstance(out, Step) or not isinstance(out.observation, str) or not isinstance(out.done, bool) \
            or not isinstance(out.reward, (int, float)) or not isinstance(out.reason, str):
        return Step(done=True, reason="bad_observation")
    if len(out.observation) > MAX_OBSERVATION_CHARS:
        return Step(done=True, reason="observation_too_long")
    if out.done and not math.isfinite(out.reward):
        return Step(done=True, reason="bad_reward")
    return Step(str(out.observation), bool(out.done), float(out.reward) if out.done else 0.0,
                str(out.reason)[:64] or ("answer" if out.done else ""))


class EnvPool(WorkerPool):
    """Calls of one environment (`name` with `options`) in `workers` processes, `timeout_s` each.
    `submit([("step", problem, turns)])` -> ticket; `finished()` -> {ticket: [Step]}."""

    name = "EnvPool"

    def __init__(self, env: str, options: dict, workers: int = 2, timeout_s: float = 10.0,
                 start_timeout_s: float = 60.0):
        super().__init__(partial(call_env, env, dict(options)), workers, timeout_s, start_timeout_s,
                         warm_up=partial(cached_env, env, dict(options)))

    def failed(self, status: str, message: str) -> Step:
        return Step(done=True, reason="env_timeout" if status == "timeout" else "env_error")

    def run_step(self, problem: Problem, turns: list[str]) -> Step:
        """One call, waited for (tests and tools)."""
        return self.run([("step", problem, turns)])[0]
