"""The knob values a run actually uses, written to RUN_DIR/effective_config.json by global rank 0.

    {"train": {activation_checkpointing, micro_batch_tokens, dtype, grad_reduce_dtype,
               lr, grad_clip, warmup_steps, lr_decay_steps, lr_final_frac, weight_decay, ppo_minibatches},
     "rollout": {"replicas": [{id, max_running, max_batch_tokens, kv_pages, page_size, dtype}]},
     "groups": [{name, ranks, backend, weights?}],  # every process group, as torch made it
     "colocate": {kv_fraction, train_fraction, rollout_fraction}}  # only where the roles share a GPU

Every key is the plan's own name (plan["trainer"], plan["rl"], plan["rollout"]["replicas"][i]),
so `diff` against the plan shows any knob the runtime did not take as planned. The trainer
slot (0, 0, 0) and each replica leader publish what their Trainer / Engine hold, read back
from those objects, through the torchrun store as JSON; rank 0 collects them.
"""
from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import torch

from hexrl.runtime.context import RankContext
from hexrl.runtime.files import write_json_atomic

_KEY = "hexrl/effective/"
WAIT_S = 600  # every role publishes right after building its model; a dead rank is the watchdog's job


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def train_values(trainer) -> dict:
    """The trainer knobs in use, read from the Trainer, its gradient buckets and its optimizer."""
    c, opt = trainer.config, trainer.optimizer
    return {"activation_checkpointing": c.activation_checkpointing, "micro_batch_tokens": c.micro_batch_tokens,
            "dtype": dtype_name(trainer.dtype), "grad_reduce_dtype": dtype_name(trainer.grads.reduce_dtype),
            "lr": opt.lr, "grad_clip": c.grad_clip, "warmup_steps": opt.warmup_steps,
            "lr_decay_steps": opt.decay_steps, "lr_final_frac": opt.final_frac,
            "weight_decay": opt.opt.param_groups[0]["weight_decay"], "ppo_minibatches": c.ppo_minibatches}


def rollout_values(engine) -> dict:
    """A replica's engine knobs in use, read from its scheduler and page pool."""
    return {"max_running": engine.scheduler.max_running, "max_batch_tokens": engine.scheduler.max_batch_tokens,
            "kv_pages": engine.pool.num_pages, "page_size": engine.pool.page_size, "dtype": dtype_name(engine.dtype)}


def publish(ctx: RankContext, part: str, values: dict) -> None:
    """Publish this role's values ("train" or "replica/<id>"); on global rank 0 also write the file."""
    ctx.store.set(_KEY + part, json.dumps(values))
    if ctx.rank == 0:
        write_for(ctx)


def write_for(ctx: RankContext) -> dict:
    """`write` for this run's plan and groups."""
    col = ctx.plan.job.colocate
    return write(ctx.store, [r.id for r in ctx.plan.replicas], ctx.run_dir, ctx.groups,
                 col.to_dict() if col is not None else None)


def publish_group(store, name: str, ranks: list[int], backend: str, weights: str | None = None) -> None:
    """One process group's backend as torch made it (and, for a weight-sync group, how weights travel)."""
    values = {"name": name, "ranks": ranks, "backend": backend}
    if weights is not None:
        values["weights"] = weights
    store.set(f"{_KEY}group/{name}", json.dumps(values))


def write(store, replica_ids: list[int], run_dir: Path, groups: list[str] = (), colocate: dict | None = None) -> dict:
    """Wait for every role's and group's values and write effective_config.json; returns what it wrote."""
    keys = [_KEY + "train", *(f"{_KEY}replica/{i}" for i in replica_ids), *(f"{_KEY}group/{g}" for g in groups)]
    store.wait(keys, timedelta(seconds=WAIT_S))
    values = [json.loads(store.get(k)) for k in keys]
    train, reps = values[0], values[1:1 + len(replica_ids)]
    out = {"train": train, "rollout": {"replicas": [{"id": i, **r} for i, r in zip(replica_ids, reps)]}}
    if groups:
        out["groups"] = values[1 + len(replica_ids):]
    if colocate is not None:
        out["colocate"] = colocate
    write_json_atomic(run_dir / "effective_config.json", out)
    return out
