"""Tensor-parallel building blocks: column/row parallel linears and a vocab-parallel embedding.

With `tp=None` (or size 1) each factory returns the plain torch module, so one model
definition serves single-GPU, tensor-parallel training and tensor-parallel rollout.
Parameter names stay those of `nn.Linear`/`nn.Embedding`, so checkpoints keep HF names;
`shard_dim` tells the checkpoint loader which dimension this rank holds a slice of.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass
class TPGroup:
    """This rank's place in its tensor-parallel group."""

    group: object  # a torch.distributed ProcessGroup
    rank: int
    size: int


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (input of a column-parallel layer)."""

    @staticmethod
    def forward(state, x, group):
        state.group = group
        return x

    @staticmethod
    def backward(state, g):
        g = g.contiguous()
        dist.all_reduce(g, group=state.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward; identity backward (output of a row-parallel layer)."""

    @staticmethod
    def forward(state, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(state, g):
        return g, None


def copy_to_tp(x: torch.Tensor, tp: TPGroup | None) -> torch.Tensor:
    return x if tp is None or tp.size == 1 else _CopyToTP.apply(x, tp.group)


def reduce_from_tp(x: torch.Tensor, tp: TPGroup | None) -> torch.Tensor:
    return x if tp is None or tp.size == 1 else _ReduceFromTP.apply(x, tp.group)


def _split(n: int, tp: TPGroup, what: str) -> int:
    if n % tp.size:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {tp.size}")
    return n // tp.size


class ColumnParallelLinear(nn.Linear):
    """Holds rows [rank*out/tp, (rank+1)*out/tp) of the weight; output stays sharded."""

    shard_dim = 0

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, what: str = "out_features"):
        super().__init__(in_features, _split(out_features, tp, what), bias=bias)
        self.tp = tp

    def forward(self, x):
        return super().forward(copy_to_tp(x, self.tp))


class RowParallelLinear(nn.Linear):
    """Holds columns of the weight; partial outputs are summed across the group."""

    shard_dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, what: str = "in_features"):
        super().__init__(_split(in_features, tp, what), out_features, bias=bias)
        self.tp = tp

    def forward(self, x):
        y = reduce_from_tp(F.linear(x, self.weight), self.tp)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Holds a contiguous slice of the vocabulary; ids outside it contribute zeros before the sum."""

    shard_dim = 0

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup):
        super().__init__(_split(vocab_size, tp, "vocab_size"), dim)
        self.tp = tp
        self.start = tp.rank * self.num_embeddings

    def forward(self, ids):
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.tp)


def column_linear(i: int, o: int, bias: bool, tp: TPGroup | None, what: str = "out_features") -> nn.Linear:
    return nn.Linear(i, o, bias=bias) if tp is None or tp.size == 1 else ColumnParallelLinear(i, o, bias, tp, what)


def row_linear(i: int, o: int, bias: bool, tp: TPGroup | None, what: str = "in_features") -> nn.Linear:
    return nn.Linear(i, o, bias=bias) if tp is None or tp.size == 1 else RowParallelLinear(i, o, bias, tp, what)


def embedding(v: int, d: int, tp: TPGroup | None) -> nn.Embedding:
    return nn.Embedding(v, d) if tp is None or tp.size == 1 else VocabParallelEmbedding(v, d, tp)


def shard_dim_of(module: nn.Module | None, name: str, tp: TPGroup | None) -> int | None:
    """Which dimension of tensor `name` (owned by `module`) this TP rank holds a slice of, if any."""
    dim = getattr(module, "shard_dim", None)
    if tp is None or tp.size == 1 or dim is None or (name.endswith("bias") and dim == 1):
        return None  # replicated: no TP, norms, or the bias of a row-parallel layer
    return dim
