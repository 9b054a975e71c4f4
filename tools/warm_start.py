"""Supervised warm start of a tiny model on synthetic arithmetic, before RL.

    python tools/warm_start.py OUT_DIR [--steps 300 --digits 1 2 --ops +- --seed 0]
    python tools/warm_start.py OUT_DIR --rl-check 300   # then a quick single-process GRPO check

Creates a random tiny Qwen2-shaped model, trains it with cross-entropy on the answer tokens
plus eos (prompt masked) for a deliberately SHORT budget, so held-out greedy accuracy lands
well below its ceiling and RL has room to improve. Writes an HF checkpoint, the char
tokenizer and `warm_start.json` (task, held-out split, steps, loss, accuracy, wall time).

`--rl-check` is a reference experiment only (not hexrl's trainer): on-policy REINFORCE with
group-normalised advantages, n samples per prompt at temperature 1, exact-match reward.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_tiny_model import tiny_config  # noqa: E402

from hexrl.data import make_arithmetic_split  # noqa: E402
from hexrl.evaluate import greedy_accuracy, prompt_ids  # noqa: E402
from hexrl.model import Decoder, ModelConfig, save_pretrained  # noqa: E402
from hexrl.rewards import exact_match_reward  # noqa: E402
from hexrl.tokenizer import CharTokenizer  # noqa: E402


@dataclass
class Task:
    """The arithmetic task and its train / held-out split (the RL run must use the same)."""

    digits: tuple[int, int] = (1, 2)
    ops: str = "+-"
    n_train: int = 4000
    n_heldout: int = 500
    seed: int = 0

    def split(self):
        return make_arithmetic_split(self.n_train, self.n_heldout, seed=self.seed,
                                     digits=tuple(self.digits), ops=self.ops)

    @property
    def max_new_tokens(self) -> int:
        return self.digits[1] + 3  # sign/carry digit, eos, one token of slack


@dataclass
class ModelShape:
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    vocab: int = 64


def build_model(shape: ModelShape, seed: int) -> Decoder:
    """A randomly initialised tiny Qwen2 decoder (the config `make_tiny_model` writes)."""
    cfg = ModelConfig.from_hf(tiny_config(arch="qwen2", **asdict(shape)))
    torch.manual_seed(seed)
    model = Decoder(cfg)
    model.init_weights(seed=seed)
    return model


def sft_batch(tokenizer, problems) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, S] and next-token targets [B, S] (-100 except answer + eos)."""
    seqs, starts = [], []
    for p in problems:
        prompt = prompt_ids(tokenizer, p.prompt)
        seqs.append(prompt + tokenizer.encode(p.answer) + [tokenizer.eos_id])
        starts.append(len(prompt))
    s = max(map(len, seqs))
    ids = torch.full((len(seqs), s), tokenizer.pad_id, dtype=torch.long)
    tgt = torch.full((len(seqs), s), -100, dtype=torch.long)
    for i, (seq, start) in enumerate(zip(seqs, starts)):
        ids[i, :len(seq)] = torch.tensor(seq)
        tgt[i, start - 1:len(seq) - 1] = torch.tensor(seq[start:])  # position t predicts token t+1
    return ids, tgt


