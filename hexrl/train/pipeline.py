"""Pipeline parallelism: point-to-point activation/gradient exchange and the 1F1B schedule.

Micro-batch shapes are known on every rank (each rank packs the same batch), so receivers
allocate `[tokens_i, hidden]` buffers without a shape message. Paired sends and receives go
out in one `batch_isend_irecv`, which is what keeps 1F1B free of deadlocks on NCCL (whose
sends block until the peer receives); gloo accepts the same calls. Every p2p names the DP
replica's pipeline group (hexrl/train/grid.py says why).
"""
from __future__ import annotations

from collections import deque
from contextlib import nullcontext
from typing import Callable, ContextManager

import torch
import torch.distributed as dist

from .grid import Grid


class PipeComm:
    """This rank's pipeline links: where activations come from / go to, and gradients back."""

    def __init__(self, grid: Grid, tokens: list[int], hidden: int, dtype: torch.dtype, device):
        self.group = grid.pp_group
        self.act_source, self.act_targets = grid.act_source(), grid.act_targets()
        self.grad_source, self.grad_targets = grid.grad_source(), grid.grad_targets()
        self.tokens, self.hidden, self.dtype, self.device = tokens, hidden, dtype, device

    def exchange(self, send_act=None, send_grad=None, recv_act: int | None = None,
                 recv_grad: int | None = None) -> torch.Tensor | None:
        """Send and receive in one batch; returns the tensor received (or None).

        `recv_act` / `recv_grad` name the micro-batch whose tensor is expected. Links a rank
        lacks (no previous stage, ...) are skipped, so every stage runs the same schedule.
        """
        ops, got = [], None
        for t, peers in ((send_act, self.act_targets), (send_grad, self.grad_targets)):
            if t is not None:
                t = t.detach().contiguous()
                ops += [dist.P2POp(dist.isend, t, p, self.group) for p in peers]
        for i, peer in ((recv_act, self.act_source), (recv_grad, self.grad_source)):
            if i is not None and peer is not None:
                got = torch.empty(self.tokens[i], self.hidden, dtype=self.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, got, peer, self.group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return got


def backward_step(x: torch.Tensor | None, y: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor | None:
    """Back-propagate from the stage output `y` (the loss on the last stage); return d loss / d x."""
    torch.autograd.backward(y, grad_tensors=grad)
    return x.grad if x is not None else None


def train_1f1b(n: int, forward: Callable, comm: PipeComm, stage: int, num_stages: int,
               before_backward: Callable[[int], None] | None = None,
               phase: Callable[[str], ContextManager] = lambda name: nullcontext()) -> None:
    """Run n micro-batches through this stage: warm-up forwards, one-forward-one-backward, cool-down.

    `forward(i, x)` gets the received activation (None on the first stage) and returns the
    stage output, or the micro-batch loss on the last stage. `before_backward(i)` runs before
    each backward (the trainer turns gradient sync on for the last micro-batch); `phase("backward")`
    wraps each backward (the trainer's timer).
    """
    warmup = min(num_stages - stage - 1, n)
    live = deque()  # (x, y) of forwarded micro-batches awaiting their backward, oldest first

    def backward(j, grad):
        if before_backward is not None:
            before_backward(j)
        x, y = live.popleft()
        with phase("backward"):
            return backward_step(x, y, grad)

    for i in range(warmup):
        x = _track(comm.exchange(recv_act=i))
        live.append((x, forward(i, x)))
        comm.exchange(send_act=live[-1][1])
    x = _track(comm.exchange(recv_act=warmup)) if warmup < n else None
    for i in range(warmup, n):
        y = forward(i, x)
        live.append((x, y))
        j = i - warmup  # the oldest micro-batch in flight
        dx = backward(j, comm.exchange(send_act=y, recv_grad=j))
        x = _track(comm.exchange(send_grad=dx, recv_act=i + 1 if i + 1 < n else None))
    for j in range(n - warmup, n):
        comm.exchange(send_grad=backward(j, comm.exchange(recv_grad=j)))


def forward_only(n: int, forward: Callable, comm: PipeComm) -> None:
    """Run n micro-batches forward through this stage (no autograd graph kept)."""
    with torch.no_grad():
        for i in range(n):
            comm.exchange(send_act=forward(i, comm.exchange(recv_act=i)))


def _track(x: torch.Tensor | None) -> torch.Tensor | None:
    return x.requires_grad_() if x is not None else None
