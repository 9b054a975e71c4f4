"""Environments for multi-turn (agentic) episodes: the interface (base.py), the built-ins, and
the worker pool that runs their calls out of the engine's way (pool.py).

A job's `env.name` is a built-in ("calculator", "retry") or "package.module:Class", any
importable subclass of `Environment` (that is how a user adds one without touching hexrl)."""
import importlib

from hexrl.envs.base import Environment, Problem, Step
from hexrl.envs.calculator import Calculator
from hexrl.envs.pool import EnvPool
from hexrl.envs.retry import Retry

ENVIRONMENTS: dict[str, type[Environment]] = {"calculator": Calculator, "retry": Retry}



def environment_class(name: str) -> type[Environment]:
    """The class a job's `env.name` names; ValueError saying why if none."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise ValueError(f"must be one of {', '.join(ENVIRONMENTS)} or 'package.module:Class', got {name!r}")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except Exception as e:  # ImportError, AttributeError, or the module's own error
        raise ValueError(f"cannot import {name!r}: {type(e).__name__}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"{name!r} is not a subclass of hexrl.envs.Environment")
    return cls


__all__ = ["Environment", "Problem", "Step", "EnvPool", "Calculator", "Retry", "ENVIRONMENTS", "environment_class"]
