"""Supervised warm start of a tiny model on synthetic arithmetic, before RL (`tools/warm_start.py` is its
command line, as is `python -m hexrl.train.warm_start`).

    python tools/warm_start.py OUT_DIR                  # 2-digit addition; stops at dev accuracy >= 0.4
    python tools/warm_start.py OUT_DIR --rl-check 200   # then a quick single-process GRPO check
    python tools/warm_start.py OUT_DIR --device cuda    # the supervised phase on the GPU
    python tools/warm_start.py OUT_DIR --gym '{"tasks": "chain_sum", "prompt": "{expression} ="}'  # reasoning-gym

Creates a random tiny Qwen2-shaped model and trains it with cross-entropy on the answer tokens
plus eos (prompt masked). The budget is deliberately SHORT: training stops at the first
evaluation where accuracy on a dev slice of the TRAINING split reaches `--target-acc` (the
held-out set is only reported, never used to decide), so RL has room to improve. Writes an HF
checkpoint, the char tokenizer and `warm_start.json` (task, the job.json `data.synthetic`
section that rebuilds the same train / held-out split, steps, loss, accuracies, wall time).

`--rl-check` is a reference experiment only, not hexrl's trainer: on-policy GRPO in one
process (n samples per prompt at temperature 1, exact-match reward, group-normalised
advantages, one policy-gradient step per batch).
"""
from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from hexrl.data.datasets import load_dataset
from hexrl.data.gym_problems import gym_answer
from hexrl.data.heldout import greedy_accuracy, prompt_ids
from hexrl.data.tokenizer import CharTokenizer
from hexrl.model.config import ModelConfig
from hexrl.model.decoder import Decoder
from hexrl.model.hf_checkpoint import save_pretrained
from hexrl.model.tiny import tiny_config
from hexrl.rewards import exact_match_reward, reward_fn_by_name
from hexrl.runtime.cpu_pinning import available_cores, busy_cores, fair_threads


@dataclass
class Task:
    """The arithmetic task and its train / held-out split (the RL run must use the same)."""

    digits: tuple[int, int] = (2, 2)
    ops: str = "+"
    n_train: int = 6000
    n_heldout: int = 500
    n_dev: int = 200  # last problems of the train split: SFT stopping rule only, not trained on
    seed: int = 0
    gym: dict | None = None  # a reasoning-gym task instead: data.reasoning_gym's tasks (and prompt)

    def synthetic(self) -> dict:
        """The job.json `data.synthetic` section that rebuilds exactly this split."""
        return {"task": "arithmetic", "n": self.n_train, "n_heldout": self.n_heldout, "seed": self.seed,
                "digits": list(self.digits), "ops": self.ops}

    def data(self) -> dict:
        """The job.json `data` section that rebuilds exactly this split."""
        if self.gym is None:
            return {"synthetic": self.synthetic()}
        return {"reasoning_gym": {**self.gym, "size": self.n_train, "n_heldout": self.n_heldout, "seed": self.seed}}

    @property
    def reward(self) -> str:
        """The job's reward: exact match, or the reasoning-gym task's own scorer."""
        return "exact" if self.gym is None else "gym"

    def split(self):
        """(train, dev, held_out); dev is the tail of train, so RL may still train on it."""
        data = self.data()
        train, heldout = load_dataset(synthetic=data.get("synthetic"), gym=data.get("reasoning_gym"))
        return train, train[-self.n_dev:], heldout

    def max_new_tokens(self, problems) -> int:
        if self.gym is None:
            return self.digits[1] + 3  # carry digit, eos, one token of slack
        return max(len(target(p)) for p in problems) + 2  # eos, one token of slack


def target(p) -> str:
    """What the model should answer (a reasoning-gym problem's answer field holds its whole entry)."""
    return gym_answer(p) if p.kind == "gym" else p.answer


@dataclass
class ModelShape:
    hidden: int = 128
    layers: int = 3
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    vocab: int = 64


