"""The rules every torch.distributed call in hexrl follows, and a strict mode that checks them.

gloo forgives what NCCL does not, so CPU runs alone cannot show these bugs:
  1. A collective's and a p2p's tensors live on the rank's compute device (`declare_device`).
     Under "cpu:gloo,cuda:nccl" a CPU tensor goes to gloo and a CUDA tensor to NCCL, so one
     rank passing the other kind hangs the group. (The teardown barrier is the one deliberate
     host collective: `host_collective()`.)
  2. Every p2p names its group explicitly, and its peer belongs to that group: without one,
     NCCL batches p2p on the world communicator, which the ranks outside the pipeline never join.
  3. Every member of a group creates it (every process calls new_group, in the same order) and
     every member takes part in the group's first use: NCCL builds a communicator lazily, as a
     collective over the whole group. A group whose first use would be p2p is warmed up with a
     collective first (`warm_up`).
  4. No object collectives (broadcast_object_list, ...): they pickle, and unpickling network
     data runs code. Bytes travel as uint8 tensors (hexrl.comm.store.broadcast_bytes, msgpack inside).
  5. A group whose members share a GPU (the colocated mode, hexrl/schema/colocate.py) cannot use
     NCCL, which refuses two ranks on one device: it is a gloo group (`group_backend`) and carries
     host tensors only, inside `host_collective()`. Device data between such ranks goes through
     CUDA IPC (hexrl/comm/cuda_ipc.py), never through the group.

HEXRL_STRICT_COLLECTIVES=1 (the tests set it) wraps torch.distributed's collectives and p2p
calls so that breaking rule 1, 2 or 4 raises at the call, and rule 3 is checked at a group's
first p2p with a barrier over the job's store: a member that never arrives fails the run
with the group's ranks named instead of hanging it.
"""
from __future__ import annotations

import contextlib
import functools
import os
from datetime import timedelta

import torch
import torch.distributed as dist

ENV = "HEXRL_STRICT_COLLECTIVES"
FIRST_P2P_TIMEOUT_S = float(os.environ.get("HEXRL_STRICT_TIMEOUT_S", "60"))

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "reduce", "gather", "scatter", "all_to_all_single", "barrier")
P2P = ("send", "recv")
OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list")


class RuleError(RuntimeError):
    """A torch.distributed call that would hang or misbehave under NCCL."""


class _State:
    device: torch.device | None = None  # None: not declared (the current CUDA device, else the CPU)
    host_ok = 0  # > 0 inside host_collective()
    used: set = set()  # names of groups that have had a collective or passed their first-p2p barrier
    installed = False


def declare_device(device: torch.device | str) -> None:
    """This rank's compute device: every collective's tensors must live there (rule 1)."""
    _State.device = torch.device(device)


def compute_device() -> torch.device:
    """The device this rank declared; undeclared, the current CUDA device if there is one, else the CPU."""
    if _State.device is not None:
        return _State.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@contextlib.contextmanager
def host_collective():
    """Allow CPU tensors for the collectives inside (deliberate gloo traffic on a GPU rank)."""
    _State.host_ok += 1
    try:
        yield
    finally:
        _State.host_ok -= 1


def group_backend(devices: list[tuple[int, int]]) -> str | None:
    """The backend of a group whose members compute on these (node, device) pairs (rule 5): gloo
    where two share a device, else None (the job's default: NCCL for CUDA tensors)."""
    return "gloo" if len(set(devices)) < len(devices) else None


def warm_up(groups, device: torch.device) -> None:
    """One tiny all-reduce per group, in the given (creation) order, so NCCL builds each group's
    communicator with every member present before the group's first p2p (rule 3)."""
    for g in groups:
        if g is not None:
            dist.all_reduce(torch.zeros(1, device=device), group=g)


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def maybe_install(device: torch.device | str | None = None) -> bool:
    """Declare `device` (if given) and, under HEXRL_STRICT_COLLECTIVES=1, wrap torch.distributed."""
    if device is not None:
        declare_device(device)
    if not enabled() or _State.installed:
        return _State.installed
    for name in COLLECTIVES:
        setattr(dist, name, _collective(getattr(dist, name), name))
    for name in P2P:
        setattr(dist, name, _p2p(getattr(dist, name), name))
    dist.batch_isend_irecv = _batch(dist.batch_isend_irecv)
    for name in OBJECT_COLLECTIVES:
        setattr(dist, name, _refuse(name))
    _State.installed = True
    return True


