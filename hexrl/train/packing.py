"""Sequence packing: trajectories -> PPO mini-batches -> DP shares -> micro-batches (no padding).

Every trainer rank runs the same deterministic plan on the same full batch, so all ranks of
a pipeline agree on the micro-batches and their shapes without exchanging metadata.
A sequence enters the model as prompt + completion minus its last token (whose logits
predict nothing); the logits at positions len(prompt)−1 ... predict the completion tokens.
Only the tokens the model sampled are loss tokens: an episode's observation tokens (mask 0)
are context, like the prompt, so loss, importance weights, proximal log-probs, entropy and
token counts all skip them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hexrl.trajectory import Trajectory


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


def check_trajectories(trajs: list[Trajectory], vocab_size: int | None = None) -> None:
    """Raise one ValueError naming every malformed trajectory and field."""
    problems = []
    for i, t in enumerate(trajs):
        if len(t.prompt_ids) == 0:
            problems.append(f"trajectories[{i}].prompt_ids: empty (the first completion token needs a context)")
        problems += [f"trajectories[{i}].{p}" for p in t.shape_problems()]
        if not isinstance(t.reward, (int, float)) or not math.isfinite(t.reward):
            problems.append(f"trajectories[{i}].reward: must be a finite number, got {t.reward!r}")
        ids = [*t.prompt_ids, *t.completion_ids]
        if vocab_size is not None and ids and (min(ids) < 0 or max(ids) >= vocab_size):  # C-speed scan first
            bad = [x for x in ids if not 0 <= x < vocab_size]
            problems.append(f"trajectories[{i}]: token ids outside [0, {vocab_size}): {bad[:5]}")
    if problems:
        raise ValueError(f"{len(problems)} problem(s) in the training batch:\n  " + "\n  ".join(problems))


def balance(sizes: list[int], bins: int) -> list[list[int]]:
    """Greedy longest-first assignment of items to the currently lightest bin (ties: lowest index)."""
    out, load = [[] for _ in range(bins)], [0] * bins
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        b = min(range(bins), key=lambda b: (load[b], b))
        out[b].append(i)
        load[b] += sizes[i]
    return out


def first_fit(sizes: dict[int, int], budget: int) -> list[list[int]]:
    """First-fit decreasing into bins of `budget` tokens; an oversize item gets a bin of its own."""
    bins, load = [], []
    for i in sorted(sizes, key=lambda i: (-sizes[i], i)):
        for b in range(len(bins)):
            if load[b] + sizes[i] <= budget:
                bins[b].append(i)
                load[b] += sizes[i]
                break
        else:
            bins.append([i])
            load.append(sizes[i])
    return bins


def build_micro_batch(trajs: list[Trajectory], seqs: list[int], adv: list[float]) -> MicroBatch:
    """Pack the given sequences of the batch into one flat micro-batch."""
    ids, pos, loss_index, targets, behav, advs, lens, clens, versions = [], [], [], [], [], [], [], [], []
    for i in seqs:
        t = trajs[i]
        seq = (list(t.prompt_ids) + list(t.completion_ids))[:-1]
        start = len(ids) + len(t.prompt_ids) - 1
        if t.mask is None:
            loss_index.extend(range(start, start + len(t.completion_ids)))
            targets.extend(t.completion_ids)
        else:
            where = t.generated_positions()
            loss_index.extend(start + j for j in where)
            targets.extend(t.completion_ids[j] for j in where)
        ids.extend(seq)
        pos.extend(range(len(seq)))
        behav.extend(t.logprobs)
        versions.extend(t.versions)
        advs.extend([adv[i]] * t.num_generated)
        lens.append(len(seq))
        clens.append(t.num_generated)
    i64, f32 = torch.int64, torch.float32
    return MicroBatch(seqs, lens, clens, torch.tensor(ids, dtype=i64), torch.tensor(pos, dtype=i64),
                      torch.tensor(loss_index, dtype=i64), torch.tensor(targets, dtype=i64),
                      torch.tensor(behav, dtype=f32), torch.tensor(advs, dtype=f32), torch.tensor(versions, dtype=i64))


@dataclass
class MiniBatchPlan:
    """One optimizer step's work: micro-batches per DP rank and the global loss-token count."""

    micro_batches: list[list[MicroBatch]]  # [dp rank][micro-batch]
    num_loss_tokens: int  # over all DP ranks: the loss's normaliser


def plan_step(trajs: list[Trajectory], seqs: list[int], adv: list[float], minibatches: int, dp: int,
              micro_batch_tokens: int) -> list[MiniBatchPlan]:
    """Split `seqs` (indices of trainable sequences) into token-balanced PPO mini-batches, each
    balanced across DP ranks and packed into micro-batches of at most `micro_batch_tokens`."""
    plans = []
    for part in balance([input_length(trajs[i]) for i in seqs], minibatches):
        mine = [seqs[j] for j in sorted(part)]
        shares = balance([input_length(trajs[i]) for i in mine], dp)
        mbs = []
        for share in shares:
            sizes = {mine[j]: input_length(trajs[mine[j]]) for j in sorted(share)}
            mbs.append([build_micro_batch(trajs, b, adv) for b in first_fit(sizes, micro_batch_tokens)])
        plans.append(MiniBatchPlan(mbs, sum(trajs[i].num_generated for i in mine)))
    return plans
