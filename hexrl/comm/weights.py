"""Weight sync from trainer to rollout ranks over torch.distributed broadcast groups.

No single source: every trainer rank of a pipeline stage sends its own part (`ShardLayout`). The
stage's tensors are cut into buckets; TP rank t sends its shard of each (a replicated tensor: its
t-th flat chunk), and DP replica d the buckets b with b % dp == d, each source over a group of its
own (hexrl/main.py builds one per source), so the sources' links work at once. A rollout replica's
TP ranks split the sources between them (`source_receivers`: rank s % TP takes source s) and hand
each other what they took over the replica's group; each then assembles full tensors per bucket and
keeps its own TP slice, whatever its TP degree. Both sides derive the layout from the model config,
the stage's layer range and the trainer's TP x DP, so nothing but raw numbers crosses the wire.
Device to device, a round of buckets at a time (one from each DP replica, about BUCKET_BYTES on a
receiver); nothing through host memory.

What overlaps: the sources' sends with each other, and within a round every source's transfer. The
rounds run one after the other, and the rollout engine stops decoding for the sync (it takes the
weights between two decode steps, then recomputes its sequences' KV): a receiver cannot decode with
weights half old and half new, and the engine has no second copy of the weights to fill meanwhile.

Delta option (`ShardSender.delta`): a source keeps what it sent last and sends only the elements
whose bits changed (hexrl/comm/delta.py); the receiver patches the weights it holds, so its weights
equal a full sync's bit for bit. Every rollout rank takes every version, so one version back suffices.

Where the sender and the receivers share a GPU (colocated, hexrl/schema/colocate.py) NCCL cannot
connect them: the sync group is gloo and carries only host messages, and the weights go through
CUDA IPC instead (`IpcSender`, `receive_stage_ipc`): the stage's (dp 0, tp 0) rank gathers the
stage into one export buffer in the rollout's dtype, the rollout maps it once and copies out of it,
both on the device.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from hexrl.comm import delta
from hexrl.comm.cuda_ipc import export_handle, import_handle
from hexrl.comm.store import broadcast_bytes
from hexrl.model.config import ModelConfig
from hexrl.model.decoder import Decoder
from hexrl.model.fused import hf_tensors, to_hf_names
from hexrl.model.parallel import TPGroup, shard_dim_of
from hexrl.runtime.dist_rules import host_collective

BUCKET_BYTES = 64 << 20  # big enough to amortise per-call latency, small enough to hold one extra
# "auto" sends a bucket dense above this share of changed elements, where a bf16 delta is over 56% of
# the dense bytes. A judgment for devices whose encode and decode are cheap against the link (not yet
# measured on a GPU); on a CPU core they cost more than the bytes saved on any link above ~0.5 GB/s
# (tools/bench/bench_weight_sync.py), so there the job's sync.delta stays off
AUTO_MAX_CHANGED = 0.5


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


def _buckets(specs: list[TensorSpec], elem_bytes: int, limit: int | None = None) -> list[list[int]]:
    """Consecutive spec indices, grouped into buckets of at most `limit` bytes (BUCKET_BYTES) unless
    one tensor alone is bigger."""
    out, size, limit = [[]], 0, limit or BUCKET_BYTES
    for i, s in enumerate(specs):
        nbytes = elem_bytes * _numel(s.shape)
        if out[-1] and size + nbytes > limit:
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


@dataclass
class ShardLayout:
    """How one pipeline stage's weights are split among its senders. Every trainer rank of the stage
    sends: TP rank t sends its own shard of each tensor (a replicated tensor: the t-th of `tp` flat
    chunks), and of the buckets DP replica d sends those with b % dp == d. Sender (t, d) is source
    s = t * dp + d. Both sides derive the layout from the config, so only numbers cross the wire."""

    specs: list[TensorSpec]
    dims: list[int | None]  # the trainer's TP shard dimension of each tensor (None: replicated)
    tp: int
    dp: int
    buckets: list[list[int]]  # spec indices per bucket; a bucket's pieces from every t together

    def source(self, t: int, b: int) -> int:
        """The source that sends TP piece t of bucket b."""
        return t * self.dp + b % self.dp

    def piece_numel(self, i: int, t: int) -> int:
        n = _numel(self.specs[i].shape)
        return n // self.tp + (1 if self.dims[i] is None and t < n % self.tp else 0)

    def piece(self, full: torch.Tensor, i: int, t: int) -> torch.Tensor:
        """Piece t of tensor i, as a view of the full tensor (strided for a dim > 0 shard)."""
        dim = self.dims[i]
        if dim is None:
            return full.reshape(-1).tensor_split(self.tp)[t]
        n = full.shape[dim] // self.tp
        return full.narrow(dim, t * n, n)

    def local_piece(self, local: torch.Tensor, i: int, t: int) -> torch.Tensor:
        """Piece t of tensor i from trainer TP rank t's own parameter (its shard, or the replicated whole)."""
        return local if self.dims[i] is not None else self.piece(local, i, t)


