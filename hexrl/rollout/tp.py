"""The few collectives a tensor-parallel rollout replica needs beyond the layers' own."""
from __future__ import annotations

import dataclasses

import msgpack
import torch
import torch.distributed as dist

from hexrl.comm.store import broadcast_bytes
from hexrl.model.parallel import TPGroup
from hexrl.runtime.dist_rules import compute_device

from .sequence import Prefix, Request


def _group(tp: TPGroup):
    return tp.group if tp.group is not None else dist.group.WORLD


def broadcast_from_leader(event: tuple[str, object] | None, tp: TPGroup) -> tuple[str, object]:
    """Send an engine event `(kind, arg)` from TP rank 0 to the others; every rank returns it.

    `arg` is None, an int (a version), a list of request ids (withdrawn) or a list of Requests and
    episode ops (("extend", id, ids, max_new_tokens) or ("release", id)). Events travel as msgpack
    bytes, never pickle: a length broadcast, then the payload.
    """
    group, src = _group(tp), dist.get_global_rank(_group(tp), 0)
    device = compute_device()  # the rank's own (rule 1 of hexrl/runtime/dist_rules.py)
    raw = broadcast_bytes(_encode(event) if event is not None else None, src, group, device)
    return event if event is not None else _decode(raw)


def _encode(event: tuple[str, object]) -> bytes:
    kind, arg = event
    if kind == "step":
        arg = [dataclasses.asdict(r) if isinstance(r, Request) else list(r) for r in arg]
    return msgpack.packb([kind, arg])


def _decode(raw: bytes) -> tuple[str, object]:
    kind, arg = msgpack.unpackb(raw)
    if kind == "step":
        arg = [_request(r) if isinstance(r, dict) else tuple(r) for r in arg]
    return kind, arg


def _request(fields: dict) -> Request:
    """A Request from its `dataclasses.asdict` (tuples and a prefix come back as lists and a map)."""
    fields = {k: tuple(v) if k in ("stop_ids", "stop_strings") else v for k, v in fields.items()}
    if fields.get("prefix") is not None:
        fields["prefix"] = Prefix(**fields["prefix"])
    return Request(**fields)


def gather_vocab(logits: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """[B, V/tp] vocab slices on each rank -> the full [B, V] logits on every rank."""
    parts = [torch.empty_like(logits) for _ in range(tp.size)]
    dist.all_gather(parts, logits.contiguous(), group=_group(tp))
    return torch.cat(parts, dim=-1)


def min_across(n: int, tp: TPGroup, device: torch.device) -> int:
    """The smallest of an integer over the TP group (every rank must size its page pool alike)."""
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_group(tp))
    return int(t.item())
