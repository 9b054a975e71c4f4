"""Rollout: a continuous-batching generation engine over a paged KV cache.

`Engine(model, EngineConfig(...), eos_ids=..., tokenizer=...)`, `engine.add(Request(...))`,
`engine.step() -> list[Finished]`, `engine.generate(requests)`, `engine.update_weights(...)`.
"""
from .engine import Engine, EngineConfig, EngineStats, load_state
from .sequence import Finished, Prefix, Request

__all__ = ["Engine", "EngineConfig", "EngineStats", "Finished", "Prefix", "Request", "load_state"]
