"""Placing a split is arithmetic over a cluster's nodes by type (hexrl/plan/placement.py), so that a
search over thousands of nodes does not loop over every node per split: the same answers as placing
node by node, on clusters whose types interleave."""
import json
import random
import subprocess
import sys

import pytest
from runtime_utils import ROOT

from hexrl.plan import candidate
from hexrl.plan.candidate import Evaluator
from hexrl.plan.cost import CostModel
from hexrl.plan.partition import makespan_bound, two_phase
from hexrl.plan.placement import counts_of, free_classes, train_per_node
from hexrl.plan.rollout_milp import makespan
from hexrl.schema import ClusterSpec, NodeSpec, load_job
from tools.bench.bench_planner import cluster_job


def node_by_node(cluster: ClusterSpec, counts: dict[str, int]) -> tuple[int, ...]:
    left, out = dict(counts), []
    for n in cluster.nodes:
        take = min(n.gpus, left.get(n.gpu_type, 0))
        left[n.gpu_type] = left.get(n.gpu_type, 0) - take
        out.append(take)
    return tuple(out)


def classes_by_hand(cluster: ClusterSpec, per_node: tuple[int, ...]) -> list[tuple]:
    groups: dict = {}
    for i, n in enumerate(cluster.nodes):
        if n.gpus - per_node[i] > 0:
            groups.setdefault((n.gpu_type, n.gpus - per_node[i]), []).append(i)
    return [(t, f, tuple(nodes)) for (t, f), nodes in groups.items()]


def test_placement_by_type_matches_placing_node_by_node():
    rng = random.Random(0)
    for _ in range(200):
        gpus = rng.choice([1, 2, 8, 16])
        types = rng.sample(["H800", "H20", "H100", "A100-80G"], rng.randint(1, 4))
        cluster = ClusterSpec([NodeSpec(f"n{i}", rng.choice(types), gpus) for i in range(rng.randint(1, 40))])
        counts = {t: rng.randint(0, cluster.count(t)) for t in cluster.types()}
        per_node = train_per_node(cluster, counts)
        assert per_node == node_by_node(cluster, counts)
        assert counts_of(cluster, per_node) == {t: counts[t] for t in cluster.types()}
        assert [(c.gpu_type, c.free, c.nodes) for c in free_classes(cluster, per_node)] == \
            classes_by_hand(cluster, per_node)


def test_the_rollout_plan_memo_is_bounded_and_changes_no_answer(monkeypatch):
    """The search memoises rollout plans; past HELD_REPLICAS replicas it drops the least recently used
    (a sweep of a 65,536-GPU type solves thousands of plans of 16,000 replicas). A dropped plan is
    solved again: the same plan as with every plan kept."""
    cm = CostModel(load_job(cluster_job("r1-distill-qwen-7b", 128, 2), check_paths=False), use_profiles=False)
    kept = Evaluator(cm)
    best_kept, _ = two_phase(kept)
    monkeypatch.setattr(candidate, "HELD_REPLICAS", 40)
    bounded = Evaluator(cm)
    best, _ = two_phase(bounded)
    assert 0 < bounded._held <= 40 + max(len(p.replicas) for p in bounded._roll.values() if p)
    assert kept._held > 40 and len(bounded._roll) < len(kept._roll)
    assert (best.per_node, best.step_s) == (best_kept.per_node, best_kept.step_s)
    assert [(r.gpu_type, r.tp, r.batch, r.node, r.share) for r in best.rollout.replicas] == \
        [(r.gpu_type, r.tp, r.batch, r.node, r.share) for r in best_kept.rollout.replicas]


@pytest.mark.slow
def test_the_ceiling_cluster_is_planned_in_bounded_memory(tmp_path):
    """65,536 GPUs (4,096 nodes of 16, four types), the largest cluster a job may give, planned in a
    process limited to 3 GB of address space, in about 20 s of CPU (docs/planner.md; one type of that
    size still takes minutes)."""
    nodes = [{"name": f"{t.lower()}-{i}", "gpu_type": t, "gpus": 16}
             for t in ("H800", "H20", "H100", "A100-80G") for i in range(1024)]
    job = cluster_job("r1-distill-qwen-7b", 56, 4)
    job["cluster"]["nodes"] = nodes
    (tmp_path / "job.json").write_text(json.dumps(job))
    limit = "import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
    code = limit + "import sys; from hexrl.plan.__main__ import main; sys.exit(main())"
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "job.json"), "-o", str(tmp_path / "plan.json"),
                          "--no-profiles"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stderr[-2000:]
    assert len(json.loads((tmp_path / "plan.json").read_text())["ranks"]) == 65536


class CountingEvaluator(Evaluator):
    """An Evaluator that counts the combined rollout plans the sweep asks for (two MILPs each)."""

    combined = 0

    def combined_rollout(self, per_node):
        self.combined += 1
        return super().combined_rollout(per_node)


def test_one_type_sweep_bounds_the_rollout_before_solving_it():
    """256 GPUs of one type: no per-type plan is shared between splits, so the sweep bounds each
    split's step (exact training, partition.makespan_bound) before solving its rollout MILPs. The
    plan is the one the sweep found when it solved them for 99 splits (34 now)."""
    cm = CostModel(load_job(cluster_job("r1-distill-qwen-7b", 256, 1), check_paths=False), use_profiles=False)
    ev = CountingEvaluator(cm)
    best, _ = two_phase(ev)
    assert counts_of(cm.cluster, best.per_node) == {"H800": 76}
    assert best.step_s == pytest.approx(171.54966452699992, rel=1e-12)
    assert ev.combined <= 40


def test_makespan_bound_is_under_every_rollout_plan_and_close():
    """The relaxed bound never exceeds the makespan of the rollout MILP's plan on the same GPUs."""
    cm = CostModel(load_job(cluster_job("r1-distill-qwen-7b", 256, 1), check_paths=False), use_profiles=False)
    ev = Evaluator(cm)
    for n in (16, 100, 172, 248):
        plan = ev.rollout(train_per_node(cm.cluster, {"H800": 256 - n}))
        exact = makespan(cm, [cm.decode_point(r.gpu_type, r.tp, r.batch) for r in plan.replicas if r.share > 0])
        assert makespan_bound(cm, "H800", n) <= exact <= 1.1 * makespan_bound(cm, "H800", n)