def sft_loss(model, ids: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the unmasked targets (right padding never affects them: causal)."""
    logits = model(ids)
    return F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten(), ignore_index=-100)


def lr_at(step: int, steps: int, lr: float, warmup: int = 20) -> float:
    """Linear warmup (the tiny model diverges without it), then cosine decay to lr/10 so the
    final checkpoint is a settled model rather than a noisy snapshot."""
    cos = 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps))
    return lr * min(1.0, step / warmup) * (0.1 + 0.9 * cos)


def train_sft(model, tokenizer, train, heldout, steps: int, batch: int, lr: float, seed: int,
              eval_every: int, max_new_tokens: int, log=print) -> dict:
    """AdamW on random training batches; returns the final loss and held-out accuracy."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng, loss = random.Random(seed), float("nan")
    model.train()
    for step in range(1, steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr)
        l = sft_loss(model, *sft_batch(tokenizer, rng.sample(train, batch)))
        opt.zero_grad(set_to_none=True)
        l.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss = l.item()
        if eval_every and (step % eval_every == 0) and step < steps:
            acc, _ = greedy_accuracy(model, tokenizer, heldout, max_new_tokens)
            log(f"sft step {step:5d}  loss {loss:.4f}  heldout_acc {acc:.3f}")
    acc, _ = greedy_accuracy(model, tokenizer, heldout, max_new_tokens)
    log(f"sft step {steps:5d}  loss {loss:.4f}  heldout_acc {acc:.3f}")
    return {"loss": loss, "heldout_accuracy": acc}


# ----------------------------------------------------------------------------- RL check


@torch.no_grad()
def sample(model, prompts: list[list[int]], max_new_tokens: int, eos: int, gen: torch.Generator) -> list[list[int]]:
    """Temperature-1 samples for equal-length prompts, each ending at (and including) eos."""
    ids = torch.tensor(prompts, dtype=torch.long)
    out, done = [], torch.zeros(len(prompts), dtype=torch.bool)
    for _ in range(max_new_tokens):
        probs = torch.softmax(model(ids)[:, -1].float(), -1)
        nxt = torch.multinomial(probs, 1, generator=gen)[:, 0]
        out.append(nxt)
        done |= nxt == eos
        if done.all():
            break
        ids = torch.cat([ids, nxt[:, None]], 1)
    rows = torch.stack(out, 1).tolist()
    return [r[:r.index(eos) + 1] if eos in r else r for r in rows]


def rollout(model, tokenizer, problems, n: int, max_new_tokens: int, gen: torch.Generator) -> dict:
    """n samples per prompt; right-padded ids, completion mask, advantages, rewards [P, n]."""
    model.eval()
    seqs, rewards = [], []
    by_len: dict[int, list] = {}
    for p in problems:
        by_len.setdefault(len(prompt_ids(tokenizer, p.prompt)), []).append(p)
    for group in by_len.values():
        prompts = [prompt_ids(tokenizer, p.prompt) for p in group for _ in range(n)]
        comps = sample(model, prompts, max_new_tokens, tokenizer.eos_id, gen)
        for i, p in enumerate(group):
            mine = comps[i * n:(i + 1) * n]
            r = torch.tensor([exact_match_reward(tokenizer.decode(c), p.answer) for c in mine])
            adv = ((r - r.mean()) / (r.std() + 1e-6)).tolist()  # GRPO group normalisation
            rewards.append(r)
            seqs += [(prompts[i * n], c, a) for c, a in zip(mine, adv)]
    s = max(len(pr) + len(c) for pr, c, _ in seqs)
    ids = torch.zeros(len(seqs), s, dtype=torch.long)
    mask, adv = torch.zeros(len(seqs), s - 1), torch.zeros(len(seqs), 1)
    for i, (pr, c, a) in enumerate(seqs):
        ids[i, :len(pr) + len(c)] = torch.tensor(pr + c)
        mask[i, len(pr) - 1:len(pr) + len(c) - 1] = 1.0  # position t scores token t+1
        adv[i] = a
    with torch.no_grad():
        old = token_logp(model, ids)
    model.train()
    return {"ids": ids, "mask": mask, "adv": adv, "old": old, "rewards": torch.stack(rewards)}


def token_logp(model, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[:, t+1] | ids[:, :t+1]) for every position: [B, S-1]."""
    return torch.log_softmax(model(ids).float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]


def grpo_step(model, opt, tokenizer, problems, n: int, max_new_tokens: int, gen: torch.Generator,
              minibatches: int = 1, clip: float = 0.2) -> dict:
    """Sample, then `minibatches` clipped-PPO updates (the first one is exactly on-policy)."""
    b = rollout(model, tokenizer, problems, n, max_new_tokens, gen)
    for rows in torch.arange(len(b["ids"])).view(minibatches, -1):  # whole groups per minibatch
        ratio = torch.exp(token_logp(model, b["ids"][rows]) - b["old"][rows])
        adv, mask = b["adv"][rows], b["mask"][rows]
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip))
        loss = (pg * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    r = b["rewards"]
    return {"reward": r.mean().item(), "groups_with_signal": (r.std(1) > 0).float().mean().item()}


def rl_check(model, tokenizer, train, heldout, steps: int, prompts_per_step: int, n: int, lr: float,
             seed: int, eval_every: int, max_new_tokens: int, minibatches: int = 1, log=print) -> list[dict]:
    """Quick single-process GRPO reference run; returns the held-out curve."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng, gen = random.Random(seed + 1), torch.Generator().manual_seed(seed)
    t0, curve = time.time(), []
    for step in range(steps + 1):
        if step % eval_every == 0:
            acc, _ = greedy_accuracy(model, tokenizer, heldout, max_new_tokens)
            curve.append({"step": step, "seconds": round(time.time() - t0, 1), "heldout_accuracy": acc})
            log(f"rl step {step:5d}  t {time.time() - t0:6.1f}s  heldout_acc {acc:.3f}")
        if step < steps:
            stats = grpo_step(model, opt, tokenizer, rng.sample(train, prompts_per_step), n, max_new_tokens, gen,
                              minibatches)
            if step % 10 == 0:
                log(f"rl step {step:5d}  reward {stats['reward']:.3f}  signal {stats['groups_with_signal']:.2f}")
    return curve


# ----------------------------------------------------------------------------- CLI


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--digits", type=int, nargs=2, default=[1, 2])
    p.add_argument("--ops", default="+-")
    p.add_argument("--n-train", type=int, default=4000)
    p.add_argument("--n-heldout", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rl-check", type=int, default=0, metavar="STEPS", help="then run this many quick GRPO steps")
    p.add_argument("--rl-prompts", type=int, default=16)
    p.add_argument("--rl-n", type=int, default=8)
    p.add_argument("--rl-lr", type=float, default=1e-3)
    a = p.parse_args(argv)
    errors = [f"--{k.replace('_', '-')} must be >= 1, got {getattr(a, k)}"
              for k in ("steps", "batch", "n_train", "n_heldout", "threads", "rl_prompts", "rl_n")
              if getattr(a, k) < 1]
    if a.batch > a.n_train:
        errors.append(f"--batch {a.batch} exceeds --n-train {a.n_train}")
    if errors:
        p.error("; ".join(errors))
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    task = Task(tuple(a.digits), a.ops, a.n_train, a.n_heldout, a.seed)
    train, heldout = task.split()
    tok = CharTokenizer()
    shape = ModelShape(a.hidden, a.layers, a.heads, a.kv_heads, a.intermediate)
    model = build_model(shape, a.seed)
    acc0, _ = greedy_accuracy(model, tok, heldout, task.max_new_tokens)
    print(f"model {model.cfg.num_params} params; task {asdict(task)}; random-init heldout_acc {acc0:.3f}")
    t0 = time.time()
    res = train_sft(model, tok, train, heldout, a.steps, a.batch, a.lr, a.seed, a.eval_every, task.max_new_tokens)
    wall = time.time() - t0
    save_pretrained(model, a.out)
    tok.save(a.out)
    info = {"steps": a.steps, "batch": a.batch, "lr": a.lr, "loss": res["loss"],
            "heldout_accuracy": res["heldout_accuracy"], "init_heldout_accuracy": acc0,
            "wall_seconds": round(wall, 2), "task": asdict(task), "model": asdict(shape),
            "max_new_tokens": task.max_new_tokens,
            "heldout_split": "hexrl.data.make_arithmetic_split(n_train, n_heldout, seed, digits=, ops=)[1]"}
    Path(a.out, "warm_start.json").write_text(json.dumps(info, indent=2))
    print(f"warm start: {a.steps} steps in {wall:.1f}s, heldout_acc {res['heldout_accuracy']:.3f}; wrote {a.out}")
    if a.rl_check:
        info["rl_check"] = rl_check(model, tok, train, heldout, a.rl_check, a.rl_prompts, a.rl_n, a.rl_lr,
                                    a.seed, a.eval_every, task.max_new_tokens)
    return info


if __name__ == "__main__":
    main()