def build_model(shape: ModelShape, seed: int) -> Decoder:
    """A randomly initialised tiny Qwen2 decoder (the config `make_tiny_model` writes)."""
    model = Decoder(ModelConfig.from_hf(tiny_config(arch="qwen2", **asdict(shape))))
    model.init_weights(seed=seed)
    return model


def sft_batch(tokenizer, problems) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, S] and next-token targets [B, S] (-100 except answer + eos)."""
    seqs, starts = [], []
    for p in problems:
        prompt = prompt_ids(tokenizer, p.prompt)
        seqs.append(prompt + tokenizer.encode(target(p)) + [tokenizer.eos_id])
        starts.append(len(prompt))
    s = max(map(len, seqs))
    ids = torch.full((len(seqs), s), tokenizer.pad_id, dtype=torch.long)
    tgt = torch.full((len(seqs), s), -100, dtype=torch.long)
    for i, (seq, start) in enumerate(zip(seqs, starts)):
        ids[i, :len(seq)] = torch.tensor(seq)
        tgt[i, start - 1:len(seq) - 1] = torch.tensor(seq[start:])  # position t predicts token t+1
    return ids, tgt


def sft_loss(model, ids: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over unmasked targets (right padding cannot affect them: causal)."""
    device = next(model.parameters()).device
    return F.cross_entropy(model(ids.to(device)).flatten(0, 1).float(), tgt.to(device).flatten(), ignore_index=-100)


