"""The staleness study: what does eta=4 cost against eta=0, and why? One command.

    python -m tools.experiments.staleness_study OUT --docs docs/studies/staleness-price  # eta 0, 4 decoupled, 4 naive
    python -m tools.experiments.staleness_study OUT --configs 2.5e-4:0:decoupled 2.5e-4:4:decoupled --seeds 2
    python -m tools.experiments.staleness_study OUT --smoke         # 8 steps, batch 16, one seed: a pipeline check
    python -m tools.experiments.staleness_study OUT --causes --eval-every 10  # each candidate cause vs eta=0
    python -m tools.experiments.staleness_study OUT --seeds 6 --background ...  # detached; log in OUT/study.log

Every configuration (LR:ETA:OBJ) runs from the same warm start (OUT/model, tools/warm_start.py)
at every seed, through tools/experiments/learning_run.py's `run_config`: 1 trainer rank and 1
rollout rank, each pinned to its own core with one thread, held-out accuracy every
`--eval-every` steps. Each run also writes the per-step staleness metrics (hexrl/train/trainer_rank.py):
the trained tokens' lag histogram, the importance weights' spread, the cap's and the clip's
shares, the share of groups filtered for equal rewards, and (rl.policy_kl_probe) the KL between
consecutive policy versions on fixed held-out answers. OUT/staleness.md (tables, the study's
targets for each learning rate with an eta=0 run) and OUT/staleness.png (curves); `--docs DIR`
copies them to DIR/staleness-study.md and .png. Finished runs are reused, so an interrupted
study resumes, and a re-run with more configurations only adds what is missing; a second invocation
on the same OUT waits for the first (OUT/.study.lock), so configurations can be queued.

Paired: every configuration of a seed shares the warm start (OUT/model), the prompt order
and the sampling noise (rl.seed: hexrl/control/dataset.py, the controller's per-group seeds); the
report checks that each pair's job.json differ in nothing else, and gives every configuration's
per-seed difference to eta=0 at its learning rate (OUT/paired.md, DIR/staleness-paired.md): the gap
at the last step and over the run, the wall time to 80% as a ratio, with a 95% t-interval over seeds.
"""
from __future__ import annotations

import argparse
import copy
import fcntl
import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from hexrl.control.metrics import read_metrics
from tools.experiments import learning_run as lr
from tools.experiments.learning_study import fmt, spread, summed_hist, write_report

ROOT = Path(__file__).resolve().parents[2]

DEFAULT = ["1e-4:0:decoupled", "1e-4:4:decoupled", "1e-4:4:naive"]
TARGET = 0.8
LAGS = 5  # token lag shares reported: 0 .. LAGS-1, then "LAGS+"
WINDOW = 100  # steps per window of the per-window tables
SMOOTH = 10  # the smoothed time to TARGET averages the evaluations within this many steps either side


def parse_configs(items: list[str], p: argparse.ArgumentParser) -> list[tuple[float, str, bool, float]]:
    """LR:ETA:OBJ[:LAG] -> (lr, eta key of learning_run.ETAS, decoupled, rl.lr_lag_scale or 0); every bad
    item named at once."""
    out, bad = [], []
    for x in items:
        parts = x.split(":")
        try:
            ok = len(parts) in (3, 4) and float(parts[0]) > 0 and parts[1] in lr.ETAS and \
                parts[2] in ("naive", "decoupled") and (len(parts) == 3 or float(parts[3]) > 0)
        except ValueError:
            ok = False
        if ok:
            lag = float(parts[3]) if len(parts) == 4 else 0.0
            out.append((float(parts[0]), parts[1], parts[2] == "decoupled", lag))
        else:
            bad.append(x)
    if bad:
        p.error(f"--configs: {bad}: each must be LR:ETA:OBJ[:LAG], LR > 0, ETA in {list(lr.ETAS)}, OBJ naive or "
                "decoupled, LAG (rl.lr_lag_scale) > 0")
    return out


def name_of(lr_: float, eta: str, decoupled: bool, lag: float = 0.0) -> str:
    """lr1e-04-eta4-decoupled; with rl.lr_lag_scale, lr1e-04-eta4lag0.25-decoupled."""
    return f"lr{lr_:g}-eta{eta}{f'lag{lag:g}' if lag else ''}-{'decoupled' if decoupled else 'naive'}"


# ----------------------------------------------------------------------------- one run

def read(path: Path) -> list[dict]:
    """A run's metrics.jsonl step rows (its events left out), or eval.jsonl's records."""
    return read_metrics(path)


