"""Environments for multi-turn (agentic) episodes: the interface (base.py), the built-ins, and
the worker pool that runs their calls out of the engine's way (pool.py).

A job's `env.name` is a built-in ("calculator", "retry") or "package.module:Class", any
importable subclass of `Environment` (that is how a user adds one without touching hexrl).
The job's `env` section checks the class (`class_problems`), its options (`setup_problems`) and,
where the model's tokenizer is, its stop strings (`stop_string_problems`) before anything runs."""
import importlib
import inspect

from hexrl.envs.base import Environment, Problem, Step
from hexrl.envs.calculator import Calculator
from hexrl.envs.pool import EnvPool
from hexrl.envs.retry import Retry
from hexrl.ranges import number_problem

ENVIRONMENTS: dict[str, type[Environment]] = {"calculator": Calculator, "retry": Retry}
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 64  # the engine decodes this many tokens (and 8 more) after every token to find one


def environment_class(name: str) -> type[Environment]:
    """The class a job's `env.name` names; ValueError saying why if none."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise ValueError(f"must be one of {', '.join(ENVIRONMENTS)} or 'package.module:Class', got {name!r}")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except BaseException as e:  # ImportError, AttributeError, the module's own error, or its sys.exit()
        raise ValueError(f"cannot import {name!r}: {_raised(e)}") from None
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"{name!r} is not a subclass of hexrl.envs.Environment")
    return cls


def _raised(e: BaseException) -> str:
    """'KeyError: 'x'': what the user's code raised, in a line."""
    return (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)[:300]


def class_problems(cls: type[Environment]) -> list[str]:
    """Why `cls` cannot run as written: abstract (no `step` of its own), `options` not {name: number},
    `stop_strings` not a short tuple of short non-empty strings."""
    out = []
    if inspect.isabstract(cls) or cls.step is Environment.step:
        out.append("abstract: it must define step (and every abstract method)")
    opts = cls.options
    if not isinstance(opts, dict):
        out.append(f"options must be a dict {{name: default number}}, got {type(opts).__name__}")
    else:
        out += [f"options[{k!r}]: {why}" for k, v in opts.items()
                if (why := "names must be strings" if not isinstance(k, str) else number_problem(v))]
    return out + _stop_problems(cls.stop_strings)


def _stop_problems(stops) -> list[str]:
    if not isinstance(stops, (tuple, list)) or not all(isinstance(s, str) for s in stops):
        return [f"stop_strings must be a tuple of strings, got {stops!r}"[:200]]
    if len(stops) > MAX_STOP_STRINGS:
        return [f"stop_strings: at most {MAX_STOP_STRINGS}, got {len(stops)}"]
    if "" in stops:
        return ["stop_strings must not hold an empty string (every turn would end after one token)"]
    return [f"stop_strings: {s[:20]!r}... is longer than {MAX_STOP_CHARS} characters" for s in stops
            if len(s) > MAX_STOP_CHARS]


def setup_problems(cls: type[Environment], options: dict) -> list[str]:
    """Why `cls` cannot be made with `options`: what its `option_problems` says (or raises), else what
    its `__init__` raises. Run once where the job is read, as a worker would run them."""
    try:
        found = cls.option_problems(dict(options))
    except BaseException as e:  # the user's code: whatever it raises, even SystemExit, is a problem to name
        return [f"option_problems raised {_raised(e)}"]
    if not isinstance(found, (list, tuple)) or not all(isinstance(p, str) for p in found):
        return [f"option_problems must return a list of strings, got {found!r}"[:200]]
    if found:
        return list(found)
    try:
        cls(**options)
    except BaseException as e:
        return [f"{cls.__name__}(**options) raised {_raised(e)}"]
    return []


def writable(tokenizer, text: str) -> bool:
    """Whether `tokenizer` can write `text`: it encodes, and decodes back to hold it."""
    try:
        return text in tokenizer.decode(tokenizer.encode(text))
    except (ValueError, KeyError, TypeError):  # e.g. a character outside the char alphabet
        return False


def stop_string_problems(cls: type[Environment], tokenizer) -> list[str]:
    """The stop strings of `cls` the model could never write with `tokenizer`, naming the characters."""
    out = []
    for s in cls.stop_strings:
        if not writable(tokenizer, s):
            chars = "".join(c for c in dict.fromkeys(s) if not writable(tokenizer, c))
            out.append(f"the tokenizer cannot write {chars or s!r} of the stop string {s!r}: "
                       "the model could never end a turn there")
    return out


__all__ = ["Environment", "Problem", "Step", "EnvPool", "Calculator", "Retry", "ENVIRONMENTS", "environment_class",
           "class_problems", "setup_problems", "stop_string_problems"]
