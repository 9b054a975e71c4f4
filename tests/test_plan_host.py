"""The host costs in the planner: the trainer's hand-off lengthens its step, the controller's work on
its share of a core bounds the step, a plan says when a host term binds it, and the job's
workload.host is checked and used in place of the measured defaults."""

import json
from dataclasses import asdict

import pytest
from test_simulate import two_gpu_job

from hexrl.gpus import HOST_FIELDS, Host, host_costs, read_host_profile, write_host_profile
from hexrl.plan.__main__ import summary
from hexrl.plan.candidate import step_times
from hexrl.plan.cost import CostModel
from hexrl.plan.planner import plan_candidate, plan_job
from hexrl.schema import ConfigError, load_job

ZERO = {k: 0.0 for k in HOST_FIELDS if k != "controller_core_share"}


def job_with(host: dict | None, **rl) -> dict:
    """two_gpu_job (1 H800 trains, 1 generates; prompts of 2048, outputs of 10) with a batch of 8
    groups of 2 and these host costs."""
    job = two_gpu_job(eta=1, batch_size=8, **rl)
    if host is not None:
        job["workload"]["host"] = host
    return job


def test_the_host_terms_price_as_the_formula_says():
    """8 groups x 2 samples of 2048 + 10 tokens: the hand-off is every trained token at 100 + 10 ns,
    added to training; the controller takes 16 trajectories (50 us), 160 generated tokens (1 us),
    8 groups (20 us) and publishes to 1 replica (5 us) on a quarter of a core."""
    host = {"controller_us_per_traj": 50, "controller_ns_per_token": 1000, "controller_us_per_group": 20,
            "publish_us_per_replica": 5, "handoff_ns_per_token_rank0": 100, "handoff_ns_per_token_other": 10,
            "controller_core_share": 0.25}
    cm = CostModel(load_job(job_with(host)), use_profiles=False)
    assert cm.handoff_s() == pytest.approx(16 * 2058 * 110e-9, rel=1e-12)
    control = 16 * 50e-6 + 160 * 1e-6 + 8 * 20e-6 + 1 * 5e-6
    assert cm.host.controller_s(1) == pytest.approx(control, rel=1e-12)
    assert cm.controller_floor_s(1) == pytest.approx(control / 0.25, rel=1e-12)

    plan = plan_job(load_job(job_with(host)), use_profiles=False)
    bare = plan_job(load_job(job_with({**ZERO, "controller_core_share": 1})), use_profiles=False)
    cand, before = plan_candidate(cm, plan), plan_candidate(CostModel(load_job(job_with(ZERO))), bare)
    assert cand.C_handoff == pytest.approx(16 * 2058 * 110e-9, rel=1e-12)
    assert cand.C_T == pytest.approx(before.C_T + cand.C_handoff, rel=1e-12)
    # the step is the rollout beside the longer training, the controller far from binding
    assert cand.step_s == pytest.approx(step_times(cm, cand.C_T, cand.C_sync, cand.rollout)[2], rel=1e-12)
    h = plan.predicted["host"]
    assert h["handoff_s"] == pytest.approx(cand.C_handoff, abs=1e-4) and h["controller_core_share"] == 0.25
    assert h["controller_load"] == pytest.approx(control / 0.25 / cand.step_s, abs=1e-4)
    assert h["bound"] == []


