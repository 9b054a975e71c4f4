"""Walk a dataset epoch after epoch in a seeded shuffled order, with a resumable position.

The order of epoch e depends only on (seed, e, len(problems)), so `state()` is just
(epoch, index): restoring it continues exactly where the saved run stopped, with no prompt
repeated or skipped.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


class DatasetCursor:
    """`next()` returns problems in a deterministic per-epoch order; `max_epochs` ends it."""

    def __init__(self, problems: Sequence, seed: int = 0, shuffle: bool = True, max_epochs: int | None = None):
        if len(problems) == 0:
            raise ValueError("the dataset is empty")
        if max_epochs is not None and max_epochs < 1:
            raise ValueError(f"max_epochs must be >= 1 or None, got {max_epochs}")
        self.problems = problems
        self.seed, self.shuffle, self.max_epochs = seed, shuffle, max_epochs
        self.epoch, self.index = 0, 0  # position: next problem is order(epoch)[index]
        self._order = self._order_of(0)

    def _order_of(self, epoch: int) -> np.ndarray:
        n = len(self.problems)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def next_indexed(self) -> tuple[int, object]:
        """(index in the dataset, problem) of the next problem; StopIteration after max_epochs."""
        if self.index == len(self.problems):
            if self.max_epochs is not None and self.epoch + 1 >= self.max_epochs:
                raise StopIteration
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._order_of(self.epoch)
        i = int(self._order[self.index])
        self.index += 1
        return i, self.problems[i]

    def next(self):
        """The next problem."""
        return self.next_indexed()[1]

    __next__ = next

    def __iter__(self):
        return self

    @property
    def consumed(self) -> int:
        """Problems handed out since the start of the run (all epochs)."""
        return self.epoch * len(self.problems) + self.index

    def state(self) -> dict:
        """Position to save with a checkpoint (plus what must match on restore)."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "shuffle": self.shuffle,
                "size": len(self.problems)}

    def load_state(self, state: dict) -> None:
        """Continue from a saved position; the dataset, seed and shuffle must be the same."""
        problems = [f"{k}: saved {state.get(k)!r}, now {mine!r}" for k, mine in
                    (("seed", self.seed), ("shuffle", self.shuffle), ("size", len(self.problems)))
                    if state.get(k) != mine]
        epoch, index = state.get("epoch"), state.get("index")
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(index, int) and 0 <= index <= len(self.problems)):
            problems.append(f"bad position epoch={epoch!r} index={index!r}")
        if problems:
            raise ValueError("cannot resume dataset cursor: " + "; ".join(problems))
        self.epoch, self.index = epoch, index
        self._order = self._order_of(epoch)
