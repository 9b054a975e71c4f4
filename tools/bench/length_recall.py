"""Recall of the long tail: how many of a batch's truly longest 20% of groups the length predictor
(hexrl/control/length_predictor.py) marks as long, signal by signal, on synthetic workloads or on
a run's recorded lengths.

    python -m tools.bench.length_recall [--prompts 1024] [--group 8] [--batch 64] [--epochs 4] [--seed 0] [--seeds 5]
    python -m tools.bench.length_recall --run RUN_DIR    # a real run's recorded lengths (its lengths.jsonl)

Each workload gives every prompt a typical length (its difficulty) that drifts a little each epoch
(lengths grow 10% an epoch and each prompt's by a random 10% more or less), and draws a group's
samples around it (log-normal, cut at 8,192 tokens). A batch of groups is ranked by predicted mean
length; recall@alpha = |predicted longest alpha ∩ truly longest alpha| / |truly longest alpha|, a
group's true length being its samples' mean, averaged over the batches of the last epoch. Rows:
length-blind (random order: alpha), a prompt never seen (the running median, or a noisy hint),
siblings finished (the group's shortest samples, as they finish first; no history), history of
1..epochs-1 earlier epochs, both, mid-wave (every group started together and t tokens have passed:
the samples up to t long have finished, the rest have t tokens), and a batch half of prompts never
seen. "oracle" ranks by each prompt's true typical length this epoch: the best a per-prompt
predictor can do before any sibling finishes (the group's own draw is chance).

With --run, the batches are a run's trained steps as its lengths.jsonl recorded them (each sample's
problem id, group id and generated length): replayed in step order, each step's groups are ranked
by the prediction from every earlier step (history across epochs), alone and with each group's
shortest siblings finished, beside length-blind; every group is recorded after its step is scored.
A second column scores only the steps whose every prompt an earlier step recorded (a later epoch).
"""
from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hexrl.control.length_predictor import LengthPredictor, recall
from hexrl.control.metrics import LENGTHS_FILE, read_metrics

ALPHA = 0.2
MAX_LEN = 8192
FRACTIONS = (0.125, 0.25, 0.5, 0.75)  # of each group finished


