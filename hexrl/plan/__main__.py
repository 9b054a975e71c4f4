"""python -m hexrl.plan JOB.json -o PLAN.json [--baseline exhaustive|homogeneous|uniform] [--draw plan.png]

Exit code 0 with the plan written, 2 with every problem of an invalid or infeasible job on stderr.
"""

import argparse
import sys

from hexrl.config import ConfigError, load_job
from hexrl.plan.planner import plan_job


def summary(plan) -> str:
    pr, t = plan.predicted, plan.trainer
    stages = ", ".join(f"{s.gpu_type} tp{s.tp} layers {s.layers[0]}-{s.layers[1] - 1}" for s in t.stages)
    reps: dict = {}
    for r in plan.replicas:
        reps[(r.gpu_type, r.tp)] = reps.get((r.gpu_type, r.tp), 0) + 1
    roll = ", ".join(f"{n} x {k} tp{tp}" for (k, tp), n in reps.items())
    b = pr["breakdown"]
    return "\n".join([
        f"trainer : dp={t.dp} pp={t.pp} [{stages}]",
        f"rollout : {len(plan.replicas)} replicas [{roll}]",
        f"step    : {pr['step_time_s']:.2f} s  (train {b['train_s']:.2f}, rollout {b['rollout_s']:.2f}, "
        f"reward {b['reward_s']:.2f}, weight sync {b['weight_sync_s']:.2f})",
        f"predict : {pr['tokens_per_s']:.0f} tokens/s, ${pr['cost_per_hour']:.2f}/h "
        f"({pr['search'].get('method')}, {pr['search'].get('wall_s', 0)} s)",
    ])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hexrl.plan", description="Plan an RL job on a heterogeneous cluster.")
    ap.add_argument("job", help="job.json")
    ap.add_argument("-o", "--out", required=True, help="where to write plan.json")
    ap.add_argument("--baseline", choices=["exhaustive", "homogeneous", "uniform"],
                    help="plan with a baseline instead of the two-phase search")
    ap.add_argument("--draw", metavar="PNG", help="also draw the assignment (needs matplotlib)")
    ap.add_argument("--no-profiles", action="store_true", help="ignore measured profiles/<gpu>.json")
    args = ap.parse_args(argv)
    try:
        job = load_job(args.job, check_paths=False)
        plan = plan_job(job, args.baseline or "two-phase", use_profiles=not args.no_profiles)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    plan.save(args.out)
    print(summary(plan))
    print(f"wrote {args.out}")
    if args.draw:
        from hexrl.plan.draw import draw_plan
        if draw_plan(plan, args.draw):
            print(f"drew {args.draw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
