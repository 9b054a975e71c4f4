"""The agentic result: a tiny char-level model with and without the calculator environment.

    python tools/experiments/agentic_study.py OUT                # 2 seeds x {tool, no tool}: warm start, RL, eval
    python tools/experiments/agentic_study.py OUT --quick        # one seed, a few steps (the demo's one-liner)

Task: 3-digit multiplication ("123*456="), which the tiny model cannot learn to do reliably in
its head on this budget. Each arm is warm-started with the same supervised budget on the same
`--demos` problems: the tool arm on demonstrations of tool use (`<calc>123*456</calc>`, the
environment's `=56088`, then ` 56088` and EOS; the observation is context, not a target), the
no-tool arm on the answers alone. Then each runs hexrl's GRPO under torchrun for `--steps` steps
with the same batch (the tool arm with the job's `env: calculator`; groups whose rewards are all
equal are kept, as zero-advantage samples, so both arms spend the same budget). Held-out accuracy (greedy,
exact match) and the tool-call rate (episodes that called the calculator at least once) are
measured before and after RL with the rollout engine and the same episode driver as the runtime.
Writes OUT/results.json, OUT/summary.md and, with matplotlib, OUT/agentic.png.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hexrl.control.metrics import read_metrics
from hexrl.data.datasets import load_dataset
from hexrl.data.tokenizer import DEFAULT_ALPHABET, CharTokenizer
from hexrl.envs import Problem
from hexrl.envs.pool import EnvPool
from hexrl.model.hf_checkpoint import load_pretrained, save_pretrained
from hexrl.rewards import exact_match_reward
from hexrl.rollout import Engine, EngineConfig, Request
from hexrl.rollout.episodes import EpisodeDriver
from hexrl.schema.job import EnvSpec
from hexrl.train.warm_start import ModelShape, build_model

ROOT = Path(__file__).resolve().parents[2]

TOK = CharTokenizer(DEFAULT_ALPHABET + "<>")
TURN_TOKENS = {"tool": 24, "no_tool": 8}  # rl.max_new_tokens: "<calc>999*999</calc>" is 20
ENV = {"name": "calculator", "max_turns": 3, "timeout_s": 10, "max_obs_tokens": 16, "workers": 1}


def synthetic(a) -> dict:
    return {"task": "arithmetic", "n": a.n_train, "n_heldout": a.n_heldout, "seed": 0, "digits": [3, 3], "ops": "*"}


def demonstration(p, tool: bool) -> list[tuple[list[int], bool]]:
    """(ids, trained?) segments after the prompt: the model's tokens are targets, observations not."""
    if not tool:
        return [(TOK.encode(p.answer) + [TOK.eos_id], True)]
    return [(TOK.encode(f"<calc>{p.prompt[:-1]}</calc>"), True), (TOK.encode(f"={p.answer}"), False),
            (TOK.encode(f" {p.answer}") + [TOK.eos_id], True)]


