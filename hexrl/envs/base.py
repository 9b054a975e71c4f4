"""The environment interface: what a multi-turn (agentic) episode talks to.

An environment is one small class. Given a problem it gives the first observation (text
appended after the prompt, often empty); given the model's turns so far it gives the next
observation, whether the episode is done, and the reward when it is. A model turn ends at one
of the environment's `stop_strings` (or at EOS, or after rl.max_new_tokens tokens).

Environments run in worker processes (hexrl/envs/pool.py), never in the engine's loop: a call
that raises, hangs past env.timeout_s, or returns something other than a `Step` ends its
episode with reward 0 and a named reason. So `step` is a plain function of its arguments (the
whole turn history is passed in; nothing is kept between calls): any worker can serve any call.

    class Echo(Environment):
        stop_strings = ("\\n",)

        def step(self, problem, turns):
            if len(turns) < 2:
                return Step(observation="again\\n")
            return Step(done=True, reward=float(turns[-1].strip() == problem.answer))
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Problem:
    """What an environment sees of a problem: the prompt text, the answer (or tests), its id."""

    prompt: str
    answer: str | None = None
    id: object = None
    tests: list | None = None


@dataclass
class Step:
    """The environment's reply to a model turn. `reason` names how a done episode ended
    ("answer" if not given); `reward` counts only when `done`."""

    observation: str = ""
    done: bool = False
    reward: float = 0.0
    reason: str = ""


class Environment:
    """Base class: subclass it, set `stop_strings` and `options` (name -> default, numbers), and
    write `step` (and `start` if the episode opens with an observation).

    The job's `env` section names the class (hexrl/envs/__init__.py: ENVIRONMENTS) and sets the
    options; `__init__` receives them as keyword arguments, every one given or defaulted. Where the
    job is read the class is checked and made once (hexrl/envs/__init__.py: class_problems,
    setup_problems): `stop_strings` a tuple of non-empty strings the tokenizer can write,
    `option_problems` and `__init__` raising nothing.
    """

    stop_strings: tuple[str, ...] = ()
    options: dict[str, float] = {}

    def __init__(self, **options):
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise ValueError(f"{type(self).__name__}: unknown options {unknown}")
        for name, default in self.options.items():
            setattr(self, name, options.get(name, default))

    @classmethod
    def option_problems(cls, options: dict) -> list[str]:
        """Everything wrong with `options` beyond being numbers (override to add checks)."""
        return []

    def start(self, problem: Problem) -> str:
        """The first observation, appended after the prompt before the model's first turn."""
        return ""

    def step(self, problem: Problem, turns: list[str]) -> Step:
        """The reply to the model's latest turn `turns[-1]` (all its turns so far, in order)."""
        raise NotImplementedError
