"""Fused projections for the rollout: q/k/v as one weight and gate/up as one, under HF names outside.

A decode step is memory-bound: one [q+2kv, h] matmul reads the bytes three would and launches one
GEMM instead of three (seven weight GEMMs per layer become four). The trainer keeps HF's split
layout; the rollout engine fuses its model in place (`Decoder.fuse`). Every tensor still crosses
the boundary (checkpoint load and save, weight sync, `update_weights`) under its HF name:
`hf_tensors(model)` maps each HF name to the (view of the) parameter it lives in, whatever the layout.

Under tensor parallelism each part is sharded first and the shards stacked: rank r's fused weight is
[q_r; k_r; v_r], not rows [r*n/tp, (r+1)*n/tp) of the stacked full matrix (which would mix heads).
"""
from __future__ import annotations

import torch
from torch import nn

from .parallel import column_linear


@torch.no_grad()
def fuse_linears(owner: nn.Module, names: tuple[str, ...]) -> nn.Linear:
    """One (column-parallel, under TP) linear holding `owner`'s linears `names` stacked along the output
    dimension; the parts leave `owner`. `.parts` records (name, rows) of each, in order."""
    linears = [getattr(owner, n) for n in names]
    first, tp = linears[0], getattr(linears[0], "tp", None)
    local = sum(m.out_features for m in linears)
    with torch.device("meta"):
        fused = column_linear(first.in_features, local * (tp.size if tp else 1), first.bias is not None, tp)
    grad = first.weight.requires_grad
    fused.weight = nn.Parameter(torch.cat([m.weight for m in linears]), requires_grad=grad)
    if first.bias is not None:
        fused.bias = nn.Parameter(torch.cat([m.bias for m in linears]), requires_grad=grad)
    fused.parts = tuple((n, m.out_features) for n, m in zip(names, linears))
    for n in names:
        delattr(owner, n)
    return fused


def _split_names(path: str, leaf: str, parts: tuple[tuple[str, int], ...]):
    """(HF name, first row, rows) of each part of the fused tensor `path.leaf`
    ('model.layers.0.self_attn.qkv_proj', 'weight')."""
    prefix = path.rpartition(".")[0] + "." if "." in path else ""
    row = 0
    for part, rows in parts:
        yield f"{prefix}{part}.{leaf}", row, rows
        row += rows


def hf_tensors(model: nn.Module) -> dict[str, tuple[nn.Module, torch.Tensor]]:
    """Each parameter under its HF name -> (owning module, tensor): the parameter itself, or for a fused
    one the view of its rows that the HF tensor fills. A tied lm_head appears once, as the embedding."""
    modules, out = dict(model.named_modules()), {}
    for name, p in model.named_parameters():
        path, _, leaf = name.rpartition(".")
        mod = modules[path]
        parts = getattr(mod, "parts", None)
        if parts is None:
            out[name] = (mod, p)
            continue
        for hf, row, rows in _split_names(path, leaf, parts):
            out[hf] = (mod, p.narrow(0, row, rows))
    return out


def to_hf_names(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with HF names: tensors of `model`'s fused parameters split into their parts
    (views), every other entry as given."""
    modules, out = dict(model.named_modules()), {}
    for name, t in state.items():
        path, _, leaf = name.rpartition(".")
        parts = getattr(modules.get(path), "parts", None)
        if parts is None or t.shape[0] != sum(rows for _, rows in parts):
            out[name] = t
            continue
        for hf, row, rows in _split_names(path, leaf, parts):
            out[hf] = t.narrow(0, row, rows)
    return out


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model.state_dict()` under HF names (fused tensors split): what a checkpoint holds."""
    return to_hf_names(model, model.state_dict())