def sft(model, problems, tool: bool, steps: int, batch: int, lr: float, seed: int) -> float:
    """Cross-entropy on the demonstrations' model tokens (right-padded; causal, so padding is harmless)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng, loss = random.Random(seed), torch.tensor(0.0)
    model.train()
    for step in range(1, steps + 1):
        seqs = []
        for p in rng.sample(problems, min(batch, len(problems))):
            ids, tgt = TOK.encode(p.prompt), [-100] * len(p.prompt)
            for seg, trained in demonstration(p, tool):
                ids, tgt = ids + seg, tgt + (seg if trained else [-100] * len(seg))
            seqs.append((ids, tgt[1:] + [-100]))  # position t predicts token t + 1
        width = max(len(s) for s, _ in seqs)
        ids = torch.tensor([s + [TOK.pad_id] * (width - len(s)) for s, _ in seqs])
        tgt = torch.tensor([t + [-100] * (width - len(t)) for _, t in seqs])
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, step / 20)
        loss = F.cross_entropy(model(ids).flatten(0, 1).float(), tgt.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return loss.item()


def evaluate(model_dir: Path, problems, tool: bool) -> dict:
    """Greedy held-out accuracy, and for the tool arm the share of episodes that called the calculator."""
    engine = Engine(load_pretrained(model_dir), EngineConfig(page_size=16, max_pages=2048), tokenizer=TOK)
    requests = [Request(str(i), TOK.encode(p.prompt), max_new_tokens=TURN_TOKENS["tool" if tool else "no_tool"],
                        temperature=0.0) for i, p in enumerate(problems)]
    if not tool:
        outs = engine.generate(requests)
        right = [exact_match_reward(TOK.decode(o.token_ids), p.answer) for o, p in zip(outs, problems)]
        return {"accuracy": sum(right) / len(problems), "tool_rate": 0.0, "turns": 1.0}
    env = EnvSpec(**{k: v for k, v in ENV.items() if k != "name"}, name=ENV["name"])
    with EnvPool(env.name, {}, workers=1, timeout_s=env.timeout_s) as pool:
        driver, ended = EpisodeDriver(engine, TOK, env, pool), []
        for r, p in zip(requests, problems):
            driver.start(r, Problem(p.prompt, p.answer, p.id))
        while len(ended) < len(problems):
            for out in engine.step():
                driver.on_turn(out)
            ended += driver.poll(0.0 if engine.has_work() else 0.01)
    calls = [any(t.endswith("</calc>") for t in e.turns) for e in ended]
    return {"accuracy": sum(e.reward for e in ended) / len(ended), "tool_rate": sum(calls) / len(ended),
            "turns": sum(len(e.turns) for e in ended) / len(ended),
            "reasons": {r: sum(e.reason == r for e in ended) for r in sorted({e.reason for e in ended})}}


def rl(out: Path, model: Path, tool: bool, seed: int, a) -> Path:
    """hexrl's GRPO under torchrun (1 trainer rank, 1 rollout rank); returns the run directory."""
    run = out / "run"
    if (run / "final" / "config.json").exists():
        return run
    job = {"name": out.name, "model": {"path": str(model)}, "data": {"synthetic": synthetic(a)},
           "rl": {"batch_size": a.batch, "group_size": a.group, "eta": 1, "lr": a.lr, "steps": a.steps, "seed": seed,
                  "max_new_tokens": TURN_TOKENS["tool" if tool else "no_tool"], "ppo_minibatches": 2,
                  "filter_equal_groups": False},  # the no-tool arm is all wrong: filtering would starve it
           "workload": {"prompt_len": 8, "output_len": {"mean": 26 if tool else 6, "max": 48 if tool else 8},
                        **({"turns": 2, "obs_len": 7} if tool else {})},
           "cluster": {"nodes": [{"name": "local", "gpu_type": "cpu", "gpus": 2}]},
           "layout": {"train_gpus": 1, "dp": 1}, **({"env": ENV} if tool else {"reward": {"name": "exact"}})}
    (out / "job.json").write_text(json.dumps(job, indent=1))
    py = sys.executable
    subprocess.run([py, "-m", "hexrl.plan", str(out / "job.json"), "-o", str(out / "plan.json")], check=True, cwd=ROOT,
                   capture_output=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with open(out / "torchrun.log", "w") as log:
        subprocess.run([py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "hexrl.main",
                        str(out / "plan.json"), "--run-dir", str(run)], check=True, cwd=ROOT, env=env, stdout=log,
                       stderr=subprocess.STDOUT)
    return run


def arm(out: Path, tool: bool, seed: int, train, heldout, a) -> dict:
    """Warm start, evaluate, RL, evaluate: one arm of one seed (reused if already done)."""
    name = ("tool" if tool else "no_tool") + f"-seed{seed}"
    d = out / name
    if (d / "result.json").exists():
        return json.loads((d / "result.json").read_text())
    d.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = build_model(ModelShape(), seed)
    t0 = time.time()
    loss = sft(model, train[:a.demos], tool, a.sft_steps, 32, 3e-3, seed)
    save_pretrained(model, d / "model")
    TOK.save(d / "model")
    before = evaluate(d / "model", heldout, tool)
    print(f"{name}: warm start loss {loss:.3f}, before RL {before}", flush=True)
    t1 = time.time()
    run = rl(d, d / "model", tool, seed, a)
    after = evaluate(run / "final", heldout, tool)
    metrics = read_metrics(run / "metrics.jsonl")
    res = {"arm": name, "tool": tool, "seed": seed, "sft_loss": loss, "before": before, "after": after,
           "warm_start_s": round(t1 - t0, 1), "rl_s": round(time.time() - t1, 1),
           "train_reward": [m["reward_mean"] for m in metrics], "turns_mean": [m["turns_mean"] for m in metrics]}
    print(f"{name}: after RL {after}", flush=True)
    (d / "result.json").write_text(json.dumps(res, indent=1))
    return res


def summarize(out: Path, results: list[dict], a) -> str:
    lines = [f"# Agentic study: 3-digit multiplication, calculator vs none ({a.steps} RL steps, "
             f"B={a.batch} x G={a.group}, {a.demos} warm-start problems, {a.sft_steps} warm-start steps)", "",
             "| arm | seed | held-out acc before | after | tool-call rate before | after | turns after |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        b, f = r["before"], r["after"]
        lines.append(f"| {'calculator' if r['tool'] else 'no tool'} | {r['seed']} | {b['accuracy']:.3f} | "
                     f"{f['accuracy']:.3f} | {b['tool_rate']:.3f} | {f['tool_rate']:.3f} | {f['turns']:.2f} |")
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return text
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for r in results:
        label = f"{'calculator' if r['tool'] else 'no tool'}, seed {r['seed']}"
        axes[0].plot(range(1, len(r["train_reward"]) + 1), r["train_reward"], label=label)
        axes[1].plot([0, 1], [r["before"]["accuracy"], r["after"]["accuracy"]], marker="o", label=label)
    axes[0].set(xlabel="RL step", ylabel="train reward (batch mean)", title="reward during RL")
    axes[1].set(xticks=[0, 1], xticklabels=["before RL", "after RL"], ylabel="held-out accuracy (greedy)",
                title="held-out accuracy")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "agentic.png", dpi=120)
    return text


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--demos", type=int, default=300)
    p.add_argument("--sft-steps", type=int, default=150)
    p.add_argument("--n-train", type=int, default=4000)
    p.add_argument("--n-heldout", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="one seed, 4 RL steps, 100 held-out problems")
    a = p.parse_args(argv)
    if a.quick:
        a.seeds, a.steps, a.n_heldout = a.seeds[:1], 4, 100
    a.out = a.out.resolve()  # the jobs it writes name their model by path, read relative to the job file
    torch.set_num_threads(1)
    train, heldout = load_dataset(synthetic=synthetic(a))
    results = [arm(a.out, tool, seed, train, heldout, a) for seed in a.seeds for tool in (True, False)]
    print(summarize(a.out, results, a))


if __name__ == "__main__":
    main()
