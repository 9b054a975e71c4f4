"""The runtime's host path per unit of work, this code side by side with an older checkout, in one run.

    python tools/bench/bench_host_path.py                    # against c27c36e (lists on the wire)
    python tools/bench/bench_host_path.py --old /tmp/old     # against a checkout (its hexrl/ is imported)
    python tools/bench/bench_host_path.py --sections ingest --repeats 7 --lengths 128,1024,8192
    python -m tools.bench.bench_host_path --write            # this code only: its fit into profiles/host.json

A section (SECTIONS) is a pair of functions: one measures this process's hexrl and returns JSON-able
results, the other prints old and new side by side.

Ingest (`ingest`): what the controller thread spends per trajectory message it receives, with the
real classes in the order the controller runs them: `Auth.open` (HMAC and replay check), `wire.decode`
(msgpack unpack and schema validation), and `Controller._handle` (admission, msg_to_trajectory and the
replay buffer's add), on messages as the rollout leader builds them (`trajectory_to_msg` of the
engine's lists: token ids uniform in a 151,936-token vocabulary, float32 log-probs, one version,
a 256-token prompt). Also the sender's cost (to message, encode, seal) and the bytes per token the
buffer then holds (tracemalloc: everything the received trajectories keep alive). Printed per
completion length, min / median over repeats, and a least-squares fit over the lengths: us per
trajectory + ns per generated token. Every time is CPU time of the thread doing the work
(time.thread_time), which a loaded machine distorts much less than wall time.

The older code runs in a subprocess of this same script with that checkout's hexrl first on the path
(a git revision is extracted with `git archive` into a temporary directory). The script only uses
what both have: Trajectory, trajectory_to_msg, encode/decode, Auth and Controller.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
OLD = "c27c36e"  # the last commit whose trajectory messages carried lists
VOCAB = 151_936
PROMPT = 256
GROUP = 8  # samples per prompt group (rewards alternate, so no group is filtered)
STAGES = ("open", "decode", "handle")  # the receive path, in order


# ---------------------------------------------------------------- ingest


def ingest_controller(groups: int, max_tokens: int):
    """A controller (no thread, no socket: a router stand-in records what it sends) that has handed out
    `groups` prompt groups to replica 0; returns (controller, the prompt messages it sent)."""
    import numpy as np

    from hexrl.control.controller import Controller, ReplicaInfo
    from hexrl.control.dataset import DatasetCursor
    from hexrl.data.problems import Problem

    rl = SimpleNamespace(batch_size=groups, group_size=GROUP, eta=0, max_concurrent_rollouts=None,
                         filter_equal_groups=False, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_tokens,
                         seed=0, reward_bound=1e6)
    prompt = np.random.default_rng(1).integers(0, VOCAB, PROMPT).tolist()
    sent = []
    router = SimpleNamespace(rejected={}, peers={"replica-0"},
                             send=lambda msg, to, timeout_s: sent.append(msg) or True)
    problems = [Problem(f"{i}+{i}=", str(2 * i), id=i, kind="synthetic") for i in range(groups)]
    ctl = Controller(rl, DatasetCursor(problems, seed=0), lambda text: prompt, [ReplicaInfo(0, 1.0)], router,
                     vocab_size=VOCAB)
    ctl._dispatch()
    assert len(sent) == groups, f"dispatched {len(sent)} of {groups} groups"
    return ctl, sent


def rollout_trajectories(prompts: list[dict], length: int, seed: int) -> list:
    """What a rollout leader sends for these prompts: Trajectories of the engine's lists (its log-probs
    are float32 values, read back as Python floats)."""
    import numpy as np

    from hexrl.trajectory import Trajectory

    rng = np.random.default_rng(seed)
    out = []
    for p in prompts:
        for i in range(p["n"]):
            ids = rng.integers(0, VOCAB, length).tolist()
            logprobs = (-rng.exponential(1.0, length)).astype(np.float32).tolist()
            out.append(Trajectory(p["group_id"], list(p["prompt_ids"]), ids, logprobs, [0] * length,
                                  reward=float(i % 2), finish_reason="length", problem_id=p["problem_id"]))
    return out


def ingest_repeat(length: int, messages: int, seed: int, memory: bool) -> dict:
    """One repeat at one completion length: CPU seconds per message of each stage (and the sender's),
    wire bytes per message, and (memory) bytes per generated token the buffer holds."""
    from hexrl.comm.channel import Auth
    from hexrl.comm.wire import decode, encode, trajectory_to_msg

    ctl, prompts = ingest_controller(max(1, messages // GROUP), length)
    trajs = rollout_trajectories(prompts, length, seed)
    sender, receiver = Auth(b"k" * 32, "replica-0"), Auth(b"k" * 32, "controller")
    clock = time.thread_time
    gc.collect()
    t0 = clock()
    payloads = [encode(trajectory_to_msg(t, rank=0)) for t in trajs]
    frames = [(sender.seal(p), p) for p in payloads]
    t1 = clock()
    names = [receiver.open(a, p) for a, p in frames]
    t2 = clock()
    if memory:
        tracemalloc.start()
    msgs = [decode(p) for p in payloads]
    t3 = clock()
    for name, msg in zip(names, msgs):
        ctl._handle(name, msg)
    t4 = clock()
    n = len(trajs)
    out = {"send": (t1 - t0) / n, "open": (t2 - t1) / n, "decode": (t3 - t2) / n, "handle": (t4 - t3) / n,
           "bytes": sum(len(p) for p in payloads) / n}
    assert ctl.counters()["accepted"] == n and not ctl.counters()["rejected_reasons"], ctl.counters()
    if memory:  # what the buffer keeps once the received messages are gone
        del msgs, payloads, frames
        gc.collect()
        out["buffer_bytes_per_token"] = tracemalloc.get_traced_memory()[0] / (n * length)
        tracemalloc.stop()
    return out


def measure_ingest(args) -> dict:
    """{length: [repeat results]} for this process's hexrl; one more repeat measures memory
    (tracemalloc slows what it watches, so that repeat's times are not used)."""
    runs = {}
    for length in lengths(args):
        messages = max(2 * GROUP, args.tokens // length)
        runs[length] = [ingest_repeat(length, messages, seed=r, memory=False) for r in range(args.repeats)]
        runs[length].append(ingest_repeat(length, messages, seed=args.repeats, memory=True))
    return runs


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares cost = a + b * tokens; returns (a, b)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


def show_ingest(old: dict, new: dict, args) -> None:
    """The side-by-side table and the fits (results keyed by str(length), as JSON has them)."""
    def us(runs, key, length):
        v = [r[key] * 1e6 for r in runs[str(length)][:-1]]
        return f"{min(v):.0f} / {statistics.median(v):.0f}"

    def total(runs, length):
        return [sum(r[k] for k in STAGES) * 1e6 for r in runs[str(length)][:-1]]

    print(f"ingest: the controller's receive path per trajectory message, CPU us of this thread, min / median of "
          f"{args.repeats} repeats; prompt {PROMPT} tokens; old = {args.old}, new = this checkout")
    print(f"{'':<34}" + "".join(f"{f'{n:,} tokens':>26}" for n in lengths(args)))
    print(f"{'':<34}" + "".join(f"{'old':>13}{'new':>13}" for _ in lengths(args)))
    rows = [("wire bytes", lambda r, n: f"{r[str(n)][0]['bytes']:,.0f}"),
            ("Auth.open (HMAC, replay)", lambda r, n: us(r, "open", n)),
            ("wire.decode (unpack, validate)", lambda r, n: us(r, "decode", n)),
            ("Controller._handle (admission,", lambda r, n: us(r, "handle", n)),
            ("  to Trajectory, buffer add)", lambda r, n: ""),
            ("receive path total", lambda r, n: f"{min(total(r, n)):.0f} / {statistics.median(total(r, n)):.0f}"),
            ("sender (to message, encode, seal)", lambda r, n: us(r, "send", n)),
            ("buffer bytes per token", lambda r, n: f"{r[str(n)][-1]['buffer_bytes_per_token']:.1f}")]
    for name, cell in rows:
        print(f"{name:<34}" + "".join(f"{cell(old, n):>13}{cell(new, n):>13}" for n in lengths(args)))
    for name, runs in (("old", old), ("new", new)):
        a, b = ingest_fit(runs, args)
        print(f"fit, receive path, {name}: {a:.1f} us per trajectory + {b * 1e3:.1f} ns per generated token")
    print("targets: <= 60 us per trajectory + <= 40 ns per token")


def ingest_fit(runs: dict, args) -> tuple[float, float]:
    """The receive path's fit over the lengths, medians of the repeats: (us per trajectory, us per token)."""
    return fit([(n, statistics.median(sum(r[k] for k in STAGES) * 1e6 for r in runs[str(n)][:-1]))
                for n in lengths(args)])


def write_ingest(new: dict, args) -> None:
    """The controller's terms of the host profile (hexrl.gpus.Host) from this code's fit."""
    from hexrl.gpus import write_host_profile  # here: the old code's subprocess imports its own hexrl
    a, b = ingest_fit(new, args)
    path = write_host_profile({"controller_us_per_traj": a, "controller_ns_per_token": b * 1e3},
                              "tools/bench/bench_host_path.py")
    print(f"wrote {path}: controller {a:.1f} us per trajectory + {b * 1e3:.1f} ns per generated token")


# ---------------------------------------------------------------- sections, old code in a subprocess

# name -> (measure(args) -> JSON-able results for this process's hexrl, show(old, new, args))
SECTIONS = {"ingest": (measure_ingest, show_ingest)}


def lengths(args) -> list[int]:
    return [int(x) for x in args.lengths.split(",")]


def old_checkout(old: str, tmp: Path) -> Path:
    """A directory whose hexrl/ is the old code: `old` itself if it is one, else that git revision
    extracted into `tmp`."""
    if (Path(old) / "hexrl").is_dir():
        return Path(old)
    archive = tmp / "old.tar"
    git = subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), old, "hexrl"], capture_output=True,
                         text=True)
    if git.returncode != 0:
        raise SystemExit(f"--old {old}: neither a directory holding hexrl/ nor a git revision "
                         f"({git.stderr.strip().splitlines()[-1] if git.stderr.strip() else 'git failed'})")
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
    return tmp


