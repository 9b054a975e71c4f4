"""Sequence packing: trajectories -> PPO mini-batches -> DP shares -> micro-batches (no padding).

The step's assignment (`assign`: which sequence goes to which mini-batch, DP rank and
micro-batch) comes from lengths only, so it is cheap and the same wherever it is computed.
A DP rank then packs only its own sequences into flat arrays (`Packed`: one numpy copy per
field, no per-token Python object; Trajectory fields may be lists or numpy arrays) and slices
those into micro-batch tensors. `hexrl.train.handoff` sends each DP rank its `RankShare`.
A sequence enters the model as prompt + completion minus its last token (whose logits
predict nothing); the logits at positions len(prompt)−1 ... predict the completion tokens.
Only the tokens the model sampled are loss tokens: an episode's observation tokens (mask 0)
are context, like the prompt, so loss, importance weights, proximal log-probs, entropy and
token counts all skip them.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from hexrl.trajectory import Trajectory

from .loss import equal_reward_groups, group_advantages


@dataclass
class MicroBatch:
    """Packed sequences, flattened; attention stays within `seq_lens`, positions restart per sequence."""

    seqs: list[int]  # indices into the step's batch
    seq_lens: list[int]  # packed input length of each sequence
    completion_lens: list[int]  # loss (sampled) tokens of each sequence, in order
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    loss_index: torch.Tensor  # [N] rows whose logits predict a sampled completion token
    targets: torch.Tensor  # [N] the sampled completion tokens
    behav: torch.Tensor  # [N] float32 behaviour log-probs
    adv: torch.Tensor  # [N] float32 advantages
    versions: torch.Tensor  # [N] int64 the weight version that generated each token

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        return len(self.targets)

    def to(self, device) -> "MicroBatch":
        moved = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in vars(self).items()}
        return MicroBatch(**moved)


def input_length(t: Trajectory) -> int:
    return len(t.prompt_ids) + len(t.completion_ids) - 1


def _token_problem(i: int, t: Trajectory, vocab_size: int) -> str | None:
    """A trajectory's ids outside [0, vocab_size), checked with one min/max per array."""
    parts = [np.asarray(t.prompt_ids), np.asarray(t.completion_ids)]
    if all(not len(a) or (a.min() >= 0 and a.max() < vocab_size) for a in parts):
        return None
    ids = np.concatenate(parts)
    bad = ids[(ids < 0) | (ids >= vocab_size)][:5].tolist()
    return f"trajectories[{i}]: token ids outside [0, {vocab_size}): {bad}"


def check_trajectories(trajs: list[Trajectory], vocab_size: int | None = None) -> None:
    """Raise one ValueError naming every malformed trajectory and field."""
    problems = []
    for i, t in enumerate(trajs):
        if len(t.prompt_ids) == 0:
            problems.append(f"trajectories[{i}].prompt_ids: empty (the first completion token needs a context)")
        problems += [f"trajectories[{i}].{p}" for p in t.shape_problems()]
        if not isinstance(t.reward, (int, float)) or not math.isfinite(t.reward):
            problems.append(f"trajectories[{i}].reward: must be a finite number, got {t.reward!r}")
        bad = _token_problem(i, t, vocab_size) if vocab_size is not None else None
        if bad:
            problems.append(bad)
    if problems:
        raise ValueError(f"{len(problems)} problem(s) in the training batch:\n  " + "\n  ".join(problems))


