"""The long tail in the plan: two length classes in the rollout MILP, the long groups' replicas at a
batch cap from the job's caps, the split printed, and the simulator playing both classes."""

import copy
import json
from types import SimpleNamespace

import numpy as np
import pytest

from hexrl.plan import rollout_milp
from hexrl.plan.__main__ import report, summary
from hexrl.plan.candidate import Evaluator
from hexrl.plan.cost import CostModel
from hexrl.plan.lengths import LengthDist
from hexrl.plan.partition import _raise, bound_parts, lower_bounds, makespan_bound, split_grid
from hexrl.plan.placement import free_classes
from hexrl.plan.planner import plan_job
from hexrl.plan.simulate import simulate
from hexrl.schema import load_job, load_plan
from tools.experiments.long_tail_study import heavy_tail, job_dict, recorded_lengths
from tools.experiments.long_tail_study import main as study_main

CAPS = [4, 8, 16]


def heavy_job(eta: int = 0, **over) -> dict:
    """2 H800 + 2 H20 nodes of 4 GPUs, the 1.5B model, 32 groups of 8, log-normal output lengths
    (median 1,500 tokens, log sd 1.0, cut at 8,192)."""
    nodes = [{"name": f"{t.lower()}-{i}", "gpu_type": t, "gpus": 4} for t in ("H800", "H20") for i in range(2)]
    return {"model": {"preset": "r1-distill-qwen-1.5b"}, "data": {"synthetic": {}},
            "rl": {"batch_size": 32, "group_size": 8, "max_new_tokens": 8192, "eta": eta, "ppo_minibatches": 2},
            "workload": {"prompt_len": 256, "output_len": heavy_tail(1500, 1.0, 8192, 32)},
            "cluster": {"nodes": nodes, "inter_node_GBps": 5, "cross_type_GBps": 1.5}, **over}


@pytest.fixture(scope="module")
def plans():
    """(length-blind plan, skew-aware plan: alpha 0.25) of heavy_job."""
    return (plan_job(load_job(heavy_job())),
            plan_job(load_job(heavy_job(long_tail={"alpha": 0.25, "caps": CAPS}))))


def without_timing(plan) -> dict:
    d = plan.to_dict()
    d.pop("long_tail", None)  # the job's own section
    d["predicted"]["search"].pop("wall_s")
    return d


def test_alpha_zero_plans_exactly_as_without_the_section(plans):
    off = plan_job(load_job(heavy_job(long_tail={"alpha": 0, "caps": [4]})))
    assert without_timing(off) == without_timing(plans[0])
    assert not any(r.long_tail for r in off.replicas) and "long_tail" not in off.predicted
    assert CostModel(off.job).tail is None  # no length classes: every cost is the one-class cost


def test_split_keeps_the_mean_and_puts_the_longest_mass_on_top():
    d = LengthDist([100.0, 200.0, 400.0, 800.0], [0.4, 0.3, 0.2, 0.1])
    long, rest = d.split(0.25)  # the boundary length 400 gives 0.15 of its 0.2 to the long side
    assert sum(long.probs) == pytest.approx(1) and sum(rest.probs) == pytest.approx(1)
    assert 0.25 * long.mean() + 0.75 * rest.mean() == pytest.approx(d.mean())
    assert long.mean() == pytest.approx((0.1 * 800 + 0.15 * 400) / 0.25)
    assert min(long.lengths) >= max(rest.lengths)


def test_milp_gives_the_long_groups_replicas_of_their_own_at_a_cap(plans):
    blind, aware = plans
    long = [r for r in aware.replicas if r.long_tail]
    assert long and len(long) < len(aware.replicas)
    assert all(r.knobs.max_running in CAPS for r in long)  # the cap is one of the job's
    assert len({r.knobs.max_running for r in long}) == 1
    # shares are of all groups: the long tail's add up to its 8 of 32 groups
    assert sum(r.share for r in long) == pytest.approx(8 / 32, abs=1e-5)
    assert sum(r.share for r in aware.replicas) == pytest.approx(1, abs=1e-6)
    assert [r.to_dict().get("long_tail") for r in aware.replicas] == [r.long_tail or None for r in aware.replicas]
    lt = aware.predicted["long_tail"]
    assert lt["groups"] == 8 and lt["long_mean_output_len"] > 3 * lt["regular_mean_output_len"]
    assert not any(r.long_tail for r in blind.replicas)


