"""Drift re-planning: the decision on measurements, its job fields, its command line, and the
simulator's drifting workload."""

import json
from pathlib import Path

import pytest

from hexrl.plan import replan
from hexrl.plan.__main__ import main as plan_cli
from hexrl.plan.cost import CostModel
from hexrl.plan.planner import plan_candidate, plan_job
from hexrl.plan.simulate import Simulation
from hexrl.schema import ConfigError, load_job

CONFIGS = Path(__file__).resolve().parent.parent / "tools" / "configs"


def paper_job(mean_out: float, **extra) -> dict:
    """The paper's 7B job on 3 H800 + 3 H20 nodes, outputs of `mean_out` tokens on average."""
    d = json.loads((CONFIGS / "paper_7b_hetero.json").read_text())
    d["workload"]["output_len"] = {"mean": mean_out, "max": 8192}
    return {**d, **extra}


@pytest.fixture(scope="module")
def short_plan():
    """The plan for 2,500-token outputs, allowed a long horizon (a switch pays off within it)."""
    return plan_job(load_job(paper_job(2500, replan={"horizon_s": 36000}), check_paths=False))


def rows_at(plan, mean_out: float, n: int = 5) -> list[dict]:
    """Metrics rows of `plan` running outputs of `mean_out` tokens exactly as the cost model predicts."""
    cm = CostModel(replan.drifted_job(plan.job, mean_out))
    c = plan_candidate(cm, plan)
    return [{"step": i + 1, "train_s": c.C_T, "tokens_trained": cm.w.samples * (cm.w.prompt_len + mean_out),
             "rollout_tokens_per_s": cm.w.gen_tokens / c.step_s, "wait_s": c.step_s - c.C_T - c.C_sync,
             "step_s": c.step_s} for i in range(n)]


def rollout_gpus(split: dict) -> int:
    return sum(split["rollout"].values())


def test_longer_outputs_switch_toward_generation(short_plan):
    row, new = replan.decide(short_plan, rows_at(short_plan, 5000), now_s=10_000)
    assert row["taken"] and new is not None, row["why"]
    assert row["measured"]["output_len_mean"] == pytest.approx(5000)
    assert row["calibration"]["train"] == pytest.approx(1.0, rel=1e-6)  # the rows are the model's own
    assert row["amortised_gain"] > short_plan.job.replan.min_gain
    assert row["predicted_gain"] > row["amortised_gain"]  # the switch is paid for
    assert rollout_gpus(row["new_split"]) > rollout_gpus(row["running_split"])
    json.dumps(row)  # one metrics.jsonl line


def test_shorter_outputs_move_back(short_plan):
    long_plan = plan_job(replan.drifted_job(short_plan.job, 5000))
    row, _ = replan.decide(long_plan, rows_at(long_plan, 2500), now_s=10_000)
    assert rollout_gpus(row["new_split"]) < rollout_gpus(row["running_split"])


def test_no_switch_within_the_horizon_after_a_switch(short_plan):
    row, new = replan.decide(short_plan, rows_at(short_plan, 5000), now_s=10_000, last_switch_s=9_000)
    assert not row["taken"] and new is None
    assert "within replan.horizon_s" in row["why"]


def test_no_switch_when_the_gain_is_below_the_margin(short_plan):
    costly = replan.decide(short_plan, rows_at(short_plan, 5000), now_s=10_000, switch_s=30_000)[0]
    assert not costly["taken"] and "replan.min_gain" in costly["why"]
    assert costly["predicted_gain"] > 0.1 > costly["amortised_gain"]  # the switch cost made the difference
    same = replan.decide(short_plan, rows_at(short_plan, 2500), now_s=10_000)[0]
    assert not same["taken"] and abs(same["predicted_gain"]) < 0.05


def test_slower_training_than_predicted_is_fitted(short_plan):
    rows = [{**r, "train_s": 2 * r["train_s"]} for r in rows_at(short_plan, 2500)]
    m = replan.measure(rows, short_plan.job)
    _, cal = replan.calibrate(short_plan, m)
    assert cal.train == pytest.approx(0.5, rel=1e-6)


def test_decode_speed_is_fitted_only_when_generation_is_the_bottleneck(short_plan):
    rows = rows_at(short_plan, 2500)
    waiting = [{**r, "rollout_tokens_per_s": 0.8 * r["rollout_tokens_per_s"], "wait_s": 0.3 * r["step_s"]}
               for r in rows]
    assert replan.calibrate(short_plan, replan.measure(waiting, short_plan.job))[1].decode == pytest.approx(0.8)
    busy = [{**r, "rollout_tokens_per_s": 1.3 * r["rollout_tokens_per_s"], "wait_s": 0.0} for r in rows]
    cal = replan.calibrate(short_plan, replan.measure(busy, short_plan.job))[1]
    assert (cal.decode, cal.generation_bound) == (1.0, False)  # what training consumes is no speed


