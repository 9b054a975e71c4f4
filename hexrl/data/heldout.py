"""Held-out evaluation: batched greedy decoding with the plain model, scored by exact match.

The model has no padding mask, so prompts are grouped by token length and each batch holds
prompts of one length; every step re-runs the whole prefix (no KV cache), which is fast
enough for the tiny models this is used with (a few thousand problems in seconds).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

import torch

from hexrl.rewards import exact_match_reward


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of a problem's prompt as the model sees it (chat template, no specials added)."""
    return tokenizer.encode(tokenizer.chat_prompt(prompt))


def _stop_ids(tokenizer) -> set[int]:
    return set(getattr(tokenizer, "stop_ids", None) or [tokenizer.eos_id])


@torch.inference_mode()
def greedy_decode(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: set[int]) -> list[list[int]]:
    """Greedy continuations of equal-length prompts, each cut before its first stop token (on the
    model's device)."""
    device = _device(model)
    ids = torch.tensor([list(p) for p in prompts], dtype=torch.long, device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    out = []
    for _ in range(max_new_tokens):
        nxt = model(ids)[:, -1].argmax(-1)
        out.append(nxt)
        done |= torch.isin(nxt, stop)
        if done.all():
            break
        ids = torch.cat([ids, nxt[:, None]], dim=1)
    rows = torch.stack(out, dim=1).tolist()
    return [_cut(r, stop_ids) for r in rows]


def _device(model) -> torch.device:
    """Where the model's weights live (the CPU for a model without parameters)."""
    first = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return first.device if first is not None else torch.device("cpu")


def _cut(tokens: list[int], stop_ids: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[:i]
    return tokens


def greedy_accuracy(model, tokenizer, problems: Sequence, max_new_tokens: int, batch_size: int = 256,
                    reward_fn: Callable[[str, str], float] = exact_match_reward) -> tuple[float, list[str]]:
    """Mean reward of greedy completions over `problems` (objects with .prompt and .answer).

    Returns (accuracy, completions in the order of `problems`).
    """
    errors = []
    if not problems:
        errors.append("problems: empty")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        errors.append(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        errors.append(f"batch_size: expected an int >= 1, got {batch_size!r}")
    if errors:
        raise ValueError("greedy_accuracy: " + "; ".join(errors))
    was_training = model.training
    model.eval()
    encoded = [prompt_ids(tokenizer, p.prompt) for p in problems]
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(encoded):
        by_len[len(ids)].append(i)
    completions: list[str] = [""] * len(problems)
    stop = _stop_ids(tokenizer)
    for idx in by_len.values():
        for s in range(0, len(idx), batch_size):
            chunk = idx[s:s + batch_size]
            outs = greedy_decode(model, [encoded[i] for i in chunk], max_new_tokens, stop)
            for i, toks in zip(chunk, outs):
                completions[i] = tokenizer.decode(toks)
    model.train(was_training)
    acc = sum(reward_fn(c, p.answer) for c, p in zip(completions, problems)) / len(problems)
    return acc, completions
