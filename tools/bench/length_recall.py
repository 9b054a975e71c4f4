"""Recall of the long tail: how many of a batch's truly longest 20% of groups the length predictor
(hexrl/control/length_predictor.py) marks as long, signal by signal, on synthetic workloads.

    python tools/bench/length_recall.py [--prompts 1024] [--group 8] [--batch 64] [--epochs 4] [--seed 0] [--seeds 5]

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
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from hexrl.control.length_predictor import LengthPredictor, recall

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (GRPO group)")
    ap.add_argument("--batch", type=int, default=64, help="groups ranked together")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0, help="the first seed")
    ap.add_argument("--seeds", type=int, default=5, help="how many seeds the figures average over")
    args = ap.parse_args(argv)
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
