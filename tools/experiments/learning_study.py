"""The async-advantage study: every main configuration over several seeds, measured and simulated.

    python -m tools.experiments.learning_run OUT --study          # eta 0,1,2,4 decoupled + eta 4 naive, 3 seeds
    python -m tools.experiments.learning_run OUT --study --smoke  # a few steps, one seed: checks the pipeline only

Each rank has its own core (1 trainer rank + 1 rollout rank, `cpu_affinity` in the job). Just
before each run starts, the CPU "device" is profiled on one pinned core into RUN/profiles/cpu.json
(tools/bench/bench_kernels.py, the format the planner reads for GPUs): this machine's speed drifts by
more than the 15% the simulator is held to, so each run is simulated with the machine it met.
Runs from before per-run profiles use OUT/profiles/cpu.json, taken after all runs. Each run's
plan, with the workload it measured (prompt and completion lengths), goes through the simulator
CLI (`python -m hexrl.plan simulate`). The workload drifts as the model learns (more groups come
out all correct and are filtered, so each step generates more), so the simulator is run once per
window of WINDOW steps with that window's measured filtered share and completion length, and
compared window by window, averaged over seeds. The rollout leader's time trace
(RUN/engine/replica0.jsonl) tells how fast the machine really ran in each window against the
profile (engine steps, host work; training from the metrics); each window is simulated a second
time with the profile slowed to those speeds, which tests the simulator's model of the pipeline
apart from the machine's drift. OUT/study.md and OUT/study.json hold mean and
min-max over seeds next to the simulator's prediction; OUT/study.png the curves.
Finished runs, the profiles and the simulations are reused, so a re-run only adds what is missing.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np

from hexrl.control.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
STUDY = [("0", True), ("1", True), ("2", True), ("4", True), ("4", False)]  # (eta, decoupled)
TARGETS = (0.7, 0.8, 0.9)  # held-out accuracy levels: steps and wall seconds to reach each
WINDOW = 50  # steps per simulator comparison window
# averaged over windows and seeds
SIM_KEYS = ("step_s", "train_s", "trainer_idle", "rollout_idle", "mean_staleness", "rollout_s", "mean_batch")


# ----------------------------------------------------------------------------- one run

def run_stats(run: Path) -> dict:
    """What the study reports for one finished run (metrics.jsonl, eval.jsonl, cpu/rank*.json)."""
    metrics = read_metrics(run / "metrics.jsonl")
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    wall = metrics[-1]["wall_s"]
    hist = staleness(metrics)
    cpu = {json.loads(p.read_text())["role"]: json.loads(p.read_text()) for p in sorted((run / "cpu").glob("*.json"))}
    out = {"acc_by_step": {e["step"]: e["heldout_accuracy"] for e in evals},
           "wall_by_step": {e["step"]: e["wall_s"] for e in evals}, "wall_s": wall,
           "step_s": wall / len(metrics), "train_s": statistics.fmean(m["train_s"] for m in metrics),
           "traj_per_s": metrics[-1]["trajectories_trained"] / wall,
           "generated_per_s": metrics[-1]["trajectories_produced"] / wall,
           # equal-reward groups are filtered, so generation does more; the simulator is given this share
           "generated_per_trained": metrics[-1]["trajectories_produced"] / max(1, metrics[-1]["trajectories_trained"]),
           "trainer_wait": sum(m["wait_s"] for m in metrics) / wall,
           "trainer_idle_cpu": 1 - cpu["train"]["utilisation"] if "train" in cpu else None,
           "rollout_idle_cpu": 1 - cpu["rollout"]["utilisation"] if "rollout" in cpu else None,
           "cores": {role: c["actual"] for role, c in cpu.items()},
           "mean_staleness": mean_age(hist), "staleness": hist}
    out["windows"] = windows(metrics, min(WINDOW, len(metrics)))
    for w, r in zip(out["windows"], rollout_time(run, out["windows"]) or []):
        w["rollout"] = r
    for t in TARGETS:
        hit = next((e for e in evals if e["heldout_accuracy"] >= t), None)
        out[f"step_{t}"], out[f"wall_{t}"] = (hit["step"], hit["wall_s"]) if hit else (None, None)
    return out


def windows(metrics: list[dict], width: int) -> list[dict]:
    """Per window of `width` steps: mean step seconds (wall, evaluation excluded), training seconds,
    the share of generated trajectories filtered for equal rewards, mean completion tokens, and the
    mean staleness of what was trained."""
    out, prev = [], {"wall_s": 0.0, "trajectories_produced": 0, "trajectories_filtered": 0}
    for end in range(width, len(metrics) + 1, width):
        seg, last = metrics[end - width:end], metrics[end - 1]
        produced = max(1, last["trajectories_produced"] - prev["trajectories_produced"])
        out.append({"steps": [end - width, end], "step_s": (last["wall_s"] - prev["wall_s"]) / width,
                    "produced": [prev["trajectories_produced"], last["trajectories_produced"]],
                    "train_s": statistics.fmean(m["train_s"] for m in seg),
                    "equal_fraction": (last["trajectories_filtered"] - prev["trajectories_filtered"]) / produced,
                    "completion_len": sum(m["rollout_tokens_per_s"] * m["step_s"] for m in seg) / produced,
                    "mean_staleness": mean_age(staleness(seg))})
        prev = last
    return out


def rollout_time(run: Path, windows: list[dict]) -> list[dict] | None:
    """Per window and training step: seconds the rollout leader spent in engine steps, in the rest
    of its loop on the CPU (prompts, rewards, sending) and waiting; the engine's steps, generated
    and prefilled tokens; trajectories sent. From RUN/engine/replica0.jsonl (hexrl/rollout/rollout_rank.py),
    lined up with the window by trajectories sent (the controller's `trajectories_produced`).
    None for runs without it."""
    path = run / "engine" / "replica0.jsonl"
    if not path.exists():
        return None
    trace = [json.loads(x) for x in path.read_text().splitlines()]
    sent = [t["sent"] for t in trace]

    def at(n: float, key: str) -> float:  # the counter when the n-th trajectory was sent
        return float(np.interp(n, sent, [t[key] for t in trace]))

    out = []
    for w in windows:
        (p0, p1), steps = w["produced"], w["steps"][1] - w["steps"][0]
        keys = ("time", "cpu_s", "engine_step_s", "steps", "generated_tokens", "prefill_tokens")
        d = {k: (at(p1, k) - at(p0, k)) / steps for k in keys}
        out.append({"engine_s": d["engine_step_s"], "host_s": d["cpu_s"] - d["engine_step_s"],
                    "wait_s": d["time"] - d["cpu_s"], "decode_steps": d["steps"], "generated": d["generated_tokens"],
                    "prefill": d["prefill_tokens"], "sent": (p1 - p0) / steps,
                    "mean_batch": d["generated_tokens"] / max(d["steps"], 1e-9)})
    return out


def summed_hist(metrics: list[dict], key: str) -> dict[int, int]:
    """The steps' histograms under `key` ({versions behind: count}), summed."""
    hist: dict[int, int] = {}
    for m in metrics:
        for age, n in m[key].items():
            hist[int(age)] = hist.get(int(age), 0) + n
    return hist


def staleness(metrics: list[dict]) -> dict[int, int]:
    """Trained trajectories by staleness (versions behind), summed over the steps."""
    return summed_hist(metrics, "staleness_hist")


def write_report(out: Path, name: str, text: str, data: dict, png: Path | None, docs: Path | None,
                 docs_name: str) -> None:
    """OUT/<name>.md and .json; with `docs`, the .md and the plot copied there as <docs_name>.md / .png."""
    (out / f"{name}.md").write_text(text + "\n")
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))
    if docs:
        docs.mkdir(parents=True, exist_ok=True)
        shutil.copy(out / f"{name}.md", docs / f"{docs_name}.md")
        if png:
            shutil.copy(png, docs / f"{docs_name}.png")