@dataclass
class Workload:
    """Per-prompt typical log-lengths, and the spread of a group's samples around them."""

    name: str
    log_typical: np.ndarray  # one per prompt, at epoch 0
    spread: float  # std of log-length within a prompt
    growth: float = 1.1  # lengths grow as the policy learns to reason longer
    drift: float = 0.1  # std of each prompt's own change per epoch (log scale)

    def epochs(self, rng, n: int, group: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """n epochs of (typical length per prompt, lengths [prompts, group])."""
        out, mu = [], self.log_typical.copy()
        for _ in range(n):
            lengths = np.exp(mu[:, None] + self.spread * rng.standard_normal((len(mu), group)))
            out.append((np.exp(mu), np.clip(np.rint(lengths), 1, MAX_LEN)))
            mu = mu + np.log(self.growth) + self.drift * rng.standard_normal(len(mu))
        return out


def workloads(rng, prompts: int) -> list[Workload]:
    """Heavy-tailed difficulty, two kinds of problem (bimodal), and weak structure (noise dominates)."""
    hard = rng.random(prompts) < 0.25
    return [
        Workload("heavy tail", np.log(1000) + 0.8 * rng.standard_normal(prompts), spread=0.5),
        Workload("bimodal", np.where(hard, np.log(4000), np.log(600)) + 0.3 * rng.standard_normal(prompts),
                 spread=0.5),
        Workload("weak structure", np.log(1000) + 0.4 * rng.standard_normal(prompts), spread=0.8),
    ]


def batch_recall(predicted: np.ndarray, true: np.ndarray, batch: int) -> float:
    """recall@ALPHA averaged over consecutive batches of `batch` groups."""
    starts = range(0, len(true) - batch + 1, batch)
    return float(np.mean([recall(predicted[s:s + batch].tolist(), true[s:s + batch].tolist(), ALPHA)
                          for s in starts]))


def history(eps: list, upto: int, prompts: np.ndarray | None = None) -> LengthPredictor:
    """A predictor that recorded epochs [0, upto) (of `prompts` only, if given)."""
    p = LengthPredictor()
    keep = range(len(eps[0][1])) if prompts is None else prompts
    for e in range(upto):
        for i in keep:
            p.record(i, eps[e][1][i].tolist())
    return p


def median_only(eps: list, others: np.ndarray) -> LengthPredictor:
    """A predictor that knows the running median (from other prompts' last epoch) and no prompt here."""
    p = LengthPredictor()
    for i in others:
        p.record(("other", i), eps[-2][1][i].tolist())
    return p


def predictions(p: LengthPredictor, lengths: np.ndarray, order: np.ndarray, fraction: float = 0.0,
                hints: np.ndarray | None = None) -> np.ndarray:
    """p's prediction for each group in `order`, with its shortest `fraction` of samples finished."""
    k = int(fraction * lengths.shape[1] + 0.5)
    out = []
    for i in order:
        finished = np.sort(lengths[i])[:k].tolist()
        hint = None if hints is None else float(hints[i])
        out.append(p.predict(i, hint=hint, finished=finished, group_size=lengths.shape[1]))
    return np.asarray(out)


def wave_predictions(p: LengthPredictor, lengths: np.ndarray, order: np.ndarray, t: float) -> np.ndarray:
    """p's prediction for each group in `order` t tokens into a wave they all started together: the
    samples no longer than t have finished, the others have generated t tokens."""
    return np.asarray([p.predict(i, finished=lengths[i][lengths[i] <= t].tolist(), group_size=lengths.shape[1],
                                 generated=t) for i in order])


def column(w: Workload, args, seed: int) -> dict[str, float]:
    """Every row's recall on one workload (the last epoch's batches, in a shuffled order)."""
    rng = np.random.default_rng(seed + 1)
    eps = w.epochs(rng, args.epochs, args.group)
    typical, lengths = eps[-1]
    order = rng.permutation(args.prompts)
    true = lengths.mean(axis=1)[order]
    score = lambda pred: batch_recall(pred, true, args.batch)  # noqa: E731
    unseen = median_only(eps, np.arange(args.prompts))
    hints = typical * np.exp(0.5 * rng.standard_normal(args.prompts))  # an offline guess, off by ~50%
    rows = {"length-blind (random order)": score(rng.random(args.prompts)),
            "oracle: true typical length": score(typical[order]),
            "never seen: running median": score(predictions(unseen, lengths, order)),
            "never seen: hint (log-noise 0.5)": score(predictions(unseen, lengths, order, hints=hints))}
    for f in FRACTIONS:
        rows[f"siblings only, {f:.0%} finished"] = score(predictions(unseen, lengths, order, f))
    last = args.epochs - 1
    for e in range(1, last + 1):
        rows[f"history, {e} epoch{'s' if e > 1 else ''}"] = score(predictions(history(eps, e), lengths, order))
    full = history(eps, last)
    for f in FRACTIONS[:3]:
        rows[f"history {last} + siblings {f:.0%}"] = score(predictions(full, lengths, order, f))
    for q in (0.25, 0.5):
        t = float(np.quantile(lengths, q))
        at = f"mid-wave at the P{q * 100:.0f} length"
        rows[f"{at}, no history"] = score(wave_predictions(unseen, lengths, order, t))
        rows[f"{at}, history {last}"] = score(wave_predictions(full, lengths, order, t))
    half = history(eps, last, np.arange(0, args.prompts, 2))  # odd prompts never seen
    rows[f"half the prompts never seen, history {last}"] = score(predictions(half, lengths, order))
    rows[f"half never seen, history {last} + siblings 12%"] = score(predictions(half, lengths, order, 0.125))
    return rows


def run_steps(run_dir: Path) -> list[list[tuple[str, list[int]]]]:
    """Per recorded step, in step order: its groups as (problem id, the samples' lengths)."""
    steps = []
    for row in sorted(read_metrics(run_dir / LENGTHS_FILE), key=lambda r: r["step"]):
        groups = defaultdict(list)
        for pid, gid, n in zip(row["problem_ids"], row["group_ids"], row["lengths"]):
            groups[(gid, str(pid))].append(n)
        steps.append([(pid, lengths) for (_, pid), lengths in groups.items()])
    return steps


def replay(steps: list[list[tuple[str, list[int]]]], seen_only: bool = False, seed: int = 0,
           draws: int = 100) -> dict[str, float]:
    """recall@ALPHA per signal, averaged over the steps (with seen_only, over those whose every prompt
    was recorded at an earlier step), replaying them all through one LengthPredictor."""
    rng = np.random.default_rng(seed)
    p, rows = LengthPredictor(), defaultdict(list)
    for groups in steps:
        if seen_only and not all(pid in p.prompts for pid, _ in groups):
            for pid, lengths in groups:
                p.record(pid, lengths)
            continue
        true = [float(np.mean(lengths)) for _, lengths in groups]
        rows["length-blind (random order)"].append(np.mean([recall(rng.random(len(true)).tolist(), true, ALPHA)
                                                            for _ in range(draws)]))
        for f in (0.0, *FRACTIONS):
            pred = []
            for pid, lengths in groups:
                k = int(f * len(lengths) + 0.5)
                pred.append(p.predict(pid, finished=sorted(lengths)[:k], group_size=len(lengths)))
            name = "history (earlier steps)" if f == 0 else f"history + siblings {f:.0%} finished"
            rows[name].append(recall(pred, true, ALPHA))
        for pid, lengths in groups:
            p.record(pid, lengths)
    return {name: float(np.mean(v)) for name, v in rows.items()}


def main_run(run_dir: Path) -> int:
    """The recall table of a real run's recorded lengths; 2 with one line if it recorded none."""
    path = run_dir / LENGTHS_FILE
    steps = run_steps(run_dir) if path.is_file() else []
    if not steps:
        print(f"length_recall: {path}: no recorded steps (a run records them from this version on)")
        return 2
    prompts = {pid for groups in steps for pid, _ in groups}
    lengths = [n for groups in steps for _, ls in groups for n in ls]
    groups = sum(len(g) for g in steps)
    seen, repeats = set(), 0
    for g in steps:
        repeats += sum(pid in seen for pid, _ in g)
        seen.update(pid for pid, _ in g)
    print(f"recall@{ALPHA:.0%}: {run_dir}: {len(steps)} steps, {groups} groups of {len(prompts)} prompts "
          f"({repeats} groups of a prompt seen at an earlier step), {len(lengths)} samples; generated length "
          f"P10/P50/P90/max {np.percentile(lengths, 10):.0f}/{np.median(lengths):.0f}/"
          f"{np.percentile(lengths, 90):.0f}/{max(lengths)} tokens\n")
    every, seen = replay(steps), replay(steps, seen_only=True)
    print("| signal | every step | steps whose prompts all recur |\n|---|---:|---:|")
    for name, value in every.items():
        print(f"| {name} | {value:.2f} | " + (f"{seen[name]:.2f} |" if name in seen else "- |"))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (GRPO group)")
    ap.add_argument("--batch", type=int, default=64, help="groups ranked together")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0, help="the first seed")
    ap.add_argument("--seeds", type=int, default=5, help="how many seeds the figures average over")
    ap.add_argument("--run", type=Path, help="replay this run directory's lengths.jsonl instead")
    args = ap.parse_args(argv)
    if args.run is not None:
        return main_run(args.run)
    seeds = range(args.seed, args.seed + args.seeds)
    tables = []  # per seed: {workload: {row: recall}}
    for seed in seeds:
        tables.append({w.name: column(w, args, seed) for w in workloads(np.random.default_rng(seed), args.prompts)})
    names, rows = list(tables[0]), list(next(iter(tables[0].values())))
    print(f"recall@{ALPHA:.0%}: {args.prompts} prompts x {args.group} samples, batches of {args.batch} groups,"
          f" epoch {args.epochs - 1} of 0..{args.epochs - 1}, mean over seeds {seeds.start}..{seeds.stop - 1}\n")
    print("| signal | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for row in rows:
        print(f"| {row} | " + " | ".join(f"{np.mean([t[n][row] for t in tables]):.2f}" for n in names) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
