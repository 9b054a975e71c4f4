"""Which groups of a batch will run long: a cheap per-prompt predictor of rollout output length.

RL output lengths are skewed, and the skew belongs to the prompt more than to chance: a hard problem
draws long answers epoch after epoch, and the samples of one group run long together. So the
predictor remembers, per prompt, a decayed mean of the lengths its earlier groups produced (prompts
recur across epochs), and reads the lengths of a group's samples that have already finished (its
siblings): the ones still running started with them, so each is at least as long as the longest
finished one, and as the tokens it has generated so far. A prompt never seen starts from the job's
per-problem hint if it gives one, else from the running median of every length recorded (the
typical sample: a single runaway sample does not move it, and it is the length a plan prices the
regular samples at).

    predictor = LengthPredictor()
    predictor.record("p7", [812, 1430, 655, 2010])       # a completed group's lengths, in tokens
    guesses = [predictor.predict("p7"), predictor.predict("p9", finished=[3100], group_size=4)]
    long = is_long(guesses, alpha=0.2)                  # the predicted longest 20% of the batch
    window = LongTailWindow(alpha=0.2, size=64)         # ... or of the last 64 groups, one at a time:
    mark = window.is_long(guesses[1])                   # at dispatch, then once it went out:
    window.add(guesses[1], mark)

Memory is bounded (the `capacity` prompts recorded most recently; a fixed histogram for the median),
and `record` is O(1) per sample, `predict` O(1) per call.
"""
from __future__ import annotations

import bisect
import math
import numbers
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from hexrl.data.problems import check_length

BINS_PER_OCTAVE = 8  # the median's histogram resolves lengths to about 9%
OCTAVES = 24  # ... up to 2**24 tokens; longer lengths count in the last bin


@dataclass
class LengthQuantiles:
    """Quantiles of every length added, from a log-spaced histogram of fixed size (O(1) to add)."""

    counts: list[int] = field(default_factory=lambda: [0] * (BINS_PER_OCTAVE * OCTAVES))
    total: int = 0

    def add(self, length: float) -> None:
        """Count one length (tokens; under 1 counts as 1)."""
        b = int(BINS_PER_OCTAVE * math.log2(max(length, 1.0)))
        self.counts[min(b, len(self.counts) - 1)] += 1
        self.total += 1

    def quantile(self, q: float) -> float:
        """The q-quantile (the midpoint of its bin on the log scale); 0.0 before anything was added."""
        if self.total == 0:
            return 0.0
        rank, seen = q * self.total, 0
        for b, c in enumerate(self.counts):
            seen += c
            if seen >= rank and c:
                return 2 ** ((b + 0.5) / BINS_PER_OCTAVE)
        return 2 ** ((len(self.counts) - 0.5) / BINS_PER_OCTAVE)


@dataclass
class PromptHistory:
    """One prompt's lengths so far: their decayed mean and the weight behind it (in samples)."""

    mean: float
    weight: float


@dataclass
class LengthPredictor:
    """Predicted mean output length of a prompt's group, from the run's own lengths.

    capacity: prompts remembered (the least recently recorded is forgotten first).
    decay: the weight a prompt's past keeps each time a new group of it is recorded (the policy
    drifts: with 0.5, the last epoch counts as much as all earlier ones together).
    prior_weight: how many samples the prior (hint, else the running median) counts for against a
    prompt's own lengths.
    """

    capacity: int = 100_000
    decay: float = 0.5
    prior_weight: float = 1.0
    prompts: OrderedDict[Hashable, PromptHistory] = field(default_factory=OrderedDict, repr=False)
    seen: LengthQuantiles = field(default_factory=LengthQuantiles, repr=False)

    def __post_init__(self):
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int) or self.capacity < 1:
            raise ValueError(f"capacity must be an int >= 1 (prompts remembered), got {self.capacity!r}")
        if not isinstance(self.decay, numbers.Real) or not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay!r}")
        if not isinstance(self.prior_weight, numbers.Real) or not self.prior_weight > 0:
            raise ValueError(f"prior_weight must be > 0, got {self.prior_weight!r}")

    def record(self, prompt: Hashable, lengths: Sequence[float]) -> None:
        """Remember a completed group of `prompt`: its samples' output lengths in tokens."""
        values = [check_length(v, f"lengths of prompt {prompt!r}") for v in lengths]
        if not values:
            return
        for v in values:
            self.seen.add(v)
        h = self.prompts.pop(prompt, None) or PromptHistory(mean=0.0, weight=0.0)
        old = h.weight * self.decay
        weight = old + len(values)
        self.prompts[prompt] = PromptHistory((h.mean * old + sum(values)) / weight, weight)  # now the most recent
        if len(self.prompts) > self.capacity:
            self.prompts.popitem(last=False)

    def quantile(self, q: float) -> float:
        """The q-quantile of every length recorded (0.0 before any)."""
        if not 0 <= q <= 1:
            raise ValueError(f"q must be in [0, 1], got {q!r}")
        return self.seen.quantile(q)

    def predict(self, prompt: Hashable, hint: float | None = None, finished: Sequence[float] = (),
                group_size: int | None = None, generated: float = 0) -> float:
        """Predicted mean output length of the samples of `prompt`'s group.

        hint: the problem's expected length, the prior for a prompt never seen (else the median).
        finished: the lengths of the group's samples that have finished (of `group_size` in all).
        generated: the tokens its samples still running have produced so far.
        The finished lengths are known; the longest length known (finished or generated) counts as
        that many samples of evidence, blended with the prompt's past, and is a floor for every
        sample still running (they started with the finished ones).
        """
        prior = self.seen.quantile(0.5) if hint is None else check_length(hint, "hint")
        h = self.prompts.get(prompt) or PromptHistory(mean=0.0, weight=0.0)
        weight = self.prior_weight + h.weight
        guess = (self.prior_weight * prior + h.weight * h.mean) / weight
        done = [check_length(v, "finished lengths") for v in finished]
        floor = max([check_length(generated, "generated"), *done])
        running = max(floor, (weight * guess + len(done) * floor) / (weight + len(done)))
        if not done:
            return running
        if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral) or group_size < len(done):
            raise ValueError(f"group_size must be an int >= the {len(done)} finished samples, got {group_size!r}")
        return (sum(done) + (group_size - len(done)) * running) / group_size