def test_plan_prints_the_split(plans):
    text = summary(plans[1])
    long = next(line for line in text.splitlines() if line.startswith("long    :"))
    assert "8 of 32 groups (alpha 0.25" in long and "max_running" in long
    assert "regular : 24 groups" in text
    assert "long    :" not in summary(plans[0])


def test_simulated_skew_aware_step_is_shorter_on_a_heavy_tail(plans):
    """Synchronous steps (eta 0) end with their longest group: on their own replicas at a small batch
    the long groups end sooner than mixed into full batches. Both arms draw the same workload: a
    quarter of each batch's groups long."""
    blind, aware = (simulate(p, steps=6, warmup=2, long_share=0.25) for p in plans)
    assert blind.step_time_s / aware.step_time_s > 1.0
    assert aware.tail_latency_s < blind.tail_latency_s
    assert sum(aware.tail_staleness.values()) == 6 * 8 * 8  # the long groups' trajectories, every step
    assert "long tail : the long groups took" in report(aware, plans[1])


def test_simulator_without_long_groups_draws_as_before(plans):
    """long_share 0 (the default for a plan without long-tail replicas) leaves the draws alone."""
    a = simulate(plans[0], steps=4, warmup=1)
    b = simulate(plans[0], steps=4, warmup=1, long_share=0.0)
    assert a.step_time_s == b.step_time_s and a.tail_staleness == {} and np.isfinite(a.step_time_s)


def test_hand_edited_long_tail_marks_simulate_as_the_controller_dispatches(plans):
    """Every replica marked long: the regular groups go to the long pool, as the controller's dispatcher
    hands a class with no replica to the other (the simulator raised KeyError). Marks in a plan whose job
    has no long tail are ignored, as the controller ignores them: the same run as without them."""
    blind, skewed = (p.to_dict() for p in plans)
    for r in skewed["rollout"]["replicas"]:
        r["long_tail"] = True
    assert simulate(load_plan(skewed, check_paths=False), 4, 1).tokens_per_s > 0
    marked = copy.deepcopy(blind)
    marked["rollout"]["replicas"][0]["long_tail"] = True
    as_marked, as_blind = (simulate(load_plan(p, check_paths=False), 4, 1) for p in (marked, blind))
    assert as_marked.tokens_per_s == as_blind.tokens_per_s


def small_cluster_job() -> dict:
    """heavy_job with the 7B model on one node of 4 L40S (whose memory limits its batches) and one of
    4 H20, long_tail caps up to 256, eta 2."""
    nodes = [{"name": "l40s-0", "gpu_type": "L40S", "gpus": 4}, {"name": "h20-0", "gpu_type": "H20", "gpus": 4}]
    return heavy_job(eta=2, model={"preset": "r1-distill-qwen-7b"},
                     long_tail={"alpha": 0.25, "caps": [32, 64, 128, 256]},
                     cluster={"nodes": nodes, "inter_node_GBps": 5, "cross_type_GBps": 1.5})


def test_every_sweep_bound_stays_under_the_two_class_step():
    """The sweep prunes a split whose lower bound cannot beat the best step and orders the rest by
    bounds of their estimates: with two length classes (the regular class's short samples decode
    faster than the one class's) each must still be at most the split's exact step and estimate,
    and makespan_bound at most the two-class makespan of the MILP's plan (it was 1.42x it on 3 free
    L40S, priced as one class). Every split of the cluster; a split where a type alone cannot hold both
    classes is estimated with the joint plan (its per-type plans do not exist)."""
    cm = CostModel(load_job(small_cluster_job(), check_paths=False))
    ev = Evaluator(cm)
    types = cm.cluster.types()
    grid = split_grid([cm.cluster.count(t) for t in types])
    train_lb, gen_lb, sync_lb = bound_parts(ev, types, grid)
    lb = lower_bounds(ev, types, grid)
    checked = 0
    for i, n in enumerate(grid):
        cand = ev.counts({t: int(v) for t, v in zip(types, n)})
        if cand is None:
            continue
        checked += 1
        assert lb[i] <= cand.step_s * (1 + 1e-9)
        up, levels = (None, i, 0, None), []
        while up is not None and up[2] < 3:
            up = _raise(ev, types, grid, i, up[2], up[3], train_lb[i], sync_lb[i])
            levels.append(up[0])
        assert levels == sorted(levels) and levels[-1] == ev.estimate(cand.per_node, ev.combined_rollout(cand.per_node))
        free = {t: cm.cluster.count(t) - int(v) for t, v in zip(types, n) if cm.cluster.count(t) > v}
        if len(free) == 1:
            assert makespan_bound(cm, *free.popitem()) <= cand.rollout.gen_s
    assert checked > 3