def test_each_gpu_types_decode_speed_is_fitted_from_its_replicas(short_plan):
    """H20 replicas generate at half the rate the plan predicted for them, H800 replicas as predicted:
    H20 decodes at 0.5, H800 at 1, and the new plan gives the H20s a smaller part of the groups."""
    cm = CostModel(replan.drifted_job(short_plan.job, 2500))
    predicted = cm.w.gen_tokens / plan_candidate(cm, short_plan).C_I  # tokens/s, all replicas together
    total = sum(r.share for r in short_plan.replicas)
    rates = {str(r.id): predicted * r.share / total * (0.5 if r.gpu_type == "H20" else 1.0)
             for r in short_plan.replicas}
    rows = [{**r, "replica_tokens_per_s": rates, "rollout_tokens_per_s": sum(rates.values()),
             "wait_s": 0.3 * r["step_s"]} for r in rows_at(short_plan, 2500)]
    row, new = replan.decide(short_plan, rows, now_s=10_000)
    cal = row["calibration"]
    assert cal["decode_by_type"] == {"H20": pytest.approx(0.5), "H800": pytest.approx(1.0)}
    assert 0.5 < cal["decode"] < 1.0  # all replicas together: what a type no replica measured gets
    h20_part = lambda plan: sum(r.share for r in plan.replicas if r.gpu_type == "H20") / sum(  # noqa: E731
        r.share for r in plan.replicas)
    assert row["taken"], row["why"]
    assert h20_part(new) < 0.75 * h20_part(short_plan)
    assert row["new_split"]["rollout"]["H800"] > row["running_split"]["rollout"]["H800"]  # H800s take it on


def test_the_measured_length_distribution_shapes_the_job(short_plan):
    """Rows that give the median, 90th percentile and longest output calibrate the job to lengths with
    those quantiles and the measured mean; rows with the mean alone keep the long tail of that mean."""
    quantiles = {"output_len_mean": 3000.0, "output_len_p50": 2400, "output_len_p90": 5600, "output_len_max": 8000}
    rows = [{**r, **quantiles} for r in rows_at(short_plan, 3000)]
    job, _ = replan.calibrate(short_plan, replan.measure(rows, short_plan.job))
    lengths = sorted(job.workload.output_len["samples"])
    assert sum(lengths) / len(lengths) == pytest.approx(3000)
    assert lengths[49] <= 2400 <= lengths[50] and lengths[89] <= 5600 <= lengths[90] and lengths[-1] <= 8000
    flat = [{**r, "output_len_mean": 3000.0, "output_len_p50": 3000, "output_len_p90": 3000, "output_len_max": 3000}
            for r in rows]
    job_flat, _ = replan.calibrate(short_plan, replan.measure(flat, short_plan.job))
    assert set(job_flat.workload.output_len["samples"]) == {3000}
    # every sample as long as the mean: no straggler to wait for, so a step generates sooner than a long tail's
    mean_only = [{**r, "output_len_mean": 3000.0} for r in rows_at(short_plan, 3000)]
    tail_job, _ = replan.calibrate(short_plan, replan.measure(mean_only, short_plan.job))
    assert tail_job.workload.output_len == {"mean": 3000.0, "max": 8192.0}
    gen_s = lambda job: plan_candidate(CostModel(job), short_plan).C_I  # noqa: E731
    assert gen_s(job_flat) < gen_s(tail_job)
    load_job(job.to_dict(), check_paths=False)  # a recorded plan's job loads again


def test_a_switch_that_cannot_pay_back_before_the_run_ends_is_not_taken(short_plan):
    early = replan.decide(short_plan, rows_at(short_plan, 5000), now_s=10_000)[0]
    assert early["taken"] and early["payback_s"] == short_plan.job.replan.horizon_s
    steps = short_plan.job.rl.steps  # 200: the rows of steps 194-198 leave 2 steps, about 2,100 s
    late_rows = [{**r, "step": steps - 7 + r["step"]} for r in rows_at(short_plan, 5000)]
    late = replan.decide(short_plan, late_rows, now_s=10_000)[0]
    step_s = late_rows[0]["step_s"]
    assert late["run_left_s"] == pytest.approx(2 * step_s, abs=0.01) and late["payback_s"] == late["run_left_s"]
    assert late["predicted_gain"] == pytest.approx(early["predicted_gain"])  # the same plans, less time to pay
    assert not late["taken"] and late["amortised_gain"] < 0.1 < early["amortised_gain"]
    assert f"over the {2 * step_s:.0f} s the run has left, short of replan.horizon_s 36000 s" in late["why"]


def test_no_measurements_no_switch(short_plan):
    row, new = replan.decide(short_plan, [{"step": 1, "reward_mean": 0.5}], now_s=10)
    assert (row["taken"], row["why"], new) == (False, "no step measured yet", None)


