"""Cost models and the search-phase solvers, each against an independent reference:
hand arithmetic, brute-force enumeration, or the full cost model (for the lower bounds)."""

import itertools
import random

import pytest

from hexrl.gpus import PAPER_DECODE_FACTOR
from hexrl.plan.candidate import Evaluator
from hexrl.plan.cost import CostModel, StageCoeffs
from hexrl.plan.partition import lower_bounds, split_grid
from hexrl.plan.placement import FreeClass, free_classes, train_per_node
from hexrl.plan.rollout_milp import _columns, _solve
from hexrl.plan.train_search import assign_layers
from hexrl.schema import load_job


def job(nodes, model="r1-distill-qwen-1.5b", **rl):
    return load_job({
        "model": {"preset": model}, "data": {"synthetic": {}},
        "rl": {"batch_size": 64, "group_size": 8, "max_new_tokens": 4096, "eta": 2, **rl},
        "workload": {"prompt_len": 256, "output_len": {"mean": 1500, "max": 4096}},
        "cluster": {"nodes": nodes, "inter_node_GBps": 5, "cross_type_GBps": 1.5},
    })


def nodes(*spec, gpus=8):
    return [{"name": f"n{i}", "gpu_type": t, "gpus": gpus} for i, t in enumerate(spec)]


def test_decode_step_is_the_hbm_roofline_at_batch_one():
    cm = CostModel(job(nodes("H20")), use_profiles=False)
    pt = cm.decode_point("H20", 1, 1)
    # by hand: 28 layers x 46.8M + 233M head params, bf16, over 4 TB/s x 0.75; KV of one sequence
    weights = 2 * (28 * 46_797_824 + 151_936 * 1536)
    kv = 2 * 28 * 2 * 128 * 2 * cm.w.ctx_decode
    f = PAPER_DECODE_FACTOR["H20"]  # the paper-calibrated share of the roofline (hexrl/gpus.py)
    expect = (2e-3 + (weights + kv) / (4e12 * 0.75)) / f
    assert pt.step_s == pytest.approx(expect, rel=1e-6)


def test_kv_capacity_fits_memory():
    cm = CostModel(job(nodes("H800")), use_profiles=False)
    for tp in cm.tp_options("H800"):
        b = cm.max_decode_batch("H800", tp)
        per_gpu = 2 * cm.m.num_params / tp + b * cm.w.ctx_decode * cm.kv_bytes_per_token(tp)
        assert 0 < b and per_gpu <= cm.usable_bytes("H800")
    assert cm.tp_options("H800") == [1, 2, 4]  # 12 heads: 8 does not divide


def test_layer_assignment_matches_brute_force():
    rng = random.Random(0)
    for _ in range(40):
        p, n_layers = rng.randint(1, 4), rng.randint(4, 12)
        coeffs = [StageCoeffs(rng.uniform(0.5, 3), rng.uniform(0, 5), rng.randint(1, n_layers)) for _ in range(p)]
        best = None
        for split in itertools.product(range(1, n_layers + 1), repeat=p):
            if sum(split) == n_layers and all(l <= c.max_layers for l, c in zip(split, coeffs)):
                t = max(c.per_layer * l + c.fixed for l, c in zip(split, coeffs))
                best = t if best is None else min(best, t)
        got = assign_layers(coeffs, n_layers)
        if best is None:
            assert got is None
        else:
            assert max(c.per_layer * l + c.fixed for l, c in zip(got, coeffs)) == pytest.approx(best)


def brute_force_rollout(cm, classes, cols, rates, concurrency):
    """Best total token rate by trying every packing of every node (tiny cases only)."""
    per_class = []
    for ci, c in enumerate(classes):
        mine = [j for j, (cj, _) in enumerate(cols) if cj == ci]
        options = []  # multisets of columns whose TP sizes fill one node exactly
        for k in range(c.free + 1):
            for combo in itertools.combinations_with_replacement(mine, k):
                if sum(cols[j][1].tp for j in combo) == c.free:
                    options.append(combo)
        per_class.append([sum((list(o) for o in pick), []) for pick in
                          itertools.combinations_with_replacement(options, len(c.nodes))])
    best = 0.0
    for choice in itertools.product(*per_class):
        used = [j for part in choice for j in part]
        if concurrency is None or sum(cols[j][1].batch for j in used) <= concurrency:
            best = max(best, sum(rates[j] for j in used))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_rollout_milp_matches_brute_force(seed):
    rng = random.Random(seed)
    cm = CostModel(job(nodes("H20", "L40S", gpus=4), batch_size=rng.choice([2, 4, 8]), eta=rng.choice([0, 1])),
                   use_profiles=False)
    classes = [FreeClass("H20", rng.choice([2, 3, 4]), (0,)), FreeClass("L40S", rng.choice([1, 2, 4]), (1,))]
    concurrency = (cm.w.eta + 1) * cm.w.samples
    cols, _ = _columns(cm, classes, concurrency)
    rates = [pt.tokens_per_s for _, pt in cols]
    y, sol = _solve(cm, classes, cols, rates, concurrency)
    assert sol[-1] == pytest.approx(brute_force_rollout(cm, classes, cols, rates, concurrency), rel=1e-6)
    for ci, c in enumerate(classes):  # every rollout GPU is in a replica
        assert sum(cols[j][1].tp * y[j] for j in range(len(cols)) if cols[j][0] == ci) == c.free


