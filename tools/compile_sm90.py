"""Compile the split-vocabulary sampler's Triton kernels for an H100 (sm_90) on a machine without a GPU.

    TRITON_INTERPRET=0 python tools/compile_sm90.py

The interpreter runs the kernels' logic on CPU; this runs Triton's real compiler (down to ptxas)
on every variant the engine launches, so a kernel that would not compile on the device fails here.
Prints one line per variant: name, constexprs, compile seconds, "ok".
"""
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import kernels.sampling_split as split  # noqa: E402

KINDS = {"f": "*fp32", "i": "*i32", "l": "*i64", "n": "i32"}  # one letter per runtime argument, in order
ROW, NOISE = "fnflf", "lll"  # logits, stride, temperature, top_k, top_p; seeds, offsets, streams
COMMON = dict(GREEDY=1e-5, ROWS=1, NBP=128)


def build(fn, types: str, warps: int = 4, **constexprs) -> None:
    """Compile `fn` for sm_90 with runtime argument kinds `types` and the given constexprs."""
    kinds = iter(types)
    sig = {a: "constexpr" if a in constexprs else KINDS[next(kinds)] for a in fn.arg_names}
    t0 = time.perf_counter()
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps})
    assert kernel.asm["cubin"]
    shown = {k: v for k, v in constexprs.items() if k not in COMMON}
    print(f"{fn.__name__} {shown} {time.perf_counter() - t0:.1f}s ok", flush=True)


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("compile_sm90: TRITON_INTERPRET=1 is set; run with TRITON_INTERPRET=0")
        return 2
    for cand in (0, split.GPU_CAND):
        build(split._stats_kernel, ROW + NOISE + "ffiifi" + "iif" + "nn", BLOCK=split.GPU_BLOCK,
              CHUNK=split.GPU_CHUNK, CAND=cand, BAND=split.BAND, **COMMON)
    build(split._cand_kernel, ROW + NOISE + "ffii" + "iif" + "ifi" + "iif" + "nnn", 8, BLOCK=split.GPU_CAND_BLOCK,
          CAND=split.GPU_CAND, BAND=split.BAND, NC=split.NC, **COMMON)
    for phase, first in ((0, True), (0, False), (1, True), (1, False)):
        build(split._round_kernel, ROW + "ffii" + "iii" + "nnnn", PHASE=phase, FIRST=first,
              BLOCK=split.GPU_SEARCH_BLOCK, CHUNK=split.GPU_CHUNK, NC=split.NC, **COMMON)
    build(split._kept_kernel, ROW + NOISE + "iii" + "fi" + "nnnn", BLOCK=split.GPU_BLOCK, CHUNK=split.GPU_CHUNK,
          NC=split.NC, **COMMON)
    for filtered in (False, True):
        build(split._finish_kernel, ROW + "ffii" + "fi" + "i" + "fi" + "iif" + "lf" + "nnnn", FILTERED=filtered,
              **COMMON)
    return 0


if __name__ == "__main__":
    sys.exit(main())
