"""A trajectory: one sampled completion (or episode) of one prompt, as it travels from rollout to trainer."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# The token fields' dtypes on the wire and in the controller's buffer (numpy arrays, one value per token).
ID_DTYPE = np.dtype("<i4")  # token ids: every vocabulary has fewer than 2**31 entries
LOGPROB_DTYPE = np.dtype("<f4")  # the sampler's own precision and the trainer's: float32 keeps them exact
VERSION_DTYPE = np.dtype("<i4")  # weight versions
MASK_DTYPE = np.dtype("u1")  # 1 sampled, 0 observation

TOKEN_FIELDS = ("prompt_ids", "completion_ids", "logprobs", "versions", "mask")


@dataclass(eq=False)  # the generated __eq__ would ask an array for one truth value: see __eq__
class Trajectory:
    """One completion with everything the decoupled PPO loss needs.

    `logprobs[i]` is the behaviour log-prob of `completion_ids[i]` under the distribution it was
    sampled from, and `versions[i]` the weight version that produced it (interrupts can change
    the version mid-sequence).

    An episode (multi-turn) interleaves the model's tokens with the environment's: `mask[j]` is 1
    where `completion_ids[j]` was sampled and 0 where an observation put it (the ids exactly as
    sampled, and each observation as tokenized once: never a re-tokenized transcript). Then
    `logprobs` and `versions` hold one value per sampled token, in order. `mask` None: every
    completion token was sampled (single-turn).

    `start_version` is the weight version the sample was started under: the trajectory's version when
    it has no sampled token (an episode whose environment failed before the model's first turn).

    The token fields are 1-D numpy arrays of ID_DTYPE, LOGPROB_DTYPE, VERSION_DTYPE and MASK_DTYPE
    when the trajectory came over the wire (everything the controller files and hands the trainer;
    read-only views of the received bytes); one built by hand may hold lists. `as_arrays` converts.
    """

    group_id: int  # the prompt group (n samples of one prompt share it)
    prompt_ids: np.ndarray | list[int]
    completion_ids: np.ndarray | list[int]
    logprobs: np.ndarray | list[float]
    versions: np.ndarray | list[int]
    reward: float = 0.0
    finish_reason: str = "length"  # "eos" | "stop" | "length"
    problem_id: str | int | None = None
    meta: dict = field(default_factory=dict)
    mask: np.ndarray | list[int] | None = None
    start_version: int = 0

    @property
    def oldest_version(self) -> int:
        """The version of the first sampled token (the oldest: versions only grow along a sequence), or
        the version the sample was started under if it has none."""
        if len(self.versions) == 0:
            return self.start_version
        return int(self.versions.min()) if isinstance(self.versions, np.ndarray) else min(self.versions)

    @property
    def num_generated(self) -> int:
        """Tokens the model sampled (the loss's tokens)."""
        if self.mask is None:
            return len(self.completion_ids)
        return int(np.count_nonzero(np.asarray(self.mask)))  # mask values are 0 or 1 (shape_problems)

    def generated_positions(self) -> np.ndarray:
        """Indices into `completion_ids` of the sampled tokens (int64)."""
        if self.mask is None:
            return np.arange(len(self.completion_ids))
        return np.flatnonzero(np.asarray(self.mask))

    def shape_problems(self) -> list[str]:
        """What is inconsistent among completion_ids, mask, logprobs and versions."""
        p = []
        if self.mask is not None:
            if len(self.mask) != len(self.completion_ids):
                p.append(f"mask: {len(self.mask)} values for {len(self.completion_ids)} completion tokens")
            if not _zeros_and_ones(self.mask):
                p.append("mask: values must be 0 (environment) or 1 (model)")
        n = self.num_generated if not p else len(self.completion_ids)
        for name in ("logprobs", "versions"):
            if len(getattr(self, name)) != n:
                p.append(f"{name}: {len(getattr(self, name))} values for {n} generated tokens")
        return p

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def as_arrays(self) -> Trajectory:
        """This trajectory with its token fields as arrays of the wire's dtypes (arrays already of
        them are kept, not copied); ValueError if a value does not fit its dtype."""
        return Trajectory(
            group_id=self.group_id, prompt_ids=to_array(self.prompt_ids, ID_DTYPE, "prompt_ids"),
            completion_ids=to_array(self.completion_ids, ID_DTYPE, "completion_ids"),
            logprobs=to_array(self.logprobs, LOGPROB_DTYPE, "logprobs"),
            versions=to_array(self.versions, VERSION_DTYPE, "versions"), reward=self.reward,
            finish_reason=self.finish_reason, problem_id=self.problem_id, meta=self.meta,
            mask=None if self.mask is None else to_array(self.mask, MASK_DTYPE, "mask"),
            start_version=self.start_version)

    def __eq__(self, other) -> bool:
        """Every field equal; token fields by value (a list equals an array of the same numbers)."""
        if not isinstance(other, Trajectory):
            return NotImplemented
        return all(_same_tokens(getattr(self, f), getattr(other, f)) if f in TOKEN_FIELDS else
                   getattr(self, f) == getattr(other, f) for f in self.__dataclass_fields__)


def to_array(values, dtype: np.dtype, name: str) -> np.ndarray:
    """`values` (a list or 1-D array) as a 1-D array of `dtype`; ValueError naming `name` for a value an
    int dtype cannot hold (a bool, a fraction, an int out of range) rather than a silent cast. Floats are
    rounded to the float dtype (one beyond its range becomes infinite, which the controller refuses)."""
    if isinstance(values, np.ndarray) and values.dtype == dtype and values.ndim == 1:
        return values
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a flat sequence, got {arr.ndim} dimensions")
    if arr.size == 0:
        return np.zeros(0, dtype)
    if dtype.kind == "f":
        if arr.dtype.kind not in "iuf":
            raise ValueError(f"{name}: expected numbers, got {arr.dtype}")
        return arr.astype(dtype)
    info = np.iinfo(dtype)
    if arr.dtype.kind not in "iu" or arr.min() < info.min or arr.max() > info.max:
        raise ValueError(f"{name}: expected integers in [{info.min}, {info.max}], got {arr.dtype} "
                         f"in [{arr.min()}, {arr.max()}]")
    return arr.astype(dtype)


def _same_tokens(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and bool(np.all(np.asarray(a) == np.asarray(b)))


def _zeros_and_ones(mask) -> bool:
    """Every value of `mask` is 0 or 1 (an int; a bool in a list does not count)."""
    if isinstance(mask, np.ndarray):
        return mask.dtype.kind in "iu" and (mask.size == 0 or (mask.min() >= 0 and mask.max() <= 1))
    return not any(m not in (0, 1) or isinstance(m, bool) for m in mask)
