"""Plan quality: the two-phase planner against exhaustive search on random heterogeneous clusters.

    python tools/experiments/plan_quality.py [--clusters 200] [--seed 0] [--max-splits 3000] [--exhaustive-cache F]

Clusters are drawn across the planner's whole space: 2-4 GPU types, 16-40 GPUs in nodes of 4 or 8,
1.5B / 7B / 14B models, eta in {0, 1, 2, 4, 8, unbounded}, links 0.2-50 GB/s (log-uniform),
batch x group from 8x8 to 64x16, long-tailed outputs. For each, both searches cost the same
model; the table lists the step-time ratio (two-phase / exhaustive; 1.0 is optimal) and the
wall-time ratio, and the summary the worst ratio and the share within 2%. `random_job(seed)`
is shared with tests/test_plan_quality.py. Splits above --max-splits are skipped (exhaustive
would take minutes each on this machine). --exhaustive-cache keeps each cluster's exhaustive
optimum (split and step time) in a JSON file and reuses it on a later run only where costing that
split now gives the same step time (else exhaustive runs again): a change to the search alone is
then checked in minutes, not the 45 of exhaustive search.
"""

import argparse
import json
import math
import random
import time
from pathlib import Path

from hexrl.plan.candidate import Evaluator
from hexrl.plan.cost import CostModel
from hexrl.plan.partition import exhaustive, n_splits, two_phase
from hexrl.schema import load_job

TYPES = ["H100", "H200", "H800", "H20", "A100-80G", "L40S", "RTX4090"]
MODELS = ["r1-distill-qwen-1.5b", "r1-distill-qwen-7b", "r1-distill-qwen-14b"]

# A cluster once planned 28% off (docs/planner.md): 16 H100 + 8 A100-80G + 8 RTX4090, 7B, 16 x 16, eta = 1
KNOWN_BAD = {
    "model": {"preset": "r1-distill-qwen-7b"}, "data": {"synthetic": {}},
    "rl": {"batch_size": 16, "group_size": 16, "max_new_tokens": 2048, "eta": 1, "ppo_minibatches": 1},
    "workload": {"prompt_len": 256, "output_len": {"mean": 1229, "max": 2048}},
    "cluster": {"nodes": [{"name": f"n{i}", "gpu_type": t, "gpus": 8}
                          for i, t in enumerate(["H100", "H100", "A100-80G", "RTX4090"])],
                "inter_node_GBps": 5.0, "cross_type_GBps": 1.5},
}


