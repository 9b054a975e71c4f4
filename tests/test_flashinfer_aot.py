"""Prebuilt FlashInfer modules: FlashInfer's own lookup (`JitSpec.build_and_load` with JIT
disabled) finds every module the GPU runs need in the carried AOT directory, by FlashInfer's own names and
paths, so nothing compiles on the device. Needs flashinfer-python 0.5.3 (it imports on CPU torch; the
`gpu` extra, or `pip install --no-deps flashinfer-python==0.5.3 apache-tvm-ffi==0.1.15.post2`)."""
from __future__ import annotations

from pathlib import Path

import pytest

flashinfer = pytest.importorskip("flashinfer", reason="flashinfer-python is not installed (the gpu extra)")
from hexrl.rollout.flashinfer_backend import _use_tensor_cores  # noqa: E402
from tools import one_gpu  # noqa: E402
from tools.bench.bench_rollout import SHAPES  # noqa: E402
from tools.device import flashinfer_aot  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_the_module_list_is_flashinfers_own_names_for_every_run():
    names = list(flashinfer_aot.specs())
    assert names[:4] == ["norm", "rope", "page", "silu_and_mul"]
    b15 = SHAPES["qwen2.5-1.5b"]  # the 1.5B benchmarks: GQA 6 decodes as the tensor-core prefill
    assert _use_tensor_cores(b15["num_attention_heads"], b15["num_key_value_heads"])
    head = b15["hidden_size"] // b15["num_attention_heads"]
    assert (f"batch_prefill_with_kv_cache_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_head_dim_qk_{head}_"
            f"head_dim_vo_{head}_posenc_0_use_swa_False_use_logits_cap_False_f16qk_False") in names
    shape = dict(zip(one_gpu.WARM_SHAPE[::2], map(int, one_gpu.WARM_SHAPE[1::2])))  # gpu_e2e.sh's model
    e2e = ("e2e", shape["--heads"], shape["--kv-heads"], shape["--hidden"] // shape["--heads"])
    assert any(r[1:4] == e2e[1:] for r in flashinfer_aot.RUNS), (e2e, flashinfer_aot.RUNS)
    assert any(n.startswith("batch_decode_with_kv_cache_dtype_q_bf16") and "head_dim_qk_64_" in n for n in names)
    assert len(names) == len(set(names)) == 9


def test_flashinfer_loads_each_module_from_the_aot_dir_without_compiling(tmp_path):
    """Every name FlashInfer looks for is placed where FlashInfer's own path function says (`spec.aot_path`
    under the AOT directory): its `build_and_load` then loads instead of building; one left out is reported
    as one it would compile (with JIT disabled its build raises instead of compiling)."""
    specs = flashinfer_aot.specs()
    assert flashinfer_aot.would_compile(tmp_path) == list(specs)  # empty dir: everything would compile
    for name in specs:
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.so").write_bytes(b"")
    assert flashinfer_aot.would_compile(tmp_path) == []
    gone = next(n for n in specs if n.startswith("batch_decode"))
    (tmp_path / gone / f"{gone}.so").unlink()
    assert flashinfer_aot.would_compile(tmp_path) == [gone]


@pytest.mark.skipif(not (ROOT / ".whl" / "aot").is_dir(),
                    reason="no .whl/aot: tools/device/prepare_device_wheels.sh not run")
def test_the_carried_modules_are_complete_and_fit_the_carry_limit():
    assert flashinfer_aot.would_compile(ROOT / ".whl" / "aot") == []
    size = sum(f.stat().st_size for f in (ROOT / ".whl").rglob("*") if f.is_file())
    assert size < 64 * 2**20 - 4 * 2**20, size  # the work tree travels within the same 64 MiB


def test_the_compile_seconds_saved_are_read_from_ninjas_log(tmp_path):
    (tmp_path / ".ninja_log").write_text("# ninja log v5\n0\t1000\t1\tnorm/a.o\th\n5\t2500\t1\tnorm/norm.so\th\n"
                                         "0\t9000\t1\trope/rope.o\th\n100\t3100\t2\trope/rope.o\th\n")
    assert flashinfer_aot.compile_seconds(tmp_path) == {"norm": 3.495, "rope": 3.0}  # the latest run of each output
