"""FlashInfer's kernels for sm_90 (H100, H200) built ahead of time on a CPU machine, so a GPU run compiles none.

    python tools/device/flashinfer_aot.py list           # the modules the GPU runs load, by FlashInfer's own names
    python tools/device/flashinfer_aot.py build AOT_DIR  # compile them (CUDA_HOME: pip's nvcc): AOT_DIR/<name>/
    python tools/device/flashinfer_aot.py check AOT_DIR  # FlashInfer would load every one from AOT_DIR, compiling none

On a fresh device FlashInfer JIT-compiles each module on first use, one after another (minutes); it loads
`flashinfer/data/aot/<name>/<name>.so` instead when that file exists (`JitSpec.build_and_load`,
`jit/core.py`). tools/device/prepare_device_wheels.sh runs `build` and carries the result;
tools/device/gpu_check.sh copies it into the installed package's AOT directory and runs `check` there. The
module list is derived with FlashInfer's own spec generators from the models the runs use (`RUNS`) and from
what our backend plans (`hexrl.rollout.flashinfer_backend.attention_modules`). Needs flashinfer-python
(imports on CPU torch).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from hexrl.rollout.flashinfer_backend import attention_modules

ARCH = "9.0a"  # sm_90a: H100 and H200 (FlashInfer's own choice for a capability-9 device)
# (what, q heads, kv heads, head_dim, dtype) of every model a GPU run pages attention for
RUNS = [
    ("gpu_check: bench_kernels, bench_rollout, bench_fused, bench_host_overhead (qwen2.5-1.5b)", 12, 2, 128,
     torch.bfloat16),
    ("gpu_e2e.sh and the colocated GPU test: tools/one_gpu.py WARM_SHAPE", 2, 1, 64, torch.bfloat16),
    ("pytest -m gpu: test_rollout_gpu gqa2 (bf16 parity, memory budget)", 4, 2, 64, torch.bfloat16),
    ("pytest -m gpu: test_rollout_gpu gqa4-tensor-cores (bf16 parity)", 8, 2, 64, torch.bfloat16),
    ("pytest -m gpu: test_rollout_gpu engines, test_rollout_overlap, test_rollout_uploads (fp16)", 4, 2, 64,
     torch.float16),
    ("pytest -m gpu: test_rollout_gpu gqa4-tensor-cores engines (fp16)", 8, 2, 64, torch.float16),
]
os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", ARCH)  # before flashinfer reads it: no device here to ask


def specs() -> dict:
    """{name: FlashInfer JitSpec} of every module the runs load, made by FlashInfer's own generators."""
    from flashinfer.jit import core, gen_act_and_mul_module, gen_batch_decode_module, gen_batch_prefill_module
    from flashinfer.jit.norm import gen_norm_module  # the imports flashinfer's norm.py, rope.py, page.py make
    from flashinfer.jit.page import gen_page_module
    from flashinfer.jit.rope import gen_rope_module

    if not core.current_compilation_context.TARGET_CUDA_ARCHS:  # flashinfer imported before ARCH was set
        core.current_compilation_context.TARGET_CUDA_ARCHS = {(int(ARCH[0]), ARCH[2:])}
    out = {s.name: s for s in (gen_norm_module(), gen_rope_module(), gen_page_module(), gen_act_and_mul_module("silu"))}
    gen = {"prefill": gen_batch_prefill_module, "decode": gen_batch_decode_module}
    for _, hq, hkv, d, dtype in RUNS:
        for kind, args in attention_modules(hq, hkv, d, dtype):
            spec = gen[kind](*args)
            out[spec.name] = spec
    return out


def point_aot_dir(aot_dir: Path) -> None:
    """Make FlashInfer look for prebuilt modules in `aot_dir` (its env module is meant to be overridden)."""
    from flashinfer.jit import env as jit_env

    jit_env.FLASHINFER_AOT_DIR = Path(aot_dir).resolve()


