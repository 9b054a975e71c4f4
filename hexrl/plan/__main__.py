"""The planner's command line.

    python -m hexrl.plan JOB.json -o PLAN.json [--baseline exhaustive|homogeneous|uniform] [--draw plan.png] [--json]
    python -m hexrl.plan simulate PLAN.json [--steps 12] [--warmup 2] [--gantt gantt.png] [--json out.json]
    python -m hexrl.plan replan RUN_DIR [--plan PLAN.json] [--switch-s S] [--now-s T --last-switch-s T]
                                [--since-step S] [--new-plan NEW.json] [--json]

The first plans a job; the second runs the plan through the discrete-event simulator
(tokens/s, idle fractions, staleness histogram, a Gantt chart of the first steps); the third says
what a run's measurements (RUN_DIR/metrics.jsonl against RUN_DIR/plan.json) imply: the split the
calibrated planner would choose, its predicted gain and the switch cost (hexrl/plan/replan.py),
without touching the run (a running job's controller rank runs it every replan.every_s, with
--new-plan for the plan to switch to: hexrl/train/replanning.py). Exit code 0
on success, 2 with every problem of an invalid or infeasible job or plan on stderr, 1 when a
picture was asked for and could not be drawn (matplotlib missing). A plan that takes more than
a few seconds shows its phase and how far along it is on stderr, when stderr is a terminal and
--json (the predictions as JSON on stdout, in place of the summary) is not given. Layers are printed half-open,
as plan.json stores them: [0, 12) is layers 0 to 11.
"""

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

from hexrl.control.metrics import read_metrics
from hexrl.plan.planner import plan_job
from hexrl.plan.progress import Progress
from hexrl.plan.replan import decide
from hexrl.plan.simulate import simulate
from hexrl.preflight import plan_time_checks
from hexrl.schema import ConfigError, load_job, load_plan
from hexrl.schema.fields import plural


def summary(plan) -> str:
    pr, t = plan.predicted, plan.trainer
    stages = ", ".join(f"{s.gpu_type} tp{s.tp} layers [{s.layers[0]}, {s.layers[1]})" for s in t.stages)
    b = pr["breakdown"]
    return "\n".join([
        f"trainer : dp={t.dp} pp={t.pp} [{stages}]",
        f"rollout : {plural(len(plan.replicas), 'replica')} [{replica_kinds(plan.replicas)}]",
        *long_tail_lines(plan),
        f"step    : {pr['step_time_s']:.2f} s  (train {b['train_s']:.2f}, rollout {b['rollout_s']:.2f}, "
        f"reward {b['reward_s']:.2f}, weight sync {b['weight_sync_s']:.2f})",
        f"predict : {pr['tokens_per_s']:.0f} tokens/s, ${pr['cost_per_hour']:.2f}/h "
        f"({pr['search'].get('method')}, {pr['search'].get('wall_s', 0)} s)",
        *host_lines(pr.get("host")),
    ])


def replica_kinds(replicas, cap: bool = False) -> str:
    """'6 x H800 tp2, 24 x H20 tp1' (cap: with each kind's max_running)."""
    reps: dict = {}
    for r in replicas:
        key = (r.gpu_type, r.tp, r.knobs.max_running if cap else None)
        reps[key] = reps.get(key, 0) + 1
    return ", ".join(f"{n} x {k} tp{tp}" + (f" max_running {b}" if cap else "") for (k, tp, b), n in reps.items())


def long_tail_lines(plan) -> list[str]:
    """The split of a plan with a long tail: which replicas serve the longest groups, and the rest."""
    lt = plan.predicted.get("long_tail")
    if not lt:
        return []
    long = [r for r in plan.replicas if r.long_tail]
    rest = [r for r in plan.replicas if not r.long_tail]
    return [f"long    : {lt['groups']} of {lt['batch_size']} groups (alpha {lt['alpha']:g}, mean output "
            f"{lt['long_mean_output_len']:.0f} tokens) on {plural(len(long), 'replica')} "
            f"[{replica_kinds(long, True)}], share {sum(r.share for r in long):.3f}",
            f"regular : {lt['batch_size'] - lt['groups']} groups (mean output {lt['regular_mean_output_len']:.0f} "
            f"tokens) on {plural(len(rest), 'replica')} [{replica_kinds(rest)}], "
            f"share {sum(r.share for r in rest):.3f}"]


def host_lines(h: dict | None) -> list[str]:
    """The host line of the summary: the controller's load on its core, the hand-off's share of the
    step, and what binds the step if a host term does."""
    if not h:
        return []
    line = (f"host    : controller {h['controller_s']:.3g} s a step on {h['controller_core_share']:g} of a core "
            f"({h['controller_load']:.0%} of its time), trainer hand-off {h['handoff_s']:.3g} s "
            f"({h['handoff_share']:.0%} of the step)")
    return [line] + [f"HOST-BOUND: {' and '.join(h['bound'])}"] if h["bound"] else [line]


