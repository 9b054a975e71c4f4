"""Plot a run directory: reward and held-out accuracy vs step and vs wall-clock.

    python tools/experiments/plot_run.py RUN_DIR [RUN_DIR ...] [--out DIR]

Reads `metrics.jsonl` (and `eval.jsonl` when the run evaluated) and writes `learning.png`
into each run directory (or one comparison figure into --out when several runs are given).
Needs matplotlib (`pip install -e .[plot]`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hexrl.control.metrics import read_metrics
from hexrl.plan.draw import pyplot


def read_jsonl(path: Path) -> list[dict]:
    """Its records (a line torn by a crash skipped; metrics.jsonl's events left out); none if it is missing."""
    return read_metrics(path) if path.exists() else []


def curves(run: Path) -> dict[str, tuple[list, list]]:
    """Named (x, y) series of one run."""
    m, e = read_jsonl(run / "metrics.jsonl"), read_jsonl(run / "eval.jsonl")
    return {
        "reward vs step": ([r["step"] for r in m], [r["reward_mean"] for r in m]),
        "reward vs wall-clock (s)": ([r.get("wall_s", 0) for r in m], [r["reward_mean"] for r in m]),
        "held-out accuracy vs step": ([r["step"] for r in e], [r["heldout_accuracy"] for r in e]),
        "held-out accuracy vs wall-clock (s)": ([r["wall_s"] for r in e], [r["heldout_accuracy"] for r in e]),
    }


def plot(runs: list[Path], out: Path) -> Path | None:
    """Write out/learning.png (one line per run); None if matplotlib is missing."""
    plt = pyplot("plot_run", str(out))
    if plt is None:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for run in runs:
        for ax, (title, (x, y)) in zip(axes.flat, curves(run).items()):
            ax.plot(x, y, marker=".", label=run.name)
            ax.set_title(title)
            ax.grid(alpha=0.3)
    if len(runs) > 1:
        axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "learning.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    missing = [str(r) for r in a.runs if not (r / "metrics.jsonl").exists()]
    if missing:
        sys.exit(f"plot_run: no metrics.jsonl in {', '.join(missing)}")
    groups = [([run], run) for run in a.runs] if a.out is None and len(a.runs) > 1 else [(a.runs, a.out or a.runs[0])]
    for runs, out in groups:
        path = plot(runs, out)
        if path is None:
            sys.exit(1)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
