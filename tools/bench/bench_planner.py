"""Planner wall time vs cluster size, beside exhaustive search where that is feasible.

    python tools/bench/bench_planner.py [--model r1-distill-qwen-7b] [--exhaustive-limit 5000]

Clusters: 56 GPUs of two types (24 H800 + 32 H20, the paper's largest case study) and 512 GPUs
of four types (128 each of H100, H800, H20, A100-80G). Targets on a 2-core CPU: < 2 s and < 30 s.
Exhaustive search is timed twice: costing every split, and pruned (a split's rollout MILP is
skipped once its training alone is slower than the best step found; same answer).
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hexrl.plan.candidate import Evaluator  # noqa: E402
from hexrl.plan.cost import CostModel  # noqa: E402
from hexrl.plan.partition import exhaustive, n_splits, two_phase  # noqa: E402
from hexrl.schema import load_job  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def cluster_job(model: str, groups: list[tuple[str, int]]) -> dict:
    base = json.loads((CONFIGS / "paper_7b_hetero.json").read_text())
    nodes = [{"name": f"{t.lower()}-{i}", "gpu_type": t, "gpus": 8} for t, n in groups for i in range(n // 8)]
    base.update(model={"preset": model}, cluster={"nodes": nodes, "inter_node_GBps": 5.0, "cross_type_GBps": 1.5},
                prices={})
    return base


def bench(name: str, job: dict, exhaustive_limit: int):
    cm = CostModel(load_job(job, check_paths=False), use_profiles=False)
    ev = Evaluator(cm)
    t0 = time.perf_counter()
    ours, log = two_phase(ev)
    t_ours = time.perf_counter() - t0
    splits = n_splits(ev)
    line = (f"{name:<28} {cm.cluster.world_size:>4} GPUs  two-phase {t_ours:7.2f} s "
            f"({log.evaluations} splits costed, step {ours.step_s:8.1f} s)")
    if splits <= exhaustive_limit:
        times = {}
        for prune in (True, False):
            t0 = time.perf_counter()
            best, _ = exhaustive(Evaluator(cm), prune=prune)
            times[prune] = time.perf_counter() - t0
        line += (f"\n{'':<28} exhaustive over {splits} splits: {times[False]:7.2f} s "
                 f"({times[False] / t_ours:.1f}x slower), pruned {times[True]:.2f} s "
                 f"({times[True] / t_ours:.1f}x); quality (exhaustive step / ours) {best.step_s / ours.step_s:.4f}")
    else:
        per = t_ours / max(1, log.evaluations)
        line += f" | exhaustive skipped: {splits:,} splits (~{splits * per / 3600:,.0f} h at {per * 1e3:.0f} ms each)"
    print(line, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="r1-distill-qwen-7b")
    ap.add_argument("--exhaustive-limit", type=int, default=5000, help="largest split count to enumerate")
    args = ap.parse_args()
    bench("56 GPUs: 24 H800 + 32 H20", cluster_job(args.model, [("H800", 24), ("H20", 32)]), args.exhaustive_limit)
    bench("512 GPUs: 4 types x 128", cluster_job(args.model, [("H100", 128), ("H800", 128), ("H20", 128),
                                                               ("A100-80G", 128)]), args.exhaustive_limit)


if __name__ == "__main__":
    main()
