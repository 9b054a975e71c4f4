"""The drift study: a fixed plan against re-planning on measurements, over a run whose outputs
lengthen, in the discrete-event simulator. One command.

    python -m tools.experiments.drift_study                   # the table in docs/elastic.md
    python -m tools.experiments.drift_study --segments        # and every segment's tokens/s
    python -m tools.experiments.drift_study --configs paper_7b_hetero --steps 400 --every 50

Each scenario is a paper job (tools/configs/paper_*_hetero.json) with outputs of 2,500 tokens on
average at step 0 growing linearly to `--growth` times that at step `--steps`
(workload.output_len_growth). The run is played in segments of `--every` steps; each segment is
simulated (hexrl/plan/simulate.py, `--sim-steps` steps, the first `--warmup` not counted) at the
step in its middle, and its time is `--every` times the simulated step. Both arms plan for step 0.
The fixed arm keeps its plan; the re-planning arm, after every segment, turns the segment's
simulated steps into metrics rows and asks hexrl/plan/replan.py's `decide` (the job's replan
fields: the switch costs `--switch-s` seconds of no progress, spread over `--horizon-s`, and must
gain more than `--min-gain`, 10%), then runs the next segment on the new plan when the answer is to switch.
"Loses a node" drops node `--lose` at the run's middle step: both arms restart there (paying the
switch), the fixed arm into the plan for the job's own workload on the nodes left, the re-planning
arm into the plan for what it measured.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from hexrl.plan.planner import plan_job
from hexrl.plan.replan import decide, drifted_job, split_of
from hexrl.plan.simulate import Simulation
from hexrl.schema import Job, Plan, load_job

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
START_MEAN = 2500  # tokens at step 0: room under max_new_tokens 8192 to double


@dataclass
class Arm:
    """One arm's run so far: the plan in force, time, tokens, switches, and each segment's tokens/s."""

    plan: Plan
    min_gain: float | None  # the re-planning margin; None: the fixed plan
    time_s: float = 0.0
    tokens: float = 0.0
    switches: int = 0
    last_switch_s: float | None = None
    segments: list = field(default_factory=list)
    measured: float = START_MEAN  # mean output length over the last segment

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s


def scenario_job(config: str, growth: float, steps: int, switch_s: float, horizon_s: float) -> Job:
    d = json.loads((CONFIGS / f"{config}.json").read_text())
    d["workload"].update(output_len={"mean": START_MEAN, "max": d["rl"]["max_new_tokens"]},
                         output_len_growth={"factor": growth, "steps": steps})
    d["replan"] = {"switch_s": switch_s, "horizon_s": horizon_s}
    d["rl"]["steps"] = steps  # the run played: a decision pays a switch back only within the steps left
    return load_job(d, check_paths=False)


def on_workload(plan: Plan, job: Job) -> Plan:
    """`plan` running `job`'s true workload and replan fields (a re-planned plan carries the lengths
    it measured)."""
    return replace(plan, job=replace(plan.job, workload=job.workload, cluster=job.cluster, replan=job.replan))


def without(job: Job, node: str) -> Job:
    return replace(job, cluster=replace(job.cluster, nodes=[n for n in job.cluster.nodes if n.name != node]))


def run_segment(arm: Arm, job: Job, start: int, args, cache: dict) -> list[dict]:
    """Play `args.every` steps from `start` on the arm's plan; the simulated steps as metrics rows.
    Arms on one plan object share its simulation (`cache`)."""
    key = (id(arm.plan), start)
    if key not in cache:
        sim = Simulation(on_workload(arm.plan, job), start_step=start + args.every // 2)
        cache[key] = (arm.plan, sim, sim.run(args.sim_steps, args.warmup))
    _, sim, res = cache[key]
    arm.time_s += args.every * res.step_time_s
    arm.tokens += args.every * res.tokens_per_s * res.step_time_s
    arm.segments.append(res.tokens_per_s)
    prompt, samples = sim.cm.w.prompt_len, sim.cm.w.samples
    rows = []
    for i in range(args.warmup, len(sim.step_ends)):
        tokens, step_s = sim.step_tokens[i], sim.step_ends[i] - sim.step_ends[i - 1]
        train_s = sim.cand.C_T * tokens / sim.cm.w.tokens
        rows.append({"step": start + i, "train_s": train_s, "tokens_trained": tokens, "step_s": step_s,
                     "rollout_tokens_per_s": (tokens - samples * prompt) / step_s,
                     "wait_s": max(0.0, step_s - train_s - sim.cand.C_sync)})
    arm.measured = sum(r["tokens_trained"] for r in rows) / len(rows) / samples - prompt
    return rows


def restart(arm: Arm, plan: Plan, switch_s: float) -> None:
    arm.plan, arm.time_s, arm.switches, arm.last_switch_s = plan, arm.time_s + switch_s, arm.switches + 1, arm.time_s


def play(job: Job, args, lose: str | None) -> list[Arm]:
    """Every arm over the run: the fixed plan, then re-planning at each margin of --min-gain."""
    first = plan_job(job)
    arms = [Arm(first, None)] + [Arm(first, g) for g in args.min_gain]
    cache: dict = {}
    for start in range(0, args.steps, args.every):
        if lose and start == args.steps // 2 // args.every * args.every:
            job = without(job, lose)
            fresh = plan_job(job)
            for a in arms:
                restart(a, fresh if a.min_gain is None else plan_job(drifted_job(job, a.measured)), args.switch_s)
        for a in arms:
            rows = run_segment(a, job, start, args, cache)
            if a.min_gain is None or start + args.every >= args.steps:
                continue
            mine = replace(job, replan=replace(job.replan, min_gain=a.min_gain))
            row, new = decide(on_workload(a.plan, mine), rows, a.time_s, a.last_switch_s)
            if new is not None:
                restart(a, new, args.switch_s)
            if args.log:
                print(json.dumps({"step": start + args.every, "min_gain": a.min_gain, **{k: row.get(k) for k in (
                    "calibration", "predicted_gain", "amortised_gain", "taken", "why", "new_split")}}))
    return arms


def scenarios(args) -> list[tuple[str, str, str | None]]:
    """(label, config, node lost at mid-run or None)."""
    out = [(c.removeprefix("paper_").replace("_hetero", " H800+H20"), c, None) for c in args.configs]
    if args.lose:
        c = args.configs[min(1, len(args.configs) - 1)]
        out.append((c.removeprefix("paper_").replace("_hetero", " H800+H20") + f", loses {args.lose}", c, args.lose))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.experiments.drift_study", description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="+", default=["paper_1.5b_hetero", "paper_7b_hetero", "paper_14b_hetero"])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--growth", type=float, default=2.0, help="output length at the last step over step 0's")
    ap.add_argument("--every", type=int, default=100, help="steps per segment: a decision after each")
    ap.add_argument("--sim-steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--switch-s", type=float, default=600.0)
    ap.add_argument("--horizon-s", type=float, default=86400.0)
    ap.add_argument("--min-gain", type=float, nargs="+", default=[0.1, 0.03], help="replan.min_gain, one arm each")
    ap.add_argument("--lose", default="h20-2", help="the node the last scenario loses at mid-run ('' for none)")
    ap.add_argument("--segments", action="store_true", help="print every segment's tokens/s")
    ap.add_argument("--log", action="store_true", help="print every decision")
    args = ap.parse_args(argv)
    margins = " | ".join(f"re-planning, min_gain {g:.0%}: tokens/s (gain, switches)" for g in args.min_gain)
    print(f"| scenario | fixed plan tokens/s | {margins} | rollout GPUs at the end (start) |")
    print("|---" * (3 + len(args.min_gain)) + "|")
    details = []
    for label, config, lose in scenarios(args):
        job = scenario_job(config, args.growth, args.steps, args.switch_s, args.horizon_s)
        fixed, *moving = play(job, args, lose)
        cells = " | ".join(f"{a.tokens_per_s:,.0f} ({a.tokens_per_s / fixed.tokens_per_s - 1:+.1%}, "
                           f"{a.switches - bool(lose)})" for a in moving)
        gpus = ", ".join(str(sum(split_of(a.plan)["rollout"].values())) for a in (fixed, *moving))
        start = sum(split_of(plan_job(job))["rollout"].values())
        print(f"| {label} | {fixed.tokens_per_s:,.0f} | {cells} | {gpus} ({start}) |", flush=True)
        details.append((label, [fixed, *moving]))
    if args.segments:
        for label, arms in details:
            print(f"\n{label}: tokens/s per segment of {args.every} steps (fixed / each margin)")
            print("  " + "  ".join("/".join(f"{x:,.0f}" for x in seg) for seg in zip(*(a.segments for a in arms))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
