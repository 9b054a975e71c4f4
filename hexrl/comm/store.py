"""torch.distributed store and broadcast helpers: the channel endpoints go through the torchrun
store (never the job's secret: hexrl.comm.secret); `broadcast_bytes` sends raw bytes over a
process group, `scatter_bytes` each member its own.

Kept apart from the ZeroMQ channels (hexrl.comm.channel) so that users of these helpers alone
(the rollout TP group, the weight sync) import neither zmq nor msgpack.
"""
from __future__ import annotations

from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

# ---------------------------------------------------------------- endpoint exchange

_KEY_PREFIX = "hexrl/endpoint/"


def publish_endpoint(store, name: str, endpoint: str) -> None:
    """Publish `endpoint` under `name` in a torch.distributed Store (TCPStore, HashStore, ...)."""
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"endpoint {endpoint!r} is not a ZeroMQ endpoint (tcp://host:port)")
    store.set(_KEY_PREFIX + name, endpoint)


def lookup_endpoint(store, name: str, timeout_s: float = 60.0) -> str:
    """The endpoint published under `name`, waiting up to `timeout_s`; raises TimeoutError."""
    key = _KEY_PREFIX + name
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except RuntimeError as e:  # DistStoreError is a RuntimeError
        raise TimeoutError(f"no endpoint {name!r} published within {timeout_s}s ({e})") from None
    return store.get(key).decode()


def broadcast_bytes(payload: bytes | None, src: int, group, device="cpu") -> bytes:
    """Raw bytes from global rank `src` (which passes them; others pass None) to every rank of a
    torch.distributed group: the length, then the payload. Callers put msgpack in it, never pickle."""
    size = torch.tensor([len(payload or b"")], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    if payload:
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src, group=group)
    return payload if payload is not None else buf.cpu().numpy().tobytes()


def scatter_bytes(payloads: dict[int, bytes] | None, src: int, group, device="cpu") -> bytes:
    """Each rank of a torch.distributed group gets its own bytes from global rank `src`, which passes
    {global rank: bytes} for every member (others pass None): the sizes, then one scatter padded to
    the largest payload."""
    members = dist.get_process_group_ranks(group)
    lens = [len(payloads[r]) for r in members] if payloads is not None else [0] * len(members)
    sizes = torch.tensor(lens, dtype=torch.int64, device=device)
    dist.broadcast(sizes, src=src, group=group)
    sizes = sizes.tolist()
    out = torch.empty(max(sizes), dtype=torch.uint8, device=device)
    chunks = None
    if payloads is not None:
        host = np.zeros((len(members), max(sizes)), dtype=np.uint8)
        for row, r in zip(host, members):
            row[:len(payloads[r])] = np.frombuffer(payloads[r], dtype=np.uint8)
        chunks = list(torch.from_numpy(host).to(device).unbind(0))
    dist.scatter(out, chunks, src=src, group=group)
    me = members.index(dist.get_rank())
    return out[:sizes[me]].cpu().numpy().tobytes()