def _tensors(args, kwargs) -> list[torch.Tensor]:
    out = []
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += [x for x in v if isinstance(x, torch.Tensor)]
    return out


def _check_device(name: str, tensors: list[torch.Tensor]) -> None:
    want = compute_device()
    for t in tensors:
        if t.device != want and not (_State.host_ok and t.device.type == "cpu"):
            raise RuleError(f"strict collectives: {name} got a tensor on {t.device} but this rank "
                            f"(global rank {dist.get_rank()}) computes on {want}; under NCCL the group's ranks "
                            "would split between gloo and NCCL and hang (rule 1, hexrl/runtime/dist_rules.py)")


def _group_name(group) -> str:
    return (group or dist.group.WORLD).group_name


def _collective(fn, name: str):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _check_device(name, _tensors(args, kwargs))
        _State.used.add(_group_name(kwargs.get("group")))
        return fn(*args, **kwargs)
    return wrapper


def _check_p2p(name: str, tensor: torch.Tensor, peer: int, group) -> None:
    if group is None or group is dist.group.WORLD:
        raise RuleError(f"strict collectives: {name} to/from rank {peer} names no group; name the group "
                        "the two ranks share, e.g. their pipeline's (rule 2, hexrl/runtime/dist_rules.py): NCCL would "
                        "build the world's communicator, which the ranks outside it never join")
    members = dist.get_process_group_ranks(group)
    if peer not in members:
        raise RuleError(f"strict collectives: {name} peer {peer} is not in its group {members} (rule 2)")
    _check_device(name, [tensor])
    _first_p2p(group, members)


def _first_p2p(group, members: list[int]) -> None:
    """Rule 3: before a group's first p2p (with no collective on it before), every member must arrive."""
    name = _group_name(group)
    if name in _State.used:
        return
    store = dist.distributed_c10d._get_default_store()
    key = f"hexrl/strict/first-p2p/{name}/"
    store.set(key + str(dist.get_rank()), b"1")
    try:
        store.wait([key + str(r) for r in members], timedelta(seconds=FIRST_P2P_TIMEOUT_S))
    except RuntimeError:
        missing = [r for r in members if not store.check([key + str(r)])]
        raise RuleError(f"strict collectives: rank {dist.get_rank()} reached the first p2p on group {members} "
                        f"but ranks {missing} did not within {FIRST_P2P_TIMEOUT_S:.0f}s; NCCL builds a group's "
                        "communicator with every member, so this hangs on GPUs: warm the group up with a "
                        "collective first (rule 3, hexrl/runtime/dist_rules.py)") from None
    _State.used.add(name)


def _p2p(fn, name: str):
    @functools.wraps(fn)
    def wrapper(tensor, *args, **kwargs):
        peer = args[0] if args else kwargs.get("dst" if name == "send" else "src")
        group = args[1] if len(args) > 1 else kwargs.get("group")
        _check_p2p(name, tensor, peer, group)
        return fn(tensor, *args, **kwargs)
    return wrapper


def _batch(fn):
    @functools.wraps(fn)
    def wrapper(ops):
        for op in ops:
            _check_p2p("batch_isend_irecv", op.tensor, op.peer, op.group)
        return fn(ops)
    return wrapper


def _refuse(name: str):
    def wrapper(*args, **kwargs):
        raise RuleError(f"strict collectives: {name} pickles Python objects; send bytes in a uint8 tensor "
                        "(hexrl.comm.store.broadcast_bytes, msgpack inside) instead "
                        "(rule 4, hexrl/runtime/dist_rules.py)")
    return wrapper