def plan_main(argv) -> int:
    ap = argparse.ArgumentParser(prog="python -m hexrl.plan", formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description="Plan an RL job on a heterogeneous cluster.",
                                 epilog="Simulate a plan: python -m hexrl.plan simulate PLAN.json [--steps 12] "
                                        "[--gantt gantt.png]\n(see python -m hexrl.plan simulate --help)")
    ap.add_argument("job", help="job.json")
    ap.add_argument("-o", "--out", required=True, help="where to write plan.json")
    ap.add_argument("--baseline", choices=["exhaustive", "homogeneous", "uniform"],
                    help="plan with a baseline instead of the two-phase search")
    ap.add_argument("--draw", metavar="PNG", help="also draw the assignment (needs matplotlib)")
    ap.add_argument("--no-profiles", action="store_true", help="ignore measured profiles/<gpu>.json")
    ap.add_argument("--json", action="store_true", help="print the predictions as JSON (no progress on stderr)")
    args = ap.parse_args(argv)
    progress = Progress(enabled=False if args.json else None)
    try:
        job = load_job(args.job, check_paths=False)
        problems, warnings = plan_time_checks(job)  # every prompt tokenized where the data is
        for warning in warnings:
            print(warning, file=sys.stderr)
        if problems:
            raise ConfigError(problems, "invalid job")
        plan = plan_job(job, args.baseline or "two-phase", use_profiles=not args.no_profiles, progress=progress)
    except ConfigError as e:
        progress.close()
        print(e, file=sys.stderr)
        return 2
    progress.close()
    plan.save(args.out)
    print(json.dumps(plan.predicted, indent=1) if args.json else summary(plan))
    if not args.json:
        print(f"wrote {args.out}")
    if args.draw:
        from hexrl.plan.draw import draw_plan
        if not draw_plan(plan, args.draw):
            return 1  # the plan is written; the picture asked for is not
        if not args.json:
            print(f"drew {args.draw}")
    return 0


def staleness_table(hist: dict[int, int]) -> list[str]:
    """Two aligned rows: versions behind, and how many trajectories were trained that far behind."""
    cols = [(str(k), str(v)) for k, v in sorted(hist.items())] or [("-", "0")]
    width = [max(len(a), len(b)) for a, b in cols]
    return ["  versions behind " + "  ".join(a.rjust(w) for (a, _), w in zip(cols, width)),
            "  trajectories    " + "  ".join(b.rjust(w) for (_, b), w in zip(cols, width))]


def report(res, plan) -> str:
    pr = plan.predicted
    return "\n".join([
        f"steps     : {res.steps} simulated, {res.window_s:.1f} s measured after warm-up",
        f"step time : {res.step_time_s:.2f} s simulated, {res.predicted_step_s:.2f} s predicted by the cost model",
        f"throughput: {res.tokens_per_s:.0f} tokens/s ({res.gen_tokens_per_s:.0f} generated/s); "
        f"plan predicted {pr.get('tokens_per_s', float('nan')):.0f}",
        f"busy      : trainer {res.trainer_busy:.0%}, rollout GPUs {res.rollout_busy:.0%}, "
        f"weight sync {res.sync_fraction:.0%}",
        f"idle      : trainer GPUs {res.idle['train']:.0%}, rollout GPUs {res.idle['rollout']:.0%}",
        f"staleness : over eta: {res.violations}; dropped as stale: {res.dropped_stale}; trained on:",
        *staleness_table(res.staleness),
        *([f"long tail : the long groups took {res.tail_latency_s:.1f} s from hand-out to their last sample; "
           "trained on:",
           *staleness_table(res.tail_staleness)] if res.tail_staleness else []),
        *([f"eta auto  : {res.eta_by_step} after each step (w std {plan.job.rl.eta_w_std_target:g} allowed)"]
          if plan.job.rl.eta == "auto" else []),
    ])


def simulate_main(argv) -> int:
    ap = argparse.ArgumentParser(prog="python -m hexrl.plan simulate", description="Simulate a plan.")
    ap.add_argument("plan", help="plan.json from python -m hexrl.plan")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gantt", metavar="PNG", help="Gantt chart of the first steps (needs matplotlib)")
    ap.add_argument("--gantt-steps", type=int, default=3)
    ap.add_argument("--json", metavar="PATH", help="write the metrics as JSON")
    ap.add_argument("--w-spread", type=float, default=0.04,
                    help='rl.eta "auto": the importance weights\' std per version of lag to assume (default 0.04)')
    args = ap.parse_args(argv)
    if args.steps <= args.warmup:
        print(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})", file=sys.stderr)
        return 2
    try:
        plan = load_plan(args.plan, check_paths=False)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    res = simulate(plan, args.steps, args.warmup, args.seed, args.gantt_steps, w_spread=args.w_spread)
    print(report(res, plan))
    if args.json:
        d = asdict(res)
        d.pop("gantt")
        with open(args.json, "w") as f:
            json.dump(d, f, indent=1)
    if args.gantt:
        from hexrl.plan.draw import draw_gantt
        if not draw_gantt(res.gantt, args.gantt, f"{plan.job.name}: first {args.gantt_steps} steps"):
            return 1
        print(f"drew {args.gantt}")
    return 0


