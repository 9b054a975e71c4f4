"""Plan quality: the two-phase planner's predicted step time is within 2% of exhaustive search
over every split, on random heterogeneous clusters drawn across the planner's whole space
(tools/experiments/plan_quality.py: 2-4 GPU types, 16-40 GPUs, 1.5B/7B/14B, eta in {0,1,2,4,8,inf}, links
0.2-50 GB/s). CI runs the clusters whose exhaustive search is quick; the slow tests add the
case once found 28% off (KNOWN_BAD) and more clusters; `python tools/experiments/plan_quality.py` runs 200."""


import pytest

from hexrl.plan.candidate import Evaluator
from hexrl.plan.cost import CostModel
from hexrl.plan.partition import exhaustive, n_splits, two_phase
from hexrl.schema import load_job
from tools.experiments.plan_quality import KNOWN_BAD, random_job


def seeds(max_splits: int, count: int, skip: int = 0) -> list[int]:
    """The first `count` seeds (after `skip`) whose cluster has at most max_splits splits."""
    out, seed = [], 0
    while len(out) < skip + count:
        cm = CostModel(load_job(random_job(seed)), use_profiles=False)
        if n_splits(Evaluator(cm)) <= max_splits:
            out.append(seed)
        seed += 1
    return out[skip:]


def check(job: dict):
    cm = CostModel(load_job(job), use_profiles=False)
    assert 2 <= len(cm.cluster.types()) <= 4 and 16 <= cm.cluster.world_size <= 40
    best, _ = exhaustive(Evaluator(cm))
    ev = Evaluator(cm)
    ours, log = two_phase(ev)
    if best is None:
        assert ours is None
        return
    assert ours is not None
    assert ours.step_s <= best.step_s * 1.02, (ev.counts_of(ours.per_node), ev.counts_of(best.per_node))
    assert ours.step_s >= best.step_s * (1 - 1e-9)  # exhaustive really is the optimum
    assert log.evaluations <= n_splits(ev)


@pytest.mark.parametrize("seed", seeds(max_splits=90, count=4))
def test_two_phase_within_two_percent_of_exhaustive(seed):
    check(random_job(seed))


@pytest.mark.slow
@pytest.mark.parametrize("seed", seeds(max_splits=800, count=12, skip=0))
def test_two_phase_within_two_percent_of_exhaustive_larger(seed):
    check(random_job(seed))


@pytest.mark.slow
def test_h100_a100_rtx4090_cluster_plans_within_2_percent_of_exhaustive():
    check(KNOWN_BAD)


# Clusters where the planner was more than 2% off before the estimate sweep (tools/experiments/plan_quality.py,
# 7 of 200; seed: ratio): its lower bounds ranked the optimum's split 109th to 2,332nd, and the
# budget ran out first. The two quickest run in CI; the others with -m slow (214, at 1.147 the
# worst, and 9 and 11 take minutes of exhaustive search: the 200-cluster run covers them).
@pytest.mark.parametrize("seed", [88, 110])  # 1.027, 1.053
def test_former_misses(seed):
    check(random_job(seed))


# 97 and 167: misses before the estimate sweep; 152: the one miss after it (1.030, eta = 2: the
# gate caps running sequences and the optimum's estimate came out 11% pessimistic), within 2%
# since the wave's course is a renewal (hexrl/plan/wave.py), which moved the estimates.
@pytest.mark.slow
@pytest.mark.parametrize("seed", [97, 167, 152])  # 1.076, 1.057, 1.030
def test_former_misses_slower(seed):
    check(random_job(seed))
