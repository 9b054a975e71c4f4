"""The learning experiment: warm start, then asynchronous GRPO with hexrl, evaluated on held-out problems.

    python tools/learning_run.py OUT                 # eta=4 (decoupled, naive) vs eta=0 (synchronous)
    python tools/learning_run.py OUT --ablation      # eta in {0,1,4,8,inf} x {naive PPO, decoupled}
    python tools/learning_run.py OUT --steps 20      # shorter budget

Phase 1 (reported separately): `tools/warm_start.py` trains a tiny char-level model on
arithmetic with cross-entropy for a short budget, into OUT/model. Phase 2: each configuration
is planned (`python -m hexrl.plan`) and run with torchrun (2 trainer ranks + 1 rollout rank),
evaluated with greedy decoding on the warm start's held-out set every `--eval-every` steps.
Same seeds and step budget for every configuration; a table of final held-out accuracy and
throughput is printed and written to OUT/summary.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ETAS = {"0": 0, "1": 1, "4": 4, "8": 8, "inf": None}


def warm_start(out: Path) -> dict:
    model = out / "model"
    if not (model / "warm_start.json").exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "warm_start.py"), str(model)], check=True)
    return json.loads((model / "warm_start.json").read_text())


def job_for(out: Path, ws: dict, name: str, eta, decoupled: bool, a) -> dict:
    return {
        "name": name, "model": {"path": str(out / "model")},
        "data": {"synthetic": ws["data_synthetic"]},  # the warm start's train / held-out split
        "reward": {"name": "exact", "timeout_s": 5},
        "rl": {"batch_size": a.batch, "group_size": a.group, "eta": eta, "lr": a.lr, "decoupled": decoupled,
               "max_new_tokens": ws["max_new_tokens"], "temperature": 1.0, "steps": a.steps, "seed": a.seed,
               "eval_every": a.eval_every},
        "cluster": {"nodes": [{"name": "local", "gpu_type": "cpu", "gpus": 3}]},
        "layout": {"train_gpus": 2, "dp": 2},
        "out_dir": str(out / name),
    }


def run_config(out: Path, job: dict) -> dict:
    run = Path(job["out_dir"])
    if not (run / "final" / "config.json").exists():
        run.mkdir(parents=True, exist_ok=True)
        (run / "job.json").write_text(json.dumps(job, indent=1))
        subprocess.run([sys.executable, "-m", "hexrl.plan", str(run / "job.json"), "-o", str(run / "plan.json")],
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        t0 = time.time()
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
                        "-m", "hexrl.main", str(run / "plan.json"), "--run-dir", str(run)],
                       check=True, cwd=ROOT, env=env)
        print(f"  {job['name']}: {time.time() - t0:.0f} s")
    return summarize(run)


def summarize(run: Path) -> dict:
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    wall = metrics[-1]["wall_s"]
    return {"name": run.name, "start_acc": evals[0]["heldout_accuracy"], "final_acc": evals[-1]["heldout_accuracy"],
            "best_acc": max(e["heldout_accuracy"] for e in evals), "wall_s": wall,
            "traj_per_s": metrics[-1]["trajectories_trained"] / wall,
            "max_staleness": max(m["max_staleness"] for m in metrics),
            "reward_first": metrics[0]["reward_mean"], "reward_last": metrics[-1]["reward_mean"]}


def table(rows: list[dict]) -> str:
    lines = ["| config | held-out acc (start -> final, best) | trajectories/s | wall s | max staleness |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['start_acc']:.3f} -> {r['final_acc']:.3f} ({r['best_acc']:.3f}) | "
                     f"{r['traj_per_s']:.1f} | {r['wall_s']:.0f} | {r['max_staleness']} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--ablation", action="store_true")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch", type=int, default=64, help="prompt groups per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    ws = warm_start(a.out)
    print(f"warm start: {ws['steps']} SFT steps, held-out accuracy {ws['heldout_accuracy']:.3f}, "
          f"{ws['wall_seconds']:.0f} s")
    main_runs = [("4", True), ("4", False), ("0", True)]
    configs = [(e, d) for e in ETAS for d in (False, True)] if a.ablation else main_runs
    rows = []
    for eta, decoupled in configs:
        name = f"eta{eta}-{'decoupled' if decoupled else 'naive'}"
        rows.append(run_config(a.out, job_for(a.out, ws, name, ETAS[eta], decoupled, a)))
    text = table(rows)
    by = {r["name"]: r for r in rows}
    if "eta4-decoupled" in by and "eta0-decoupled" in by:
        s, w = by["eta0-decoupled"], by["eta4-decoupled"]
        text += (f"\n\nasync (eta=4) vs sync (eta=0): final accuracy {w['final_acc']:.3f} vs {s['final_acc']:.3f}; "
                 f"throughput ratio {w['traj_per_s'] / s['traj_per_s']:.2f}x trajectories/s")
    print(text)
    (a.out / "summary.md").write_text(f"warm start: {json.dumps(ws)}\n\n{text}\n")
    (a.out / "summary.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