def replan_report(row: dict) -> str:
    """The decision's lines: what was measured and fitted, both plans, the verdict."""
    if "measured" not in row:
        return f"decision : no switch ({row['why']})"
    m, c = row["measured"], row["calibration"]
    split = lambda s: "; ".join(f"{role} " + ", ".join(f"{n} {t}" for t, n in sorted(s[role].items()))  # noqa: E731
                                for role in ("train", "rollout"))
    return "\n".join([
        f"measured : {m['rows']} steps: train {m['train_s']:.2f} s/step, rollout {m['rollout_tokens_per_s']:.0f} "
        f"generated tokens/s, trainer waits {m['wait_share']:.0%}, mean output {m['output_len_mean']:.0f} tokens",
        f"fitted   : train x{c['train']:.3f}, decode x{c['decode']:.3f}"
        + "".join(f", {t} x{f:.3f}" for t, f in c.get("decode_by_type", {}).items()) + " against the cost model"
        + ("" if c["generation_bound"] else " (decode not measured: training is the bottleneck)"),
        f"running  : {split(row['running_split'])}: {row['running_tokens_per_s']:.0f} tokens/s predicted",
        f"new plan : {split(row['new_split'])}: {row['new_tokens_per_s']:.0f} tokens/s predicted",
        f"gain     : {row['predicted_gain']:+.1%}; {row['amortised_gain']:+.1%} after a {row['switch_s']:g} s switch "
        f"over {row.get('payback_s', row['horizon_s']):g} s (replan.min_gain {row['min_gain']:.0%})",
        f"decision : {'switch' if row['taken'] else 'no switch'} ({row['why']})",
    ])


def finite_float(text: str) -> float:
    """An argparse type: a finite number of seconds (nan and inf are no time)."""
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, got {text!r}")
    return x


def replan_main(argv) -> int:
    ap = argparse.ArgumentParser(prog="python -m hexrl.plan replan",
                                 description="What a run's measurements imply; the run is not touched.")
    ap.add_argument("run_dir", help="a run directory holding plan.json and metrics.jsonl")
    ap.add_argument("--plan", help="the running plan (default: RUN_DIR/plan.json)")
    ap.add_argument("--switch-s", type=finite_float, help="seconds a switch costs (default: the job's replan.switch_s)")
    ap.add_argument("--now-s", type=finite_float, default=0.0,
                    help="the decision's time (the clock of --last-switch-s)")
    ap.add_argument("--last-switch-s", type=finite_float, help="when the run last switched plans (default: never)")
    ap.add_argument("--since-step", type=int, default=0, help="measure only the steps after this one "
                    "(those the running plan trained)")
    ap.add_argument("--new-plan", help="write the plan to switch to here, when the decision is to switch")
    ap.add_argument("--no-profiles", action="store_true", help="ignore measured profiles/<gpu>.json")
    ap.add_argument("--json", action="store_true", help="print the decision as one JSON object")
    args = ap.parse_args(argv)
    run = Path(args.run_dir)
    plan_path = Path(args.plan) if args.plan else run / "plan.json"
    missing = [str(f) for f in (plan_path, run / "metrics.jsonl") if not f.is_file()]
    if missing:
        print(f"replan: {', '.join(missing)} not found", file=sys.stderr)
        return 2
    if args.switch_s is not None and args.switch_s < 0:
        print(f"--switch-s: must be >= 0, got {args.switch_s:g}", file=sys.stderr)
        return 2
    try:
        plan = load_plan(plan_path, check_paths=False)
        records = [r for r in read_metrics(run / "metrics.jsonl")
                   if isinstance(r.get("step"), int) and r["step"] > args.since_step]
        row, new = decide(plan, records, now_s=args.now_s, last_switch_s=args.last_switch_s, switch_s=args.switch_s,
                          use_profiles=not args.no_profiles)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    if new is not None and args.new_plan:
        try:
            new.save(args.new_plan)
        except OSError as e:
            print(f"--new-plan: cannot write {args.new_plan}: {e.strerror or e}", file=sys.stderr)
            return 2
    print(json.dumps(row) if args.json else replan_report(row))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["simulate"]:
        return simulate_main(argv[1:])
    if argv[:1] == ["replan"]:
        return replan_main(argv[1:])
    return plan_main(argv)


if __name__ == "__main__":
    sys.exit(main())
