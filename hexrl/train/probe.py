"""The policy-change probe: KL(π_v ‖ π_{v+1}) between consecutive weight versions.

A fixed set of held-out problems, each fed as prompt + reference answer + end-of-sequence
(teacher-forced, never trained on), is run through the trainer's model after every step; at
each answer position the full next-token distribution (at the sampling temperature) is kept
until the next step, and the KL between the two is averaged over positions. One packed forward
pass per step; it needs the whole model on the rank (pp = 1, tp = 1), as the tiny CPU study has.
Memory: positions x vocab float32 (32 problems x 6 positions x 20 tokens here; a 150k vocab
with long answers would need a top-k variant).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from hexrl.data.heldout import prompt_ids
from hexrl.trajectory import Trajectory

from .packing import MicroBatch, build_micro_batch


def probe_batch(problems: Sequence, tokenizer, n: int) -> MicroBatch:
    """The first `n` problems (objects with .prompt and .answer) packed as prompt + answer + eos."""
    trajs = []
    for i, p in enumerate(problems[:n]):
        answer = [*tokenizer.encode(p.answer), tokenizer.eos_id]
        trajs.append(Trajectory(group_id=i, prompt_ids=prompt_ids(tokenizer, p.prompt), completion_ids=answer,
                                logprobs=[0.0] * len(answer), versions=[0] * len(answer)))
    return build_micro_batch(trajs, list(range(len(trajs))), [0.0] * len(trajs))


def policy_kl(prev: torch.Tensor, cur: torch.Tensor) -> float:
    """Mean over positions of KL(prev ‖ cur) = Σ_x e^prev (prev − cur), from [N, V] log-probs, in float64."""
    p, q = prev.double(), cur.double()
    terms = torch.where(p > -torch.inf, p.exp() * (p - q), 0.0)  # 0 · log 0 = 0
    return float(terms.sum(-1).mean())


class PolicyProbe:
    """`measure(trainer)` after each step: KL from the previous call's policy (None the first time)."""

    def __init__(self, batch: MicroBatch):
        self.batch = batch
        self.last: torch.Tensor | None = None

    def logprobs(self, trainer) -> torch.Tensor:
        """[N, V] float32 log-probs of the next token at every answer position under the trainer's model."""
        g = trainer.grid
        if g.layout.pp != 1 or g.tp is not None:
            raise ValueError("rl.policy_kl_probe: needs the whole model on one rank (pp = 1, tp = 1)")
        mb = self.batch.to(trainer.device)
        with torch.no_grad():
            h = trainer._run_stage(trainer.model, mb, None)
            logits = trainer.model.logits(h[mb.loss_index], fp32=True)
            return torch.log_softmax(logits / trainer.config.temperature, -1).cpu()

    def measure(self, trainer) -> float | None:
        cur = self.logprobs(trainer)
        kl = policy_kl(self.last, cur) if self.last is not None else None
        self.last = cur
        return kl
