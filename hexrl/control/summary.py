"""A run in a few lines, from its run directory: held-out accuracy before -> after, steps, wall time,
and where every trajectory went (produced = trained + filtered + dropped + pending).

    python -m hexrl.control.summary RUN_DIR [--launch-s SECONDS]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hexrl.control.metrics import read_metrics
from hexrl.schema.fields import plural


def read_evals(run_dir: Path) -> list[dict]:
    """The held-out evaluations of eval.jsonl (empty when the run evaluated nothing)."""
    path = run_dir / "eval.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def accounting(row: dict) -> str:
    """`produced = trained + filtered + dropped + pending` with the numbers of one metrics row."""
    parts = [row[f"trajectories_{k}"] for k in ("trained", "filtered", "dropped", "pending")]
    produced = row["trajectories_produced"]
    verdict = "balanced" if produced == sum(parts) else f"does NOT balance: off by {produced - sum(parts)}"
    return (f"trajectories: produced {produced} = trained {parts[0]} + filtered {parts[1]} + dropped {parts[2]} "
            f"+ pending {parts[3]} ({verdict})")


def summarize(run_dir: str | Path, launch_s: float | None = None) -> str:
    """The summary of the run in `run_dir`; `launch_s`: seconds from launch to exit, when known."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    if not rows:
        return f"{run_dir}: no training step recorded (no metrics.jsonl rows)"
    last, evals = rows[-1], read_evals(run_dir)
    lines = [f"run {run_dir}: {plural(last['step'], 'step')} (weights version {last['version']})"]
    if evals:
        a, b = evals[0], evals[-1]
        lines.append(f"held-out accuracy: {a['heldout_accuracy']:.3f} at step {a['step']} -> "
                     f"{b['heldout_accuracy']:.3f} at step {b['step']} ({b['n']} problems, greedy)")
    else:
        lines.append("held-out accuracy: not evaluated (rl.eval_every is 0, or the data has no held-out set)")
    wall = f"wall time: {last['wall_s']:.0f} s training" if last.get("wall_s") is not None else "wall time:"
    lines.append(wall + (f", {launch_s:.0f} s launch to exit" if launch_s is not None else ""))
    lines.append(accounting(last))
    lines.append(f"max staleness: {max(r['max_staleness'] for r in rows)} versions")
    if (run_dir / "final" / "config.json").is_file():
        lines.append(f"final model: {run_dir / 'final'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hexrl.control.summary", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--launch-s", type=float, default=None, help="seconds from launch to exit, to print beside")
    args = p.parse_args(argv)
    print(summarize(args.run_dir, args.launch_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