def test_a_plan_is_host_bound_when_the_controller_needs_more_than_its_core():
    """At 0.2 s of controller work a trajectory, 16 a step need 3.2 s of a core, more than the GPUs'
    step: the step is the controller's, and the plan and its summary say so."""
    host = {**ZERO, "controller_us_per_traj": 2e5, "controller_core_share": 1}
    plan = plan_job(load_job(job_with(host)), use_profiles=False)
    bare = plan_job(load_job(job_with({**ZERO, "controller_core_share": 1})), use_profiles=False)
    assert bare.predicted["step_time_s"] < 3.2
    assert plan.predicted["step_time_s"] == pytest.approx(3.2, abs=1e-4)
    assert plan.predicted["host"]["bound"] == ["controller"]
    assert plan.predicted["host"]["controller_load"] == pytest.approx(1.0)
    assert "HOST-BOUND: controller" in summary(plan)
    assert bare.predicted["host"]["bound"] == [] and "HOST-BOUND" not in summary(bare)
    # on half a core the same work binds at twice the step
    half = plan_job(load_job(job_with({**host, "controller_core_share": 0.5})), use_profiles=False)
    assert half.predicted["step_time_s"] == pytest.approx(6.4, abs=1e-4)


def test_a_hand_off_that_is_most_of_the_step_is_called_host_bound():
    host = {**ZERO, "handoff_ns_per_token_rank0": 1e5, "controller_core_share": 1}  # 0.1 ms a token
    plan = plan_job(load_job(job_with(host)), use_profiles=False)
    assert plan.predicted["host"]["handoff_s"] == pytest.approx(16 * 2058 * 1e-4, abs=1e-4)
    assert plan.predicted["host"]["bound"] == ["trainer hand-off"]


def test_zero_host_costs_leave_the_step_as_the_gpus_set_it():
    """With every host cost 0 the candidate is the GPUs' alone: no hand-off, the step as step_times
    composes it, nothing host-bound."""
    cm = CostModel(load_job(job_with({**ZERO, "controller_core_share": 1})), use_profiles=False)
    plan = plan_job(cm.job, use_profiles=False)
    cand = plan_candidate(cm, plan)
    assert cand.C_handoff == 0 and cand.C_T == cand.train.time_s
    assert cand.step_s == step_times(cm, cand.train.time_s, cand.C_sync, cand.rollout)[2]
    assert plan.predicted["host"] == {"controller_s": 0.0, "controller_core_share": 1.0, "controller_load": 0.0,
                                      "handoff_s": 0.0, "handoff_share": 0.0, "bound": []}


def test_bad_host_costs_are_each_named():
    host = {"controller_us_per_traj": -1, "controller_ns_per_token": "fast", "controller_core_share": 0,
            "handoff_ns_per_token_rank0": 2, "gil": 1}
    with pytest.raises(ConfigError) as e:
        load_job(job_with(host))
    problems = "\n".join(e.value.problems)
    for name in ("workload.host.controller_us_per_traj: must be >= 0", "workload.host.controller_ns_per_token",
                 "workload.host.controller_core_share: must be > 0", "workload.host.gil: unknown field"):
        assert name in problems
    assert len(e.value.problems) == 4  # handoff_ns_per_token_rank0 is fine
    with pytest.raises(ConfigError, match="workload.host.controller_core_share: must be <= 1"):
        load_job(job_with({"controller_core_share": 2}))
    with pytest.raises(ConfigError, match="workload.host: must be an object"):
        load_job(job_with([30, 10]))


def test_a_job_replaces_the_measured_profile_which_replaces_the_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("HEXRL_PROFILES", str(tmp_path))
    assert read_host_profile() == {} and host_costs() == Host()
    path = write_host_profile({"controller_us_per_traj": 12.5, "controller_ns_per_token": 3.0}, "a test")
    assert path == tmp_path / "host.json"
    assert json.loads(path.read_text())["measured"]["controller_ns_per_token"]["tool"] == "a test"
    assert read_host_profile() == {"controller_us_per_traj": 12.5, "controller_ns_per_token": 3.0}
    h = host_costs({"controller_ns_per_token": 7.0})
    assert (h.controller_us_per_traj, h.controller_ns_per_token) == (12.5, 7.0)
    assert host_costs(use_profiles=False) == Host()
    job = load_job(job_with({"handoff_ns_per_token_other": 9}))
    assert job.workload.to_dict()["host"] == {"handoff_ns_per_token_other": 9.0}
    assert asdict(CostModel(job).host.host)["controller_us_per_traj"] == 12.5
