"""The study's simulator path: a CPU profile in the planner's format -> `python -m hexrl.plan simulate`."""
import json
import sys
from pathlib import Path

import pytest

from hexrl.plan.planner import plan_job
from hexrl.schema import load_job
from tools.experiments import learning_study as ls

# what tools/bench/bench_kernels.py --cpu-core writes for a CPU core (the planner reads only these keys)
PROFILE = {"gpu": "cpu", "bf16_tflops": 0.02, "hbm_TBps": 0.005, "hbm_efficiency": 0.5, "decode_mfu": 0.3,
           "decode_overhead_s": 2e-3, "prefill_mfu": 0.3, "train_mfu": 0.5}


def tiny_run(tmp: Path, name: str, eta: int) -> Path:
    """A run directory holding the plan of a 1 trainer + 1 rollout CPU job (as learning_run writes it)."""
    job = load_job({"model": {"preset": "tiny"}, "data": {"synthetic": {"task": "arithmetic", "n": 200}},
                    "reward": {"name": "exact"},
                    "rl": {"batch_size": 8, "group_size": 4, "eta": eta, "max_new_tokens": 5},
                    "cluster": {"nodes": [{"name": "local", "gpu_type": "cpu", "gpus": 2}]},
                    "layout": {"train_gpus": 1, "dp": 1},
                    "cpu_affinity": {"cores": [[0], [1]]}})
    run = tmp / name
    run.mkdir()
    plan_job(job, "two-phase", use_profiles=False).save(run / "plan.json")
    return run


def profiles(tmp: Path, name: str, **change) -> Path:
    d = tmp / name
    d.mkdir()
    (d / "cpu.json").write_text(json.dumps({**PROFILE, **change}))
    return d


def test_simulated_staleness_stays_within_eta(tmp_path):
    prof = profiles(tmp_path, "p")
    sync = ls.simulate(tiny_run(tmp_path, "sync", 0), prof, prompt=7, completion=4, equal=0.0, steps=8)
    assert sync["staleness"] and set(sync["staleness"]) == {0} and sync["mean_staleness"] == 0
    asyn = ls.simulate(tiny_run(tmp_path, "async", 2), prof, prompt=7, completion=4, equal=0.0, steps=8)
    assert max(asyn["staleness"]) <= 2 and asyn["step_s"] > 0
    plan = json.loads((tmp_path / "async" / "plan_simulated.json").read_text())
    assert plan["workload"] == {"prompt_len": 7, "output_len": {"mean": 4, "max": 5},  # the measured workload
                                "equal_reward_fraction": 0.0}


def test_the_measured_filtered_share_slows_the_simulated_rollout(tmp_path):
    """Half the groups filtered: the rollout generates twice the groups per step (trainer-bound
    runs aside), so a rollout-bound synchronous step takes longer."""
    prof = profiles(tmp_path, "p", train_mfu=0.5)
    plain = ls.simulate(tiny_run(tmp_path, "plain", 0), prof, 7, 4, 0.0, 8)
    half = ls.simulate(tiny_run(tmp_path, "half", 0), prof, 7, 4, 0.5, 8)
    assert half["step_s"] > 1.3 * plain["step_s"]


def test_a_simulation_is_reused_only_for_the_same_workload(tmp_path):
    """The study caches each window's simulation; another filtered share (a study with more seeds
    averages differently) must run it again, not return the old result."""
    prof, run = profiles(tmp_path, "p"), tiny_run(tmp_path, "r", 0)
    plain = ls.simulate(run, prof, 7, 4, 0.0, 8, tag="-w0")
    assert ls.simulate(run, prof, 7, 4, 0.0, 8, tag="-w0") == plain  # reused
    half = ls.simulate(run, prof, 7, 4, 0.5, 8, tag="-w0")
    assert half["step_s"] > 1.3 * plain["step_s"]


def test_the_profile_sets_the_simulated_trainer_speed(tmp_path):
    """Trainer-bound at eta=4: halving the profile's train_mfu doubles the step (weight sync aside)."""
    slow = ls.simulate(tiny_run(tmp_path, "a", 4), profiles(tmp_path, "slow", train_mfu=0.004), 7, 4, 0.0, 8)
    slower = ls.simulate(tiny_run(tmp_path, "b", 4), profiles(tmp_path, "slower", train_mfu=0.002), 7, 4, 0.0, 8)
    assert slow["trainer_idle"] < 0.05 and slower["trainer_idle"] < 0.05  # the trainer never waits
    assert slower["step_s"] / slow["step_s"] == pytest.approx(2.0, rel=0.05)
    assert slower["rollout_idle"] > slow["rollout_idle"]  # the rollout waits more on a slower trainer