def shard_layout(cfg: ModelConfig, layers: tuple[int, int], tp: int, dp: int, dtype: torch.dtype) -> ShardLayout:
    """The layout of a stage trained with `tp` x `dp` ranks. A bucket holds BUCKET_BYTES / dp over its
    TP pieces, so a receiver taking one round (a bucket from each DP replica) holds about BUCKET_BYTES."""
    specs = stage_specs(cfg, layers)
    with torch.device("meta"):
        stage = Decoder(cfg, layers=layers, tp=TPGroup(None, 0, tp) if tp > 1 else None)
    modules = dict(stage.named_modules())
    dims = [shard_dim_of(modules[s.name.rpartition(".")[0]], s.name, stage.tp) for s in specs]
    elem = torch.empty((), dtype=dtype).element_size()
    return ShardLayout(specs, dims, tp, dp, _buckets(specs, elem, max(1, BUCKET_BYTES // dp)))


def source_receivers(s: int, replicas: list[list[int]]) -> list[int]:
    """The rollout ranks that take source s over the network: in each replica (its ranks in TP
    order), rank s % TP. A replica's TP ranks so split the stage's bytes between their links, then
    share them over the replica's own group (`receive_shards`)."""
    return [ranks[s % len(ranks)] for ranks in replicas]


@dataclass
class SyncLink:
    """One source of a stage's sharded sync, as a member of its group sees it."""

    src: int  # the sending trainer rank
    group: object | None  # src + the rollout ranks that take it over the network; None: this rank is not in it


@dataclass
class ShardSender:
    """One trainer rank's part of a stage's sync. With `delta`, it keeps what it sent last (its own
    share of the stage, in the sync dtype) and sends only the elements that changed, as a bitmap and
    their values (hexrl/comm/delta.py); "auto" sends a bucket dense once more than `auto_max` of its
    elements changed. The first version always goes dense: the receivers' weights are not yet ours."""

    layout: ShardLayout
    t: int
    d: int
    delta: bool | str = False
    auto_max: float = AUTO_MAX_CHANGED
    last: dict[int, torch.Tensor] = field(default_factory=dict)  # bucket -> what was sent

    def send(self, local: Callable[[str], torch.Tensor], link: SyncLink, dtype: torch.dtype) -> int:
        """Send this rank's piece of each of its buckets; `local(name)` is its parameter (shard) on
        the compute device. Returns the bytes it sent. With `delta`, every bucket is encoded first and
        their sizes go ahead in one message, so a receiver reads sizes once per stage, not per bucket
        (a host read would wait for the transfers before it and stall the pipeline)."""
        lay = self.layout
        mine = range(self.d, len(lay.buckets), lay.dp)

        def flat(b: int) -> torch.Tensor:  # this rank's pieces of bucket b, in the sync dtype
            return torch.cat([lay.local_piece(local(lay.specs[i].name).detach(), i, self.t).to(dtype).reshape(-1)
                              for i in lay.buckets[b]])
        if not self.delta:  # one bucket at a time: no copy of the whole share
            sent = 0
            for b in mine:
                f = flat(b)
                dist.broadcast(f, src=link.src, group=link.group)
                sent += f.numel() * f.element_size()
            return sent
        flats = [flat(b) for b in mine]
        encoded = [self._encode(b, flat) for b, flat in zip(mine, flats)]
        counts = torch.tensor([count for _, count in encoded], dtype=torch.long, device=flats[0].device) \
            if flats else torch.zeros(0, dtype=torch.long)
        if flats:
            dist.broadcast(counts, src=link.src, group=link.group)
        for payload, _ in encoded:
            dist.broadcast(payload, src=link.src, group=link.group)
        self.last.update(zip(mine, flats))
        return 8 * len(flats) + sum(p.numel() for p, _ in encoded)

    def _encode(self, b: int, flat: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The bucket as a delta (count: changed elements) or dense (count -1: the first version, or
        "auto" with too much changed)."""
        old = self.last.get(b)
        if old is not None:
            payload, count = delta.encode(flat, old)
            if self.delta is True or count <= self.auto_max * flat.numel():
                return payload, count
        return flat.view(torch.uint8), -1


def receive_shards(layout: ShardLayout, links: list[SyncLink], replica: TPGroup | None, dtype: torch.dtype,
                   device: torch.device, consume: Callable[[dict[str, torch.Tensor]], None],
                   previous: Callable[[str, torch.Tensor], None] | None = None) -> None:
    """Receiver side of ShardSender: each bucket's TP pieces, from every source of its round at once,
    assembled into full tensors for `consume`. A replica's TP ranks split the sources (`links[s].group`
    is None where another rank of the replica takes source s) and hand each other what they took
    over the replica's group. With `previous` (delta mode), `previous(name, full)` writes this rank's
    current values into a full tensor (its own slice suffices: only that slice is kept), and a delta
    patches them. No host read between rounds, so the transfers of successive rounds queue back to back."""
    lay = layout
    counts = _take_counts(lay, links, replica, device) if previous is not None else {}
    for r in range(0, len(lay.buckets), lay.dp):
        bs = range(r, min(r + lay.dp, len(lay.buckets)))
        got = _take_round(lay, links, bs, counts, dtype, device)
        _share_round(lay, replica, bs, got, counts, dtype, device)
        for b in bs:
            consume(_assemble(lay, b, got, counts, dtype, device, previous))


def _sources(lay: ShardLayout) -> list[tuple[int, int, range]]:
    """(t, d, the buckets it sends) of each source, in source order."""
    return [(t, d, range(d, len(lay.buckets), lay.dp)) for t in range(lay.tp) for d in range(lay.dp)]


def _take_counts(lay: ShardLayout, links: list[SyncLink], replica: TPGroup | None, device) -> dict:
    """(bucket, t) -> changed elements (-1: dense) of every piece of the stage: each source's sizes in one
    message, shared within the replica like the pieces, then read to the host once."""
    sizes = [torch.full((len(bs),), -1, dtype=torch.long, device=device) for _, _, bs in _sources(lay)]
    _wait([dist.broadcast(sizes[s], src=links[s].src, group=links[s].group, async_op=True)
           for s, (_, _, bs) in enumerate(_sources(lay)) if links[s].group is not None and len(bs)])
    if replica is not None and replica.size > 1:
        for s, (_, _, bs) in enumerate(_sources(lay)):
            if len(bs):
                dist.broadcast(sizes[s], src=dist.get_global_rank(replica.group, s % replica.size),
                               group=replica.group)
    host = torch.cat(sizes).tolist() if sizes else []
    out, at = {}, 0
    for t, _, bs in _sources(lay):
        for b in bs:
            out[(b, t)], at = host[at], at + 1
    return out


def _piece_size(lay: ShardLayout, b: int, t: int, count: int, elem: int) -> int:
    """Bytes of piece t of bucket b on the wire: dense (count -1) or a delta of `count` values."""
    n = sum(lay.piece_numel(i, t) for i in lay.buckets[b])
    return n * elem if count < 0 else delta.delta_bytes(n, count, elem)


def _take_round(lay: ShardLayout, links: list[SyncLink], bs: range, counts: dict, dtype, device) -> dict:
    """(bucket, t) -> payload of the pieces this rank receives over the network, every source of the
    round in flight at once (each over its own group, in the order every member issues them)."""
    elem, got = torch.empty((), dtype=dtype).element_size(), {}
    mine = [(b, t) for b in bs for t in range(lay.tp) if links[lay.source(t, b)].group is not None]
    for b, t in mine:
        got[(b, t)] = torch.empty(_piece_size(lay, b, t, counts.get((b, t), -1), elem), dtype=torch.uint8,
                                  device=device)
    _wait([dist.broadcast(got[(b, t)], src=links[lay.source(t, b)].src, group=links[lay.source(t, b)].group,
                          async_op=True) for b, t in mine])
    return got


def _share_round(lay: ShardLayout, replica: TPGroup | None, bs: range, got: dict, counts: dict, dtype,
                 device) -> None:
    """Within a TP>1 replica, the rank that took source s (s % size) broadcasts its pieces to the others."""
    if replica is None or replica.size == 1:
        return
    elem = torch.empty((), dtype=dtype).element_size()
    for b in bs:
        for t in range(lay.tp):
            if (b, t) not in got:
                got[(b, t)] = torch.empty(_piece_size(lay, b, t, counts.get((b, t), -1), elem), dtype=torch.uint8,
                                          device=device)
            owner = dist.get_global_rank(replica.group, lay.source(t, b) % replica.size)
            dist.broadcast(got[(b, t)], src=owner, group=replica.group)


def _assemble(lay: ShardLayout, b: int, got: dict, counts: dict, dtype, device,
              previous) -> dict[str, torch.Tensor]:
    """Bucket b's full tensors from their TP pieces (a delta patches the previous values in place)."""
    out = {}
    for i in lay.buckets[b]:
        spec = lay.specs[i]
        out[spec.name] = torch.empty(spec.shape, dtype=dtype, device=device)
        if previous is not None:
            previous(spec.name, out[spec.name])
    for t in range(lay.tp):
        payload, count = got.pop((b, t)), counts.get((b, t), -1)
        views = [lay.piece(out[lay.specs[i].name], i, t) for i in lay.buckets[b]]
        if count < 0:
            new = payload.view(dtype)
        else:
            new = torch.cat([v.reshape(-1) for v in views])  # the previous values, patched
            delta.apply(payload, new)
        at = 0
        for view in views:
            view.copy_(new[at:at + view.numel()].view(view.shape))
            at += view.numel()
    return out


def _wait(works: list) -> None:
    for w in works:
        w.wait()


class IpcSender:
    """One stage's export buffer, shared with the colocated rollout ranks through CUDA IPC."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.handle = b""

    def send(self, full: Callable[[str], torch.Tensor | None], specs: list[TensorSpec], src: int, group,
             dtype: torch.dtype, device: torch.device) -> None:
        """Fill the buffer (every TP rank calls `full`: it may gather over the TP group), then hand the
        receivers its handle over the gloo group and wait until they have copied it out."""
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


def current_values(model: Decoder) -> Callable[[str, torch.Tensor], None]:
    """`fill(name, full)`: write the model's current values of tensor `name` (HF name) into its slice of
    a full tensor, the inverse of `load_into` (which then reads back exactly that slice)."""
    targets = hf_tensors(model)

    @torch.no_grad()
    def fill(name: str, full: torch.Tensor) -> None:
        module, src = targets[name]
        shard_for(module, name, full, model.tp).copy_(src)
    return fill


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
