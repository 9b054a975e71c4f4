"""The trainer hand-off's host cost per batch token, the code before and now side by side, in one run.

    PYTHONPATH=. python tools/bench/bench_trainer_handoff.py --old /tmp/hexrl-old   # a checkout of the code before
    PYTHONPATH=. python tools/bench/bench_trainer_handoff.py --groups 64 --samples 16 --mean 1000 --dp 2,4,8
    python -m tools.bench.bench_trainer_handoff --write   # also writes the arrays' figures into profiles/host.json

What each trainer rank does between the controller's batch and its first forward, per token of
the batch (prompt + completion, every trajectory), in CPU time of the thread (min over repeats):
- before: the controller rank packs the whole batch (msgpack of lists) and broadcasts it, every
  other rank unpacks it into Trajectory lists; every rank checks the whole batch and builds every
  DP rank's micro-batches (`plan_step`, torch.tensor of lists);
- now: the controller rank checks the batch, plans the step from lengths and packs each DP rank's
  share into arrays (`send`: every share, one copy per field, and its msgpack bytes); each rank
  decodes its own share (`receive`) and builds only its own micro-batches (`build`).
The transport (scatter/broadcast) is not counted on either side. The old code runs in a
subprocess with `--old` as its PYTHONPATH; the new one here (the hexrl this Python imports: the
first lines say which), with Trajectory fields as lists and as numpy arrays. Both build the same
batch from one seed, and the run checks that DP rank 0's micro-batches hash the same in every column.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

VOCAB = 151_936


def make_batch(groups: int, samples: int, mean: int, prompt: int, arrays: bool, seed: int = 0) -> list:
    """Prompt groups of `samples` completions, lengths exponential around `mean` (a long tail),
    uniform token ids, one sampling version per trajectory (a tenth straddle a weight update)."""
    from hexrl.trajectory import Trajectory
    rng, out = np.random.default_rng(seed), []
    for g in range(groups):
        p = rng.integers(prompt // 2, prompt * 3 // 2)
        prompt_ids = rng.integers(0, VOCAB, p)
        for _ in range(samples):
            c = int(min(max(rng.exponential(mean), 1), 8 * mean))
            versions = np.full(c, 7) if rng.random() > 0.1 else np.repeat([6, 7], [c // 2, c - c // 2])
            f = (lambda a: a) if arrays else (lambda a: a.tolist())
            out.append(Trajectory(g, f(prompt_ids), f(rng.integers(0, VOCAB, c)), f(rng.normal(-1.0, 0.5, c)),
                                  f(versions), reward=float(rng.random() < 0.5)))
    return out


def cpu_ns(fn, repeats: int) -> tuple[float, object]:
    """Min thread CPU ns of fn() over repeats, and its last result."""
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.thread_time_ns()
        out = fn()
        best = min(best, time.thread_time_ns() - t0)
    return best, out


def digest(mbs) -> str:
    """One hash of micro-batches' sequences and tensors."""
    h = hashlib.sha256()
    for mb in mbs:
        h.update(str((mb.seqs, mb.seq_lens, mb.completion_lens)).encode())
        for k in ("input_ids", "positions", "loss_index", "targets", "behav", "adv", "versions"):
            h.update(getattr(mb, k).numpy().tobytes())
    return h.hexdigest()[:16]


def hexrl_dir() -> str:
    import hexrl
    return str(Path(hexrl.__file__).parent)


def measure_old(args, dps: list[int]) -> dict:
    """The code before: pack / unpack of the whole batch, check, every rank's plan_step."""
    import msgpack

    from hexrl.comm.wire import msg_to_trajectory, trajectory_to_msg
    from hexrl.train.loss import equal_reward_groups, group_advantages
    from hexrl.train.packing import check_trajectories, plan_step
    batch = make_batch(args.groups, args.samples, args.mean, args.prompt, arrays=False)
    pack, raw = cpu_ns(lambda: msgpack.packb([trajectory_to_msg(t) for t in batch]), args.repeats)
    unpack, batch = cpu_ns(lambda: [msg_to_trajectory(m) for m in msgpack.unpackb(raw)], args.repeats)
    check, _ = cpu_ns(lambda: check_trajectories(batch, VOCAB), args.repeats)
    rewards, gids = [t.reward for t in batch], [t.group_id for t in batch]
    out = {"pack": pack, "receive": unpack, "check": check, "plan": {}, "digest": {}, "hexrl": hexrl_dir()}
    for dp in dps:
        def plan(dp=dp):
            adv = group_advantages(rewards, gids)
            dropped = equal_reward_groups(rewards, gids)
            seqs = [i for i, t in enumerate(batch) if t.group_id not in dropped and t.num_generated]
            return plan_step(batch, seqs, adv, args.minibatches, dp, args.micro_batch_tokens)
        out["plan"][dp], plans = cpu_ns(plan, args.repeats)
        out["digest"][dp] = digest([mb for p in plans for mb in p.micro_batches[0]])
    return out