def test_training_packs_nodes_and_rollout_takes_the_rest():
    c = job(nodes("H800", "H800", "H20", "H20")).cluster
    per_node = train_per_node(c, {"H800": 12, "H20": 2})
    assert per_node == (8, 4, 2, 0)
    assert [(f.gpu_type, f.free, f.nodes) for f in free_classes(c, per_node)] == \
        [("H800", 4, (1,)), ("H20", 6, (2,)), ("H20", 8, (3,))]


def test_memory_caps_hold_for_the_chosen_layout():
    cm = CostModel(job(nodes("L40S", "L40S"), model="r1-distill-qwen-7b"), use_profiles=False)
    cand = Evaluator(cm)(train_per_node(cm.cluster, {"L40S": 8}))
    assert cand is not None
    L = cm.m.num_hidden_layers
    for i, s in enumerate(cand.train.stages):  # weights + grads + Adam of the stage fit one GPU
        edge = cm.head_params() * ((i == 0) + (i == cand.train.pp - 1))
        assert (s.layers * cm.layer_params + edge) * 18 / s.tp < cm.usable_bytes("L40S")
    assert sum(s.layers for s in cand.train.stages) == L


@pytest.mark.parametrize("spec", [("H800", "H20"), ("A100-80G", "L40S", "RTX4090"), ("H100", "H20")])
def test_lower_bounds_never_exceed_the_cost_model(spec):
    for eta in (0, 2):
        cm = CostModel(job(nodes(*spec, gpus=4), eta=eta), use_profiles=False)
        ev = Evaluator(cm)
        types = cm.cluster.types()
        grid = split_grid([cm.cluster.count(t) for t in types])
        lb = lower_bounds(ev, types, grid)
        checked = 0
        for n, bound in zip(grid, lb):
            cand = ev.counts({t: int(v) for t, v in zip(types, n)})
            if cand is not None:
                assert bound <= cand.step_s * (1 + 1e-9)
                checked += 1
        assert checked > 3


def test_more_rollout_gpus_never_slow_generation():
    cm = CostModel(job(nodes("H20", "H20")), use_profiles=False)
    ev = Evaluator(cm)
    gens = [ev.rollout(train_per_node(cm.cluster, {"H20": k})).gen_s for k in range(1, 15)]
    assert all(a >= b * (1 - 1e-6) for a, b in zip(gens[1:], gens))


def test_per_type_plans_combine_into_one_rollout():
    """The planner's sweep estimates a split with one small MILP per GPU type: combined, the
    replicas keep their types' token rates as shares, the makespan is the recompute fixed point
    of all of them, and on the H800 + H20 cluster the estimates pick the exhaustive optimum."""
    from hexrl.plan.partition import exhaustive
    from hexrl.plan.rollout_milp import combine, makespan, solve_rollout
    cm = CostModel(job(nodes("H800", "H20", gpus=4), eta=4), use_profiles=False)
    ev = Evaluator(cm)
    per_node = train_per_node(cm.cluster, {"H800": 2, "H20": 2})
    by_type = [[c] for c in free_classes(cm.cluster, per_node)]
    plans = [solve_rollout(cm, cs) for cs in by_type]
    both = combine(cm, plans)
    assert sum(r.share for r in both.replicas) == pytest.approx(1.0)
    h800 = sum(r.share for r in both.replicas if r.gpu_type == "H800")
    assert h800 == pytest.approx(plans[0].tokens_per_s / sum(p.tokens_per_s for p in plans))
    points = [cm.decode_point(r.gpu_type, r.tp, r.batch) for r in both.replicas]
    assert both.theta_s == pytest.approx(makespan(cm, points))
    assert both.theta_s < min(p.theta_s for p in plans)  # both types together are faster than either
    splits = [train_per_node(cm.cluster, {"H800": a, "H20": b}) for a in range(5) for b in range(5)]
    estimates = {s: ev.estimate(s, r) for s in splits if (r := ev.combined_rollout(s)) is not None}
    best, _ = exhaustive(Evaluator(cm))
    assert min(estimates, key=estimates.get) == best.per_node
