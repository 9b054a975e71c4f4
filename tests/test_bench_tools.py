"""The device benchmarks' CPU side: bench_kernels writes a profile the planner reads,
compare_cost_model puts the planner's predictions next to it, gpu_check.sh is valid bash.

    bench_kernels.main(["--out", dir])          # CPU: tiny shape, writes dir/cpu.json
    compare_cost_model.main([dir + "/cpu.json"]) # prints predicted vs measured, median and worst error
"""
import json
import re
import subprocess
from pathlib import Path

import pytest
from test_plan_cost import ATTN, HEAD, KV_BYTES, LAYER, MATMUL  # the 1.5B shape, by hand

from hexrl.gpus import CATALOGUE, GPU, SHIPPED_PROFILES, gpu, read_profile
from hexrl.plan import profile as calibration
from hexrl.plan.cost import CostModel
from tools.bench import bench_kernels
from tools.bench import compare_cost_model as ccm
from tools.bench.bench_rollout import model_config

TOOLS = Path(__file__).resolve().parents[1] / "tools" / "bench"

PLANNER_KEYS = {"hbm_TBps", "bf16_tflops", "hbm_efficiency", "decode_mfu", "decode_overhead_s", "prefill_mfu",
                "train_mfu", "host_s_per_sample", "train_overhead_s", "train_fwd_overhead_s",
                "optimizer_overhead_s"}


@pytest.fixture(scope="module")
def cpu_profile(tmp_path_factory):
    """One quick CPU run of bench_kernels (torch sampling path: the interpreter is for kernel tests)."""
    out = tmp_path_factory.mktemp("profiles")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        assert bench_kernels.main(["--quick", "--out", str(out)]) == 0
    return out / "cpu.json"