def mean_of(metrics: list[dict], key: str) -> float | None:
    v = [m[key] for m in metrics if m.get(key) is not None]
    return statistics.fmean(v) if v else None


def token_lags(metrics: list[dict]) -> dict[int, int]:
    """Trained completion tokens by lag (versions behind the trainer), summed over steps."""
    return summed_hist(metrics, "token_staleness_hist")


def smooth_hit(evals: list[dict], half: int = SMOOTH) -> dict | None:
    """The first evaluation at which the mean accuracy of the evaluations within `half` steps of it
    reaches TARGET: one 500-problem evaluation has a standard error of ~1.8 points at 80%, so with
    frequent evaluations the first one past 80% is as much luck as learning."""
    for e in evals:
        near = [x["heldout_accuracy"] for x in evals if abs(x["step"] - e["step"]) <= half]
        if statistics.fmean(near) >= TARGET:
            return e
    return None


def run_stats(run: Path, seed: int = 0) -> dict:
    """What the study reports for one finished run (metrics.jsonl and eval.jsonl)."""
    metrics, evals = read(run / "metrics.jsonl"), read(run / "eval.jsonl")
    last, wall = metrics[-1], metrics[-1]["wall_s"]
    lags = token_lags(metrics)
    total = max(1, sum(lags.values()))
    hit = next((e for e in evals if e["heldout_accuracy"] >= TARGET), None)
    smooth = smooth_hit(evals)
    equal = last["filtered_reasons"].get("equal_rewards", 0)
    out = {"seed": seed, "acc_by_step": {e["step"]: e["heldout_accuracy"] for e in evals},
           "wall_by_step": {e["step"]: e["wall_s"] for e in evals},
           "final": evals[-1]["heldout_accuracy"],
           "average": statistics.fmean(e["heldout_accuracy"] for e in evals[1:]),  # the evaluations after step 0
           "wall_s": wall, "wall_target": hit and hit["wall_s"], "step_target": hit and hit["step"],
           "wall_target_smooth": smooth and smooth["wall_s"], "step_target_smooth": smooth and smooth["step"],
           "traj_per_s": last["trajectories_trained"] / wall,
           "trainer_wait": sum(m["wait_s"] for m in metrics) / wall,
           "train_s": statistics.fmean(m["train_s"] for m in metrics),  # the same work per step: the machine's speed
           "mean_lag": sum(k * n for k, n in lags.items()) / total,
           **{f"lag{k}": lags.get(k, 0) / total for k in range(LAGS)},
           f"lag{LAGS}+": sum(n for k, n in lags.items() if k >= LAGS) / total,
           "equal_share": equal / max(1, last["trajectories_accepted"] + sum(last["filtered_reasons"].values())),
           **{k: mean_of(metrics, k) for k in ("policy_kl", "w_std", "w_p05", "w_p95", "capped_frac", "clip_frac",
                                               "grad_norm")}}
    out["windows"] = [{"steps": [a, a + WINDOW],
                       **{k: mean_of(metrics[a:a + WINDOW], k) for k in ("policy_kl", "w_std", "equal_reward_share",
                                                                          "clip_frac", "eta")},
                       "mean_lag": (lambda h: sum(k * n for k, n in h.items()) / max(1, sum(h.values())))(
                           token_lags(metrics[a:a + WINDOW]))}
                      for a in range(0, len(metrics) - WINDOW + 1, WINDOW)]
    return out


# ----------------------------------------------------------------------------- aggregate and report

KEYS = ("final", "average", "wall_s", "wall_target", "step_target", "wall_target_smooth", "step_target_smooth",
        "traj_per_s", "trainer_wait", "train_s", "mean_lag",
        *(f"lag{k}" for k in range(LAGS)), f"lag{LAGS}+", "equal_share", "policy_kl", "w_std", "w_p05", "w_p95",
        "capped_frac", "clip_frac", "grad_norm")


def aggregate(name: str, stats: list[dict]) -> dict:
    row = {"name": name, "seeds": len(stats), **{k: spread(s[k] for s in stats) for k in KEYS}}
    steps = sorted(set.intersection(*(set(s["acc_by_step"]) for s in stats)))
    row["acc_by_step"] = {st: spread(s["acc_by_step"][st] for s in stats) for st in steps}
    row["wall_by_step"] = {st: spread(s["wall_by_step"][st] for s in stats) for st in steps}
    n = min(len(s["windows"]) for s in stats)
    row["windows"] = [{"steps": stats[0]["windows"][i]["steps"],
                       **{k: spread(s["windows"][i][k] for s in stats)
                          for k in ("policy_kl", "w_std", "equal_reward_share", "clip_frac", "mean_lag", "eta")}}
                      for i in range(n)]
    return row