def test_windows_measure_each_span_of_steps_on_its_own():
    """The filtered share rises as the model learns; each window reports its own, from counter deltas,
    and its step time from wall time with evaluation excluded (`wall_s`)."""
    rows, produced, filtered = [], 0, 0
    for step in range(1, 5):
        share = 0.25 if step <= 2 else 0.5  # of this step's generated trajectories, filtered
        produced += round(512 / (1 - share))
        filtered += round(512 / (1 - share)) - 512
        rows.append({"wall_s": step * (1.0 if step <= 2 else 2.0) + (step > 2) * -2.0, "train_s": 0.4,
                     "trajectories_produced": produced, "trajectories_filtered": filtered,
                     "rollout_tokens_per_s": 3.0 * round(512 / (1 - share)), "step_s": 1.0,
                     "staleness_hist": {"0": 256, str(step): 256}})
    first, second = ls.windows(rows, 2)
    assert first["steps"] == [0, 2] and second["steps"] == [2, 4]
    assert first["step_s"] == pytest.approx(1.0) and second["step_s"] == pytest.approx(2.0)
    assert first["equal_fraction"] == pytest.approx(0.25, abs=1e-3)
    assert second["equal_fraction"] == pytest.approx(0.5, abs=1e-3)
    assert first["completion_len"] == pytest.approx(3.0) and first["mean_staleness"] == pytest.approx(0.75)


def test_the_rollout_trace_is_cut_into_windows_by_trajectories_sent(tmp_path):
    """The leader's cumulative counters, read at the trajectory counts where each window starts and
    ends (the controller's `trajectories_produced`), per training step."""
    (tmp_path / "engine").mkdir()
    lines = [{"time": 10.0 * i, "cpu_s": 8.0 * i, "engine_step_s": 6.0 * i, "steps": 100 * i,
              "generated_tokens": 1000 * i, "prefill_tokens": 500 * i, "sent": 400 * i} for i in range(5)]
    (tmp_path / "engine" / "replica0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    first, second = ls.rollout_time(tmp_path, [{"steps": [0, 2], "produced": [0, 800]},
                                               {"steps": [2, 6], "produced": [800, 1400]}])
    assert first == pytest.approx({"engine_s": 6.0, "host_s": 2.0, "wait_s": 2.0, "decode_steps": 100,
                                   "generated": 1000, "prefill": 500, "sent": 400, "mean_batch": 10})
    assert second["engine_s"] == pytest.approx(6.0 * 1.5 / 4) and second["sent"] == pytest.approx(150)


def test_a_window_measured_slower_than_its_profile_is_simulated_that_much_slower(tmp_path):
    """The engine took twice what the profile predicts for its measured steps, the host work 3x,
    training 1.5x: the profile slowed by those factors predicts exactly that."""
    prof = profiles(tmp_path, "p", host_s_per_sample=1e-4)
    run = tiny_run(tmp_path, "r", 0)
    sim = ls.simulate(run, prof, 7, 4, 0.0, 8, tag="-w0")
    cm = ls.cost_model(run / "plan_simulated-w0.json", prof)
    a, c = cm.decode_coeffs("cpu", 1, 16)
    engine = 10 * a + c * 160 * (7 + 4 / 2) + cm.prefill_s("cpu", 1, 70, 7 / 2)
    window = {"steps": [0, 10], "completion_len": 4, "train_s": 1.5 * sim["train_s"],
              "rollout": {"engine_s": 2 * engine, "host_s": 3 * 1e-4 * 40, "decode_steps": 10, "generated": 160,
                          "prefill": 70, "sent": 40, "mean_batch": 16}}
    k = ls.speeds(run, prof, 7, window, sim)
    assert k == pytest.approx({"rollout": 2.0, "host": 3.0, "train": 1.5})
    slow = ls.at_speeds(prof, k, tmp_path / "slow")
    cm2 = ls.cost_model(run / "plan_simulated-w0.json", slow)
    assert cm2.decode_coeffs("cpu", 1, 16) == pytest.approx((2 * a, 2 * c))
    assert cm2.prefill_s("cpu", 1, 70, 3.5) == pytest.approx(2 * cm.prefill_s("cpu", 1, 70, 3.5))
    assert cm2.gpus["cpu"].host_s_per_sample == pytest.approx(3e-4)
    slowed = ls.simulate(run, slow, 7, 4, 0.0, 8, tag="-w0-slow")
    assert slowed["train_s"] == pytest.approx(1.5 * sim["train_s"], rel=0.05)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
