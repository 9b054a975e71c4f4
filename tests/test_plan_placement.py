"""Placing a split is arithmetic over a cluster's nodes by type (hexrl/plan/placement.py), so that a
search over thousands of nodes does not loop over every node per split: the same answers as placing
node by node, on clusters whose types interleave."""
import json
import random
import subprocess
import sys

import pytest
from runtime_utils import ROOT

from hexrl.plan import candidate, rollout_milp
from hexrl.plan.candidate import Evaluator
from hexrl.plan.cost import CostModel
from hexrl.plan.partition import TYPE_POINTS, makespan_bound, split_grid, two_phase
from hexrl.plan.placement import counts_of, free_classes, train_per_node
from hexrl.plan.rollout_milp import makespan, repeated_sum
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
    """The search memoises rollout plans; past HELD_NODES nodes it drops the least recently used
    (a sweep of a 4,096-node type solves thousands of plans). A dropped plan is solved again: the
    same plan as with every plan kept."""
    cm = CostModel(load_job(cluster_job("r1-distill-qwen-7b", 128, 2), check_paths=False), use_profiles=False)
    kept = Evaluator(cm)
    best_kept, _ = two_phase(kept)
    monkeypatch.setattr(candidate, "HELD_NODES", 40)
    bounded = Evaluator(cm)
    best, _ = two_phase(bounded)
    assert 0 < bounded._roll.held <= 40 + max(len(p.nodes) for p in bounded._roll.entries.values() if p)
    assert kept._roll.held > 40 and len(bounded._roll.entries) < len(kept._roll.entries)
    assert (best.per_node, best.step_s) == (best_kept.per_node, best_kept.step_s)
    assert [(r.gpu_type, r.tp, r.batch, r.node, r.share) for r in best.rollout.replicas] == \
        [(r.gpu_type, r.tp, r.batch, r.node, r.share) for r in best_kept.rollout.replicas]


def plan_in_a_bounded_process(tmp_path, job: dict, cpu_s: int) -> dict:
    """`python -m hexrl.plan` on `job` in a process limited to 3 GB of address space and cpu_s of CPU."""
    (tmp_path / "job.json").write_text(json.dumps(job))
    limit = (f"import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
             f"resource.setrlimit(resource.RLIMIT_CPU, ({cpu_s}, {cpu_s})); ")
    code = limit + "import sys; from hexrl.plan.__main__ import main; sys.exit(main())"
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "job.json"), "-o", str(tmp_path / "plan.json"),
                          "--no-profiles"], cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads((tmp_path / "plan.json").read_text())


@pytest.mark.slow
def test_the_ceiling_cluster_is_planned_in_bounded_memory(tmp_path):
    """65,536 GPUs (4,096 nodes of 16, four types), the largest cluster a job may give, planned in a
    process limited to 3 GB of address space, in about 20 s of CPU (docs/planner.md)."""
    job = cluster_job("r1-distill-qwen-7b", 65536, 4, node_gpus=16)
    assert len(plan_in_a_bounded_process(tmp_path, job, 600)["ranks"]) == 65536


@pytest.mark.slow
def test_the_ceiling_cluster_of_one_gpu_type_is_planned_in_bounded_time_and_memory(tmp_path):
    """65,536 GPUs of one type (4,096 nodes of 16 H800, the 1.5B model): no rollout plan is shared
    between its splits, so what bounds the sweep is the grid (2,049 counts of the type), plans held
    as replica kinds and the memos' bounds (docs/planner.md, the ceiling)."""
    job = cluster_job("r1-distill-qwen-1.5b", 65536, 1, node_gpus=16)
    plan = plan_in_a_bounded_process(tmp_path, job, 600)
    assert len(plan["ranks"]) == 65536 and {r["gpu_type"] for r in plan["ranks"]} == {"H800"}


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


def test_the_search_places_only_the_plan_it_writes(monkeypatch):
    """Rollout plans hold replica kinds with counts; replicas are placed on nodes only when the
    written plan asks for them, and the plan is the one of placing every costed plan's replicas
    (the code before: the split, step time and every replica as pinned here)."""
    placed = []

    def counting_place(*args):
        placed.append(args)
        return place(*args)

    place = rollout_milp._place
    monkeypatch.setattr(rollout_milp, "_place", counting_place)
    cm = CostModel(load_job(cluster_job("r1-distill-qwen-7b", 256, 1), check_paths=False), use_profiles=False)
    best, _ = two_phase(Evaluator(cm))
    assert placed == [] and best.rollout.count == 45
    replicas = best.rollout.replicas
    assert len(placed) == 1 and best.rollout.replicas is replicas  # placed once, then kept
    assert counts_of(cm.cluster, best.per_node) == {"H800": 76} and best.step_s == 171.54966452699992
    assert {(r.gpu_type, r.tp, r.batch, r.share) for r in replicas} == {("H800", 4, 256, 0.022222222222222206)}
    assert [(r.node, r.locals) for r in replicas[:3]] == [(9, [4, 5, 6, 7]), (10, [0, 1, 2, 3]), (10, [4, 5, 6, 7])]
    assert [(r.node, r.locals) for r in replicas[-1:]] == [(31, [4, 5, 6, 7])]


def test_a_repeated_sum_adds_as_sum_does():
    """Kinds with counts give the same sums as the replicas one by one, bit for bit (exact plans)."""
    rng = random.Random(1)
    for _ in range(200):
        values = [rng.uniform(0, 1e5) for _ in range(rng.randint(1, 6))]
        counts = [rng.randint(0, 3000) for _ in values]
        assert repeated_sum(values, counts) == sum(v for v, c in zip(values, counts) for _ in range(c))


def test_the_grid_holds_at_most_type_points_counts_of_a_type():
    """One GPU type of 65,536 GPUs offers the sweep 2,049 counts (steps of 32), not 65,537; a type of
    2,048 GPUs or fewer keeps every count, so plans there are unchanged."""
    assert split_grid([2048])[:, 0].tolist() == list(range(2049))
    assert split_grid([65536])[:, 0].tolist() == list(range(0, 65537, 32))
    grid = split_grid([65528, 8])
    assert len(set(grid[:, 0])) == TYPE_POINTS and len(set(grid[:, 1])) == 9


def test_makespan_bound_is_under_every_rollout_plan_and_close():
    """The relaxed bound never exceeds the makespan of the rollout MILP's plan on the same GPUs."""
    cm = CostModel(load_job(cluster_job("r1-distill-qwen-7b", 256, 1), check_paths=False), use_profiles=False)
    ev = Evaluator(cm)
    for n in (16, 100, 172, 248):
        plan = ev.rollout(train_per_node(cm.cluster, {"H800": 256 - n}))
        exact = makespan(cm, [cm.decode_point(r.gpu_type, r.tp, r.batch) for r in plan.replicas if r.share > 0])
        assert makespan_bound(cm, "H800", n) <= exact <= 1.1 * makespan_bound(cm, "H800", n)