def train_sft(model, tokenizer, train, dev, heldout, max_steps: int, batch: int, lr: float, seed: int,
              eval_every: int, target_acc: float, max_new_tokens: int, log=print,
              reward_fn=exact_match_reward) -> dict:
    """AdamW on random batches until dev accuracy >= target_acc (0: run all max_steps); the held-out
    accuracy is measured once, at the end (it decides nothing)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng, dev_set = random.Random(seed), {p.prompt for p in dev}
    pool = [p for p in train if p.prompt not in dev_set]
    model.train()
    res, t0, prev = {}, time.time(), None
    for step in range(1, max_steps + 1):
        for g in opt.param_groups:  # linear warmup: the tiny model diverges without it
            g["lr"] = lr * min(1.0, step / 20)
        loss = sft_loss(model, *sft_batch(tokenizer, rng.sample(pool, batch)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % eval_every == 0 or step == max_steps:
            res = {"steps": step, "loss": loss.item(),
                   "dev_accuracy": greedy_accuracy(model, tokenizer, dev, max_new_tokens, reward_fn=reward_fn)[0]}
            elapsed = time.time() - t0
            log(f"sft step {step:5d}  loss {res['loss']:.4f}  dev_acc {res['dev_accuracy']:.3f}  {elapsed:6.1f}s  "
                + time_left(elapsed, step, max_steps, res["dev_accuracy"], prev, target_acc))
            if target_acc and res["dev_accuracy"] >= target_acc:
                break
            prev = (step, res["dev_accuracy"])
    res["heldout_accuracy"] = greedy_accuracy(model, tokenizer, heldout, max_new_tokens, reward_fn=reward_fn)[0]
    log(f"held-out accuracy {res['heldout_accuracy']:.3f} ({len(heldout)} problems)")
    return res


def time_left(elapsed: float, step: int, max_steps: int, acc: float, prev: tuple[int, float] | None,
              target: float) -> str:
    """'left ~A s (at most B s)': B at this pace to max_steps; A where the dev accuracy's trend since
    the previous evaluation reaches the target sooner."""
    per_step = elapsed / step
    most = per_step * (max_steps - step)
    rate = (acc - prev[1]) / (step - prev[0]) if prev else 0.0
    if target and acc < target and rate > 0:
        return f"left ~{min(most, per_step * (target - acc) / rate):.0f}s (at most {most:.0f}s)"
    return f"left at most {most:.0f}s"


# ----------------------------------------------------------------------------- RL check (reference)


@torch.no_grad()
def sample(model, prompts: list[list[int]], max_new_tokens: int, eos: int, gen: torch.Generator) -> list[list[int]]:
    """Temperature-1 samples for equal-length prompts, each ending at (and including) eos."""
    ids, out, done = torch.tensor(prompts), [], torch.zeros(len(prompts), dtype=torch.bool)
    for _ in range(max_new_tokens):
        nxt = torch.multinomial(torch.softmax(model(ids)[:, -1].float(), -1), 1, generator=gen)[:, 0]
        out.append(nxt)
        done |= nxt == eos
        if done.all():
            break
        ids = torch.cat([ids, nxt[:, None]], 1)
    rows = torch.stack(out, 1).tolist()
    return [r[:r.index(eos) + 1] if eos in r else r for r in rows]


def grpo_step(model, opt, tokenizer, problems, n: int, max_new_tokens: int, gen: torch.Generator) -> float:
    """Sample n completions per prompt, A = (r - mean) / (std + 1e-6), one token-mean PG step."""
    model.eval()
    seqs, rewards = [], []
    by_len: dict[int, list] = {}
    for p in problems:  # the model has no padding mask: sample equal-length prompts together
        by_len.setdefault(len(prompt_ids(tokenizer, p.prompt)), []).append(p)
    for group in by_len.values():
        prompts = [prompt_ids(tokenizer, p.prompt) for p in group for _ in range(n)]
        comps = sample(model, prompts, max_new_tokens, tokenizer.eos_id, gen)
        for i, p in enumerate(group):
            mine = comps[i * n:(i + 1) * n]
            r = torch.tensor([exact_match_reward(tokenizer.decode(c), p.answer) for c in mine])
            rewards.append(r)
            seqs += [(prompts[i * n], c, a) for c, a in zip(mine, ((r - r.mean()) / (r.std() + 1e-6)).tolist())]
    model.train()
    ids = torch.zeros(len(seqs), max(len(p) + len(c) for p, c, _ in seqs), dtype=torch.long)
    mask, adv = torch.zeros(ids.shape[0], ids.shape[1] - 1), torch.tensor([[a] for _, _, a in seqs])
    for i, (p, c, _) in enumerate(seqs):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        mask[i, len(p) - 1:len(p) + len(c) - 1] = 1.0  # position t scores token t+1
    logp = torch.log_softmax(model(ids).float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    loss = -(logp * adv * mask).sum() / mask.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return torch.cat(rewards).mean().item()


def rl_check(model, tokenizer, train, heldout, steps: int, prompts_per_step: int, n: int, lr: float,
             seed: int, eval_every: int, max_new_tokens: int, log=print) -> list[dict]:
    """Quick single-process GRPO reference run; returns the held-out curve."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng, gen = random.Random(seed + 1), torch.Generator().manual_seed(seed)
    t0, curve, reward = time.time(), [], float("nan")
    for step in range(steps + 1):
        if step % eval_every == 0 or step == steps:
            acc = greedy_accuracy(model, tokenizer, heldout, max_new_tokens)[0]
            curve.append({"step": step, "seconds": round(time.time() - t0, 1), "heldout_accuracy": acc})
            log(f"rl step {step:5d}  {time.time() - t0:6.1f}s  train_reward {reward:.3f}  heldout_acc {acc:.3f}")
        if step < steps:
            reward = grpo_step(model, opt, tokenizer, rng.sample(train, prompts_per_step), n, max_new_tokens, gen)
    return curve


