"""The reward pool's and the environment pool's cost per call, and a worker's start, for two hexrl
trees side by side in one run (the old tree a checkout: `git worktree add --detach /tmp/old main`).

    python tools/bench/bench_pools.py --old /tmp/old                 # this tree against /tmp/old
    python tools/bench/bench_pools.py --old /tmp/old --calls 400 --repeats 5

Each tree is measured in a process of its own (PYTHONPATH=tree), this script run with --measure, the
trees alternating `--repeats` times so that load changes hit both alike. That process imports torch
first, as hexrl.main does before it starts the pools, so a worker that re-imports its launcher pays
for it. What is timed:
- reward call: one item's round trip, `pool.run([("1", "1")])` with the exact-match reward (submit,
  dispatch, the worker's call, its reply), one worker;
- reward batch: a batch of 64 such items, per item, two workers;
- env call: one calculator step ("<calc>1+2</calc>") through `EnvPool.run_step`, one worker;
- gym call: `gym_reward` on a countdown problem's right answer, in the process (the task's scorer
  and, where the tree has one, its gate);
- worker start: a one-worker RewardPool constructed until its worker is ready (what replacing a
  worker costs), and closed;
- hung env batch: `--hung` calls of an environment that never answers (tests/env_fixtures.py's
  Hostile, turn "hang"), two workers, a 1 s timeout, so every call replaces a worker: the batch's
  wall time.
Prints the median (and min-max) over all samples of each tree, and n.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch  # noqa: F401  (the launcher's heavy import, as hexrl.main's)

HERE = Path(__file__).resolve()


def timed(fn, n: int) -> list[float]:
    """Seconds of each of `n` calls of fn()."""
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def measure(calls: int, starts: int, hung: int) -> dict[str, list[float]]:
    """The samples of one tree (the hexrl on sys.path)."""
    try:
        from hexrl.data.gym_problems import entries
    except ImportError:  # a tree from before the module's rename
        from hexrl.data.gym import entries
    from hexrl.envs import EnvPool, Problem
    from hexrl.rewards import RewardPool
    from hexrl.rewards.gym import gym_reward

    out = {}
    with RewardPool("exact", workers=1, timeout_s=30) as pool:
        timed(lambda: pool.run([("1", "1")]), 20)  # warm-up
        out["reward call"] = timed(lambda: pool.run([("1", "1")]), calls)
    with RewardPool("exact", workers=2, timeout_s=30) as pool:
        batch = [("1", "1")] * 64
        pool.run(batch)
        out["reward batch, per item"] = [t / 64 for t in timed(lambda: pool.run(batch), max(1, calls // 16))]
    with EnvPool("calculator", {}, workers=1, timeout_s=30) as pool:
        p = Problem("1+2=", "3")
        timed(lambda: pool.run_step(p, ["<calc>1+2</calc>"]), 20)
        out["env call"] = timed(lambda: pool.run_step(p, ["<calc>1+2</calc>"]), calls)
    entry = entries("countdown", {}, 1, 0)[0]
    problem, right = json.dumps(entry, sort_keys=True), f"<answer>{entry['answer']}</answer>"
    gym_reward(right, problem)
    out["gym call (in process)"] = timed(lambda: gym_reward(right, problem), calls)
    out["worker start"] = timed(lambda: RewardPool("exact", workers=1, timeout_s=30).close(), starts)
    with EnvPool("env_fixtures:Hostile", {}, workers=2, timeout_s=1.0) as pool:
        out["hung env batch"] = timed(lambda: pool.run([("step", p, ["hang"])] * hung), 1)
    return out


def run_tree(tree: Path, calls: int, starts: int, hung: int) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(HERE.parents[2] / "tests")])}
    out = subprocess.run([sys.executable, str(HERE), "--measure", "--calls", str(calls), "--starts", str(starts),
                          "--hung", str(hung)], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def show(samples: list[float]) -> str:
    ms = [s * 1e3 for s in samples]
    return f"{statistics.median(ms):8.3f} ({min(ms):.3f}-{max(ms):.3f}) n={len(ms)}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", type=Path, help="the other hexrl tree (a checkout's root)")
    p.add_argument("--calls", type=int, default=200, help="timed calls per measure and repeat")
    p.add_argument("--starts", type=int, default=3, help="worker starts per repeat")
    p.add_argument("--hung", type=int, default=8, help="calls in the hung environment's batch")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--measure", action="store_true", help="(internal) measure the hexrl on sys.path, print JSON")
    args = p.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.calls, args.starts, args.hung)))
        return
    trees = {"old": args.old.resolve(), "new": HERE.parents[2]}
    runs = {name: {} for name in trees}
    for _ in range(args.repeats):
        for name, tree in trees.items():
            for key, samples in run_tree(tree, args.calls, args.starts, args.hung).items():
                runs[name].setdefault(key, []).extend(samples)
    print(f"old {trees['old']}, new {trees['new']}; ms: median (min-max), n samples over {args.repeats} repeats")
    for key in runs["new"]:
        print(f"  {key:<24} old {show(runs['old'][key])}   new {show(runs['new'][key])}")


if __name__ == "__main__":
    main()
