"""The learning experiment: warm start, then asynchronous GRPO with hexrl, evaluated on held-out problems.

    python -m tools.experiments.learning_run OUT              # eta=4 (decoupled, naive) vs eta=0
    python -m tools.experiments.learning_run OUT --ablation   # eta in {0,1,2,4,8,inf} x {naive PPO, decoupled}
    python -m tools.experiments.learning_run OUT --study      # eta 0,1,2,4 decoupled + 4 naive, 3 seeds, vs simulator
    python -m tools.experiments.learning_run OUT --steps 100  # shorter budget
    python -m tools.experiments.learning_run OUT --only 1:naive 4:decoupled

Phase 1 (reported separately): `tools/warm_start.py` trains a tiny char-level model on
arithmetic with cross-entropy for a short budget, into OUT/model. Phase 2: each configuration
is planned (`python -m hexrl.plan`) and run with torchrun: 1 trainer rank and 1 rollout rank, each
pinned to its own core with one thread (the job's `cpu_affinity`; `--shared-cores` restores the
old 2 trainer ranks + 1 rollout rank on whatever cores are free), evaluated with greedy decoding
on the warm start's held-out set every `--eval-every` steps.
Same seeds and step budget for every configuration; a table of final held-out accuracy, steps
and wall time to `--target` accuracy and throughput is printed and written to OUT/summary.md
(and summary.json); with matplotlib, learning.png goes into each run directory and OUT.
Finished configurations (same job.json) are reused, so a re-run only adds what is missing.
`--study` is tools/experiments/learning_study.py: seeds, spread, and the simulator next to the measurements.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from hexrl.control.metrics import read_metrics
from tools.experiments.plot_run import plot

ROOT = Path(__file__).resolve().parents[2]

ETAS = {"0": 0, "1": 1, "2": 2, "4": 4, "8": 8, "inf": None, "auto": "auto"}  # "auto": hexrl/control/auto_eta.py


# --smoke: a short warm start (its accuracy is beside the point) on a small held-out set
SMOKE_WARM_START = ["--steps", "100", "--eval-every", "100", "--target-acc", "0", "--n-heldout", "100",
                    "--n-dev", "50", "--threads", "1"]


def warm_start(out: Path, args: list[str] = ()) -> dict:
    model = out / "model"
    if not (model / "warm_start.json").exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "warm_start.py"), str(model), *args], check=True)
    return json.loads((model / "warm_start.json").read_text())


def layout(shared: bool) -> tuple[dict, dict]:
    """(job fields, their description): 1 trainer + 1 rollout rank on a core each, or the old shared layout."""
    if shared:
        return {"cluster": {"nodes": [{"name": "local", "gpu_type": "cpu", "gpus": 3}]},
                "layout": {"train_gpus": 2, "dp": 2}}, "2 trainer ranks + 1 rollout rank, cores shared"
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit(f"learning_run: a core per rank needs 2 cores, this process may use {cores}; try --shared-cores")
    return {"cluster": {"nodes": [{"name": "local", "gpu_type": "cpu", "gpus": 2}]},
            "layout": {"train_gpus": 1, "dp": 1},
            "cpu_affinity": {"cores": [[cores[0]], [cores[1]]], "disjoint": True, "threads": 1}}, \
        f"1 trainer rank + 1 rollout rank, pinned to cores {cores[0]} and {cores[1]}, one thread each"


def job_for(out: Path, ws: dict, name: str, eta, decoupled: bool, a, seed: int | None = None) -> dict:
    return {
        "name": name, "model": {"path": str(out / "model")},
        "data": ws.get("data") or {"synthetic": ws["data_synthetic"]},  # the warm start's train / held-out split
        "reward": {"name": ws.get("reward", "exact"), "timeout_s": 5},
        "rl": {"batch_size": a.batch, "group_size": a.group, "eta": eta, "lr": a.lr, "decoupled": decoupled,
               "ppo_minibatches": a.minibatches, "behav_cap": a.behav_cap,
               "max_new_tokens": ws["max_new_tokens"], "temperature": 1.0, "steps": a.steps,
               "seed": a.seed if seed is None else seed, "eval_every": a.eval_every,
               **lr_decay(a), **objective(a)},
        **layout(a.shared_cores)[0],
        "out_dir": str(out / name),
    }


CLIP, PROXIMAL = 0.2, ("step", "minibatch")  # the job's defaults (rl.clip_low/high, rl.proximal) and choices


def objective_args(p: argparse.ArgumentParser) -> None:
    """The objective's and the schedule's options, shared with staleness_study.py."""
    p.add_argument("--behav-cap", type=float, default=5.0, help="mask tokens with exp(p - b) above this")
    p.add_argument("--clip", type=float, default=CLIP, help="PPO clip range (rl.clip_low and clip_high)")
    p.add_argument("--proximal", choices=PROXIMAL, default=PROXIMAL[0],
                   help="the proximal policy's weights: the step's (AReaL) or each mini-batch's (rl.proximal)")
    p.add_argument("--lr-final", type=float, help="decay lr linearly to this fraction of it by the last step")


def objective(a) -> dict:
    """--clip and --proximal, only where they differ from the defaults (so earlier runs' job.json still match)."""
    out = {}
    if getattr(a, "clip", CLIP) != CLIP:
        out.update(clip_low=a.clip, clip_high=a.clip)
    if getattr(a, "proximal", PROXIMAL[0]) != PROXIMAL[0]:
        out["proximal"] = a.proximal
    return out


def lr_decay(a) -> dict:
    """--lr-final F: lr falls linearly to F * lr over the whole run (every optimizer step); none without it."""
    if getattr(a, "lr_final", None) is None:
        return {}
    return {"lr_decay_steps": max(1, a.steps * a.minibatches - 1), "lr_final_frac": a.lr_final}


def run_config(out: Path, job: dict, target: float, before=None) -> dict:
    """Plan and run one configuration with torchrun (reused if it finished with the same job.json);
    `before(run_dir)` is called just before a new run starts (the study profiles the CPU there)."""
    run = Path(job["out_dir"])
    same = (run / "job.json").exists() and json.loads((run / "job.json").read_text()) == job
    if not (same and (run / "final" / "config.json").exists()):
        shutil.rmtree(run, ignore_errors=True)  # a run that did not finish: start it again from scratch
        run.mkdir(parents=True)
        (run / "job.json").write_text(json.dumps(job, indent=1))
        if before:
            before(run)
        subprocess.run([sys.executable, "-m", "hexrl.plan", str(run / "job.json"), "-o", str(run / "plan.json")],
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        t0 = time.time()
        nproc = job["cluster"]["nodes"][0]["gpus"]
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                        "-m", "hexrl.main", str(run / "plan.json"), "--run-dir", str(run)],
                       check=True, cwd=ROOT, env=env)
        print(f"  {job['name']}: {time.time() - t0:.0f} s")
    return summarize(run, target)


