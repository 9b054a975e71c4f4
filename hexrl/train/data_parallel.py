"""Data parallelism: float32 gradient buckets all-reduced while the backward pass is still running.

Each parameter's gradient is added into `param.main_grad`, a view of a flat float32 bucket,
by a post-accumulate-grad hook (so bf16 micro-batch gradients accumulate in float32). When
sync is on (the last micro-batch's backward) and every parameter of a bucket has reported,
the bucket's all-reduce starts asynchronously. Buckets launch strictly in index order, so
every DP rank issues the same collectives in the same order. The reduction is a SUM: the
loss is already divided by the global token count, so summing gives the global gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class Bucket:
    def __init__(self, params: list[torch.nn.Parameter], device):
        self.params = params
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=device)
        self.ready = 0
        offset = 0
        for p in params:
            p.main_grad = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()


class GradBuckets:
    """float32 gradient accumulation for `params` and their bucketed all-reduce over `group`."""

    def __init__(self, params: list[torch.nn.Parameter], group=None, bucket_mb: float = 25.0, device="cpu"):
        params = list({id(p): p for p in params if p.requires_grad}.values())  # tied weights once
        self.group, self.sync, self.works, self.launched = group, False, [], 0
        self.reduce_dtype = torch.float32  # buckets are all-reduced as they accumulate (plan: grad_reduce_dtype)
        self.buckets, cap, current, size = [], int(bucket_mb * 2**20 / 4), [], 0
        for p in reversed(params):  # backward visits parameters roughly in reverse order
            current.append(p)
            size += p.numel()
            if size >= cap:
                self.buckets.append(Bucket(current, device))
                current, size = [], 0
        if current:
            self.buckets.append(Bucket(current, device))
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        p.main_grad.add_(p.grad)
        p.grad = None
        if self.sync:
            b = self.buckets[self.bucket_of[id(p)]]
            b.ready += 1
            self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self.launched < len(self.buckets):
            b = self.buckets[self.launched]
            if not (force or b.ready == len(b.params)):
                return
            if self.group is not None:
                self.works.append(dist.all_reduce(b.flat, group=self.group, async_op=True))
            self.launched += 1

    def wait(self) -> None:
        """Launch whatever did not fill (a rank with no micro-batches) and wait for every all-reduce."""
        self._launch_ready(force=True)
        for w in self.works:
            w.wait()
        self.works, self.sync = [], False

    def zero(self) -> None:
        for b in self.buckets:
            b.flat.zero_()
            b.ready = 0
        self.launched, self.sync = 0, False
