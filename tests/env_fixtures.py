"""Environments for the tests, in a module of their own: worker processes import it, and it
imports nothing heavy (a worker's start-up is then quick on a busy machine)."""
import abc
import os
import sys
import time

from hexrl.envs import Environment, Step


class Hostile(Environment):
    """Misbehaves as the turn says."""

    def step(self, problem, turns):
        t = turns[-1]
        if t == "raise":
            raise RuntimeError("boom")
        if t == "hang":
            time.sleep(60)
        if t == "die":
            os._exit(3)
        if t == "huge":
            return Step(observation="x" * (1 << 20))
        if t == "bytes":
            return Step(observation=b"\x00\xff")
        if t == "none":
            return None
        if t == "nan":
            return Step(done=True, reward=float("nan"))
        if t == "exit":
            raise SystemExit(1)
        return Step(observation="=" + t)


class Chatty(Environment):
    """A first observation, two more, then done with reward 1."""

    def start(self, problem):
        return " ok "

    def step(self, problem, turns):
        return Step(done=True, reward=1.0) if len(turns) == 3 else Step(observation=f"\nobs {len(turns)}\n")


class Scripted(Environment):
    """Does what the model's turn says: a calculator that always answers 1, or one of many ways to
    misbehave; any other turn is the final answer."""

    stop_strings = ("</calc>",)

    def step(self, problem, turns):
        t = turns[-1]
        if t.endswith("</calc>"):
            return Step(observation="=1")
        if t.startswith("<calc>"):
            return Step(done=True, reason="unclosed_call")
        if t == "raise":
            raise ValueError("tool broke")
        if t == "hang":
            time.sleep(60)
        obs = {"mega": "x" * (1 << 20), "big": "y" * 500, "weird": "\u00e9\u00e9", "empty": "", "bytes": b"1"}
        if t in obs:
            return Step(observation=obs[t])
        return Step(done=True, reward=float(t == problem.answer))


# ----------------------------------------------------------------------------- environments that cannot run


class Abstract(Environment, abc.ABC):
    """A base for other environments: an abstract method left to its subclasses."""

    @abc.abstractmethod
    def score(self, turn: str) -> float: ...

    def step(self, problem, turns):
        return Step(done=True, reward=self.score(turns[-1]))


class BrokenInit(Environment):
    def __init__(self, **options):
        raise RuntimeError("no licence server")

    def step(self, problem, turns):
        return Step(done=True)


class ListOptions(Chatty):
    options = ["penalty"]


class RaisingChecks(Chatty):
    options = {"penalty": 0.1}

    @classmethod
    def option_problems(cls, options):
        return options["penalty "]  # a typo: KeyError


class NoStops(Chatty):
    stop_strings = None


class EmptyStop(Chatty):
    stop_strings = ("\n", "")


class BareStop(Chatty):
    stop_strings = "</calc>"  # a string, not a tuple: seven one-character stop strings


class LongStop(Chatty):
    stop_strings = ("=" * 100,)


class FailsAtStart(Environment):
    """Ends every episode before the model's first turn: `start` raises, or with bad_observation=1
    returns something that is not text."""

    options = {"bad_observation": 0}

    def start(self, problem):
        if self.bad_observation:
            return b"\x00"
        raise RuntimeError("could not open a session")

    def step(self, problem, turns):
        return Step(done=True)


class Broken(Environment):
    """Cannot start: its __init__ raises (a missing key, say)."""

    def __init__(self, **options):
        raise ValueError("Broken needs an API key")


class Introspect(Environment):
    """Tells about its worker process: the turn "secret" gets HEXRL_SECRET ("unset" if none), "torch"
    whether torch is imported; "hang" never returns."""

    def step(self, problem, turns):
        if turns[-1] == "hang":
            time.sleep(60)
        if turns[-1] == "secret":
            return Step(observation=os.environ.get("HEXRL_SECRET", "unset"))
        return Step(observation=str("torch" in sys.modules))