def test_bench_kernels_writes_a_profile_the_planner_reads(cpu_profile, monkeypatch):
    profile = json.loads(cpu_profile.read_text())
    for key in ("gpu", "device_name", "date", "versions", "model", "model_config", "decode", "prefill", "train",
                "train_s_per_token", "prefill_tokens_per_s", "sampling", "logprob", "optimizer", *PLANNER_KEYS):
        assert key in profile, key
    assert profile["gpu"] == "cpu" and profile["errors"] == []
    assert {"torch", "triton", "flashinfer", "cuda"} <= set(profile["versions"])
    grid = bench_kernels.GRIDS["cpu"]
    points = {(r["batch"], r["prompt_len"]) for r in profile["decode"]}
    assert points == {(b, c) for b in grid.decode_batches for c in grid.decode_contexts}
    for r in profile["decode"]:  # the timed steps come after the prompt and some decoded tokens
        assert r["step_s"] > 0 and r["context"] > r["prompt_len"]
    assert [r["seq_len"] for r in profile["train"]] == [s for s, _ in grid.train]
    assert len(profile["sampling"]) == 2 * len(grid.sample_batches)
    # the planner's own reader takes exactly the catalogue keys, and gpu() applies them
    assert set(read_profile("cpu", cpu_profile.parent)) == PLANNER_KEYS
    monkeypatch.setenv("HEXRL_PROFILES", str(cpu_profile.parent))
    planned = gpu("cpu")
    assert planned.hbm_TBps == pytest.approx(profile["hbm_TBps"]) and planned.train_mfu == pytest.approx(
        profile["train_mfu"])
    assert planned.host_s_per_sample == pytest.approx(profile["host"]["s_per_sample"])
    assert 0 < planned.host_s_per_sample < 0.1 and profile["host"]["samples"] == 512
    assert gpu("cpu", use_profiles=False) == CATALOGUE["cpu"]
    # a training micro-batch's fixed cost: the intercepts of time vs tokens over the grid's points
    fit = profile["train_overhead"]
    assert [(r["seq_len"], r["tokens"] // r["seq_len"]) for r in fit["points"]] == list(grid.overhead)
    assert planned.train_overhead_s == profile["train_overhead_s"] == max(0.0, fit["fit"]["a"]) >= 0
    assert planned.train_fwd_overhead_s == profile["train_fwd_overhead_s"] == max(0.0, fit["fit"]["forward_a"]) >= 0
    assert all(r["seconds"] > 0 and r["forward_s"] > 0 for r in fit["points"])
    # an optimizer step's: the whole model's, then its first layer's
    full, layer = profile["optimizer"]
    assert full["params"] > layer["params"] > 0 and full["seconds"] > 0 and layer["seconds"] > 0
    assert planned.optimizer_overhead_s == profile["optimizer_overhead_s"] == bench_kernels.optimizer_fit(
        profile["optimizer"]) >= 0


def test_line_fit_by_hand():
    """The overhead fit: y = 2 + 3x exactly, and a least-squares line through (0, 1), (1, 2), (2, 4)."""
    assert bench_kernels.line_fit([1.0, 4.0, 10.0], [5.0, 14.0, 32.0]) == pytest.approx((2.0, 3.0))
    assert bench_kernels.line_fit([0.0, 1.0, 2.0], [1.0, 2.0, 4.0]) == pytest.approx((5 / 6, 1.5))
    # the optimizer's: 1 ms + 1 ns a parameter through 1e6 and 1e5 parameters; a negative intercept is 0
    rows = [{"params": 10**6, "seconds": 2e-3}, {"params": 10**5, "seconds": 1.1e-3}]
    assert bench_kernels.optimizer_fit(rows) == pytest.approx(1e-3)
    assert bench_kernels.optimizer_fit([{"params": 10**6, "seconds": 2e-3}, {"params": 10**5, "seconds": 1e-4}]) == 0
    assert bench_kernels.optimizer_fit(rows[:1]) == 0


def test_compare_cost_model_prints_errors(cpu_profile, capsys):
    assert ccm.main([str(cpu_profile)]) == 0
    text = capsys.readouterr().out
    assert re.search(r"decode step \+ training step: median error \d+\.\d%, worst \d+\.\d%", text)
    assert len(re.findall(r"^decode  batch", text, re.M)) == len(json.loads(cpu_profile.read_text())["decode"])
    assert re.search(r"leave-one-out .* median error \d+\.\d%", text)


def test_compare_cost_model_reports_every_problem(tmp_path, capsys):
    bad = tmp_path / "H100.json"
    bad.write_text(json.dumps({"gpu": "H100", "decode": [{"batch": 0, "context": 10}], "train": []}))
    assert ccm.main([str(bad)]) == 2
    err = capsys.readouterr().err
    for what in ("'model_config'", "'hbm_TBps'", "'bf16_tflops'", "decode[0]: needs positive numbers for batch, "
                 "step_s", "train: must be a non-empty list"):
        assert what in err


def test_calibration_recovers_known_efficiencies():
    """Measurements worked out by hand for a GPU with known keys: the fit finds them again. The
    H800 entry is only the name; its peaks and efficiencies are the `truth` below."""
    cfg = model_config("qwen2.5-1.5b").to_hf()  # r1-distill-qwen-1.5b's layers and head, tied embedding
    assert [cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                             "num_key_value_heads", "vocab_size")] == [1536, 8960, 28, 12, 2, 151936]
    bw, decode_peak = 2.9e12 * 0.7, 780e12 * 0.3  # truth: measured peaks x hbm_efficiency, x decode_mfu

    def decode_s(b: int, ctx: float) -> float:  # overhead, weights read or multiplied, KV of b contexts
        return 2.5e-3 + max(2 * MATMUL / bw, 2 * MATMUL * b / decode_peak) + b * ctx * KV_BYTES / bw

    decode = [{"batch": b, "context": c, "step_s": decode_s(b, c)} for b in (1, 64, 256) for c in (300.5, 4100.0)]
    # 8 prompts of 2048 tokens: 2 FLOPs a parameter and causal attention (context 1024) per token, at prefill_mfu
    prefill = [{"batch": 8, "prompt_len": 2048,
                "seconds": 8 * 2048 * (2 * MATMUL + 28 * ATTN * 1024) / (780e12 * 0.45)}]
    # fwd + bwd (3 passes) per token of 1024-token sequences (causal context 512), at train_mfu
    train = [{"seq_len": 1024, "s_per_token": 3 * (28 * (2 * LAYER + ATTN * 512) + 2 * HEAD) / (780e12 * 0.35)}]
    profile = {"gpu": "H800", "model_config": cfg, "hbm_TBps": 2.9, "bf16_tflops": 780.0, "decode": decode,
               "prefill": prefill, "train": train}
    keys = calibration.calibrate(profile)
    assert keys["prefill_mfu"] == pytest.approx(0.45)
    assert keys["train_mfu"] == pytest.approx(0.35)
    assert keys["hbm_efficiency"] == pytest.approx(0.7, rel=0.04)  # the search grid is 6.7% apart
    assert keys["decode_overhead_s"] == pytest.approx(2.5e-3, rel=0.1)
    rows = ccm.compare({**profile, **keys})
    assert max(abs(r.error()) for r in rows) < 0.03
    assert max(abs(r.error("catalogue")) for r in rows if r.kind == "decode") > 0.1  # datasheet alone is off


def test_an_unknown_gpu_type_uses_its_measured_peaks():
    profile = {"gpu": "Tesla-T4", "hbm_TBps": 0.3, "bf16_tflops": 60.0, "hbm_GB": 16.0}
    g = calibration.profile_gpu({**profile, "train_mfu": 0.3})
    assert isinstance(g, GPU) and (g.bf16_tflops, g.hbm_TBps, g.hbm_GB, g.train_mfu) == (60.0, 0.3, 16.0, 0.3)
    assert calibration.host_type(profile) == calibration.STAND_IN


@pytest.mark.parametrize("name, want", [
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H200", "H200"), ("NVIDIA H20", "H20"), ("NVIDIA H800", "H800"),
    ("NVIDIA A100-SXM4-80GB", "A100-80G"), ("NVIDIA GeForce RTX 4090", "RTX4090"), ("NVIDIA L40S", "L40S"),
    ("Tesla T4", "Tesla-T4"), ("cpu", "cpu"),
])
def test_gpu_type_names(name, want):
    assert bench_kernels.gpu_type_name(name) == want


def test_decode_roofline_by_hand():
    cfg = model_config("tiny")  # 4 layers, 4 heads of 16, 2 KV heads, tied 256 x 64 embedding
    weights = cfg.num_params * 4  # fp32, tied: the head is the embedding
    kv = 2 * 4 * 2 * 16 * 4
    assert bench_kernels.decode_roofline_s(cfg, 4, 8, 100, bw=1e9, peak=1e18) == pytest.approx(
        (weights + 8 * 100 * kv) / 1e9)


def test_gpu_check_script_is_valid_bash():
    script = TOOLS.parent / "device" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    for stage in ("pytest -m gpu", "bench_kernels.py", "compare_cost_model.py", "bench_sampling.py",
                  "bench_rollout.py"):
        assert stage in text
    assert "BUDGET_S=${BUDGET_S:-290}" in text  # each of the two device calls: at most 300 s start to end
    assert "--hf-runs 1x128,64x256" in text  # HF generate only on short runs (its 1024-token runs took 186 s)


def test_bench_rollout_hf_runs_are_parsed_and_bad_ones_named():
    import argparse

    from tools.bench import bench_rollout

    p = argparse.ArgumentParser()
    assert bench_rollout.parse_runs(p, "1x128,64x256") == [(1, 128), (64, 256)]
    with pytest.raises(SystemExit):
        bench_rollout.parse_runs(p, "1x128,64by256")


def test_bench_fused_prints_split_and_fused_side_by_side(monkeypatch, capsys):
    from tools.bench import bench_fused

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the torch sampling path, as bench_kernels above
    assert bench_fused.main(["--batch", "2", "--context", "8"]) == 0
    out = capsys.readouterr().out
    assert "split" in out and "fused, torch" in out
    row = [line.split() for line in out.splitlines() if line.split()[:1] == ["2"]]
    assert len(row) == 1 and len(row[0]) == 3 and all(float(ms) > 0 for ms in row[0][1:])


def test_bench_host_plan_plans_under_each_host_setting(capsys):
    """56 GPUs of bench_planner's four types: a row per host setting; the old hand-off (46 s a step)
    lengthens the step, the new costs barely."""
    from tools.bench import bench_host_plan

    bench_host_plan.main(["--gpus", "56"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[1].strip(), r[2].strip()) for r in rows] == [("none", "1"), ("old", "1"), ("old", "0.1"),
                                                             ("new", "1"), ("new", "0.1")]
    step = {(r[1].strip(), r[2].strip()): float(r[3]) for r in rows}
    assert step[("old", "1")] > step[("new", "1")] >= step[("none", "1")]
    assert float(rows[1][6]) == pytest.approx(46.29, abs=0.01)  # 43.1 M tokens x 1.075 us


def test_bench_host_path_writes_the_controllers_fit_into_the_host_profile(tmp_path, monkeypatch, capsys):
    from hexrl.gpus import read_host_profile
    from tools.bench import bench_host_path

    monkeypatch.setenv("HEXRL_PROFILES", str(tmp_path))
    bench_host_path.main(["--write", "--repeats", "1", "--lengths", "64,512", "--tokens", "4096"])
    assert f"wrote {tmp_path / 'host.json'}" in capsys.readouterr().out
    assert set(read_host_profile()) == {"controller_us_per_traj", "controller_ns_per_token"}


def test_bench_controller_scale_measures_every_item_on_this_code(monkeypatch, capsys):
    from tools.bench import bench_controller_scale as bench

    monkeypatch.setattr(bench, "CPU_PER_ITEM_S", 0.01)  # a few calls each: this checks it runs, not the figures
    results = bench.scale_run([8], repeats=1, groups=16)
    assert set(results[8]) == {"flush", "pass", "dispatch", "pick", "publish"}
    assert all(len(xs) == 1 and xs[0] > 0 for xs in results[8].values())
    bench.scale_report({"new": {"8": results[8]}}, [8])
    assert "publish" in capsys.readouterr().out


def test_bench_controller_ingest_runs_the_thread_and_the_process(capsys):
    from tools.bench import bench_controller_scale as bench

    rows = [bench.ingest_run(64, mode, seconds=0.3) for mode in ("thread, alone", "process, busy trainer")]
    assert all(r["traj_s"] > 0 and r["cpu_us_per_traj"] > 0 for r in rows), rows  # none rejected (it asserts)
    bench.ingest_report(rows)
    assert "process, busy trainer" in capsys.readouterr().out


def test_the_planner_reads_the_shipped_h100_profile_from_any_directory(monkeypatch, tmp_path):
    """The shipped hexrl/profiles/H100.json sets the planner's H100 decode times: median error
    5% against its own measurements, where the paper-calibrated catalogue is 40-140% slow."""
    monkeypatch.delenv("HEXRL_PROFILES", raising=False)
    monkeypatch.chdir(tmp_path)  # no ./profiles here: the shipped profile is found anyway
    profile = json.loads((SHIPPED_PROFILES / "H100.json").read_text())
    planned = gpu("H100")
    for key in ("bf16_tflops", "hbm_TBps", "hbm_efficiency", "decode_mfu", "decode_overhead_s", "train_mfu"):
        assert getattr(planned, key) == pytest.approx(profile[key]), key
    errors = {True: [], False: []}
    for row in profile["decode"]:
        job = calibration.context_job(profile["model_config"], "H100", float(row["context"]))
        for use in errors:
            step = CostModel(job, use_profiles=use).decode_point("H100", 1, row["batch"]).step_s
            errors[use].append(abs(step / row["step_s"] - 1))
    assert ccm.summary(errors[True])[0] < 0.10 and ccm.summary(errors[False])[0] > 0.30
    local = tmp_path / "profiles"  # a fresh local measurement (bench_kernels --out profiles/) comes first
    local.mkdir()
    (local / "H100.json").write_text(json.dumps({"decode_mfu": 0.123}))
    assert gpu("H100").decode_mfu == 0.123 and gpu("H100").hbm_TBps == CATALOGUE["H100"].hbm_TBps


def test_compare_cost_model_on_the_shipped_h100_profile(capsys):
    assert ccm.main([str(SHIPPED_PROFILES / "H100.json")]) == 0
    text = capsys.readouterr().out
    median = float(re.search(r"^decode\s+median error\s+([\d.]+)%", text, re.M).group(1))
    assert median < 10.0 and "meets the 15% median target" in text