# ----------------------------------------------------------------------------- CLI


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=1500, help="max SFT steps")
    p.add_argument("--target-acc", type=float, default=0.4, help="stop once dev accuracy reaches this; 0 = off")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--digits", type=int, nargs=2, default=[2, 2], metavar=("MIN", "MAX"))
    p.add_argument("--ops", default="+")
    p.add_argument("--n-train", type=int, default=6000)
    p.add_argument("--n-heldout", type=int, default=500)
    p.add_argument("--n-dev", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: the cores this process may use that other work leaves free)")
    p.add_argument("--gym", type=json.loads, metavar="JSON",
                   help='a reasoning-gym task instead of --digits/--ops: data.reasoning_gym\'s "tasks" and "prompt" '
                        '(pip install -e .[gym]); --n-train, --n-heldout, --seed as for arithmetic')
    p.add_argument("--device", default="cpu", help="where the supervised phase runs (cpu, cuda); saved from the CPU")
    p.add_argument("--rl-check", type=int, default=0, metavar="STEPS", help="then run this many reference GRPO steps")
    p.add_argument("--rl-prompts", type=int, default=64)
    p.add_argument("--rl-n", type=int, default=8)
    p.add_argument("--rl-lr", type=float, default=3e-4)
    a = p.parse_args(argv)
    errors = [f"--{k.replace('_', '-')} must be >= 1, got {getattr(a, k)}"
              for k in ("steps", "batch", "eval_every", "n_train", "n_heldout", "n_dev", "threads", "rl_prompts")
              if getattr(a, k) is not None and getattr(a, k) < 1]
    if a.rl_n < 2:
        errors.append(f"--rl-n must be >= 2 (GRPO compares samples of one prompt), got {a.rl_n}")
    if not 0 <= a.target_acc <= 1:
        errors.append(f"--target-acc must be in [0, 1], got {a.target_acc}")
    if a.n_dev >= a.n_train or a.batch > a.n_train - a.n_dev:
        errors.append(f"--n-train {a.n_train} must exceed --n-dev {a.n_dev} by at least --batch {a.batch}")
    if errors:
        p.error("; ".join(errors))
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.threads is None:
        a.threads = fair_threads()
        print(f"{a.threads} torch thread(s): {len(available_cores())} core(s), {busy_cores():.1f} kept busy by "
              "other work (--threads to choose)", flush=True)
    torch.set_num_threads(a.threads)
    task = Task(tuple(a.digits), a.ops, a.n_train, a.n_heldout, a.n_dev, a.seed, a.gym)
    train, dev, heldout = task.split()
    max_new_tokens, reward_fn = task.max_new_tokens(train), reward_fn_by_name(task.reward)
    tok = CharTokenizer()
    shape = ModelShape(a.hidden, a.layers, a.heads, a.kv_heads, a.intermediate)
    model = build_model(shape, a.seed).to(a.device)
    acc0 = greedy_accuracy(model, tok, heldout, max_new_tokens, reward_fn=reward_fn)[0]
    print(f"model {model.cfg.num_params} params; task {asdict(task)}; random-init heldout_acc {acc0:.3f}")
    t0 = time.time()
    res = train_sft(model, tok, train, dev, heldout, a.steps, a.batch, a.lr, a.seed, a.eval_every,
                    a.target_acc, max_new_tokens, reward_fn=reward_fn)
    wall = time.time() - t0
    model.to("cpu")  # saved, and the RL check run, from the host
    if a.target_acc and res["dev_accuracy"] < a.target_acc:
        print(f"WARNING: dev accuracy {res['dev_accuracy']:.3f} < target {a.target_acc} after {a.steps} steps")
    save_pretrained(model, a.out)
    tok.save(a.out)
    info = {**res, "init_heldout_accuracy": acc0, "wall_seconds": round(wall, 2), "batch": a.batch, "lr": a.lr,
            "target_acc": a.target_acc, "task": asdict(task), "data": task.data(), "reward": task.reward,
            **({"data_synthetic": task.synthetic()} if a.gym is None else {}),
            "model": asdict(shape), "max_new_tokens": max_new_tokens, "threads": a.threads,
            "device": a.device}
    Path(a.out, "warm_start.json").write_text(json.dumps(info, indent=2))
    print(f"warm start: {res['steps']} steps in {wall:.1f}s, heldout_acc {res['heldout_accuracy']:.3f}; wrote {a.out}")
    if a.rl_check:
        curve = rl_check(model, tok, train, heldout, a.rl_check, a.rl_prompts, a.rl_n, a.rl_lr, a.seed,
                         a.eval_every, max_new_tokens)
        info["rl_check"] = {"prompts_per_step": a.rl_prompts, "n": a.rl_n, "lr": a.rl_lr, "curve": curve}
        Path(a.out, "rl_check.json").write_text(json.dumps(info["rl_check"], indent=2))  # model not saved
    return info


if __name__ == "__main__":
    main()