def test_gate_prices_each_length_class_by_what_it_holds_in_flight():
    """Under a binding gate (eta 1) the running groups split between the classes by Little's law, not
    by the share of groups handed out: long-tail replicas whose caps cannot hold the long class's
    share queue it, and the step waits for the long class at their full rate (priced as one class,
    cap 4 came out at 125 s against the 332 s its two replicas need for the long tokens)."""
    cm = CostModel(load_job(heavy_job(eta=1, long_tail={"alpha": 0.25, "caps": [4, 64]}), check_paths=False))

    def gen_s(cap: int) -> tuple[float, float]:
        """(gated generation, the long tokens at the long-tail replicas' full rate) with 2 H20 at cap."""
        long = [SimpleNamespace(gpu_type="H20", tp=1, batch=cap, share=0.25 / 2, long_tail=True)] * 2
        regular = [SimpleNamespace(gpu_type="H800", tp=1, batch=256, share=0.75 / 4, long_tail=False)] * 4
        full = 2 * cm.tail.long.decode_point("H20", 1, cap).tokens_per_s
        return cm.gated_gen_s(long + regular, 100.0, 5.0, at_least=1.0), cm.tail.long.w.gen_tokens / full

    for cap in (4, 8, 16, 64):
        gen, long_alone = gen_s(cap)
        assert gen >= long_alone * (1 - 1e-3)  # no class generates faster than its replicas running full
    assert gen_s(4)[0] == pytest.approx(gen_s(4)[1], rel=1e-3)  # the small cap: the long class's queue is the step
    assert gen_s(64)[0] < gen_s(16)[0] < gen_s(4)[0]


def test_rollout_solves_only_the_caps_that_can_win(monkeypatch):
    """One MILP per (cap, GPU type) is the slow part of planning a long tail: a try whose relaxed
    MILP already generates slower than 1% past the best plan solved is skipped, and the plan is the
    one solving every try gives."""
    cm = CostModel(load_job(heavy_job(eta=2, long_tail={"alpha": 0.25, "caps": [4, 8, 16, 64]}), check_paths=False))
    classes = free_classes(cm.cluster, (0,) * len(cm.cluster.nodes))
    solved = []
    every = rollout_milp._solve_rollout

    def counting(*args):
        solved.append(args[-1])
        return every(*args)

    monkeypatch.setattr(rollout_milp, "_solve_rollout", counting)
    plan = rollout_milp.solve_rollout(cm, classes)
    tries = [(cap, kind) for cap in cm.tail.caps for kind in ("H800", "H20")]
    assert 0 < len(solved) < len(tries)
    plans = [p for t in tries if (p := every(cm, classes, 4, None, t)) is not None]
    gen = [cm.gen_s(p.gen_s, p.wave_s, 0.0, 0.0) for p in plans]
    best = min((p for p, g in zip(plans, gen) if g <= 1.01 * min(gen)), key=cm.long_tail_wave_s)
    assert (plan.gen_s, plan.wave_s, plan.tokens_per_s) == (best.gen_s, best.wave_s, best.tokens_per_s)


def test_study_takes_a_runs_recorded_lengths(tmp_path, capsys):
    """--lengths RUN_DIR: the workload's output lengths are every sample length the run recorded."""
    rows = [{"step": 1, "problem_ids": [3, 3], "group_ids": [0, 0], "lengths": [12, 0]},
            {"step": 2, "problem_ids": [5, 5], "group_ids": [1, 1], "lengths": [300, 7]}]
    (tmp_path / "lengths.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lengths = recorded_lengths(tmp_path)
    assert lengths == [12, 1, 300, 7]  # an empty answer still takes a token
    job = load_job(job_dict("1.5b", 4, 0.2, lengths), check_paths=False)
    assert job.workload.output_len == {"samples": [12, 1, 300, 7]} and job.long_tail.alpha == 0.2
    assert study_main(["--lengths", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().out.strip().endswith("none/lengths.jsonl: no recorded lengths")