def random_job(seed: int) -> dict:
    """One random cluster and workload from the space above (deterministic in `seed`)."""
    rng = random.Random(seed)
    gpn = rng.choice([4, 8])
    n_nodes = rng.randint(max(2, math.ceil(16 / gpn)), 40 // gpn)
    kinds = rng.sample(TYPES, min(n_nodes, rng.randint(2, 4)))
    nodes = [{"name": f"n{i}", "gpu_type": kinds[i] if i < len(kinds) else rng.choice(kinds), "gpus": gpn}
             for i in range(n_nodes)]
    link = lambda: round(math.exp(rng.uniform(math.log(0.2), math.log(50))), 2)  # noqa: E731
    max_new = rng.choice([2048, 4096, 8192])
    return {
        "model": {"preset": rng.choice(MODELS)}, "data": {"synthetic": {}},
        "rl": {"batch_size": rng.choice([8, 16, 32, 64]), "group_size": rng.choice([8, 16]),
               "max_new_tokens": max_new, "eta": rng.choice([0, 1, 2, 4, 8, None]),
               "ppo_minibatches": rng.choice([1, 2, 4])},
        "workload": {"prompt_len": rng.choice([128, 256, 512]),
                     "output_len": {"mean": round(max_new * rng.uniform(0.2, 0.65)), "max": max_new}},
        "cluster": {"nodes": nodes, "inter_node_GBps": link(), "cross_type_GBps": link()},
    }


def exhaustive_optimum(cm: CostModel, cached: dict | None) -> dict:
    """Exhaustive search's optimum {"per_node", "step_s", "t_exh"} (per_node None if nothing fits),
    from `cached` if costing its split now gives its step time, else searched again."""
    if cached is not None:
        if cached["per_node"] is None:
            return cached  # nothing fit; two-phase must find nothing either (checked by the caller)
        cand = Evaluator(cm)(tuple(cached["per_node"]))
        if cand is not None and abs(cand.step_s - cached["step_s"]) <= 1e-9 * cached["step_s"]:
            return cached
    t0 = time.perf_counter()
    best, _ = exhaustive(Evaluator(cm))
    return {"per_node": list(best.per_node) if best else None, "step_s": best.step_s if best else None,
            "t_exh": time.perf_counter() - t0}


def compare(job: dict, cached: dict | None = None) -> dict | None:
    """Both searches on one job: step times, wall times, splits; None if nothing fits."""
    cm = CostModel(load_job(job), use_profiles=False)
    t0 = time.perf_counter()
    ours, log = two_phase(Evaluator(cm))
    t_ours = time.perf_counter() - t0
    best = exhaustive_optimum(cm, cached)
    if best["per_node"] is None:
        return None if ours is None else {"error": "two-phase found a plan exhaustive did not", "exh": best}
    return {"ratio": (ours.step_s if ours else math.inf) / best["step_s"], "t_ours": t_ours,
            "t_exh": best["t_exh"], "splits": n_splits(Evaluator(cm)), "evaluations": log.evaluations,
            "gpus": cm.cluster.world_size, "types": len(cm.cluster.types()), "exh": best}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clusters", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-splits", type=int, default=3000)
    ap.add_argument("--exhaustive-cache", type=Path, help="JSON of exhaustive optima to reuse and extend")
    args = ap.parse_args()
    cache = json.loads(args.exhaustive_cache.read_text()) if args.exhaustive_cache and \
        args.exhaustive_cache.exists() else {}

    def save(key: str, r: dict | None):
        if args.exhaustive_cache is None:
            return
        cache[key] = r["exh"] if r else {"per_node": None, "step_s": None, "t_exh": 0.0}
        args.exhaustive_cache.write_text(json.dumps(cache, indent=0))

    rows = []
    known = compare(KNOWN_BAD, cache.get("known"))
    save("known", known)
    print(f"known bad case: two-phase / exhaustive {known['ratio']:.4f}, {known['t_ours']:.2f} s vs "
          f"{known['t_exh']:.2f} s", flush=True)
    seed = args.seed
    while len(rows) < args.clusters:
        job = random_job(seed)
        seed += 1
        cm = CostModel(load_job(job), use_profiles=False)
        if n_splits(Evaluator(cm)) > args.max_splits:
            continue
        r = compare(job, cache.get(str(seed - 1)))
        save(str(seed - 1), r)
        if r is None:
            continue
        rows.append(r)
        print(f"seed {seed - 1:>4}: {r['gpus']:>2} GPUs {r['types']} types {r['splits']:>5} splits  "
              f"ratio {r['ratio']:.4f}  two-phase {r['t_ours']:6.2f} s  exhaustive {r['t_exh']:6.2f} s", flush=True)
    ratios = sorted(r["ratio"] for r in rows)
    big = [r for r in rows if r["t_exh"] >= 5]
    print(f"\n{len(rows)} clusters: worst ratio {ratios[-1]:.4f}, within 2%: {sum(x <= 1.02 for x in ratios)}, "
          f"exact: {sum(x <= 1 + 1e-9 for x in ratios)}")
    tr = sorted(r["t_ours"] / r["t_exh"] for r in rows)
    print(f"time two-phase / exhaustive: median {tr[len(tr) // 2]:.2f}, worst {tr[-1]:.2f}")
    if big:
        tb = sorted(r["t_ours"] / r["t_exh"] for r in big)
        print(f"on the {len(big)} clusters where exhaustive takes >= 5 s: median {tb[len(tb) // 2]:.2f}, "
              f"worst {tb[-1]:.2f}")


if __name__ == "__main__":
    main()