def summarize(run: Path, target: float = 0.8) -> dict:
    metrics = read_metrics(run / "metrics.jsonl")
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    wall = metrics[-1]["wall_s"]
    hit = next((e for e in evals if e["heldout_accuracy"] >= target), None)  # first evaluation at the target
    return {"name": run.name, "start_acc": evals[0]["heldout_accuracy"], "final_acc": evals[-1]["heldout_accuracy"],
            "best_acc": max(e["heldout_accuracy"] for e in evals), "wall_s": wall, "target": target,
            "target_step": hit and hit["step"], "target_wall_s": hit and hit["wall_s"],
            "traj_per_s": metrics[-1]["trajectories_trained"] / wall,
            "generated_per_s": metrics[-1]["trajectories_produced"] / wall,
            "max_staleness": max(m["max_staleness"] for m in metrics),
            "reward_first": metrics[0]["reward_mean"], "reward_last": metrics[-1]["reward_mean"]}


def table(rows: list[dict]) -> str:
    target = rows[0]["target"] if rows else 0.8
    lines = [f"| config | held-out acc (start -> final, best) | trained traj/s | generated traj/s | wall s "
             f"| step, wall s to {target:.0%} | max staleness |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        hit = f"{r['target_step']}, {r['target_wall_s']:.0f}" if r["target_step"] is not None else "not reached"
        lines.append(f"| {r['name']} | {r['start_acc']:.3f} -> {r['final_acc']:.3f} ({r['best_acc']:.3f}) | "
                     f"{r['traj_per_s']:.0f} | {r['generated_per_s']:.0f} | {r['wall_s']:.0f} | {hit} | "
                     f"{r['max_staleness']} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--ablation", action="store_true")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=64, help="prompt groups per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--lr", type=float, default=2.5e-4)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--minibatches", type=int, default=4, help="PPO mini-batches (optimizer steps) per step")
    objective_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=0.8, help="report the step and wall time to this accuracy")
    p.add_argument("--only", nargs="+", metavar="ETA:OBJ", help="run only these, e.g. 4:decoupled 0:naive")
    p.add_argument("--shared-cores", action="store_true",
                   help="the old layout: 2 trainer ranks + 1 rollout rank, not pinned (cores shared)")
    p.add_argument("--study", action="store_true", help="eta 0,1,2,4 decoupled + 4 naive over --seeds seeds, "
                   "with the simulator's prediction next to each (tools/experiments/learning_study.py)")
    p.add_argument("--seeds", type=int, default=3, help="--study: N seeds, from --first-seed")
    p.add_argument("--first-seed", type=int, default=0, help="--study: the first seed (e.g. to add seeds later)")
    p.add_argument("--smoke", action="store_true", help="--study: 8 steps, batch 16, one seed (checks the pipeline; "
                   "its numbers are not a result)")
    p.add_argument("--docs", type=Path, help="--study: also copy study.md and study.png into this directory")
    a = p.parse_args(argv)
    if a.smoke:
        a.study, a.steps, a.eval_every, a.seeds, a.batch = True, 8, 4, 1, 16
    if a.study:
        return study(a)
    main_runs = [("4", True), ("4", False), ("0", True)]
    configs = [(e, d) for e in ETAS for d in (False, True)] if a.ablation else main_runs
    if a.only:
        pairs = [x.split(":") for x in a.only]
        bad = [x for x, pair in zip(a.only, pairs)
               if len(pair) != 2 or pair[0] not in ETAS or pair[1] not in ("naive", "decoupled")]
        if bad:
            p.error(f"--only: {bad}: each must be ETA:OBJ with ETA in {list(ETAS)} and OBJ naive or decoupled")
        configs = [(eta, obj == "decoupled") for eta, obj in pairs]
    a.out.mkdir(parents=True, exist_ok=True)
    ws = warm_start(a.out)
    print(f"warm start: {ws['steps']} SFT steps, held-out accuracy {ws['heldout_accuracy']:.3f}, "
          f"{ws['wall_seconds']:.0f} s")
    rows = []
    for eta, decoupled in configs:
        name = f"eta{eta}-{'decoupled' if decoupled else 'naive'}"
        rows.append(run_config(a.out, job_for(a.out, ws, name, ETAS[eta], decoupled, a), a.target))
    text = table(rows)
    by = {r["name"]: r for r in rows}
    if "eta4-decoupled" in by and "eta0-decoupled" in by:
        s, w = by["eta0-decoupled"], by["eta4-decoupled"]
        text += (f"\n\nasync (eta=4) vs sync (eta=0): final accuracy {w['final_acc']:.3f} vs {s['final_acc']:.3f}; "
                 f"throughput ratio {w['traj_per_s'] / s['traj_per_s']:.2f}x trajectories/s")
    print(text)
    (a.out / "summary.md").write_text(f"warm start: {json.dumps(ws)}\n\n{text}\n")
    (a.out / "summary.json").write_text(json.dumps(rows, indent=1))
    runs = [a.out / r["name"] for r in rows]
    if all(plot([run], run) for run in runs) and plot(runs, a.out):  # PNGs need matplotlib (optional)
        print(f"plots: {a.out}/learning.png and learning.png in each run directory")


