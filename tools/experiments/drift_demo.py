"""The drift demo on CPU: a job whose outputs lengthen mid-run, run side by side with re-planning on
and off, and a job whose outputs shorten. One command.

    python -m tools.experiments.drift_demo runs/drift_demo                       # the numbers in docs/elastic.md
    python -m tools.experiments.drift_demo runs/drift_demo --workloads lengthen --steps 40
    python -m tools.experiments.drift_demo runs/drift_demo --serial              # one arm after the other

Each workload is one job on one node of 3 `cpu` GPUs (torchrun ranks on this machine): a tiny random
model on 9-digit additions, whose samples stop after the synthetic task's token budget
(data.synthetic.budget: `--short` tokens growing linearly to `--long` over the first `--ramp` steps,
or the reverse). The model's vocabulary has 1,024 ids, so it stops on its own about once in 1,024
tokens and the budget sets the lengths. A rollout replica runs at most `--max-running` sequences at
once (runtime.rollout.max_running: a GPU's KV memory bounds its batch the same way), so a second
replica generates a step's groups in half the waves.

Both arms of a workload start from the same plan, made for the first step's lengths. The "off" arm
keeps it (replan.every_s 0). The "on" arm re-plans every `--every-s` seconds (hexrl/plan/replan.py on
the run's metrics; the switch costs `--switch-s` over `--horizon-s` and must gain more than
`--min-gain`) and, on a switch, checkpoints and exits so that torchrun (`--max-restarts`) restarts
every rank into the new plan. The planner prices `cpu` GPUs from a profile of this machine's speeds
(`--train-speed`, `--decode-speed` times the catalogue's: what re-planning fitted on a 3-rank run
here), written to OUT/profiles/cpu.json and used by every plan of the demo (HEXRL_PROFILES).

By default the two arms run at once (side by side in one window: the same machine load for both);
`--serial` runs them one after the other. Prints each arm's seconds from launch to exit, the
re-planning decisions taken (metrics.jsonl rows with event "replan") and the splits before and after,
and writes OUT/drift_demo.png: steps done against seconds since launch, switches marked.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hexrl.control.metrics import read_events, read_metrics
from hexrl.gpus import CATALOGUE, scaled_entry
from hexrl.model.tiny import make_tiny_model
from hexrl.plan.draw import pyplot

ROOT = Path(__file__).resolve().parents[2]
RANKS = 3
VOCAB = 1024  # the tiny model samples its end-of-text id about once in this many tokens
PROMPT_LEN = 20  # "123456789+987654321=": 9-digit operands


@dataclass
class Arm:
    """One run of a workload: its directory, launch and what it did."""

    workload: str  # "lengthen" | "shorten"
    replan: bool
    run: Path
    proc: subprocess.Popen | None = None
    started: float = 0.0
    wall_s: float = 0.0  # seconds from launch to exit
    progress: list = field(default_factory=list)  # (seconds since launch, steps recorded)

    @property
    def name(self) -> str:
        return f"{self.workload}, replan {'on' if self.replan else 'off'}"


def write_profile(directory: Path, train: float, decode: float) -> Path:
    """The `cpu` catalogue entry at this machine's speeds, as a profile the planner reads."""
    entry = asdict(scaled_entry(CATALOGUE["cpu"], decode=decode, train=train))
    entry.pop("name")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "cpu.json"
    path.write_text(json.dumps({**entry, "measured": f"train x{train}, decode x{decode} (drift_demo)"}, indent=1))
    return path