def measure_new(args, dps: list[int], arrays: bool) -> dict:
    """Now: check + plan + every share packed and encoded (sender), decode + own micro-batches."""
    from hexrl.train.handoff import decode_share, encode_share
    from hexrl.train.packing import check_trajectories, plan_batch
    batch = make_batch(args.groups, args.samples, args.mean, args.prompt, arrays)
    check, _ = cpu_ns(lambda: check_trajectories(batch, VOCAB), args.repeats)
    out = {"check": check, "plan": {}, "pack": {}, "receive": {}, "build": {}, "digest": {}, "hexrl": hexrl_dir()}
    for dp in dps:
        out["plan"][dp], plan = cpu_ns(lambda dp=dp: plan_batch(batch, args.minibatches, dp, args.micro_batch_tokens),
                                       args.repeats)
        out["pack"][dp], wire = cpu_ns(lambda p=plan, n=dp: [encode_share(p.share(batch, d)) for d in range(n)],
                                       args.repeats)
        receive, builds = [], []
        for d in range(dp):  # each rank's own: the slowest rank counts
            t, share = cpu_ns(lambda raw=wire[d]: decode_share(raw, VOCAB), args.repeats)
            receive.append(t)
            t, mbs = cpu_ns(share.micro_batches, args.repeats)
            builds.append(t)
            if d == 0:
                out["digest"][dp] = digest([mb for m in mbs for mb in m])
        out["receive"][dp], out["build"][dp] = max(receive), max(builds)
    return out


def pieces(side: dict, dp: int, old: bool) -> dict:
    """One side's costs at one DP degree, and each rank's total (what it does before its first forward)."""
    p = {k: (side[k] if isinstance(side[k], (int, float)) else side[k][dp]) if k in side else 0
         for k in ("pack", "receive", "check", "plan", "build")}
    if old:  # every rank checks and plans the whole batch
        p["rank 0 total"] = p["pack"] + p["check"] + p["plan"]
        p["other rank total"] = p["receive"] + p["check"] + p["plan"]
    else:  # the controller rank checks, plans and packs; every rank builds its own
        p["rank 0 total"] = p["check"] + p["plan"] + p["pack"] + p["build"]
        p["other rank total"] = p["receive"] + p["build"]
    return p


ROWS = {"pack": "rank 0: pack to send (old: msgpack of the batch; new: every share)",
        "receive": "other rank: receive (old: the whole batch; new: its share)",
        "check": "check_trajectories (old: every rank; new: rank 0)",
        "plan": "plan (old: plan_step, every rank's micro-batches; new: lengths)",
        "build": "build own micro-batches (new; the slowest rank's)",
        "rank 0 total": "rank 0 total", "other rank total": "other rank total"}


def table(args, dps: list[int], sides: dict[str, dict], tokens: int) -> None:
    for name, side in sides.items():
        print(f"{name}: {side['hexrl']}")
    print(f"ns per batch token ({tokens:,} tokens: {args.groups} groups x {args.samples}, mean completion "
          f"{args.mean}, prompt ~{args.prompt}), thread CPU, min of {args.repeats}")
    for dp in dps:
        cols = {name: pieces(side, dp, name.startswith("old")) for name, side in sides.items()}
        print(f"\nDP {dp:<66}" + "".join(f"{c:>14}" for c in cols))
        for key, label in ROWS.items():
            print(f"  {label:<68}" + "".join(f"{c[key] / tokens:14.1f}" for c in cols.values()))
        digests = {side["digest"][dp] for side in sides.values()}
        print(f"  DP rank 0's micro-batches identical in every column: {'yes' if len(digests) == 1 else 'NO'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", help="a checkout of the code before (run in a subprocess); omit for the new side only")
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--mean", type=int, default=1000, help="mean completion tokens")
    ap.add_argument("--prompt", type=int, default=256, help="mean prompt tokens")
    ap.add_argument("--dp", default="2,4,8")
    ap.add_argument("--minibatches", type=int, default=1)
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--side", choices=["new", "old"], default="new", help=argparse.SUPPRESS)
    ap.add_argument("--write", action="store_true",
                    help="write the arrays' ns per batch token at the largest --dp into the host profile the "
                         "planner reads ($HEXRL_PROFILES or ./profiles, host.json)")
    args = ap.parse_args(argv)
    dps = [int(x) for x in args.dp.split(",")]
    if args.side == "old":
        print(json.dumps(measure_old(args, dps)))
        return 0
    sides = {}
    if args.old:  # the same batch and settings, the old code
        same = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in (
            "groups", "samples", "mean", "prompt", "dp", "minibatches", "micro_batch_tokens", "repeats")]
        env = dict(os.environ, PYTHONPATH=str(Path(args.old).resolve()))
        run = subprocess.run([sys.executable, __file__, "--side=old", *same], env=env, capture_output=True,
                             text=True, check=True)
        sides["old (lists)"] = {k: {int(d): x for d, x in v.items()} if isinstance(v, dict) else v
                                for k, v in json.loads(run.stdout).items()}
    sides["new (lists)"] = measure_new(args, dps, arrays=False)
    sides["new (arrays)"] = measure_new(args, dps, arrays=True)
    batch = make_batch(args.groups, args.samples, args.mean, args.prompt, arrays=True)
    tokens = sum(t.num_tokens for t in batch)
    table(args, dps, sides, tokens)
    if args.write:
        write_handoff(pieces(sides["new (arrays)"], max(dps), old=False), tokens)
    return 0


def write_handoff(p: dict, tokens: int) -> None:
    """The hand-off's terms of the host profile (hexrl.gpus.Host): each side's total per batch token."""
    from hexrl.gpus import write_host_profile
    values = {"handoff_ns_per_token_rank0": p["rank 0 total"] / tokens,
              "handoff_ns_per_token_other": p["other rank total"] / tokens}
    path = write_host_profile(values, "tools/bench/bench_trainer_handoff.py")
    print(f"wrote {path}: " + ", ".join(f"{k} {v:.1f}" for k, v in values.items()))


if __name__ == "__main__":
    sys.exit(main())
