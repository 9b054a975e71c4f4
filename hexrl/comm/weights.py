"""Weight sync from trainer to rollout ranks over torch.distributed broadcast groups.

For each pipeline stage, the stage's (dp=0, tp=0) trainer rank broadcasts the stage's full
(TP-gathered) weights, packed into large flat buckets, to every rollout rank. Both sides derive
the tensor list (names, shapes, order) from the model config and the stage's layer range, so
nothing but raw numbers crosses the wire. Device to device, one bucket at a time: the sender
gathers a bucket's tensors on its GPU, the receivers copy each bucket into their weights in
place as it arrives; no whole-stage copy on either side and nothing through host memory.

Where the sender and the receivers share a GPU (colocated, hexrl/schema/colocate.py) NCCL cannot
connect them: the sync group is gloo and carries only host messages, and the weights go through
CUDA IPC instead (`IpcSender`, `receive_stage_ipc`): the trainer keeps one export buffer of the
stage's weights, the rollout maps it once and copies out of it, both on the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from hexrl.comm.cuda_ipc import export_handle, import_handle
from hexrl.comm.store import broadcast_bytes
from hexrl.model.config import ModelConfig
from hexrl.model.decoder import Decoder
from hexrl.model.fused import hf_tensors, to_hf_names
from hexrl.model.parallel import TPGroup, shard_dim_of
from hexrl.runtime.dist_rules import host_collective

BUCKET_BYTES = 64 << 20  # big enough to amortise per-call latency, small enough to hold one extra


@dataclass
class TensorSpec:
    name: str
    shape: tuple[int, ...]


def stage_specs(cfg: ModelConfig, layers: tuple[int, int]) -> list[TensorSpec]:
    """Full (unsharded) tensors of one pipeline stage, in a fixed order both sides agree on."""
    with torch.device("meta"):
        stage = Decoder(cfg, layers=layers)
    # named_parameters() skips the tied lm_head duplicate, so a tied weight is sent once
    return [TensorSpec(n, tuple(p.shape)) for n, p in stage.named_parameters()]


def _buckets(specs: list[TensorSpec], elem_bytes: int) -> list[list[int]]:
    out, size = [[]], 0
    for i, s in enumerate(specs):
        nbytes = elem_bytes * _numel(s.shape)
        if out[-1] and size + nbytes > BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append(i)
        size += nbytes
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def send_stage(full: Callable[[str], torch.Tensor | None], specs: list[TensorSpec], src: int, group,
               dtype: torch.dtype) -> None:
    """Sender side: `full(name)` gives a full tensor on the compute device (on `src`; it may be a
    collective over the stage's TP group, so every TP rank calls this and gets None elsewhere)."""
    elem = torch.empty((), dtype=dtype).element_size()
    for idx in _buckets(specs, elem):
        parts = [full(specs[i].name) for i in idx]
        if dist.get_rank() == src:
            flat = torch.cat([p.detach().to(dtype).reshape(-1) for p in parts])
            dist.broadcast(flat, src=src, group=group)


def receive_stage(specs: list[TensorSpec], src: int, group, dtype: torch.dtype, device: torch.device,
                  consume: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Receiver side: each bucket lands in a buffer on `device` and goes to `consume` (name -> view)
    before the next one is received."""
    elem = torch.empty((), dtype=dtype).element_size()
    for idx in _buckets(specs, elem):
        sizes = [_numel(specs[i].shape) for i in idx]
        flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        dist.broadcast(flat, src=src, group=group)
        consume({specs[i].name: part.view(specs[i].shape) for i, part in zip(idx, torch.split(flat, sizes))})


class IpcSender:
    """One stage's export buffer, shared with the colocated rollout ranks through CUDA IPC."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.handle = b""

    def send(self, full: Callable[[str], torch.Tensor | None], specs: list[TensorSpec], src: int, group,
             dtype: torch.dtype, device: torch.device) -> None:
        """Fill the buffer (every TP rank calls `full`, as in send_stage), then hand the receivers
        its handle over the gloo group and wait until they have copied it out."""
        sizes = [_numel(s.shape) for s in specs]
        if self.buffer is None and dist.get_rank() == src:
            self.buffer = torch.empty(sum(sizes), dtype=dtype, device=device)
            self.handle = export_handle(self.buffer)
        at = 0
        for spec, n in zip(specs, sizes):
            part = full(spec.name)
            if dist.get_rank() == src:
                self.buffer[at:at + n].copy_(part.detach().reshape(-1))
            at += n
        if dist.get_rank() != src:
            return
        torch.cuda.synchronize(device)  # the copies are done before any receiver reads
        with host_collective():
            broadcast_bytes(self.handle, src, group)
            dist.all_reduce(torch.zeros(1), group=group)  # every receiver is done reading


def receive_stage_ipc(specs: list[TensorSpec], src: int, group, dtype: torch.dtype, device: torch.device,
                      consume: Callable[[dict[str, torch.Tensor]], None], mapped: dict[bytes, torch.Tensor]) -> None:
    """Receiver side of IpcSender: map the buffer (once: `mapped` keeps it), hand `consume` its
    buckets as views, and tell the sender when the copies are done."""
    with host_collective():
        handle = broadcast_bytes(None, src, group)
    if handle not in mapped:
        mapped[handle] = import_handle(handle)
    flat, elem = mapped[handle], torch.empty((), dtype=dtype).element_size()
    if flat.dtype != dtype or flat.numel() != sum(_numel(s.shape) for s in specs) or flat.device != device:
        raise RuntimeError(f"weight sync: the mapped buffer is {flat.numel()} x {flat.dtype} on {flat.device}, "
                           f"expected the stage's {sum(_numel(s.shape) for s in specs)} x {dtype} on {device}")
    starts = [0]
    for s in specs:
        starts.append(starts[-1] + _numel(s.shape))
    for idx in _buckets(specs, elem):
        consume({specs[i].name: flat[starts[i]:starts[i + 1]].view(specs[i].shape) for i in idx})
    torch.cuda.synchronize(device)  # done reading before the sender may write again
    with host_collective():
        dist.all_reduce(torch.zeros(1), group=group)


def shard_for(module: torch.nn.Module, name: str, full: torch.Tensor, tp: TPGroup | None) -> torch.Tensor:
    """This TP rank's slice of a full tensor, following the owning module's `shard_dim` (a fused qkv or
    gate_up module is column-parallel: its q, k, v parts are each sliced by rank, then stacked)."""
    dim = shard_dim_of(module, name, tp)
    if dim is None:
        return full
    n = full.shape[dim] // tp.size
    return full.narrow(dim, tp.rank * n, n)


@torch.no_grad()
def load_into(model: Decoder, full_state: dict[str, torch.Tensor]) -> None:
    """Copy received full tensors (HF names) into a (possibly TP-sharded, possibly fused) model in place."""
    targets = hf_tensors(model)
    for name, full in full_state.items():
        if name in targets:
            module, dst = targets[name]
            dst.copy_(shard_for(module, name, full, model.tp))


def load_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a state dict of this rank's tensors (HF names, or the model's own fused names) into the
    model's parameters in place (CUDA graphs keep their addresses), after checking names and shapes;
    every problem is reported at once."""
    targets = hf_tensors(model)  # a tied lm_head appears once, as the embedding
    state = to_hf_names(model, state)
    has_head = getattr(model, "lm_head", None) is not None
    tied = {"lm_head.weight"} if has_head and "lm_head.weight" not in targets else set()
    problems = [f"missing {n}" for n in targets if n not in state]
    problems += [f"{n}: shape {tuple(state[n].shape)}, model has {tuple(t.shape)}"
                 for n, (_, t) in targets.items() if n in state and state[n].shape != t.shape]
    problems += [f"unexpected {n}" for n in state if n not in targets and n not in tied]
    if problems:
        raise ValueError("update_weights: state dict does not match the model: " + "; ".join(problems))
    with torch.no_grad():
        for n, (_, t) in targets.items():
            t.copy_(state[n])
