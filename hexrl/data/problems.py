"""A problem: one prompt with its reference answer (and test cases for code tasks), and optionally
its expected output length (the length predictor's prior for a prompt it has not seen run).

Kept apart from the loaders (hexrl.data.datasets, hexrl.data.code_data) so that both use it
without importing each other.
"""
from __future__ import annotations

import math
import numbers
import reprlib
from dataclasses import dataclass

KINDS = ("math", "synthetic", "code", "gym")
HINT_FIELD = "length_hint"  # a record's optional field: the problem's expected output length in tokens


def check_length(value, what: str) -> float:
    """`value` as a float if it is a finite non-negative number (numpy's too, not a bool), else
    ValueError naming `what`."""
    try:  # an int beyond a float's range is no length either
        length = None if isinstance(value, bool) or not isinstance(value, numbers.Real) else float(value)
    except OverflowError:
        length = None
    if length is None or not math.isfinite(length) or length < 0:
        raise ValueError(f"{what} must be a non-negative number of tokens, got {reprlib.repr(value)}")
    return length


def length_hint(record: dict) -> float | None:
    """The problem record's `length_hint` (None when absent); ValueError naming the field when it is
    not a non-negative number. A data loader calls it on each record it parses."""
    value = record.get(HINT_FIELD)
    return None if value is None else check_length(value, f"'{HINT_FIELD}'")


@dataclass
class Problem:
    """One prompt with its reference answer (and test cases for code tasks)."""

    prompt: str
    answer: str
    id: int | str
    tests: list | None = None
    kind: str = "math"
    length_hint: float | None = None  # expected output length in tokens, the length predictor's prior

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Problem.kind must be one of {KINDS}, got {self.kind!r}")

    def to_dict(self) -> dict:
        d = {"id": self.id, "prompt": self.prompt, "answer": self.answer, "kind": self.kind}
        if self.tests is not None:
            d["tests"] = self.tests
        if self.length_hint is not None:
            d[HINT_FIELD] = self.length_hint
        return d
