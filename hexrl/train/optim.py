"""AdamW on float32 master weights with linear warm-up (and an optional linear decay), and gradient
clipping by the global norm.

The model may compute in bf16; the optimizer keeps float32 masters (the model's own
parameters when it computes in float32) and reads gradients from `param.main_grad` (the
float32 buckets of `GradBuckets`). The global norm counts every parameter element of the
whole model exactly once: TP-sharded parameters on every TP rank, TP-replicated ones
(norms, row-parallel biases) on TP rank 0 only, a tied lm_head copy not at all, and only
DP replica 0 contributes, all summed over every trainer rank.

The norm stays on the device: clipping and the skip of a non-finite update are fused AdamW's
`grad_scale` (gradients are divided by it) and `found_inf` (the update is skipped), so an
optimizer step never waits for the GPU; the trainer reads every norm of a step in its one copy.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class AdamW:
    """torch AdamW over float32 masters of `params`; weight decay on matrices only."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float, warmup_steps: int = 0,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 masters: list[torch.Tensor] | None = None, decay_steps: int = 0, final_frac: float = 0.0):
        """`masters`: float32 copies to start from (taken before the model was cast to bf16);
        `decay_steps` > 0: after warm-up, lr falls linearly to `final_frac` * lr over that many steps."""
        self.params = list({id(p): p for p in params}.values())
        if masters is None:
            masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params]
        if not all(m.is_contiguous() for m in masters):  # fused AdamW (torch 2.13, CPU) updates them wrongly
            raise ValueError("AdamW: every master weight must be contiguous (a TP shard of columns is a strided view)")
        self.master = masters
        pairs = [(p, m) for p, m in zip(self.params, masters) if m is not p]
        self._copies = ([p for p, _ in pairs], [m for _, m in pairs]) if pairs else None  # masters -> model
        self.lr, self.warmup_steps, self.steps = lr, warmup_steps, 0
        self.decay_steps, self.final_frac = decay_steps, final_frac
        decay, no_decay = _groups([m.dim() for m in self.master])
        self.opt = torch.optim.AdamW([{"params": [masters[i] for i in decay], "weight_decay": weight_decay},
                                      {"params": [masters[i] for i in no_decay], "weight_decay": 0.0}],
                                     lr=lr, betas=betas, eps=eps, fused=True)  # CPU and CUDA alike

    def lr_at(self, step: int) -> float:
        """Linear warm-up over the first `warmup_steps` optimizer steps (step 0 at lr / warmup_steps),
        then lr at step `warmup_steps`, falling linearly to `final_frac` * lr at step
        `warmup_steps + decay_steps` and staying there (constant when `decay_steps` is 0)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.decay_steps <= 0:
            return self.lr
        done = min(1.0, (step - self.warmup_steps) / self.decay_steps)
        return self.lr * (1.0 - (1.0 - self.final_frac) * done)

    def step(self, divisor: torch.Tensor | None = None, skip: torch.Tensor | None = None) -> float:
        """Apply one update from `main_grad` divided by `divisor` (a 0-dim device tensor, None: 1),
        unless the 0-dim bool `skip` is true, without a host sync; returns the lr used. `steps`
        counts the update either way: the caller takes skipped ones back once it has read them."""
        lr = self.lr_at(self.steps)
        for g in self.opt.param_groups:
            g["lr"] = lr
        for p, m in zip(self.params, self.master):
            m.grad = p.main_grad
        self.opt.grad_scale = divisor
        self.opt.found_inf = None if skip is None else skip.float()
        self.opt.step()
        for m in self.master:
            m.grad = None
        if self._copies:
            with torch.no_grad():  # one multi-tensor launch, not one copy per parameter
                torch._foreach_copy_(*self._copies)
        self.steps += 1
        return lr

    def state_dict(self) -> dict:
        masters = [m.detach() for p, m in zip(self.params, self.master) if m is not p]
        return {"opt": self.opt.state_dict(), "steps": self.steps, "master": masters}

    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["opt"])
        self.steps = state["steps"]
        it = iter(state["master"])
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                if m is not p:
                    m.copy_(next(it))
                    p.copy_(m)


def _groups(ndims: list[int]) -> tuple[list[int], list[int]]:
    """(decayed, not decayed) parameter positions, by their number of dimensions: matrices are decayed.
    torch numbers the optimizer state in this order: the decayed group first."""
    return [i for i, n in enumerate(ndims) if n >= 2], [i for i, n in enumerate(ndims) if n < 2]


def split_by_param(state: dict, ndims: list[int]) -> list[dict]:
    """An `AdamW.state_dict()` of parameters with `ndims` dimensions as one dict per parameter, in the
    parameters' order: torch's state of it (exp_avg, exp_avg_sq, step; empty before the first step)
    and its float32 "master" when the model computes in another dtype."""
    order = [i for group in _groups(ndims) for i in group]
    out = [{} for _ in ndims]
    for index, i in enumerate(order):
        out[i].update(state["opt"]["state"].get(index, {}))
    masters = state["master"]
    if masters and len(masters) != len(ndims):  # AdamW keeps a master for every parameter or for none
        raise ValueError(f"optimizer state holds {len(masters)} master weights for {len(ndims)} parameters")
    for d, m in zip(out, masters):
        d["master"] = m
    return out


def join_by_param(per_param: list[dict], ndims: list[int], param_groups: list[dict], steps: int) -> dict:
    """The `AdamW.state_dict()` of parameters with `ndims` dimensions from `split_by_param`'s form;
    `param_groups`: a saved state's (their settings are kept, their parameter lists rebuilt)."""
    decay, no_decay = _groups(ndims)
    order = decay + no_decay
    state = {index: {k: v for k, v in per_param[i].items() if k != "master"} for index, i in enumerate(order)}
    groups = [dict(param_groups[0], params=list(range(len(decay)))),
              dict(param_groups[1], params=list(range(len(decay), len(order))))]
    return {"opt": {"state": {k: v for k, v in state.items() if v}, "param_groups": groups}, "steps": steps,
            "master": [d["master"] for d in per_param if "master" in d]}


def global_grad_norm(counted: list[torch.Tensor], group: dist.ProcessGroup | None,
                     device: torch.device) -> torch.Tensor:
    """sqrt of the sum of squares of `counted` gradients, summed over `group`, as a 0-dim float32
    tensor on the rank's compute `device` (also where nothing is counted, on DP replicas > 0:
    NCCL needs every rank's)."""
    sq = torch.zeros((), dtype=torch.float32, device=device)
    if counted:  # one multi-tensor kernel for every gradient's norm; nothing waits for the device
        sq += torch.stack(torch._foreach_norm([g.float() for g in counted])).pow(2).sum()
    if group is not None:
        dist.all_reduce(sq, group=group)
    return sq.sqrt()


def clip_divisor(norm: torch.Tensor, max_norm: float | None) -> torch.Tensor | None:
    """What to divide gradients by so their norm is at most `max_norm` (None when clipping is off):
    1 when already within, else (norm + 1e-6) / max_norm, as torch.nn.utils.clip_grad_norm_."""
    if not max_norm:
        return None
    return torch.clamp((norm + 1e-6) / max_norm, min=1.0)
