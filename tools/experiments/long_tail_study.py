"""The long tail on the paper's heterogeneous clusters: length-blind against skew-aware, planned
and simulated side by side.

    python -m tools.experiments.long_tail_study [--sizes 1.5b,7b,14b] [--etas 4,0] [--steps 8]
        [--warmup 2] [--recall 0.8] [--seed 0] [--lengths RUN_DIR] [--json out.json]

Jobs: tools/configs/paper_<size>_hetero.json (24 H800 + 24 H20, 512 groups x 16 samples, eta 4),
with a heavy-tailed output length in place of the paper's truncated exponential: log-normal,
median 1,500 tokens, log sd 1.0, cut at max_new_tokens (8,192; the mass past it at the cap), and
each eta of --etas. Every arm's simulation draws the same workload: 20% of each batch's groups
long (their samples from the longest 20% of the distribution's mass, the rest from the rest:
a prompt's difficulty sets its group's lengths). --lengths RUN_DIR: the output lengths are a real
run's instead, every trained sample's generated length it recorded (RUN_DIR/lengths.jsonl), as
workload.output_len samples.

- length-blind: the job as it is (one class), its groups dealt by share whatever their length;
- skew-aware: the job with long_tail.alpha = 0.2, its long groups predicted right (recall 1);
- skew-aware at --recall: the same plan, the prediction finding that share of the long groups.

Printed per cell: step time and generated tokens/s (simulated, the planner's prediction in
brackets), the long groups' latency (hand-out to last sample) and the staleness of their
trajectories (mean versions), and the skew-aware gain (blind step / aware step) simulated and
predicted, with StreamRL's 1.08x beside it.
"""

import argparse
import copy
import json
import math
from pathlib import Path

from hexrl.control.metrics import LENGTHS_FILE, read_metrics
from hexrl.plan.planner import plan_job
from hexrl.plan.simulate import simulate
from hexrl.schema import load_job

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
STREAMRL_GAIN = 1.08  # skewness-aware scheduling alone, 72B at 20K max length (StreamRL's ablation)
ALPHA = 0.2


def heavy_tail(median: float, sigma: float, cap: int, bins: int = 64) -> dict:
    """workload.output_len as a histogram of a log-normal (median, log sd sigma) cut at cap."""
    edges = [cap * i / bins for i in range(bins + 1)]
    cdf = [0.0] + [0.5 * math.erfc(-math.log(e / median) / (sigma * math.sqrt(2))) for e in edges[1:]]
    counts = [round(1e6 * (b - a)) for a, b in zip(cdf, cdf[1:])]
    counts[-1] += round(1e6 * (1 - cdf[-1]))
    return {"histogram": {"edges": edges, "counts": counts}}


def recorded_lengths(run_dir: Path) -> list[int]:
    """Every trained sample's generated length a run recorded (RUN_DIR/lengths.jsonl), at least 1 token
    (workload.output_len's samples); empty if it recorded none."""
    path = run_dir / LENGTHS_FILE
    rows = read_metrics(path) if path.is_file() else []
    return [max(1, int(n)) for row in rows for n in row.get("lengths", [])]


def job_dict(size: str, eta: int, alpha: float, lengths: list[int] | None = None) -> dict:
    """The hetero job of one model with the heavy tail (or these output lengths), eta, and
    long_tail.alpha (0: no section)."""
    d = json.loads((CONFIGS / f"paper_{size}_hetero.json").read_text())
    d = copy.deepcopy(d)
    d["rl"]["eta"] = eta
    d["workload"]["output_len"] = ({"samples": lengths} if lengths
                                   else heavy_tail(1500, 1.0, d["rl"]["max_new_tokens"]))
    if alpha:
        d["long_tail"] = {"alpha": alpha}
    return d


def percentile(values: list[int], q: float) -> int:
    """The q-th percentile of values (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def tail_staleness(hist: dict) -> float:
    """Mean versions of lag of the long groups' trajectories."""
    n = sum(hist.values())
    return sum(k * v for k, v in hist.items()) / n if n else float("nan")


def plan(size: str, eta: int, alpha: float, lengths: list[int] | None = None):
    return plan_job(load_job(job_dict(size, eta, alpha, lengths), check_paths=False))