def targets(rows: dict[str, dict], lrs: list[float]) -> list[str]:
    """The study's targets, for every learning rate that has eta=0 and eta=4 decoupled runs."""
    lines = []
    for x in lrs:
        sync, dec, naive = (rows.get(name_of(x, "0", True)), rows.get(name_of(x, "4", True)),
                            rows.get(name_of(x, "4", False)))
        if not (sync and dec):
            continue
        gap_final = sync["final"]["mean"] - dec["final"]["mean"]
        gap_avg = sync["average"]["mean"] - dec["average"]["mean"]
        lines += [f"lr {x:g}:",
                  f"- eta=4 decoupled vs eta=0, held-out at the last step: {dec['final']['mean']:.3f} vs "
                  f"{sync['final']['mean']:.3f}, gap {100 * gap_final:+.1f} points "
                  f"({'within' if gap_final <= 0.02 else 'NOT within'} 2);",
                  f"- averaged over the evaluations after step 0: {dec['average']['mean']:.3f} vs "
                  f"{sync['average']['mean']:.3f}, gap {100 * gap_avg:+.1f} points "
                  f"({'within' if gap_avg <= 0.02 else 'NOT within'} 2);"]
        for key, how in (("wall_target", "first evaluation"), ("wall_target_smooth", f"smoothed +-{SMOOTH} steps")):
            s, d, ratio = sync[key], dec[key], wall_ratio(sync, dec, key)
            if ratio is not None:
                lines.append(f"- wall s to {TARGET:.0%} ({how}): {d['mean']:.0f} vs {s['mean']:.0f}, {ratio:.2f}x "
                             f"({'meets' if ratio <= 0.7 else 'does NOT meet'} <= 0.7x);")
            else:
                lines.append(f"- wall s to {TARGET:.0%} ({how}): eta=4 {fmt(d, '.0f', dec['seeds'])}, eta=0 "
                             f"{fmt(s, '.0f', sync['seeds'])} (not every seed reached it: no ratio);")
        if naive:
            ahead = (dec["final"]["mean"] - naive["final"]["mean"], dec["average"]["mean"] - naive["average"]["mean"])
            lines.append(f"- decoupled vs naive at eta=4: {100 * ahead[0]:+.1f} points at the last step, "
                         f"{100 * ahead[1]:+.1f} on average ({'ahead' if min(ahead) > 0 else 'NOT ahead on both'}).")
    return lines


def wall_ratio(sync: dict, dec: dict, key: str = "wall_target") -> float | None:
    """dec's mean wall time to TARGET over sync's (`key`: first or smoothed), if every seed of both reached it."""
    s, d = sync[key], dec[key]
    return d["mean"] / s["mean"] if s and d and s["n"] == sync["seeds"] and d["n"] == dec["seeds"] else None