def demo_job(model: Path, workload: str, args, replan: bool) -> dict:
    """The workload's job: the budget drifts from the first step's lengths to the other end."""
    start, end = (args.short, args.long) if workload == "lengthen" else (args.long, args.short)
    every = args.every_s if replan else 0
    return {
        "name": f"drift-{workload}", "model": {"path": str(model)},
        "data": {"synthetic": {"task": "arithmetic", "n": 4000, "seed": 0, "digits": [9, 9], "ops": "+",
                               "budget": {"start": start, "end": end, "steps": args.ramp}}},
        "reward": {"name": "exact", "timeout_s": 5},
        "rl": {"batch_size": args.batch_size, "group_size": args.group_size, "eta": 1, "lr": 1e-4,
               "max_new_tokens": max(start, end), "steps": args.steps, "seed": 0, "filter_equal_groups": False},
        # planned for the first step's lengths (a long tail needs room above its mean)
        "workload": {"prompt_len": PROMPT_LEN, "output_len": {"mean": 0.95 * start, "max": max(start, end)}},
        "cluster": {"nodes": [{"name": "local", "gpu_type": "cpu", "gpus": RANKS}]},
        "runtime": {"rollout": {"max_running": args.max_running}},
        "replan": {"every_s": every, "min_gain": args.min_gain, "horizon_s": args.horizon_s,
                   "switch_s": args.switch_s},
    }


def env(out: Path) -> dict:
    """The demo's processes' environment: one thread each, and the demo's cpu profile (OUT/profiles)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HEXRL_PROFILES": str(out / "profiles")}


def plan(job: dict, run: Path) -> Path:
    """Plan `job` into run/plan.json (with the demo's profile: the run directory's parent's)."""
    run.mkdir(parents=True, exist_ok=True)
    (run / "job.json").write_text(json.dumps(job, indent=1))
    subprocess.run([sys.executable, "-m", "hexrl.plan", str(run / "job.json"), "-o", str(run / "plan.json")],
                   check=True, capture_output=True, env=env(run.parent), cwd=ROOT)
    return run / "plan.json"


def launch(arm: Arm, restarts: int) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}",
           f"--max-restarts={restarts}", "-m", "hexrl.main", str(arm.run / "plan.json"), "--run-dir", str(arm.run)]
    arm.started = time.perf_counter()
    arm.proc = subprocess.Popen(cmd, cwd=ROOT, env=env(arm.run.parent), stdout=open(arm.run / "log.txt", "w"),
                                stderr=subprocess.STDOUT, start_new_session=True)


