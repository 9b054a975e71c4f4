"""Simulated throughput for the AReaL-Hex paper's settings, with the paper's ratios beside ours.

    python tools/paper_table.py [--steps 8] [--no-sim]

Rows: 1.5B / 7B / 14B R1-Distill-Qwen. Columns: 32 H800, 88 H20, 24 H800 + 24 H20 (equal
budgets at $5.28/h and $1.85/h), each planned by the two-phase planner and then simulated;
plus the resource-allocation ablation on 24 H800 (planned vs uniform allocation, Table 3).
Paper (Figure 3, Table 3): hetero/H800 1.31-1.50x, hetero/H20 2.29-2.76x, planned/uniform 1.57-1.68x.
"""

import argparse
import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hexrl.schema import load_job  # noqa: E402
from hexrl.plan.planner import plan_job  # noqa: E402
from hexrl.plan.simulate import simulate  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"
PAPER = {"hetero/H800": (1.31, 1.50), "hetero/H20": (2.29, 2.76), "planned/uniform": (1.57, 1.68)}
PAPER_ROWS = {  # per model, where the paper gives them (Figure 3 text, Table 3)
    "1.5b": {"planned/uniform": 1.57}, "7b": {"hetero/H800": 1.31, "hetero/H20": 2.76, "planned/uniform": 1.68},
    "14b": {"hetero/H800": 1.50, "hetero/H20": 2.29, "planned/uniform": 1.67},
}


def throughput(job: dict, method: str, steps: int, sim: bool) -> tuple[float, float]:
    """(predicted, simulated) tokens/s of the plan `method` finds for `job`."""
    plan = plan_job(load_job(job, check_paths=False), method)
    pred = plan.predicted["tokens_per_s"]
    return pred, simulate(plan, steps=steps, warmup=2).tokens_per_s if sim else pred


def h800_24(job: dict) -> dict:
    job = copy.deepcopy(job)
    job["cluster"]["nodes"] = job["cluster"]["nodes"][:3]
    return job


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--no-sim", action="store_true", help="planner predictions only")
    args = ap.parse_args()
    sim = not args.no_sim
    kind = "simulated" if sim else "predicted"
    print(f"tokens/s ({kind}; planner prediction in brackets)")
    print(f"{'model':<6} {'32 H800':>22} {'88 H20':>22} {'24 H800+24 H20':>22} {'24 H800':>22} {'24 H800 uniform':>22}")
    ratios = {}
    for size in ["1.5b", "7b", "14b"]:
        jobs = {k: json.loads((CONFIGS / f"paper_{size}_{k}.json").read_text()) for k in ("h800", "h20", "hetero")}
        res = {k: throughput(j, "two-phase", args.steps, sim) for k, j in jobs.items()}
        res["h800_24"] = throughput(h800_24(jobs["h800"]), "two-phase", args.steps, sim)
        res["uniform_24"] = throughput(h800_24(jobs["h800"]), "uniform", args.steps, sim)
        cells = " ".join(f"{s:>11.0f} [{p:>8.0f}]" for p, s in res.values())
        print(f"{size:<6} {cells}", flush=True)
        ratios[size] = {"hetero/H800": res["hetero"][1] / res["h800"][1],
                        "hetero/H20": res["hetero"][1] / res["h20"][1],
                        "planned/uniform": res["h800_24"][1] / res["uniform_24"][1]}
    print(f"\nratios ({kind})")
    print(f"{'model':<6} " + " ".join(f"{k:>16} {'paper':>7} {'diff':>6}" for k in PAPER))
    for size, r in ratios.items():
        cells = []
        for k, v in r.items():
            paper = PAPER_ROWS[size].get(k)
            diff = f"{v / paper - 1:+.0%}" if paper else ""
            cells.append(f"{v:>15.2f}x {paper or '':>7} {diff:>6}")
        print(f"{size:<6} " + " ".join(cells))
    print("paper ranges: " + ", ".join(f"{k} {lo:.2f}-{hi:.2f}x" for k, (lo, hi) in PAPER.items()))


if __name__ == "__main__":
    main()
