"""Compile the split-vocabulary sampler's Triton kernels for an H100 (sm_90) on a machine without a GPU.

    TRITON_INTERPRET=0 python tools/device/compile_sm90.py
    TRITON_INTERPRET=0 python tools/device/compile_sm90.py --engine-start [--compile]  # one engine start's compiles

The interpreter runs the kernels' logic on CPU; this runs Triton's real compiler (down to ptxas)
on every variant the engine launches, so a kernel that would not compile on the device fails here.
Prints one line per variant: name, constexprs, compile seconds, "ok".

--engine-start: the sampler launches one engine start makes while capturing its decode graphs (every
default graph batch size x the plain and the filtered head, at the 1.5B vocabulary), each launch's
specialisation key by Triton's own rule (`native_specialize_impl`: an int equal to 1 becomes a constant,
a multiple of 16 gets a divisibility hint, unless the kernel lists it in `do_not_specialize`), and the
number of distinct keys: the compiles Triton makes. With --compile each distinct variant is built for
sm_90 and timed.
"""
import argparse
import os
import sys
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import kernels.sampling_split as split
from hexrl.rollout.cuda_graph import default_batch_sizes

KINDS = {"f": "*fp32", "i": "*i32", "l": "*i64", "n": "i32"}  # one letter per runtime argument, in order
ROW, NOISE = "fnflf", "lll"  # logits, stride, temperature, top_k, top_p; seeds, offsets, streams
COMMON = dict(GREEDY=1e-5, ROWS=1, NBP=128)
TYPES = {split._stats_kernel: ROW + NOISE + "ffiifi" + "iif" + "nn",
         split._cand_kernel: ROW + NOISE + "ffii" + "iif" + "ifi" + "iif" + "nnn",
         split._round_kernel: ROW + "ffii" + "iii" + "nnnn",
         split._kept_kernel: ROW + NOISE + "iii" + "fi" + "nnnn",
         split._finish_kernel: ROW + "ffii" + "fi" + "i" + "fi" + "iif" + "lf" + "nnnn"}


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


def engine_start_launches(max_running: int = 256, vocab: int = 151936):
    """(kernel, constexprs, {int argument: value}) of every split-sampler launch the decode-graph capture
    makes (as `sample_split_rows` launches them on a GPU), for each graph size and the plain and filtered
    heads (the greedy head is torch's argmax)."""
    for n in default_batch_sizes(max_running):
        rows, chunk, block, sblock = split._launch_shape(n, vocab, True)
        nb = triton.cdiv(vocab, chunk)
        common = dict(GREEDY=split.GREEDY_EPS, ROWS=rows, NBP=triton.next_power_of_2(nb))
        ints = dict(stride=vocab, B=n, V=vocab, NB=nb)  # the graphs' logits: [size, V] float32, contiguous
        last = 2 * split.ROUNDS
        for filtered in (False, True):
            cand = split.GPU_CAND if filtered else 0
            yield split._stats_kernel, dict(BLOCK=block, CHUNK=chunk, CAND=cand, BAND=split.BAND, **common), ints
            if filtered:
                cblock = min(split.GPU_CAND_BLOCK, triton.next_power_of_2(nb * cand))
                yield split._cand_kernel, dict(BLOCK=cblock, CAND=cand, BAND=split.BAND, NC=split.NC, **common), ints
                for it in range(last):
                    phase = dict(PHASE=it // split.ROUNDS, FIRST=it % split.ROUNDS == 0)
                    yield split._round_kernel, dict(**phase, BLOCK=sblock, CHUNK=chunk, NC=split.NC, **common), \
                        {**ints, "it": it}
                yield split._kept_kernel, dict(BLOCK=block, CHUNK=chunk, NC=split.NC, **common), {**ints, "it": last}
            yield split._finish_kernel, dict(FILTERED=filtered, **common), {**ints, "it": last}


def specialization(fn, values: dict) -> tuple:
    """Triton's specialisation of each int argument the launch passes (its own rule, no GPU needed)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    # a JITFunction keeps the list; under TRITON_INTERPRET=1 an InterpretedFunction keeps its jit keywords
    skip = getattr(fn, "do_not_specialize", None)
    skip = set(skip if skip is not None else fn.kwargs.get("do_not_specialize") or ())
    return tuple((name, native_specialize_impl(BaseBackend, v, False, name not in skip, name not in skip))
                 for name, v in values.items() if name in fn.arg_names)


def engine_start_compiles(max_running: int = 256, vocab: int = 151936) -> dict:
    """{(kernel name, constexprs, int specialisations): one launch of it}: the distinct variants (compiles)."""
    variants = {}
    for fn, consts, ints in engine_start_launches(max_running, vocab):
        key = (fn.__name__, tuple(sorted(consts.items())), specialization(fn, ints))
        variants.setdefault(key, (fn, consts, ints))
    return variants


def build_variant(fn, consts: dict, ints: dict) -> float:
    """Compile one launch's variant for sm_90, its int arguments specialised as Triton would; seconds."""
    sig, constexprs, attrs = {}, dict(consts), {}
    spec, kinds = dict(specialization(fn, ints)), iter(TYPES[fn])
    for i, a in enumerate(fn.arg_names):
        if a in consts:
            sig[a] = "constexpr"
            continue
        sig[a] = KINDS[next(kinds)]
        kind, hint = spec.get(a, (None, None))
        if kind == "constexpr":  # an int equal to 1
            sig[a], constexprs[a] = "constexpr", hint
        elif hint == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    t0 = time.perf_counter()
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 8 if fn is split._cand_kernel else 4})
    return time.perf_counter() - t0