def tables(rows: list[dict]) -> str:
    lines = [f"| config | seeds | held-out, last step | held-out, mean over the run | step / wall s to {TARGET:.0%} "
             f"| the same, smoothed +-{SMOOTH} steps | trained traj/s | trainer wait | training s / step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['seeds']} | {fmt(r['final'])} | {fmt(r['average'])} | "
                     f"{fmt(r['step_target'], '.0f', r['seeds'])} / {fmt(r['wall_target'], '.0f', r['seeds'])} | "
                     f"{fmt(r['step_target_smooth'], '.0f', r['seeds'])} / "
                     f"{fmt(r['wall_target_smooth'], '.0f', r['seeds'])} | "
                     f"{fmt(r['traj_per_s'], '.0f')} | {fmt(r['trainer_wait'], '.2f')} | {fmt(r['train_s'], '.2f')} |")
    lag_head = " | ".join(f"lag {k}" for k in range(LAGS)) + f" | lag {LAGS}+"
    lines += ["", "Per-step staleness metrics, mean over the run (then over seeds): the trained tokens' lag "
              "(versions behind the trainer) and its shares, KL(pi_v || pi_v+1) on the probe set, the importance "
              "weight w = exp(prox - behav) (std, 5th and 95th percentile; 1 for naive), the shares of tokens "
              "masked by the cap (w > 5) and clipped, the share of completed groups filtered for equal rewards, "
              "the gradient norm before clipping:", "",
              f"| config | mean lag | {lag_head} | policy KL / step | w std | w p05 - p95 | capped | clipped "
              "| equal-reward share | grad norm |", "|---|---|" + "---|" * (LAGS + 1) + "---|---|---|---|---|---|---|"]
    for r in rows:
        shares = " | ".join(fmt(r[f"lag{k}"], ".2f") for k in range(LAGS)) + f" | {fmt(r[f'lag{LAGS}+'], '.2f')}"
        lines.append(f"| {r['name']} | {fmt(r['mean_lag'], '.2f')} | {shares} | {fmt(r['policy_kl'], '.2e')} | "
                     f"{fmt(r['w_std'], '.3f')} | {fmt(r['w_p05'], '.3f')} - {fmt(r['w_p95'], '.3f')} | "
                     f"{fmt(r['capped_frac'], '.4f')} | {fmt(r['clip_frac'], '.3f')} | "
                     f"{fmt(r['equal_share'], '.2f')} | "
                     f"{fmt(r['grad_norm'], '.3f')} |")
    spans = [w["steps"] for w in rows[0]["windows"]]
    if spans:
        lines += ["", f"Per {WINDOW}-step window, mean over steps and seeds: policy KL / step, mean token lag, "
                  "share of groups filtered for equal rewards, w std, and the bound in force (the eta metric; "
                  "rl.eta auto moves it):", "",
                  "| config | " + " | ".join(f"steps {a}-{b}" for a, b in spans) + " |", "|---|" + "---|" * len(spans)]
        for r in rows:
            cells = [f"{fmt(w['policy_kl'], '.1e')}, lag {fmt(w['mean_lag'], '.2f')}, "
                     f"f {fmt(w['equal_reward_share'], '.2f')}, w std {fmt(w['w_std'], '.3f')}"
                     + (f", eta {fmt(w['eta'], '.2f')}" if w.get("eta") else "") for w in r["windows"]]
            lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    steps = sorted(set.intersection(*(set(r["acc_by_step"]) for r in rows)))
    if len(steps) > 17:  # frequent evaluations: every k-th, and the last (all of them are in staleness.json)
        steps = sorted({*steps[::-(-(len(steps) - 1) // 16)], steps[-1]})
    lines += ["", "Held-out accuracy at fixed steps, mean [min-max] over seeds:", "",
              "| config | " + " | ".join(f"step {s}" for s in steps) + " |", "|---|" + "---|" * len(steps)]
    for r in rows:
        lines.append(f"| {r['name']} | " + " | ".join(fmt(r["acc_by_step"][s]) for s in steps) + " |")
    return "\n".join(lines)

# ----------------------------------------------------------------------------- paired differences

# Student's t 97.5% quantiles for 1 .. 30 degrees of freedom (a table: no scipy dependency for 30 numbers)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
# the job.json fields a pair may differ in: the configuration itself
UNPAIRED = {("name",), ("out_dir",), ("rl", "eta"), ("rl", "eta_max"), ("rl", "lr_lag_scale")}


def t_interval(values) -> dict | None:
    """Mean and 95% t-interval over per-seed differences (None values dropped); half/low/high None below 2."""
    v = [x for x in values if x is not None]
    if not v:
        return None
    m, n = statistics.fmean(v), len(v)
    half = T975[min(n - 1, len(T975)) - 1] * statistics.stdev(v) / math.sqrt(n) if n > 1 else None
    low, high = (m - half, m + half) if half is not None else (None, None)
    return {"mean": m, "n": n, "half": half, "low": low, "high": high, "values": v}


def flat(d: dict, at: tuple = ()) -> dict:
    return {k: v for key, x in d.items() for k, v in (flat(x, at + (key,)) if isinstance(x, dict)
                                                      else {at + (key,): x}).items()}


def unpaired_fields(a: Path, b: Path) -> list[str]:
    """The job.json fields two runs of a pair differ in beyond the configuration itself (must be none)."""
    if not ((a / "job.json").exists() and (b / "job.json").exists()):
        return ["job.json (missing: cannot tell)"]
    x, y = (flat(json.loads((r / "job.json").read_text())) for r in (a, b))
    return [".".join(k) for k in sorted(set(x) | set(y)) if k not in UNPAIRED and x.get(k) != y.get(k)]


def paired(base: list[dict], other: list[dict]) -> dict:
    """Per-seed differences of `other` against `base` (matched by seed), each with its t_interval: the gap in
    points (base minus other; positive = other is below) at the last step and over the run, the wall time to
    TARGET (first and smoothed) and the trained traj/s as ratios other / base."""
    by = {s["seed"]: s for s in base}
    pairs = [(by[o["seed"]], o) for o in other if o["seed"] in by]

    def ratio(b, o, k):
        return o[k] / b[k] if b[k] and o[k] else None

    return {"seeds": [o["seed"] for _, o in pairs],
            "gap_final": t_interval(100 * (b["final"] - o["final"]) for b, o in pairs),
            "gap_average": t_interval(100 * (b["average"] - o["average"]) for b, o in pairs),
            **{k: t_interval(ratio(b, o, key) for b, o in pairs)
               for k, key in (("wall_ratio", "wall_target"), ("wall_ratio_smooth", "wall_target_smooth"),
                              ("traj_ratio", "traj_per_s"))}}


def ci(t: dict | None, f: str = ".1f", of: int | None = None) -> str:
    """'mean +- half [low, high] (width)' (and 'k/of seeds' when some seeds have no value)."""
    if t is None:
        return "-"
    text = (f"{t['mean']:{f}} +- {t['half']:{f}} [{t['low']:{f}}, {t['high']:{f}}] (width {2 * t['half']:{f}})"
            if t["half"] is not None
            else f"{t['mean']:{f}} (one seed)")
    return text + (f" ({t['n']}/{of} seeds)" if of and t["n"] < of else "")


def paired_report(stats: dict[str, list[dict]], runs: dict[str, list[Path]]) -> tuple[str, dict]:
    """The paired table: every configuration against eta=0 at its learning rate (and objective), auto
    against eta=4 for throughput, a lag-scaled step against its configuration without one; then the
    study's targets read off the intervals."""
    rows, data, bad = [], {}, []
    for name in stats:
        lr_, eta, obj = name.split("-eta")[0][2:], name.split("-eta")[1].split("-")[0], name.rsplit("-", 1)[1]
        base = f"lr{lr_}-eta0-{obj}"
        if eta == "0" or base not in stats:
            continue
        seed_run = {s["seed"]: r for s, r in zip(stats[base], runs[base])}
        for st, o in zip(stats[name], runs[name]):
            if st["seed"] in seed_run and unpaired_fields(seed_run[st["seed"]], o):
                bad.append(f"{o.name}: {unpaired_fields(seed_run[st['seed']], o)}")
        d = data[f"{name} vs eta=0"] = paired(stats[base], stats[name])
        n = len(d["seeds"])
        rows.append(f"| {name} vs eta=0 | {n} | {ci(d['gap_final'])} | {ci(d['gap_average'])} | "
                    f"{ci(d['wall_ratio'], '.2f', n)} | {ci(d['wall_ratio_smooth'], '.2f', n)} | "
                    f"{ci(d['traj_ratio'], '.2f')} |")
    for name in stats:  # auto against eta=4; a lag-scaled step against the same configuration without it
        four, plain = name.replace("-etaauto-", "-eta4-"), re.sub(r"lag[0-9.e+-]+-", "-", name)
        if "-etaauto-" in name and four in stats:
            versus = four, "eta=4"
        elif plain != name and plain in stats:
            versus = plain, "no lag scale"
        else:
            continue
        d = data[f"{name} vs {versus[1]}"] = paired(stats[versus[0]], stats[name])
        rows.append(f"| {name} vs {versus[1]} | {len(d['seeds'])} | {ci(d['gap_final'])} | {ci(d['gap_average'])} | "
                    f"{ci(d['wall_ratio'], '.2f', len(d['seeds']))} | "
                    f"{ci(d['wall_ratio_smooth'], '.2f', len(d['seeds']))} | {ci(d['traj_ratio'], '.2f')} |")
    if not rows:
        return "", data
    head = ("Paired over seeds (each seed's runs share the warm start, the prompt order and the sampling seeds): "
            "per seed, the gap = reference minus configuration in held-out points (positive: the configuration is "
            f"below), and the configuration's wall time to {TARGET:.0%} and trained traj/s over the reference's; "
            "mean +- the 95% t-interval's half-width [low, high] over the seeds. A wall ratio counts the seeds "
            "where both runs reached 80%.")
    lines = [head, "", f"| comparison | seeds | gap at the last step | gap over the run | wall to {TARGET:.0%}, ratio "
             f"| the same, smoothed +-{SMOOTH} steps | trained traj/s, ratio |", "|---|---|---|---|---|---|---|", *rows]
    if bad:
        lines += ["", "NOT PAIRED: these runs differ from their eta=0 run in more than the configuration: "
                  + "; ".join(bad)]
    goals = paired_targets(data)
    return "\n".join(lines + (["", "The targets, read off the intervals:", "", *goals] if goals else [])), data


def paired_targets(data: dict) -> list[str]:
    """The study's targets for eta=4 (within 2 points, <= 0.7x the wall time) and for auto (within 1 point
    with the interval, >= 90% of eta=4's traj/s, <= 0.7x eta=0's wall time), each judged on the interval's bound."""
    out = []
    for key, d in data.items():
        if not key.endswith("vs eta=0") or d["gap_final"] is None or d["gap_final"]["half"] is None:
            continue
        auto = "-etaauto-" in key
        pts = 1.0 if auto else 2.0
        for k, what in (("gap_final", "at the last step"), ("gap_average", "over the run")):
            t = d[k]
            out.append(f"- {key}: within {pts:g} points {what} (upper bound {t['high']:+.1f}): {verdict(t, pts)}")
        for k, what in (("wall_ratio", "first evaluation"), ("wall_ratio_smooth", "smoothed")):
            t = d[k]
            if t is None or t["n"] < len(d["seeds"]) or t["half"] is None:
                out.append(f"- {key}: wall time to 80% ({what}) <= 0.7x: not every seed reached 80%, no verdict")
            else:
                out.append(f"- {key}: wall time to 80% ({what}) <= 0.7x: {t['mean']:.2f}x, upper bound "
                           f"{t['high']:.2f}x: {verdict(t, 0.7)}")
        if auto:
            four = data.get(key.replace("vs eta=0", "vs eta=4"))
            t = four and four["traj_ratio"]
            if t and t["half"] is not None:
                out.append(f"- {key}: trained traj/s >= 0.9x eta=4's: {t['mean']:.2f}x, lower bound {t['low']:.2f}x: "
                           f"{verdict(t, 0.9, at_least=True)}")
    return out


def verdict(t: dict, bound: float, at_least: bool = False) -> str:
    """A target is met when the whole 95% interval is on its side of the bound."""
    sign = -1 if at_least else 1
    if sign * t["low" if at_least else "high"] <= sign * bound:
        return "met"
    return "NOT met (the mean is, the interval is not)" if sign * t["mean"] <= sign * bound else "NOT met"


def plot(rows: list[dict], runs: dict[str, list[Path]], out: Path) -> Path | None:
    """OUT/staleness.png: held-out accuracy vs step and vs wall time, policy KL per step (smoothed)."""
    from hexrl.plan.draw import pyplot

    plt = pyplot("staleness_study", str(out))
    if plt is None:
        return None
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    for r in rows:
        steps = sorted(r["acc_by_step"])
        mean = [r["acc_by_step"][s]["mean"] for s in steps]
        line, = a.plot(steps, mean, marker=".", label=r["name"])
        a.fill_between(steps, [r["acc_by_step"][s]["min"] for s in steps],
                       [r["acc_by_step"][s]["max"] for s in steps], alpha=0.15, color=line.get_color())
        b.plot([r["wall_by_step"][s]["mean"] for s in steps], mean, marker=".", color=line.get_color())
        kl = [[m.get("policy_kl") for m in read(d / "metrics.jsonl")] for d in runs[r["name"]]]
        n = min(map(len, kl))
        per_step = [statistics.fmean(x[i] for x in kl if x[i] is not None) if any(x[i] is not None for x in kl)
                    else float("nan") for i in range(n)]
        k = 10  # a 10-step moving mean
        smooth = [statistics.fmean(per_step[max(0, i - k + 1):i + 1]) for i in range(n)]
        c.plot(range(1, n + 1), smooth, color=line.get_color())
    a.set(xlabel="step", ylabel="held-out accuracy", title=f"mean [min-max] over {rows[0]['seeds']} seed(s)")
    b.set(xlabel="wall s (mean over seeds, evaluation excluded)", title="vs wall time")
    c.set(xlabel="step", ylabel="KL(pi_v || pi_v+1)", yscale="log", title="policy change per step (10-step mean)")
    for ax in (a, b):
        ax.axhline(TARGET, color="grey", lw=0.5)
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    fig.tight_layout()
    path = out / "staleness.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- main

def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--configs", nargs="+", default=DEFAULT, metavar="LR:ETA:OBJ[:LAG]",
                   help=f"learning rate, eta, naive|decoupled, and optionally rl.lr_lag_scale (default "
                   f"{' '.join(DEFAULT)})")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=64, help="prompt groups per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--minibatches", type=int, default=4, help="PPO mini-batches (optimizer steps) per step")
    lr.objective_args(p)  # --behav-cap, --clip, --proximal, --lr-final (each LR decays to that fraction of it)
    p.add_argument("--probe", type=int, default=32, help="held-out problems in the policy-KL probe (0 = off)")
    p.add_argument("--shared-cores", action="store_true", help="learning_run's old unpinned layout")
    p.add_argument("--smoke", action="store_true", help="8 steps, batch 16, one seed: checks the pipeline only")
    p.add_argument("--report", action="store_true", help="tables from the finished runs only; start none")
    p.add_argument("--docs", type=Path, help="copy staleness.md / .png here as staleness-study.md / .png "
                   "(--docs-name) and paired.md as staleness-paired.md")
    p.add_argument("--docs-name", default="staleness-study", help="the tables' name under --docs")
    p.add_argument("--causes", action="store_true",
                   help="every candidate cause in CAUSES against eta=0, each in OUT/<cause>, and OUT/causes.md")
    p.add_argument("--background", action="store_true",
                   help="detach (a new session, immune to hang-ups), log to OUT/study.log, print its pid; queued "
                   "behind any study already running on OUT")
    a = p.parse_args(argv)
    configs = parse_configs(a.configs, p)
    if a.smoke:
        a.steps, a.eval_every, a.seeds, a.batch = 8, 4, 1, 16
    a.out.mkdir(parents=True, exist_ok=True)
    if a.background:
        return detach(a.out, [x for x in (argv if argv is not None else sys.argv[1:]) if x != "--background"])
    if not a.report:  # one study at a time on OUT (both pin the same cores): a second one waits its turn
        lock = open(a.out / ".study.lock", "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
    ws = lr.warm_start(a.out, lr.SMOKE_WARM_START if a.smoke else ())
    if a.causes:
        return causes(a, configs[0][0], ws)
    rows = study(a, configs, ws)
    if not rows:
        sys.exit("staleness_study: no finished run to report")


def detach(out: Path, argv: list[str]) -> None:
    """This command again, without --background, in its own session with its output appended to OUT/study.log."""
    with open(out / "study.log", "a") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tools.experiments.staleness_study", *argv], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                cwd=os.getcwd())
    print(f"staleness_study: running in the background, pid {proc.pid}, log {out / 'study.log'}")


def study(a, configs: list[tuple[float, str, bool, float]], ws: dict) -> dict[str, dict] | None:
    """Run (or with --report, read) every configuration at every seed in a.out; write a.out/staleness.md
    and .png; returns the rows by name (None if no run finished)."""
    stats: dict[str, list[dict]] = {}
    runs: dict[str, list[Path]] = {}
    seeds = list(range(a.first_seed, a.first_seed + a.seeds))
    for seed in seeds:  # seed-major: an interrupted study has every configuration's first seeds
        for x, eta, decoupled, lag in configs:
            name = name_of(x, eta, decoupled, lag)
            args = copy.copy(a)
            args.lr = x
            job = lr.job_for(a.out, ws, f"{name}-s{seed}", lr.ETAS[eta], decoupled, args, seed)
            job["rl"]["policy_kl_probe"] = a.probe
            if lag:
                job["rl"]["lr_lag_scale"] = lag
            run = Path(job["out_dir"])
            if a.report and not (run / "final" / "config.json").exists():
                continue  # --report: finished runs only, as they are (never re-run)
            if not a.report:
                lr.run_config(a.out, job, TARGET)
            runs.setdefault(name, []).append(run)
            stats.setdefault(name, []).append(run_stats(run, seed))
    if not stats:
        return None
    rows = [aggregate(name, s) for name, s in stats.items()]
    by = {r["name"]: r for r in rows}
    head = (("SMOKE RUN: a few steps and one seed to check the pipeline end to end; NOT a result.\n\n" if a.smoke
             else "") + f"{a.steps} steps of {a.batch} prompts x {a.group} samples, {a.minibatches} PPO mini-batches, "
            f"clip {a.clip:g}, behaviour cap {a.behav_cap:g}, "
            f"{'proximal policy recomputed before every mini-batch, ' if a.proximal == 'minibatch' else ''}"
            f"{f'lr decaying linearly to {a.lr_final:g} x lr by the last step, ' if a.lr_final is not None else ''}"
            f"{lr.layout(a.shared_cores)[1]}; warm start "
            f"{ws['heldout_accuracy']:.3f} held-out ({ws.get('n_heldout', 500)} problems); mean [min-max] over seeds "
            f"{sorted({x['seed'] for v in stats.values() for x in v})} (finished runs). "
            "Wall time excludes evaluation and the KL probe; trainer wait = time the trainer waited for a "
            "batch / wall.")
    goals = targets(by, sorted({c[0] for c in configs}))
    text = head + "\n\n" + tables(rows) + ("\n\nThe issue's targets:\n\n" + "\n".join(goals) if goals else "")
    print(text)
    write_report(a.out, "staleness", text, {"rows": rows, "runs": stats}, plot(rows, runs, a.out), a.docs,
                 a.docs_name)
    pair_text, pair_data = paired_report(stats, runs)
    if pair_text:
        print("\n" + pair_text)
        write_report(a.out, "paired", head + "\n\n" + pair_text, pair_data, None, a.docs, "staleness-paired")
    return by


# ----------------------------------------------------------------------------- the candidate causes

# Each changes one setting of the study's own (a constant lr, clip 0.2, cap 5, the proximal policy from the
# step's weights, 64 prompts x 8 per step) and runs eta=0 and eta=4 decoupled at it: name -> (arguments, what).
CAUSES = {
    "base": ({"etas": ("1", "2")}, "the study's settings; eta 1 and 2: what the gate admits (the version mix)"),
    "clip0.1": ({"clip": 0.1}, "the clip range: 0.1 instead of 0.2"),
    "cap2": ({"behav_cap": 2.0}, "the behaviour cap: 2 instead of 5"),
    "proximal-minibatch": ({"proximal": "minibatch"},
                           "the proximal policy's version: recomputed before every mini-batch, not once per step"),
    "batch128": ({"batch_x": 2}, "twice the batch (128 prompts x 8) at equal trained samples (half the steps)"),
}


def cause_args(a, change: dict):
    """The study's arguments with one cause's change (batch_x: the batch times x, steps and evaluations / x)."""
    args = copy.copy(a)
    x = change.get("batch_x", 1)
    args.batch, args.steps, args.eval_every = a.batch * x, a.steps // x, max(1, a.eval_every // x)
    for k, v in change.items():
        if k not in ("batch_x", "etas"):
            setattr(args, k, v)
    return args


def causes(a, lr_: float, ws: dict) -> None:
    """Every cause's sub-study in a.out/<cause> (sharing a.out/model), then a.out/causes.md: per cause, the
    gap eta=0 minus eta=4 (decoupled) and what the per-step metrics say about the stale tokens."""
    rows = []
    for name, (change, what) in CAUSES.items():
        sub = a.out / name
        sub.mkdir(exist_ok=True)
        if not (sub / "model").exists():
            (sub / "model").symlink_to((a.out / "model").resolve())
        args = cause_args(a, change)
        args.out, args.docs = sub, None
        etas = ("0", *change.get("etas", ()), "4")
        by = study(args, [(lr_, e, True, 0.0) for e in etas], ws)
        for e in etas[1:]:
            sync, dec = (by or {}).get(name_of(lr_, "0", True)), (by or {}).get(name_of(lr_, e, True))
            if sync and dec:
                rows.append(cause_row(f"{name}, eta={e}", what, sync, dec))
    head = (f"The candidate causes of eta=4's price (issue 36), one at a time, each against eta=0 at the same "
            f"settings: lr {lr_:g} (constant unless --lr-final), {a.steps} steps of {a.batch} prompts x {a.group} "
            f"unless the row says otherwise, {a.seeds} seed(s) from {a.first_seed}; each row's runs and tables are in "
            "OUT/<cause>/staleness.md. Gap = eta=0 minus eta=N held-out accuracy, in points (mean over seeds); "
            "wall ratio = eta=N's wall s to 80% over eta=0's; w std, policy KL, clipped and capped are eta=N's "
            "means over the run.")
    lines = [head, "", "| cause | what changes | eta=0: last step / mean | eta=N: last step / mean "
             "| gap, last step | gap, mean | wall ratio to 80%, first / smoothed | mean lag | w std | policy KL / step "
             "| clipped | capped |",
             "|---" * 12 + "|"] + rows
    text = "\n".join(lines)
    print(text)
    write_report(a.out, "causes", text, {"rows": rows}, None, a.docs, "staleness-causes")


def cause_row(name: str, what: str, sync: dict, dec: dict) -> str:
    gap = [100 * (sync[k]["mean"] - dec[k]["mean"]) for k in ("final", "average")]
    ratios = [wall_ratio(sync, dec, k) for k in ("wall_target", "wall_target_smooth")]
    ratio = " / ".join(f"{x:.2f}x" if x is not None else "not reached" for x in ratios)
    acc = " | ".join(f"{r['final']['mean']:.3f} / {r['average']['mean']:.3f}" for r in (sync, dec))
    return (f"| {name} | {what} | {acc} | {gap[0]:+.1f} | {gap[1]:+.1f} | {ratio} | {fmt(dec['mean_lag'], '.2f')} | "
            f"{fmt(dec['w_std'], '.3f')} | {fmt(dec['policy_kl'], '.2e')} | {fmt(dec['clip_frac'], '.3f')} | "
            f"{fmt(dec['capped_frac'], '.4f')} |")


if __name__ == "__main__":
    main()
