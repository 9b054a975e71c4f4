"""tools/device/gpu_check.sh without a GPU: the rehearsal walks both device calls'
stages in their smallest CPU forms and leaves gpu_results.json; without CUDA the real run refuses in one
line; the results parsers read the lines the GPU tools print (the formats of a real H100 log)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from runtime_utils import ROOT

from tools.device import gpu_results

CALL_STAGES = {1: ["wheels", "versions", "bench_train", "bench_kernels", "compare_cost_model", "bench_sampling", "e2e"],
               2: ["wheels", "versions", "pytest -m gpu", "bench_rollout", "bench_fused", "bench_host_overhead"]}


def gpu_check(tmp_path, *args, **env):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "OMP_NUM_THREADS": "1",
           "RUN": str(tmp_path / "e2e"), **env}
    return subprocess.run(["bash", "tools/device/gpu_check.sh", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("call", [1, 2])
def test_the_rehearsal_walks_every_stage_of_the_call_and_writes_its_results(tmp_path, call):
    out = gpu_check(tmp_path, "--rehearse", "--call", str(call))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    res = json.loads((tmp_path / "out" / "gpu_results.json").read_text())
    assert res["call"] == call and res["rehearsal"] is True
    assert [(s["name"], s["status"]) for s in res["stages"]] == [(n, "OK") for n in CALL_STAGES[call]]
    assert res["versions"]["torch"] and res["gpu"] == "NO CUDA"
    if call == 1:  # the CPU forms print the GPU forms' lines: the parsers see real output
        assert set(res["trainer"]) == {"plain", "decoupled"}
        assert all(r["mfu"] > 0 and r["peak_gib"] > 0 for r in res["trainer"].values())  # peak memory on CPU too
        assert res["decode_ms"] and all(v > 0 for v in res["decode_ms"].values())
        assert "rehearsal" in (tmp_path / "out" / "gpu_check.log").read_text()
    else:
        assert res["pytest"]["collected"] > 10 and res["rollout_tok_s"]["1"] > 0
    assert "REHEARSAL" in (tmp_path / "out" / "summary.txt").read_text()


def test_without_cuda_it_refuses_in_one_line(tmp_path):
    out = gpu_check(tmp_path)
    assert out.returncode == 2 and out.stdout.count("\n") == 1, out.stdout
    assert "no CUDA device here" in out.stdout and "--rehearse" in out.stdout
    bad = gpu_check(tmp_path, "--call", "3")
    assert bad.returncode == 2 and "--call must be 1 or 2" in bad.stdout


def test_the_wheels_stage_names_only_what_does_not_import(tmp_path):
    """No .whl carried: the message lists the modules this Python cannot import (here flashinfer, never
    pyzmq or highspy, which the test environment has), and the stage fails."""
    for part in ("tools/device/install_wheels.sh", "tools/device/flashinfer_aot.py"):
        (tmp_path / part).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / part, tmp_path / part)
    env = {**os.environ, "PYTHON": sys.executable, "SITE": str(tmp_path / "site")}
    out = subprocess.run(["bash", str(tmp_path / "tools" / "device" / "install_wheels.sh")], env=env,
                         capture_output=True, text=True, timeout=120)
    importable = {m for m in ("flashinfer", "tvm_ffi", "zmq", "highspy")
                  if subprocess.run([sys.executable, "-c", f"import {m}"], capture_output=True).returncode == 0}
    named = set(out.stdout.split("not importable here: ")[-1].split()) if out.returncode else set()
    assert named == {"flashinfer", "tvm_ffi", "zmq", "highspy"} - importable, out.stdout
    assert "zmq" not in named and "highspy" not in named


H100_LOG = """torch 2.11.0+cu130 cuda 13.0 triton 3.6.0
device NVIDIA H100 80GB HBM3
flashinfer 0.5.3 import ok
  decode batch 1 context 256: 5.48 ms/step (flashinfer, 34 graph steps)
  decode batch 256 context 4096: 18.39 ms/step (flashinfer, 34 graph steps)
[plain] qwen2.5-1.5b on NVIDIA H100: 32736 tokens/step, 812 ms/step, 40,315 tokens/s, 1,543.7M params  peak mem 31.2 GiB
[plain] MFU  395.2 TFLOP/s / 753.7 TFLOP/s measured matmul peak = 52.4%
case                        B    old us    new us   GB/s  /copy  torch us  new/old torch/new
sample T=.7 k=50 p=.9      64     812.3     150.2   2590   0.89     901.1     0.18      6.00
greedy (argmax path)        1       nan      12.5    100   0.03      20.0      nan      1.60
     1    128   1024     181.2         181.9      190.1    95.7%      40.1   4.52
held-out accuracy: 0.422 at step 0 -> 0.686 at step 40 (500 problems, greedy)
rollout-trainer log-prob mismatch |behaviour - proximal| over 9120 lag-0 tokens: mean 3.10e-03, p99 <= 2.24e-02
gpu_e2e: 187 s in all
=========== 25 passed, 3 skipped, 931 deselected, 1 error in 80.12s ===========
"""


def test_the_results_parsers_read_the_gpu_tools_lines():
    assert gpu_results.versions(H100_LOG) == {"versions": {"torch": "2.11.0+cu130", "cuda": "13.0", "triton": "3.6.0",
                                                           "flashinfer": "0.5.3"}, "gpu": "NVIDIA H100 80GB HBM3"}
    assert gpu_results.decode(H100_LOG) == {"decode_ms": {"1x256": 5.48, "256x4096": 18.39}}
    assert gpu_results.trainer(H100_LOG) == {"trainer": {"plain": {"peak_gib": 31.2, "tflops": 395.2, "mfu": 0.524}}}
    assert gpu_results.sampling(H100_LOG) == {"sampling_us": {"sample T=.7 k=50 p=.9/64": 150.2,
                                                              "greedy (argmax path)/1": 12.5}}
    assert gpu_results.rollout(H100_LOG) == {"rollout_tok_s": {"1": 181.2}}
    assert gpu_results.e2e(H100_LOG) == {"e2e": {"heldout_before": 0.422, "heldout_after": 0.686, "wall_s": 187,
                                                 "logprob_mismatch_mean": 3.1e-3, "logprob_mismatch_p99": 2.24e-2}}
    assert gpu_results.pytest_counts(H100_LOG) == {"pytest": {"passed": 25, "skipped": 3, "deselected": 931,
                                                              "error": 1}}


def test_the_rehearsal_checks_the_device_forms_flags(tmp_path):
    """A flag the GPU form passes that its tool does not declare stops the rehearsal, though the CPU form
    (which the rehearsal runs) is fine."""
    shutil.copytree(ROOT / "tools", tmp_path / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    script = tmp_path / "tools" / "device" / "gpu_check.sh"
    text = script.read_text()
    assert "bench_train.py --configs plain,decoupled --steps 2" in text
    script.write_text(text.replace("bench_train.py --configs plain,decoupled --steps 2",
                                   "bench_train.py --config plain,decoupled --steps 2"))
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "STAGES": "versions"}
    out = subprocess.run(["bash", str(script), "--rehearse"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "passes --config, which tools/bench/bench_train.py does not declare" in out.stdout
