"""Decode step time with and without the fused weights and FlashInfer kernels, side by side.

    python -m tools.bench.bench_fused                       # CUDA: 1.5B shape, bf16, batch 1/64/256, context ~1k
    python -m tools.bench.bench_fused --batch 1 --context 256

Three variants of one random model, each point measured for all three in turn (same process, same
engine settings as bench_kernels' decode grid, CUDA graphs on):
  * split:        q/k/v and gate/up as separate weights, torch norms/RoPE/SiLU/KV write (no fusion);
  * fused, torch: fused qkv and gate_up weights (4 weight GEMMs per layer), torch elementwise ops;
  * fused, FI:    fused weights and FlashInfer's fused add+RMSNorm, RoPE, SiLU-and-mul and KV append.
The engine fuses whatever model it is given; a no-op `fuse` keeps the split layout for the first column.
On CPU (no FlashInfer) it runs the tiny shape and the first two columns only.
"""
from __future__ import annotations

import argparse
import copy
import sys

import torch

from hexrl.model import ops
from hexrl.model.decoder import Decoder
from tools.bench.bench_kernels import GRIDS, decode_point
from tools.bench.bench_rollout import DTYPES, SHAPES, model_config, random_model


def variants(model: Decoder, cuda: bool) -> dict[str, tuple[Decoder, bool]]:
    """name -> (model, FlashInfer ops on?)."""
    fused = copy.deepcopy(model).fuse()
    model.fuse = lambda: model  # the engine calls fuse(); this model stays split
    out = {"split": (model, False), "fused, torch": (fused, False)}
    if cuda and ops._flashinfer() is not None:
        out["fused, FI"] = (fused, True)
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the decode step time of each variant at each batch size; returns the exit code."""
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b" if cuda else "tiny")
    p.add_argument("--batch", type=int, action="append", help="decode batch (repeatable; default 1, 64, 256)")
    p.add_argument("--context", type=int, default=1024 if cuda else 32, help="prompt tokens per sequence")
    args = p.parse_args(argv)
    device = torch.device("cuda" if cuda else "cpu")
    grid = GRIDS["cuda" if cuda else "cpu"]
    batches = args.batch or ([1, 64, 256] if cuda else [1, 4])
    dtype = DTYPES["bfloat16" if cuda else "float32"]
    model = random_model(model_config(args.shape), dtype, device)
    runs = variants(model, cuda)
    print(f"bench_fused: {torch.cuda.get_device_name() if cuda else 'cpu'}, {args.shape}, context {args.context}")
    print(f"{'batch':>5} " + " ".join(f"{name:>14}" for name in runs) + "   (ms per decode step, median)")
    for b in batches:
        row = []
        for m, fi in runs.values():
            ops.FLASHINFER = fi
            try:
                row.append(decode_point(m, b, args.context, grid)["step_s"] * 1e3)
            finally:
                ops.FLASHINFER = True
        print(f"{b:>5} " + " ".join(f"{ms:>14.3f}" for ms in row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