def study(a) -> None:
    """Every configuration of the study over seeds; the CPU profile; the simulator; the tables."""
    from tools.experiments import learning_study as ls

    a.out.mkdir(parents=True, exist_ok=True)
    ws = warm_start(a.out, SMOKE_WARM_START if a.smoke else ())
    fields, where = layout(a.shared_cores)
    stats: dict[str, list[dict]] = {}
    dirs: dict[str, list[Path]] = {}
    seeds = list(range(a.first_seed, a.first_seed + a.seeds))
    core = fields.get("cpu_affinity", {}).get("cores", [[sorted(os.sched_getaffinity(0))[0]]])[0][0]

    def profile(run: Path) -> None:  # the machine as this run meets it
        ls.profile(run, a.out / "model", core)

    for seed in seeds:  # seed-major: an interrupted study has every configuration's first seeds
        for eta, decoupled in ls.STUDY:
            name = f"eta{eta}-{'decoupled' if decoupled else 'naive'}"
            job = job_for(a.out, ws, f"{name}-s{seed}", ETAS[eta], decoupled, a, seed)
            run_config(a.out, job, a.target, before=profile)
            dirs.setdefault(name, []).append(Path(job["out_dir"]))
            stats.setdefault(name, []).append(ls.run_stats(dirs[name][-1]))
    own = {d: d / "profiles" for runs in dirs.values() for d in runs if (d / "profiles" / "cpu.json").exists()}
    late = None  # for runs that predate per-run profiles: one taken now
    if len(own) < sum(map(len, dirs.values())):
        late = ls.profile(a.out, a.out / "model", core).parent
    prompt = ls.prompt_len(job)
    rows = []
    for name, runs in stats.items():
        profs = [own.get(d) or late for d in dirs[name]]
        sims = ls.simulate_windows(dirs[name], profs, prompt, runs, min(a.steps, 40))
        rows.append(ls.aggregate(name, runs, sims))
    head = (("SMOKE RUN: a few steps and one seed to check the pipeline end to end; NOT a result.\n\n" if a.smoke
             else "") + f"{a.steps} steps of {a.batch} prompts x {a.group} samples, lr {a.lr}, {where}; "
            f"warm start {ws['heldout_accuracy']:.3f} held-out; mean [min-max] over seeds {seeds}.\n"
            f"Wall time excludes evaluation; trainer wait = time the trainer waited for a batch / wall; "
            f"idle by /proc = 1 - the rank's CPU utilisation over its whole life (start-up and evaluation "
            f"included).")
    text = head + "\n\n" + ls.tables(rows)
    print(text)
    ls.write_report(a.out, "study", text, {"rows": rows, "runs": stats}, ls.plot(rows, a.out), a.docs, "study")


if __name__ == "__main__":
    main()