def steps_done(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(read_metrics(path)) if path.exists() else 0


def wait_all(arms: list[Arm], timeout_s: float) -> None:
    """Follow the running arms until each exits, noting every half second how many steps each recorded."""
    while any(a.proc.poll() is None for a in arms):
        for a in arms:
            t = time.perf_counter() - a.started
            if a.proc.poll() is None:
                a.progress.append((t, steps_done(a.run)))
            elif not a.wall_s:
                a.wall_s = t
            if t > timeout_s and a.proc.poll() is None:
                os.killpg(a.proc.pid, signal.SIGKILL)
        time.sleep(0.5)
    for a in arms:
        a.wall_s = a.wall_s or time.perf_counter() - a.started
        a.progress.append((a.wall_s, steps_done(a.run)))


def steps_at(arm: Arm, t: float) -> int:
    """Steps the arm had recorded `t` seconds after its launch."""
    return max((s for when, s in arm.progress if when <= t), default=0)


def split_text(plan: dict) -> str:
    roles = [r["role"] for r in plan["ranks"]]
    return f"{roles.count('train')} train + {roles.count('rollout')} rollout"


def summary(arm: Arm) -> dict:
    """What the arm did: steps, seconds, the decisions taken and the splits it ran."""
    rows = read_metrics(arm.run / "metrics.jsonl")
    decisions = read_events(arm.run / "metrics.jsonl", "replan")
    plans = sorted((arm.run / "plans").glob("[0-9]*.json"), key=lambda p: int(p.name.split(".")[0]))
    splits = [split_text(json.loads((arm.run / "plan.json").read_text()))]
    splits += [split_text(json.loads(p.read_text())) for p in plans if not p.name.endswith(".job.json")]
    taken = [d for d in decisions if d.get("taken")]
    return {"arm": arm.name, "steps": len(rows), "wall_s": round(arm.wall_s, 1), "exit": arm.proc.returncode,
            "decisions": len(decisions), "switches": [(d["step"], d.get("predicted_gain"), d.get("amortised_gain"),
                                                        d["measured"]["output_len_mean"]) for d in taken],
            "splits": splits,
            "output_len": [round(r.get("output_len_mean", 0)) for r in rows[:: max(1, len(rows) // 8)]]}


def figure(arms: list[Arm], out: Path) -> Path | None:
    plt = pyplot("drift_demo", str(out))
    if plt is None:
        return None
    workloads = sorted({a.workload for a in arms}, reverse=True)
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for a in (a for a in arms if a.workload == w):
            t, s = zip(*a.progress)
            ax.plot(t, s, label=f"replan {'on' if a.replan else 'off'} ({a.wall_s:.0f} s)")
            for d in read_events(a.run / "metrics.jsonl", "replan"):
                if d.get("taken"):
                    ax.axhline(d["step"], color="grey", lw=0.5, ls="--")
        ax.set(title=f"outputs {w}", xlabel="seconds since launch", ylabel="steps trained")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.experiments.drift_demo", description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="a directory for the model, the runs and the figure")
    ap.add_argument("--workloads", nargs="+", choices=("lengthen", "shorten"), default=["lengthen", "shorten"])
    ap.add_argument("--arms", nargs="+", choices=("off", "on"), default=["off", "on"], help="replan off, on, or both")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--short", type=int, default=8, help="tokens per sample at the short end")
    ap.add_argument("--long", type=int, default=128, help="tokens per sample at the long end")
    ap.add_argument("--ramp", type=int, default=30, help="steps over which the budget moves from one end to the other")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-running", type=int, default=4, help="sequences one rollout replica runs at once")
    ap.add_argument("--every-s", type=float, default=10.0)
    ap.add_argument("--min-gain", type=float, default=0.1)
    ap.add_argument("--horizon-s", type=float, default=120.0)
    ap.add_argument("--switch-s", type=float, default=20.0)
    ap.add_argument("--max-restarts", type=int, default=2)
    ap.add_argument("--train-speed", type=float, default=0.15, help="this machine's train speed over the catalogue's")
    ap.add_argument("--decode-speed", type=float, default=0.8, help="this machine's decode speed over the catalogue's")
    ap.add_argument("--serial", action="store_true", help="run the arms one after the other")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="an arm still running after it is killed")
    return ap


def prepare(args) -> list[Arm]:
    """The profile, the model and every arm's run directory with its plan."""
    out = args.out.resolve()
    write_profile(out / "profiles", args.train_speed, args.decode_speed)
    model = out / "model"
    if not (model / "config.json").exists():
        make_tiny_model(model, tokenizer="char", vocab=VOCAB)
    arms = []
    for w in args.workloads:
        for on in args.arms:
            arm = Arm(w, on == "on", out / f"{w}-{on}")
            shutil.rmtree(arm.run, ignore_errors=True)
            plan(demo_job(model, w, args, arm.replan), arm.run)
            arms.append(arm)
    return arms


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    arms = prepare(args)
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    batches = [[a] for a in arms] if args.serial else [[a for a in arms if a.workload == w] for w in args.workloads]
    for batch in batches:
        for a in batch:
            launch(a, args.max_restarts)
        wait_all(batch, args.timeout_s)
        first = min(a.wall_s for a in batch)  # after it, the other arm ran alone: compare up to it too
        for a in batch:
            print(json.dumps({**summary(a), "steps_when_the_first_arm_ended": steps_at(a, first)}), flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    if path := figure(arms, args.out / "drift_demo.png"):
        print(f"wrote {path}")
    return 0 if all(a.proc.returncode == 0 for a in arms) else 1


if __name__ == "__main__":
    raise SystemExit(main())