def balance(sizes: list[int], bins: int) -> list[list[int]]:
    """Greedy longest-first assignment of items to the currently lightest bin (ties: lowest index)."""
    out, heap = [[] for _ in range(bins)], [(0, b) for b in range(bins)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, b = heapq.heappop(heap)  # the lightest bin, the lowest index among equals
        out[b].append(i)
        heapq.heappush(heap, (load + sizes[i], b))
    return out


def first_fit(sizes: dict[int, int], budget: int) -> list[list[int]]:
    """First-fit decreasing into bins of `budget` tokens; an oversize item gets a bin of its own."""
    bins, free = [], np.zeros(0, dtype=np.int64)  # each bin's room left, scanned in C
    for i in sorted(sizes, key=lambda i: (-sizes[i], i)):
        fits = np.flatnonzero(free >= sizes[i])
        if len(fits):
            bins[fits[0]].append(i)
            free[fits[0]] -= sizes[i]
        else:
            bins.append([i])
            free = np.append(free, budget - sizes[i])
    return bins


@dataclass
class Assignment:
    """Which trained sequences go to which PPO mini-batch, DP rank and micro-batch (from lengths only)."""

    micro_batches: list[list[list[list[int]]]]  # [mini-batch][dp rank][micro-batch] -> batch indices
    num_loss_tokens: list[int]  # [mini-batch] over all DP ranks: the loss's normaliser


def assign(sizes: list[int], generated: list[int], seqs: list[int], minibatches: int, dp: int,
           micro_batch_tokens: int) -> Assignment:
    """Split `seqs` (batch indices of trainable sequences; `sizes` and `generated` are indexed by
    batch index) into token-balanced PPO mini-batches, each balanced across DP ranks and packed
    into micro-batches of at most `micro_batch_tokens`."""
    out, loss_tokens = [], []
    for part in balance([sizes[i] for i in seqs], minibatches):
        mine = [seqs[j] for j in sorted(part)]
        shares = balance([sizes[i] for i in mine], dp)
        out.append([first_fit({mine[j]: sizes[mine[j]] for j in sorted(share)}, micro_batch_tokens)
                    for share in shares])
        loss_tokens.append(sum(generated[i] for i in mine))
    return Assignment(out, loss_tokens)


def _cat(parts: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(parts, dtype=dtype) if parts else np.zeros(0, dtype=dtype)


@dataclass
class Packed:
    """Sequences as flat arrays, in the order they are trained: the input of `micro_batch`."""

    index: np.ndarray  # [S] int64 each sequence's index in the step's batch
    prompt_lens: np.ndarray  # [S] int64
    completion_lens: np.ndarray  # [S] int64
    generated: np.ndarray  # [S] int64 sampled (loss) tokens of each sequence
    adv: np.ndarray  # [S] float32 each sequence's advantage
    tokens: np.ndarray  # [sum(prompt_lens + completion_lens)] int64: each prompt, then its completion
    mask: np.ndarray | None  # [sum(completion_lens)] bool, True where sampled; None: every token was
    logprobs: np.ndarray  # [sum(generated)] float32 behaviour log-probs
    versions: np.ndarray  # [sum(generated)] int64
    _offsets: dict = field(default_factory=dict, repr=False, compare=False)

    def offset(self, name: str) -> np.ndarray:
        """[S + 1] where each sequence starts in `tokens` ("tokens"), `mask` ("completion") or `logprobs`."""
        if name not in self._offsets:
            lens = {"tokens": self.prompt_lens + self.completion_lens, "completion": self.completion_lens,
                    "generated": self.generated}[name]
            self._offsets[name] = np.concatenate(([0], np.cumsum(lens)))
        return self._offsets[name]

    def micro_batch(self, a: int, b: int) -> MicroBatch:
        """Sequences a..b-1 as one flat micro-batch (numpy index arithmetic, no per-token Python)."""
        p, c, k = self.prompt_lens[a:b], self.completion_lens[a:b], b - a
        t0, t1 = self.offset("tokens")[[a, b]]
        tokens = self.tokens[t0:t1]
        lens = p + c - 1  # each sequence minus its last token
        keep = np.ones(len(tokens), dtype=bool)
        keep[self.offset("tokens")[a + 1:b + 1] - t0 - 1] = False
        starts = np.cumsum(lens) - lens  # each sequence's first row
        positions = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(starts, lens)
        j = np.arange(int(c.sum()), dtype=np.int64) - np.repeat(np.cumsum(c) - c, c)  # index in its completion
        rows = np.repeat(starts + p - 1, c) + j  # the row whose logits predict completion token j
        targets = tokens[rows + np.repeat(np.arange(1, k + 1), c)]  # earlier sequences each lost a token
        if self.mask is not None:
            sampled = self.mask[self.offset("completion")[a]:self.offset("completion")[b]]
            rows, targets = rows[sampled], targets[sampled]
        g0, g1 = self.offset("generated")[[a, b]]
        gen, t = self.generated[a:b], torch.from_numpy
        return MicroBatch(self.index[a:b].tolist(), lens.tolist(), gen.tolist(), t(tokens[keep]), t(positions),
                          t(rows), t(targets), t(self.logprobs[g0:g1].copy()), t(np.repeat(self.adv[a:b], gen)),
                          t(self.versions[g0:g1].copy()))


def pack(trajs: list[Trajectory], seqs: list[int], adv: list[float]) -> Packed:
    """The sequences `seqs` of the batch (in that order) as flat arrays; fields may be lists or arrays."""
    ts = [trajs[i] for i in seqs]
    prompts = [np.asarray(t.prompt_ids) for t in ts]
    completions = [np.asarray(t.completion_ids) for t in ts]
    generated = [t.num_generated for t in ts]
    mask = None
    if any(t.mask is not None for t in ts):
        mask = _cat([np.asarray(t.mask) != 0 if t.mask is not None else np.ones(len(c), dtype=bool)
                     for t, c in zip(ts, completions)], bool)
    i64 = np.int64
    return Packed(np.asarray(seqs, dtype=i64).reshape(-1), np.asarray([len(x) for x in prompts], dtype=i64),
                  np.asarray([len(x) for x in completions], dtype=i64), np.asarray(generated, dtype=i64),
                  np.asarray([adv[i] for i in seqs], dtype=np.float32),
                  _cat([x for pc in zip(prompts, completions) for x in pc], i64), mask,
                  _cat([np.asarray(t.logprobs) for t in ts], np.float32),
                  _cat([np.asarray(t.versions) for t in ts], i64))


def build_micro_batch(trajs: list[Trajectory], seqs: list[int], adv: list[float]) -> MicroBatch:
    """Pack the given sequences of the batch into one flat micro-batch."""
    return pack(trajs, seqs, adv).micro_batch(0, len(seqs))


@dataclass
class BatchSummary:
    """What the step's metrics need from the whole batch (every DP rank gets the same)."""

    sequences: int  # sequences trained
    groups: int  # prompt groups in the batch
    groups_filtered: int  # of which filtered (equal rewards)
    oldest_version: int | None  # the oldest sampling version in the batch; None: empty batch
    version_tokens: dict[int, int]  # trained (sampled) tokens per sampling version

    def token_staleness(self, trainer_version: int) -> dict[str, int]:
        """{"lag": count} over the trained tokens, lag = trainer_version - the version that sampled it."""
        lags = {trainer_version - v: n for v, n in self.version_tokens.items()}
        return {str(a): lags[a] for a in sorted(lags)}


def _version_stats(trajs: list[Trajectory], trained: list[int]) -> tuple[int | None, dict[int, int]]:
    """(the oldest version of any trajectory, sampled tokens per version over `trained`), in C per array."""
    oldest, counts, trained = None, {}, set(trained)
    for i, t in enumerate(trajs):
        v = np.asarray(t.versions)
        lo, hi = (int(v.min()), int(v.max())) if len(v) else (t.start_version, t.start_version)
        oldest = lo if oldest is None else min(oldest, lo)
        if i not in trained or not len(v):
            continue
        if lo == hi:  # one version (the usual case)
            counts[lo] = counts.get(lo, 0) + len(v)
            continue
        for k, n in enumerate(np.bincount(v - lo).tolist()):
            if n:
                counts[lo + k] = counts.get(lo + k, 0) + n
    return oldest, counts


@dataclass
class RankShare:
    """One DP rank's part of a training step: its sequences packed in micro-batch order, and what
    every rank shares (each mini-batch's global loss-token count, the batch's summary)."""

    packed: Packed
    counts: list[list[int]]  # [mini-batch][micro-batch] -> its sequences (consecutive rows of `packed`)
    num_loss_tokens: list[int]  # [mini-batch] over all DP ranks: the loss's normaliser
    summary: BatchSummary

    def micro_batches(self) -> list[list[MicroBatch]]:
        """[mini-batch][micro-batch], built from this rank's arrays only."""
        out, a = [], 0
        for sizes in self.counts:
            mbs = []
            for n in sizes:
                mbs.append(self.packed.micro_batch(a, a + n))
                a += n
            out.append(mbs)
        return out


@dataclass
class StepPlan:
    """The step's global decisions, from rewards and lengths only: advantages, the filtered groups,
    the assignment and the summary. Whoever holds the full batch computes it; `share` packs one DP
    rank's part."""

    adv: list[float]  # per batch index
    assignment: Assignment
    summary: BatchSummary

    def share(self, trajs: list[Trajectory], dp_rank: int) -> RankShare:
        per_mb = [mbs[dp_rank] for mbs in self.assignment.micro_batches]
        order = [i for mbs in per_mb for mb in mbs for i in mb]
        counts = [[len(mb) for mb in mbs] for mbs in per_mb]
        return RankShare(pack(trajs, order, self.adv), counts, list(self.assignment.num_loss_tokens), self.summary)


def plan_batch(trajs: list[Trajectory], minibatches: int, dp: int, micro_batch_tokens: int,
               adv_eps: float = 1e-6, filter_equal_groups: bool = True) -> StepPlan:
    """Group advantages, equal-reward filtering and the assignment of a (checked) full batch."""
    rewards = [t.reward for t in trajs]
    group_ids = [t.group_id for t in trajs]
    adv = group_advantages(rewards, group_ids, adv_eps)
    dropped = equal_reward_groups(rewards, group_ids) if filter_equal_groups else set()
    generated = [t.num_generated for t in trajs]
    seqs = [i for i, t in enumerate(trajs) if t.group_id not in dropped and generated[i]]
    sizes = [input_length(t) for t in trajs]
    oldest, version_tokens = _version_stats(trajs, seqs)
    summary = BatchSummary(len(seqs), len(set(group_ids)), len(dropped), oldest, version_tokens)
    return StepPlan(adv, assign(sizes, generated, seqs, minibatches, dp, micro_batch_tokens), summary)


@dataclass
class MiniBatchPlan:
    """One optimizer step's work: micro-batches per DP rank and the global loss-token count."""

    micro_batches: list[list[MicroBatch]]  # [dp rank][micro-batch]
    num_loss_tokens: int  # over all DP ranks: the loss's normaliser


def plan_step(trajs: list[Trajectory], seqs: list[int], adv: list[float], minibatches: int, dp: int,
              micro_batch_tokens: int) -> list[MiniBatchPlan]:
    """Every DP rank's micro-batches of `seqs` (a reference and a tool: a trainer rank builds only
    its own, `StepPlan.share`)."""
    generated = [t.num_generated for t in trajs]
    a = assign([input_length(t) for t in trajs], generated, seqs, minibatches, dp, micro_batch_tokens)
    return [MiniBatchPlan([[build_micro_batch(trajs, mb, adv) for mb in rank] for rank in ranks], n)
            for ranks, n in zip(a.micro_batches, a.num_loss_tokens)]
