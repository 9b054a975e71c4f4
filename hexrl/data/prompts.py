"""The prompts a run can use: every problem's chat prompt tokenized, those that cannot be used
skipped with the reason (the preflight checks, hexrl/preflight.py, run this once per rank)."""
from __future__ import annotations

from dataclasses import dataclass, field

from hexrl.data.datasets import load_dataset
from hexrl.data.problems import Problem

_SHOW = 3  # how many skipped prompts a message lists


@dataclass
class Prompts:
    """The problems a run can use, with their encoded chat prompts, and those skipped (id, why)."""

    problems: list[Problem] = field(default_factory=list)
    ids: list[list[int]] = field(default_factory=list)
    skipped: list[tuple[object, str]] = field(default_factory=list)

    def summary(self) -> str:
        shown = "; ".join(f"problem {pid!r}: {why}" for pid, why in self.skipped[:_SHOW])
        more = f"; and {len(self.skipped) - _SHOW} more" if len(self.skipped) > _SHOW else ""
        return shown + more


def encode_prompts(problems: list[Problem], tokenizer, vocab_size: int, max_len: int) -> Prompts:
    """Tokenize every problem's chat prompt; skip (with the reason) those the tokenizer rejects,
    whose ids fall outside the model's vocabulary, or that leave no room for `max_len` tokens."""
    out = Prompts()
    for p in problems:
        try:
            ids = tokenizer.encode(tokenizer.chat_prompt(p.prompt))
        except (ValueError, KeyError, TypeError) as e:  # e.g. a character outside the char alphabet
            out.skipped.append((p.id, str(e)[:200]))
            continue
        if not ids:
            out.skipped.append((p.id, "encodes to no tokens"))
        elif max(ids) >= vocab_size or min(ids) < 0:
            out.skipped.append((p.id, f"token id {max(ids)} outside the model's vocabulary of {vocab_size}"))
        elif len(ids) > max_len:
            out.skipped.append((p.id, f"{len(ids)} prompt tokens leave no room within {max_len}"))
        else:
            out.problems.append(p)
            out.ids.append(ids)
    return out


def run_prompts(job, tokenizer) -> tuple[Prompts, Prompts]:
    """(train, held-out) prompts of `job` that the run can use (raises what load_dataset raises)."""
    train, heldout = load_dataset(job.data.synthetic, job.data.path, job.data.kind, job.data.reasoning_gym)
    cfg = job.model.config
    room = cfg.max_position_embeddings - job.rl.max_new_tokens
    return (encode_prompts(train, tokenizer, cfg.vocab_size, room),
            encode_prompts(heldout, tokenizer, cfg.vocab_size, room))
