"""A problem: one prompt with its reference answer (and test cases for code tasks).

Kept apart from the loaders (hexrl.data.datasets, hexrl.data.code_data) so that both use it
without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("math", "synthetic", "code", "gym")


@dataclass
class Problem:
    """One prompt with its reference answer (and test cases for code tasks)."""

    prompt: str
    answer: str
    id: int | str
    tests: list | None = None
    kind: str = "math"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Problem.kind must be one of {KINDS}, got {self.kind!r}")

    def to_dict(self) -> dict:
        d = {"id": self.id, "prompt": self.prompt, "answer": self.answer, "kind": self.kind}
        if self.tests is not None:
            d["tests"] = self.tests
        return d