def engine_start(compile_them: bool) -> int:
    launches = list(engine_start_launches())
    variants = engine_start_compiles()
    print(f"engine start (max_running 256, {len(default_batch_sizes(256))} graph sizes, V 151936): "
          f"{len(launches)} sampler launches, {len(variants)} distinct Triton variants (compiles)")
    if compile_them:
        total = 0.0
        for (name, _, spec), (fn, consts, ints) in variants.items():
            s = build_variant(fn, consts, ints)
            total += s
            print(f"  {name} {dict(spec)} {s:.1f}s", flush=True)
        print(f"compiled {len(variants)} variants for sm_90 in {total:.0f} s (one thread, this machine)")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine-start", action="store_true", help="count the compiles one engine start makes")
    p.add_argument("--compile", action="store_true", help="with --engine-start: build and time each variant")
    a = p.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("compile_sm90: TRITON_INTERPRET=1 is set; run with TRITON_INTERPRET=0")
        return 2
    if a.engine_start:
        return engine_start(a.compile)
    for cand in (0, split.GPU_CAND):
        build(split._stats_kernel, TYPES[split._stats_kernel], BLOCK=split.GPU_BLOCK,
              CHUNK=split.GPU_CHUNK, CAND=cand, BAND=split.BAND, **COMMON)
    build(split._cand_kernel, TYPES[split._cand_kernel], 8, BLOCK=split.GPU_CAND_BLOCK,
          CAND=split.GPU_CAND, BAND=split.BAND, NC=split.NC, **COMMON)
    for phase, first in ((0, True), (0, False), (1, True), (1, False)):
        build(split._round_kernel, TYPES[split._round_kernel], PHASE=phase, FIRST=first,
              BLOCK=split.GPU_SEARCH_BLOCK, CHUNK=split.GPU_CHUNK, NC=split.NC, **COMMON)
    build(split._kept_kernel, TYPES[split._kept_kernel], BLOCK=split.GPU_BLOCK, CHUNK=split.GPU_CHUNK,
          NC=split.NC, **COMMON)
    for filtered in (False, True):
        build(split._finish_kernel, TYPES[split._finish_kernel], FILTERED=filtered, **COMMON)
    return 0


if __name__ == "__main__":
    sys.exit(main())