def would_compile(aot_dir: Path) -> list[str]:
    """Names of the modules FlashInfer would compile (not load from `aot_dir`): each spec goes through
    FlashInfer's own `build_and_load` with JIT disabled and the final load recorded, not performed."""
    from flashinfer.jit.core import JitSpec, MissingJITCacheError

    point_aot_dir(aot_dir)
    missing, loaded, old_env, old_load = [], [], os.environ.get("FLASHINFER_DISABLE_JIT"), JitSpec.load
    os.environ["FLASHINFER_DISABLE_JIT"] = "1"  # build() raises instead of compiling
    JitSpec.load = lambda self, path: loaded.append(Path(path))  # no CUDA here to dlopen against
    try:
        for name, spec in specs().items():
            try:
                spec.build_and_load()
                assert loaded[-1] == Path(aot_dir).resolve() / name / f"{name}.so", loaded[-1]
            except MissingJITCacheError:
                missing.append(name)
    finally:
        JitSpec.load = old_load
        if old_env is None:
            del os.environ["FLASHINFER_DISABLE_JIT"]
        else:
            os.environ["FLASHINFER_DISABLE_JIT"] = old_env
    return missing


def compile_seconds(jit_dir: Path) -> dict[str, float]:
    """{module: seconds its compile and link jobs ran} from ninja's log in FlashInfer's JIT directory (the
    latest run of each output): what the device would otherwise spend compiling, one job at a time."""
    last = {}
    for line in (Path(jit_dir) / ".ninja_log").read_text().splitlines():
        if not line.startswith("#"):
            start, end, _, out, _ = line.split("\t")
            last[out] = (int(end) - int(start)) / 1000
    per: dict[str, float] = {}
    for out, s in last.items():
        per[out.split("/")[0]] = per.get(out.split("/")[0], 0.0) + s
    return per


def build(aot_dir: Path, jobs: int) -> None:
    """Compile every module with FlashInfer's own ninja rules (its JIT directory under build/), then copy
    each `<name>.so` to `aot_dir/<name>/`, stripped of symbols the loader does not need."""
    from flashinfer.jit import build_jit_specs
    from flashinfer.jit import env as jit_env

    os.environ.setdefault("MAX_JOBS", str(jobs))
    todo = specs()
    t0 = time.perf_counter()
    build_jit_specs(list(todo.values()), verbose=False, skip_prebuilt=False)
    print(f"compiled {len(todo)} modules in {time.perf_counter() - t0:.0f} s ({jobs} jobs)", flush=True)
    secs = compile_seconds(jit_env.FLASHINFER_JIT_DIR)
    print(f"compiling saved on the device: {sum(secs.get(n, 0.0) for n in todo):.0f} s of compile jobs here (one "
          "job at a time; per module below)", flush=True)
    for name, spec in todo.items():
        dst = Path(aot_dir) / name / f"{name}.so"
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(spec.jit_library_path, dst)
        if shutil.which("strip"):
            os.system(f"strip --strip-unneeded '{dst}'")
        print(f"  {name}: {dst.stat().st_size / 2**20:.1f} MiB, {secs.get(name, 0.0):.0f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("command", choices=("list", "build", "check"))
    p.add_argument("aot_dir", nargs="?", type=Path)
    p.add_argument("--jobs", type=int, default=2, help="parallel nvcc processes (build)")
    args = p.parse_args(argv)
    if args.command == "list":
        for name in specs():
            print(name)
        return 0
    if args.aot_dir is None:
        p.error(f"{args.command} needs AOT_DIR")
    if args.command == "build":
        build(args.aot_dir, args.jobs)
    missing = would_compile(args.aot_dir)
    print(f"flashinfer_aot: {len(specs()) - len(missing)} of {len(specs())} modules load from {args.aot_dir} "
          f"without compiling" + (f"; would compile: {', '.join(missing)}" if missing else ""))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