def measure(args) -> dict:
    """{section: results} of the chosen sections, for this process's hexrl, as JSON has them."""
    return json.loads(json.dumps({name: SECTIONS[name][0](args) for name in args.sections.split(",")}))


def measure_old(args) -> dict:
    """`measure` under the old code: this script in a subprocess that imports `args.old`'s hexrl."""
    with tempfile.TemporaryDirectory(prefix="bench-host-path-") as tmp:
        root = old_checkout(args.old, Path(tmp))
        env = {**os.environ, "PYTHONPATH": str(root)}
        cmd = [sys.executable, __file__, "--measure", "--sections", args.sections,
               "--repeats", str(args.repeats), "--lengths", args.lengths, "--tokens", str(args.tokens)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp)
    if out.returncode != 0:
        raise SystemExit(f"the old code ({args.old}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", default=OLD, help="the code to compare with: a git revision or a checkout directory")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--lengths", default="128,1024,8192", help="completion tokens per trajectory")
    p.add_argument("--tokens", type=int, default=1 << 17, help="generated tokens per repeat and length")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"which of {', '.join(SECTIONS)} to run")
    p.add_argument("--measure", action="store_true", help="(internal) measure and print JSON")
    p.add_argument("--write", action="store_true",
                   help="measure this code only and write its ingest fit into the host profile the planner "
                        "reads ($HEXRL_PROFILES or ./profiles, host.json)")
    args = p.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args)))
        return
    if args.write:
        write_ingest(json.loads(json.dumps(measure_ingest(args))), args)
        return
    old, new = measure_old(args), measure(args)
    for name in args.sections.split(","):
        SECTIONS[name][1](old[name], new[name], args)


if __name__ == "__main__":
    main()
