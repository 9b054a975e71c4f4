"""The engine's CPU fast path for linears: oneDNN matrix multiplies over prepacked weights.

On CPU, `F.linear` goes to the BLAS with the weight as stored ([out, in], read transposed), while
oneDNN can keep the weight in its own blocked layout, packed once, which makes a one-thread fp32
decode step's linears about 15% faster and the lm_head about 40% faster
(`python tools/bench/bench_cpu_vs_hf.py` shows what it does end to end). The engine routes its model's
fp32 `nn.Linear`s through here when it runs on CPU; gradients (training) always take `F.linear`.

The packed copy costs one more copy of the weights in memory. It is remade after `drop()`, which
the engine calls on every weight update (a broadcast into the weights leaves their version counter
alone), and after any in-place write that bumps the counter (`copy_`, `load_state_dict`).
"""
from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import nn


@cache
def available() -> bool:
    """Whether oneDNN's packed linear runs in this torch build (x86 and ARM builds normally have it)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.eye(2), None)
        return bool(torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), w, None, "none", [], "").eq(1).all())
    except (AttributeError, RuntimeError):
        return False


class PackedLinear:
    """Replaces one `nn.Linear`'s forward: y = x W^T + b with W prepacked for oneDNN."""

    def __init__(self, linear: nn.Linear):
        self.linear = linear
        self.source: torch.Tensor | None = None  # the weight tensor packed, and its version then
        self.version = -1
        self.packed: torch.Tensor | None = None

    def drop(self) -> None:
        """Forget the packed weight (the weight changed): the next call packs it again."""
        self.packed = self.source = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.linear.weight, self.linear.bias
        if x.dtype != torch.float32 or w.dtype != torch.float32 or (torch.is_grad_enabled() and w.requires_grad):
            return F.linear(x, w, b)
        if w is not self.source or w._version != self.version:  # drop() clears source
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            self.source, self.version = w, w._version
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, b, "none", [], "")


def pack_linears(model: nn.Module) -> list[PackedLinear]:
    """Route each plain fp32 CPU `nn.Linear` of `model` through a PackedLinear and return them (none
    when this build lacks oneDNN). Tensor-parallel linears (subclasses with their own forward) stay."""
    if not available():
        return []
    packed = []
    for m in model.modules():
        if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32:
            if not isinstance(m.__dict__.get("forward"), PackedLinear):
                m.forward = PackedLinear(m)
            packed.append(m.forward)
    return packed