def rank(predicted: Sequence[float]) -> list[int]:
    """Indices of `predicted`, longest first (ties keep their order in the batch)."""
    return sorted(range(len(predicted)), key=lambda i: -predicted[i])


def check_alpha(alpha) -> None:
    """ValueError unless alpha, the long tail's share, is a number in [0, 1)."""
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0 <= alpha < 1:
        raise ValueError(f"alpha must be in [0, 1), got {alpha!r}")


def is_long(predicted: Sequence[float], alpha: float = 0.2) -> list[bool]:
    """Per entry of a batch, whether it is among the round(alpha * len) predicted longest: the
    long-tail class (alpha 0 marks none)."""
    check_alpha(alpha)
    marked = [False] * len(predicted)
    for i in rank(predicted)[:int(alpha * len(predicted) + 0.5)]:
        marked[i] = True
    return marked


@dataclass
class LongTailWindow:
    """Marks groups long one at a time as they are dispatched, over a sliding window: a group is
    long when its prediction ranks among the round(alpha x n) longest of the last `size` groups
    dispatched (n of them, itself included; `size` is a batch's worth), with at most that many of
    the window marked: the longest first, and among equal predictions the earliest (as `is_long`
    breaks ties by batch order). A group predicted no longer than every other in the window is
    never long: where all predictions tie (nothing recorded yet, no hints) nothing is known, and
    nothing is marked. O(log size) to decide, O(size) memory moves to add."""

    alpha: float
    size: int
    recent: deque = field(default_factory=deque, repr=False)  # (prediction, marked), oldest first
    ranked: list = field(default_factory=list, repr=False)  # the window's predictions, sorted
    ranked_long: list = field(default_factory=list, repr=False)  # ... of the groups marked long

    def __post_init__(self):
        check_alpha(self.alpha)
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"size must be an int >= 1 (groups in the window), got {self.size!r}")

    def is_long(self, predicted: float) -> bool:
        """Whether a group predicted `predicted` long, dispatched next, is in the long tail."""
        quota = int(self.alpha * (len(self.recent) + 1) + 0.5)  # the window with this group in it
        longer = len(self.ranked) - bisect.bisect_right(self.ranked, predicted)
        long_ahead = len(self.ranked_long) - bisect.bisect_left(self.ranked_long, predicted)
        return longer < quota and long_ahead < quota and bool(self.ranked) and predicted > self.ranked[0]

    def add(self, predicted: float, long: bool) -> None:
        """The group went out (marked `long` or not): it enters the window, the oldest leaves when full."""
        if len(self.recent) == self.size - 1:  # the window holds size - 1 earlier groups and the next one
            old, was_long = self.recent.popleft()
            self.ranked.pop(bisect.bisect_left(self.ranked, old))
            if was_long:
                self.ranked_long.pop(bisect.bisect_left(self.ranked_long, old))
        if self.size > 1:
            self.recent.append((predicted, long))
            bisect.insort(self.ranked, predicted)
            if long:
                bisect.insort(self.ranked_long, predicted)


def outgrew(predictor: LengthPredictor, window: LongTailWindow, prompt: Hashable, hint: float | None,
            finished: Sequence[float], running: Sequence[float], group_size: int) -> bool:
    """Whether a group sent as regular has outgrown its prediction: predicted again from what its
    samples have produced (`finished`: the lengths of those done; `running`: the tokens each of the
    others has generated so far, a floor for all of them), it would now be marked long in `window`.
    A group with no sample running has nothing left to move."""
    if not running:
        return False
    guess = predictor.predict(prompt, hint, finished=finished, group_size=group_size, generated=max(running))
    return window.is_long(guess)


def recall(predicted: Sequence[float], actual: Sequence[float], alpha: float = 0.2) -> float:
    """The share of the batch's truly longest round(alpha * len) that `is_long` marks (1.0 when
    that is none): how well `predicted` finds the long tail of `actual`."""
    if len(predicted) != len(actual):
        raise ValueError(f"predicted has {len(predicted)} entries and actual {len(actual)}: one per group")
    truly = is_long(actual, alpha)
    want = sum(truly)
    return sum(t and m for t, m in zip(truly, is_long(predicted, alpha))) / want if want else 1.0
