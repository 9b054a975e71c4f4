"""What the controller accepts as a trajectory: only what it asked that replica for.

A message that passed the channel's schema and authentication can still be wrong (a buggy or
subverted replica): a group handed to another replica, a prompt that is not the one sent,
token ids the model has no embedding for (they would crash the trainer), NaN or infinite
numbers (they would poison the loss), versions from the future (sampled or started under), more
tokens than the job allows (an episode: per turn and per observation, times env.max_turns).
Such a trajectory is rejected and counted, never filed into the replay buffer. The schema made
its token fields 1-D arrays of known dtypes, so each check is one vectorized pass over a field.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Dispatched:
    """A prompt group handed out: to whom and what (it is forgotten once its n samples are back)."""

    replica: int
    problem_id: object
    prompt_ids: np.ndarray  # of hexrl.trajectory.ID_DTYPE, as a trajectory message carries it
    long: bool = False  # routed as the long tail (predicted among the longest of its window)
    lengths: list[int] = field(default_factory=list)  # sampled tokens of each sample back so far
    msg: dict = field(default_factory=dict)  # the prompt message sent (resent with a moved group's prefix)


@dataclass
class TokenLimits:
    """The most tokens a trajectory may carry: sampled ones, and all of its completion."""

    generated: int
    completion: int


def token_limits(rl, env=None) -> TokenLimits:
    """Single-turn: rl.max_new_tokens each. An episode (env: EnvSpec): max_turns turns of
    max_new_tokens, and an observation of at most max_obs_tokens before each but the first turn
    and after the start."""
    if env is None:
        return TokenLimits(rl.max_new_tokens, rl.max_new_tokens)
    generated = env.max_turns * rl.max_new_tokens
    return TokenLimits(generated, generated + env.max_turns * env.max_obs_tokens)


def _ints_in(values: np.ndarray, lo: int, hi: int) -> bool:
    """All of `values` (a 1-D integer array) within [lo, hi)."""
    return len(values) == 0 or bool(values.min() >= lo and values.max() < hi)


def _finite(values: np.ndarray) -> bool:
    return bool(np.isfinite(values).all())


def trajectory_problem(msg: dict, sent: Dispatched | None, replica: int, vocab_size: int,
                       limits: TokenLimits, version: int) -> str | None:
    """Why the (schema-valid) trajectory `msg` from `replica` must be refused, as a short reason
    tag; None to accept it. `sent`: what the controller dispatched under its group id."""
    if sent is None or sent.replica != replica:
        return "not_dispatched"  # unknown group, or a group handed to someone else
    if not np.array_equal(msg["prompt_ids"], sent.prompt_ids) or msg.get("problem_id") != sent.problem_id:
        return "wrong_prompt"
    completion = msg["completion_ids"]
    if len(completion) > limits.completion or not _ints_in(completion, 0, vocab_size):
        return "bad_tokens"
    if len(msg["logprobs"]) > limits.generated:  # the schema made it the number of sampled tokens
        return "bad_tokens"
    if not (math.isfinite(msg["reward"]) and _finite(msg["logprobs"])):
        return "not_finite"
    if not (_ints_in(msg["versions"], 0, version + 1) and 0 <= msg["start_version"] <= version):
        return "bad_versions"
    return None


def handback_problem(msg: dict, sent: Dispatched | None, replica: int, asked: bool, group_size: int,
                     vocab_size: int, limits: TokenLimits, version: int) -> str | None:
    """Why the (schema-valid) `withdrawn` group `msg` from `replica` must be refused, as a short
    reason tag; None to move it. `asked`: the controller asked that replica to hand it back. Its
    prefixes are checked as a trajectory's tokens are: they will be trained on."""
    if sent is None or sent.replica != replica or not asked:
        return "not_dispatched"
    lengths = msg["lengths"]
    if len(lengths) != group_size or max(lengths, default=0) > limits.generated:
        return "bad_tokens"
    if not _ints_in(msg["completion_ids"], 0, vocab_size):
        return "bad_tokens"
    if not _finite(msg["logprobs"]):
        return "not_finite"
    if not (_ints_in(msg["versions"], 0, version + 1) and 0 <= msg["start_version"] <= version):
        return "bad_versions"
    return None