def mean_age(hist: dict[int, int]) -> float:
    return sum(a * n for a, n in hist.items()) / max(1, sum(hist.values()))


# ----------------------------------------------------------------------------- profile + simulator

def profile(out: Path, model: Path, core: int) -> Path:
    """out/profiles/cpu.json: the tiny model measured on one pinned core (kept once written).
    Each run takes one in its own directory just before it starts (this machine's speed drifts by
    more than the 15% the simulator is held to); OUT's, taken after all runs, serves older runs."""
    path = out / "profiles" / "cpu.json"
    if not path.exists():
        subprocess.run([sys.executable, "-m", "tools.bench.bench_kernels", "--out", str(path.parent),
                        "--config", str(model), "--grid", "cpu-rl", "--cpu-core", str(core)],
                       check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return path


def prompt_len(job: dict) -> float:
    """Mean prompt tokens of the job's training problems, as the controller sends them."""
    from hexrl.data.datasets import load_dataset
    from hexrl.data.tokenizer import load_tokenizer

    tok = load_tokenizer(job["model"]["path"])
    train, _ = load_dataset(job["data"]["synthetic"])
    return statistics.fmean(len(tok.encode(tok.chat_prompt(p.prompt))) for p in train)


def simulate(run: Path, profiles: Path, prompt: float, completion: float, equal: float, steps: int,
             tag: str = "") -> dict:
    """The simulator CLI on the run's plan, with the measured workload (prompt and completion
    lengths, the share of groups filtered for equal rewards) and the CPU profile; `tag` names the
    files (one per window); a simulation is reused only for the same workload and profile."""
    out, plan_path = run / f"simulated{tag}.json", run / f"plan_simulated{tag}.json"
    plan = json.loads((run / "plan.json").read_text())
    max_new = plan["rl"]["max_new_tokens"]
    plan["workload"] = {"prompt_len": max(1, round(prompt)),
                        "output_len": {"mean": min(max(1.0, completion), max_new), "max": max_new},
                        "equal_reward_fraction": round(min(equal, 0.99), 4)}
    prof = profiles / "cpu.json"
    key = {"plan": plan, "profile": hashlib.sha256(prof.read_bytes()).hexdigest() if prof.exists() else None}
    key_path = run / f"simulated{tag}.key.json"
    if not (out.exists() and key_path.exists() and json.loads(key_path.read_text()) == key):
        plan_path.write_text(json.dumps(plan, indent=1))
        warm = min(3, steps - 1)
        subprocess.run([sys.executable, "-m", "hexrl.plan", "simulate", str(plan_path),
                        "--steps", str(steps), "--warmup", str(warm), "--json", str(out)],
                       check=True, cwd=ROOT, env={**os.environ, "HEXRL_PROFILES": str(profiles)})
        key_path.write_text(json.dumps(key))
    sim = json.loads(out.read_text())
    hist = {int(k): v for k, v in sim["staleness"].items()}
    return {"step_s": sim["step_time_s"], "train_s": sim["trainer_busy"] * sim["step_time_s"],
            "trainer_idle": sim["idle"]["train"], "rollout_idle": sim["idle"]["rollout"],
            "rollout_s": sim["rollout_busy"] * sim["step_time_s"], "mean_batch": sim["mean_batch"],
            "mean_staleness": mean_age(hist), "staleness": hist}


def cost_model(plan_path: Path, profiles: Path):
    """The planner's cost model for a simulated plan (its measured workload) and a CPU profile."""
    from hexrl.plan.cost import CostModel
    from hexrl.schema import load_plan

    with mock.patch.dict(os.environ, HEXRL_PROFILES=str(profiles)):  # read once, as the model is built
        return CostModel(load_plan(plan_path, check_paths=False).job)


def speeds(run: Path, profiles: Path, prompt: float, w: dict, sim: dict) -> dict | None:
    """How slow the machine ran in this window against its profile (measured / predicted seconds):
    `rollout`, the engine's steps (the measured steps, batch and prefill tokens through the cost
    model); `host`, the leader's other CPU work per trajectory sent; `train`, training against the
    simulator's. None without the rollout trace."""
    r = w.get("rollout")
    if r is None:
        return None
    cm = cost_model(run / f"plan_simulated-w{w['steps'][0]}.json", profiles)
    a, c = cm.decode_coeffs("cpu", 1, max(1, round(r["mean_batch"])))
    context = prompt + w["completion_len"] / 2  # a decode step's mean context per sequence
    engine = r["decode_steps"] * a + c * r["generated"] * context + cm.prefill_s("cpu", 1, r["prefill"], prompt / 2)
    return {"rollout": r["engine_s"] / engine, "host": r["host_s"] / (cm.gpus["cpu"].host_s_per_sample * r["sent"]),
            "train": w["train_s"] / sim["train_s"]}


def at_speeds(profiles: Path, k: dict, out: Path) -> Path:
    """A copy of the profile slowed by the measured factors `k` (speeds()), in out/cpu.json: the
    rollout's decode and prefill fields by k["rollout"], its host work by k["host"], training and
    the controller (on the trainer's core) by k["train"]."""
    d = json.loads((profiles / "cpu.json").read_text())
    for key in ("hbm_efficiency", "decode_mfu", "prefill_mfu"):
        d[key] /= k["rollout"]
    d["decode_overhead_s"] *= k["rollout"]
    d["host_s_per_sample"] *= k["host"]
    d["train_mfu"] /= k["train"]
    d["control_s_per_sample"] *= k["train"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu.json").write_text(json.dumps(d, indent=1))
    return out


def simulate_windows(runs: list[Path], profiles: list[Path], prompt: float, stats: list[dict],
                     steps: int) -> list[dict]:
    """The simulator once per window of every seed's run, on that run's plan and profile with that
    window's measured workload; then, where the run has a rollout trace, again with the profile
    slowed to the speeds the machine ran at in that window (`measured_speed`: whether the simulator's
    model of the pipeline is right once its inputs are). Per window, the simulated figures are
    averaged over the seeds and put next to the measured ones."""
    sims, fixed, ks = [], [], []
    for run, prof, st in zip(runs, profiles, stats):
        sims.append([]), fixed.append([]), ks.append([])
        for w in st["windows"]:
            a = w["steps"][0]
            sims[-1].append(simulate(run, prof, prompt, w["completion_len"], w["equal_fraction"], steps, tag=f"-w{a}"))
            k = speeds(run, prof, prompt, w, sims[-1][-1])
            ks[-1].append(k)
            fixed[-1].append(k and simulate(run, at_speeds(prof, k, run / f"profiles-w{a}"), prompt,
                                            w["completion_len"], w["equal_fraction"], steps,
                                            tag=f"-w{a}-measured-speed"))
    out = []
    for i, w in enumerate(stats[0]["windows"]):
        have = [k for k, st in enumerate(stats) if len(st["windows"]) > i]
        ws = [stats[k]["windows"][i] for k in have]
        traced = [k for k in have if fixed[k][i]]
        out.append({"steps": w["steps"], "equal_fraction": statistics.fmean(x["equal_fraction"] for x in ws),
                    "completion_len": statistics.fmean(x["completion_len"] for x in ws),
                    "sim": {key: statistics.fmean(sims[k][i][key] for k in have) for key in SIM_KEYS},
                    "measured_speed": {key: statistics.fmean(fixed[k][i][key] for k in traced) for key in SIM_KEYS}
                    if traced else None,
                    "speed": {key: spread(ks[k][i][key] for k in traced) for key in ("rollout", "host", "train")}
                    if traced else None,
                    **{key: spread(x[key] for x in ws) for key in ("step_s", "train_s", "mean_staleness")}})
    return out


def whole_run(windows: list[dict], which: str = "sim") -> dict | None:
    """The simulated run: each window's simulated figures (`which`: "sim" with the profile,
    "measured_speed" at the machine's measured speeds), averaged (windows have equal steps)."""
    if any(w[which] is None for w in windows):
        return None
    return {k: statistics.fmean(w[which][k] for w in windows) for k in SIM_KEYS}


# ----------------------------------------------------------------------------- aggregate

def spread(values) -> dict | None:
    """mean, min, max and n of the values that are not None (None when all are)."""
    v = [x for x in values if x is not None]
    return {"mean": statistics.fmean(v), "min": min(v), "max": max(v), "n": len(v)} if v else None


def fmt(s: dict | None, f: str = ".3f", of: int | None = None) -> str:
    if s is None:
        return "not reached" if of else "-"
    text = f"{s['mean']:{f}} [{s['min']:{f}}-{s['max']:{f}}]" if s["min"] != s["max"] else f"{s['mean']:{f}}"
    return text + (f" ({s['n']}/{of})" if of and s["n"] < of else "")


def aggregate(name: str, stats: list[dict], sim_windows: list[dict]) -> dict:
    keys = ("wall_s", "step_s", "train_s", "traj_per_s", "generated_per_s", "trainer_wait", "trainer_idle_cpu",
            "rollout_idle_cpu", "mean_staleness", "generated_per_trained") \
        + tuple(f"{k}_{t}" for t in TARGETS for k in ("step", "wall"))
    row = {"name": name, "seeds": len(stats), "sim": whole_run(sim_windows),
           "measured_speed": whole_run(sim_windows, "measured_speed"), "windows": sim_windows,
           **{k: spread(s[k] for s in stats) for k in keys}}
    eval_steps = sorted(set.intersection(*(set(s["acc_by_step"]) for s in stats)))
    row["acc_by_step"] = {st: spread(s["acc_by_step"][st] for s in stats) for st in eval_steps}
    row["wall_by_step"] = {st: spread(s["wall_by_step"][st] for s in stats) for st in eval_steps}
    return row


def tables(rows: list[dict]) -> str:
    n = rows[0]["seeds"]
    reach = "".join(f" step / wall s to {t:.0%} |" for t in TARGETS)
    head = (f"| config | seeds | final held-out |{reach} trained traj/s | generated traj/s "
            "| trainer wait (idle by /proc) | rollout idle by /proc |\n|---|---|---|" + "---|" * (len(TARGETS) + 4))
    lines = [head]
    for r in rows:
        final = r["acc_by_step"][max(r["acc_by_step"])]
        hits = "".join(f" {fmt(r[f'step_{t}'], '.0f', n)} / {fmt(r[f'wall_{t}'], '.0f', n)} |" for t in TARGETS)
        lines.append(f"| {r['name']} | {r['seeds']} | {fmt(final)} |{hits} "
                     f"{fmt(r['traj_per_s'], '.0f')} | {fmt(r['generated_per_s'], '.0f')} | "
                     f"{fmt(r['trainer_wait'], '.2f')} ({fmt(r['trainer_idle_cpu'], '.2f')}) | "
                     f"{fmt(r['rollout_idle_cpu'], '.2f')} |")
    lines += ["", f"Simulator (python -m hexrl.plan simulate, CPU profile) next to measured, whole run: the simulator "
              f"runs once per {WINDOW}-step window of each seed's run, with that window's measured workload and the "
              "run's own CPU profile (taken just before it started; runs older than that: one taken after all runs), "
              "and its figures are averaged over windows and "
              "seeds; measured step = wall (evaluation excluded) / steps:", "",
              "| config | step s: measured / simulated (ratio) | training s per step: measured / simulated (ratio) "
              "| mean staleness: measured / simulated "
              "| trainer idle: measured wait / simulated | rollout idle: measured / simulated "
              "| generated per trained (simulated with the measured share filtered) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["sim"]
        lines.append(f"| {r['name']} | {fmt(r['step_s'], '.3f')} / {s['step_s']:.3f} "
                     f"({s['step_s'] / r['step_s']['mean']:.2f}x) | {fmt(r['train_s'], '.3f')} / {s['train_s']:.3f} "
                     f"({s['train_s'] / r['train_s']['mean']:.2f}x) | {fmt(r['mean_staleness'], '.2f')} / "
                     f"{s['mean_staleness']:.2f} | {fmt(r['trainer_wait'], '.2f')} / {s['trainer_idle']:.2f} | "
                     f"{fmt(r['rollout_idle_cpu'], '.2f')} / {s['rollout_idle']:.2f} | "
                     f"{fmt(r['generated_per_trained'], '.1f')} |")
    lines += speed_tables(rows)
    spans = [w["steps"] for w in rows[0]["windows"]]
    lines += ["", "Step seconds per window, measured (mean over seeds) / simulated (ratio), and the share of "
              "generated groups filtered for equal rewards in that window (f, the workload the simulator is given):",
              "", "| config | " + " | ".join(f"steps {a}-{b}" for a, b in spans) + " |", "|---|" + "---|" * len(spans)]
    for r in rows:
        cells = [f"{w['step_s']['mean']:.2f} / {w['sim']['step_s']:.2f} "
                 f"({w['sim']['step_s'] / w['step_s']['mean']:.2f}x, f {w['equal_fraction']:.2f})"
                 for w in r["windows"]]
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    steps = sorted(set.intersection(*(set(r["acc_by_step"]) for r in rows)))
    lines += ["", "Held-out accuracy at fixed steps, mean [min-max] over seeds:", "",
              "| config | " + " | ".join(f"step {s}" for s in steps) + " |", "|---|" + "---|" * len(steps)]
    for r in rows:
        lines.append(f"| {r['name']} | " + " | ".join(fmt(r["acc_by_step"][s]) for s in steps) + " |")
    return "\n".join(lines)


def speed_tables(rows: list[dict]) -> list[str]:
    """The simulator at the speeds the machine ran at (runs with a rollout trace only)."""
    rows = [r for r in rows if r["measured_speed"]]
    if not rows:
        return []
    lines = ["", "The same, simulated at the speeds the machine ran at in each window: the profile's rollout "
             "fields slowed by the engine's measured / profile-predicted step seconds (its measured steps, batch "
             "and prefill tokens through the cost model), its host work by the measured CPU seconds per "
             "trajectory outside the engine, training by measured / simulated training seconds. This tests the "
             "simulator's model of the pipeline (overlap, gate, filtering, staleness) with inputs that match "
             "the run:", "",
             "| config | step s: measured / simulated (ratio) | training s per step: measured / simulated "
             "| mean staleness: measured / simulated | trainer idle: measured wait / simulated "
             "| machine vs profile, mean [min-max] over windows: engine / host / training |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        s = r["measured_speed"]
        k = {key: [w["speed"][key]["mean"] for w in r["windows"]] for key in ("rollout", "host", "train")}
        lines.append(f"| {r['name']} | {fmt(r['step_s'], '.3f')} / {s['step_s']:.3f} "
                     f"({s['step_s'] / r['step_s']['mean']:.2f}x) | {fmt(r['train_s'], '.3f')} / {s['train_s']:.3f} | "
                     f"{fmt(r['mean_staleness'], '.2f')} / {s['mean_staleness']:.2f} | "
                     f"{fmt(r['trainer_wait'], '.2f')} / {s['trainer_idle']:.2f} | "
                     + " / ".join(fmt(spread(v), ".2f") for v in k.values()) + "x |")
    spans = [w["steps"] for w in rows[0]["windows"]]
    lines += ["", "Step seconds per window at the measured speeds, measured / simulated (ratio):", "",
              "| config | " + " | ".join(f"steps {a}-{b}" for a, b in spans) + " |", "|---|" + "---|" * len(spans)]
    for r in rows:
        cells = [f"{w['step_s']['mean']:.2f} / {w['measured_speed']['step_s']:.2f} "
                 f"({w['measured_speed']['step_s'] / w['step_s']['mean']:.2f}x)" for w in r["windows"]]
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    return lines


def plot(rows: list[dict], out: Path) -> Path | None:
    """OUT/study.png: mean held-out accuracy (min-max band) vs step and vs wall time."""
    from hexrl.plan.draw import pyplot

    plt = pyplot("learning_study", str(out))
    if plt is None:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows:
        steps = sorted(r["acc_by_step"])
        mean = [r["acc_by_step"][s]["mean"] for s in steps]
        a.plot(steps, mean, marker=".", label=r["name"])
        a.fill_between(steps, [r["acc_by_step"][s]["min"] for s in steps],
                       [r["acc_by_step"][s]["max"] for s in steps], alpha=0.15)
        b.plot([r["wall_by_step"][s]["mean"] for s in steps], mean, marker=".", label=r["name"])
    a.set(xlabel="step", ylabel="held-out accuracy", title=f"mean [min-max] over {rows[0]['seeds']} seed(s)")
    b.set(xlabel="wall s (mean over seeds, evaluation excluded)", title="vs wall time")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.axhline(0.9, color="grey", lw=0.5)
    a.legend(fontsize=8)
    fig.tight_layout()
    path = out / "study.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
