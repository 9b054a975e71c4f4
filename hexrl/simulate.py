"""python -m hexrl.simulate plan.json [--steps 12] [--warmup 2] [--gantt gantt.png] [--json out.json]

Discrete-event run of a plan: tokens/s, GPU idle fractions, staleness histogram, Gantt chart
of the first steps (needs matplotlib). Exit code 2 with every problem if the plan is invalid.
"""

import argparse
import json
import sys
from dataclasses import asdict

from hexrl.config import ConfigError, load_plan
from hexrl.plan.simulate import simulate


def report(res, plan) -> str:
    pr = plan.predicted
    stale = ", ".join(f"{k}: {v}" for k, v in res.staleness.items())
    return "\n".join([
        f"steps     : {res.steps} simulated, {res.window_s:.1f} s measured after warm-up",
        f"step time : {res.step_time_s:.2f} s simulated, {res.predicted_step_s:.2f} s predicted by the cost model",
        f"throughput: {res.tokens_per_s:.0f} tokens/s ({res.gen_tokens_per_s:.0f} generated/s); "
        f"plan predicted {pr.get('tokens_per_s', float('nan')):.0f}",
        f"busy      : trainer {res.trainer_busy:.0%}, rollout GPUs {res.rollout_busy:.0%}, "
        f"weight sync {res.sync_fraction:.0%}",
        f"idle      : trainer GPUs {res.idle['train']:.0%}, rollout GPUs {res.idle['rollout']:.0%}",
        f"staleness : {{{stale}}} trajectories by versions behind; over eta: {res.violations}",
    ])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hexrl.simulate", description="Simulate a plan.")
    ap.add_argument("plan", help="plan.json from python -m hexrl.plan")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gantt", metavar="PNG", help="Gantt chart of the first steps (needs matplotlib)")
    ap.add_argument("--gantt-steps", type=int, default=3)
    ap.add_argument("--json", metavar="PATH", help="write the metrics as JSON")
    args = ap.parse_args(argv)
    if args.steps <= args.warmup:
        print(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})", file=sys.stderr)
        return 2
    try:
        plan = load_plan(args.plan, check_paths=False)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    res = simulate(plan, args.steps, args.warmup, args.seed, args.gantt_steps)
    print(report(res, plan))
    if args.json:
        d = asdict(res)
        d.pop("gantt")
        with open(args.json, "w") as f:
            json.dump(d, f, indent=1)
    if args.gantt:
        from hexrl.plan.draw import draw_gantt
        if draw_gantt(res.gantt, args.gantt, f"{plan.job.name}: first {args.gantt_steps} steps"):
            print(f"drew {args.gantt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