def arm(plan, recall: float, args) -> dict:
    """One simulated arm of a plan, the prediction's recall given."""
    res = simulate(plan, steps=args.steps, warmup=args.warmup, seed=args.seed, long_share=ALPHA, recall=recall)
    lt = plan.predicted.get("long_tail", {})
    return {"eta": plan.job.rl.eta, "alpha": plan.job.long_tail.alpha, "recall": recall, "step_s": res.step_time_s,
            "predicted_step_s": plan.predicted["step_time_s"], "gen_tokens_per_s": res.gen_tokens_per_s,
            "predicted_gen_tokens_per_s": plan.predicted["gen_tokens_per_s"],
            "tail_latency_s": res.tail_latency_s, "tail_staleness": tail_staleness(res.tail_staleness),
            "staleness": tail_staleness(res.staleness), "long_replicas": lt.get("replicas", 0),
            "long_gpus": lt.get("gpus", 0), "long_max_running": lt.get("max_running", []),
            "long_types": sorted({r.gpu_type for r in plan.replicas if r.long_tail}),
            "search_s": plan.predicted["search"].get("wall_s")}


def cell(size: str, eta: int, args) -> list[dict]:
    """The arms of one model and eta: length-blind, skew-aware, skew-aware at --recall."""
    aware = plan(size, eta, ALPHA, args.run_lengths)
    rows = [arm(plan(size, eta, 0.0, args.run_lengths), 1.0, args), arm(aware, 1.0, args)]
    if args.recall < 1:
        rows.append(arm(aware, args.recall, args))
    return [{"size": size, **r} for r in rows]


def print_cell(rows: list[dict]) -> None:
    blind = rows[0]
    print(f"\n{blind['size']} hetero, eta {blind['eta']}")
    print(f"  {'arm':<24} {'step s (pred)':>18} {'gen tok/s (pred)':>20} {'tail latency s':>15} "
          f"{'tail stale':>10} {'all stale':>9}  long-tail replicas")
    for r in rows:
        name = "length-blind" if not r["alpha"] else f"skew-aware, recall {r['recall']:g}"
        long = (f"{r['long_replicas']} ({r['long_gpus']} {'+'.join(r['long_types'])}, "
                f"max_running {r['long_max_running']})"
                if r["long_replicas"] else "-")
        print(f"  {name:<24} {r['step_s']:>9.1f} ({r['predicted_step_s']:>6.1f}) "
              f"{r['gen_tokens_per_s']:>10.0f} ({r['predicted_gen_tokens_per_s']:>7.0f}) {r['tail_latency_s']:>15.1f} "
              f"{r['tail_staleness']:>10.2f} {r['staleness']:>9.2f}  {long}")
    for r in rows[1:]:
        sim, pred = blind["step_s"] / r["step_s"], blind["predicted_step_s"] / r["predicted_step_s"]
        print(f"  gain (recall {r['recall']:g}): simulated {sim:.3f}x, predicted {pred:.3f}x "
              f"(predicted/simulated {pred / sim:.3f}); StreamRL {STREAMRL_GAIN}x; tail latency "
              f"{blind['tail_latency_s'] / r['tail_latency_s']:.2f}x shorter, tail staleness "
              f"{blind['tail_staleness']:.2f} -> {r['tail_staleness']:.2f} versions")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1.5b,7b,14b")
    ap.add_argument("--etas", default="4,0")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--recall", type=float, default=0.8, help="the prediction's recall of the third arm (1: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lengths", type=Path, metavar="RUN_DIR",
                    help="the output lengths a run recorded (RUN_DIR/lengths.jsonl) in place of the heavy tail")
    ap.add_argument("--json", help="write every arm's numbers here")
    args = ap.parse_args(argv)
    args.run_lengths = None
    if args.lengths is not None:
        args.run_lengths = recorded_lengths(args.lengths)
        if not args.run_lengths:
            print(f"long_tail_study: {args.lengths / LENGTHS_FILE}: no recorded lengths")
            return 2
        print(f"output lengths: {len(args.run_lengths)} samples of {args.lengths}, "
              f"P10/P50/P90/max {percentile(args.run_lengths, 10)}/{percentile(args.run_lengths, 50)}/"
              f"{percentile(args.run_lengths, 90)}/{max(args.run_lengths)} tokens")
    out = []
    for size in args.sizes.split(","):
        for eta in (int(e) for e in args.etas.split(",")):
            rows = cell(size, eta, args)
            print_cell(rows)
            out += rows
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
