"""The planner's step with and without the host costs, for the paper's 1.5B job on bench_planner's
clusters: is a plan host-bound by the cost model's own accounting?

    python -m tools.bench.bench_host_plan [--gpus 512,4096] [--model r1-distill-qwen-1.5b]

Each row plans the job (two-phase search, the shipped GPU profiles, as python -m hexrl.plan does) under one set of
host costs (hexrl.gpus.Host) and one share of a core for the controller: none (every host cost 0),
the costs measured before the typed-array ingest and hand-off (old), and the defaults (new). The
controller's load is its work per step over its share of a core's time; a plan is host-bound
where that reaches 100% or the trainer's hand-off is half the step. The last column prices the
plan made without host costs (the first row of each size) with these: how far over its step the
host terms would take it.
"""

import argparse
from dataclasses import asdict

from hexrl.gpus import HOST_FIELDS, Host
from hexrl.plan.planner import plan_job
from hexrl.schema import load_job
from tools.bench.bench_planner import cluster_job

# The code before: the controller's end-to-end fit and the trainer's hand-off per trained token
# (shared/notes/2026-11-29-host-path-at-scale.md: 344 us + 401 ns per token; ~1.0-1.15 us per token,
# serial on every trainer rank), dispatch and publish of the old Dispatcher and broadcast at 1,024
# replicas (docs/fast-paths.md, bench_controller_scale: 303 us a group, 12.0 ms a version).
OLD = {"controller_us_per_traj": 344.0, "controller_ns_per_token": 401.0, "controller_us_per_group": 303.0,
       "publish_us_per_replica": 11.7, "handoff_ns_per_token_rank0": 1075.0, "handoff_ns_per_token_other": 0.0}
COSTS = {"none": {k: 0.0 for k in HOST_FIELDS if k != "controller_core_share"}, "old": OLD,
         "new": {k: v for k, v in asdict(Host()).items() if k != "controller_core_share"}}


def row(model: str, gpus: int, costs: str, share: float) -> dict:
    """Plan the job under these host costs; its step and host figures."""
    job = cluster_job(model, gpus, 4)
    job["workload"]["host"] = {**COSTS[costs], "controller_core_share": share}
    plan = plan_job(load_job(job, check_paths=False))
    p = plan.predicted
    return {"gpus": gpus, "costs": costs, "share": share, "step_s": p["step_time_s"], **p["host"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default="512,4096")
    ap.add_argument("--model", default="r1-distill-qwen-1.5b")
    args = ap.parse_args(argv)
    print("| GPUs | host costs | controller's share of a core | step s | controller s a step | its load "
          "| hand-off s | its share of the step | host-bound | on the plan without: controller load, hand-off share |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for gpus in (int(g) for g in args.gpus.split(",")):
        bare = None
        for costs, share in (("none", 1.0), ("old", 1.0), ("old", 0.1), ("new", 1.0), ("new", 0.1)):
            r = row(args.model, gpus, costs, share)
            bare = bare or r["step_s"]
            print(f"| {gpus:,} | {costs} | {share:g} | {r['step_s']:.2f} | {r['controller_s']:.3f} "
                  f"| {r['controller_load']:.0%} | {r['handoff_s']:.2f} | {r['handoff_share']:.0%} "
                  f"| {', '.join(r['bound']) or 'no'} | {r['controller_s'] / share / bare:.0%}, "
                  f"{r['handoff_s'] / bare:.0%} |", flush=True)


if __name__ == "__main__":
    main()