def test_replan_fields_are_validated():
    bad = paper_job(2500, replan={"every_s": -1, "min_gain": "lots", "horizon_s": 100, "switch_s": 200, "often": 1})
    bad["workload"]["output_len_growth"] = {"factor": 0, "steps": 1000}
    with pytest.raises(ConfigError) as e:
        load_job(bad, check_paths=False)
    text = str(e.value)
    for field in ("replan.every_s", "replan.min_gain", "replan.switch_s", "replan.often",
                  "workload.output_len_growth.factor"):
        assert field in text, field
    job = load_job(paper_job(2500), check_paths=False)
    assert (job.replan.every_s, job.replan.min_gain) == (600.0, 0.1)
    assert "replan" not in job.to_dict()  # the defaults leave plan files as they were


def test_cli_prints_what_a_run_implies(short_plan, tmp_path, capsys):
    short_plan.save(tmp_path / "plan.json")
    rows = [{**r, "reward_mean": 0.1} for r in rows_at(short_plan, 5000)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert plan_cli(["replan", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "new plan :" in out and "decision : switch" in out and "mean output 5000 tokens" in out
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # the run is not touched
    assert plan_cli(["replan", str(tmp_path), "--json", "--switch-s", "35000"]) == 0
    assert json.loads(capsys.readouterr().out)["taken"] is False
    assert plan_cli(["replan", str(tmp_path / "nowhere")]) == 2
    assert "plan.json" in capsys.readouterr().err


def hostile_lines(good: dict) -> list[bytes]:
    """metrics.jsonl lines no run writes: values that are no measurement, rows that are not objects,
    steps that are not numbers, bytes that are not UTF-8, nesting deeper than the parser goes."""
    bad_values = [("train_s", float("inf")), ("train_s", "1"), ("train_s", True), ("tokens_trained", float("nan")),
                  ("tokens_trained", 10**400), ("rollout_tokens_per_s", 0), ("rollout_tokens_per_s", -5),
                  ("wait_s", -1.0), ("step", "x"), ("step", None)]
    rows = [json.dumps({**good, k: v}).encode() for k, v in bad_values]
    return rows + [b"[1, 2]", b"5", b"\xff\xfe\x00", b"[" * 100_000 + b"]" * 100_000]


def test_metrics_rows_that_are_no_measurement_are_not_measured(short_plan, tmp_path, capsys):
    short_plan.save(tmp_path / "plan.json")
    (tmp_path / "metrics.jsonl").write_bytes(b"\n".join(hostile_lines(rows_at(short_plan, 5000)[0])) + b"\n")
    assert plan_cli(["replan", str(tmp_path), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert (row["taken"], row["why"]) == (False, "no step measured yet")


def test_measurements_that_cannot_be_the_running_plans_switch_nothing(short_plan):
    rows = [{**r, "tokens_trained": 1e308, "rollout_tokens_per_s": 1e308} for r in rows_at(short_plan, 5000)]
    row, new = replan.decide(short_plan, rows, now_s=10_000)
    assert new is None and not row["taken"]
    assert row["why"].startswith("the measurements do not fit the running plan (train x")
    json.loads(json.dumps(row, allow_nan=False))  # nothing infinite reaches metrics.jsonl


def test_cli_times_must_be_finite_and_an_unwritable_new_plan_is_named(short_plan, tmp_path, capsys):
    short_plan.save(tmp_path / "plan.json")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_at(short_plan, 5000)))
    for flag in ("--now-s", "--last-switch-s", "--switch-s"):
        with pytest.raises(SystemExit) as e:
            plan_cli(["replan", str(tmp_path), flag, "nan"])
        assert e.value.code == 2 and f"{flag}: must be a finite number of seconds" in capsys.readouterr().err
    assert plan_cli(["replan", str(tmp_path), "--now-s", "1e6", "--new-plan", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"--new-plan: cannot write {tmp_path}: Is a directory\n"


def test_simulated_outputs_grow_with_the_step(short_plan):
    job = load_job(paper_job(2500, workload={"prompt_len": 256, "output_len": {"mean": 2500, "max": 8192},
                                             "output_len_growth": {"factor": 3, "steps": 6}}), check_paths=False)
    plan = plan_job(job)
    sim = Simulation(plan)
    sim.run(steps=8, warmup=2)
    assert sim.growth(0) == 1.0 and sim.growth(3) == 2.0 and sim.growth(60) == 3.0
    assert sum(sim.step_tokens[-2:]) > 1.5 * sum(sim.step_tokens[:2])
    later = Simulation(plan, start_step=6)
    later.run(steps=3, warmup=1)
    assert sum(later.step_tokens[:2]) > 1.5 * sum(sim.step_tokens[:2])
