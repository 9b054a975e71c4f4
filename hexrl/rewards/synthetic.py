"""Reward for synthetic tasks (e.g. arithmetic from `hexrl.data.datasets.make_arithmetic`)."""

from __future__ import annotations

EOS_MARKERS = ("<eos>", "</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>")


def first_line(completion: str) -> str:
    """The completion up to the first newline or textual eos marker, stripped."""
    text = completion.lstrip(" \t")
    for marker in ("\n", *EOS_MARKERS):
        text = text.split(marker, 1)[0]
    return text.strip()


def exact_match_reward(completion: str, answer: str) -> float:
    """1.0 if the completion's first line equals `answer` exactly (whitespace stripped), else 0.0."""
    if not isinstance(completion, str) or not isinstance(answer, str):
        return 0.0
    return 1.0 if first_line(completion) == answer.strip() else 0.0
