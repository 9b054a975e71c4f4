"""The controller's fixed work against the number of rollout replicas R, and its ingest capacity
with and without a busy Python thread beside it, as a thread and in its own process.

    python tools/bench/bench_controller_scale.py --old /tmp/hexrl-old     # new and old side by side
    python tools/bench/bench_controller_scale.py --replicas 64 1024 --repeats 5
    python tools/bench/bench_controller_scale.py --ingest --tokens 1024 8192 --seconds 5
    python -m tools.bench.bench_controller_scale --ingest --modes "thread, busy trainer" "process, busy trainer"

Scale (the default): the controller's real methods on R replicas that have all connected, the
socket's send replaced by a no-op after encoding and sealing (so every message costs what it
costs up to the kernel). Per unit, the CPU time of the thread doing the work (min / median over
repeats; it holds up on a loaded machine far better than wall time):
- flush: one `_flush_outbox` pass with nothing to send (it runs every loop pass);
- pass: one whole loop pass without receiving (flush, dispatch with the gate shut, the
  heartbeat check);
- dispatch: one prompt group handed out by `_dispatch` (pick, encode + seal, bookkeeping);
- pick: `Dispatcher.assign` + `done` of one group, nothing else;
- publish: `publish_version` and the flush that tells all R replicas.
Each code base (this checkout, and with --old another one, e.g. `git worktree add /tmp/hexrl-old
<commit>`) runs in its own subprocess, one after the other, and the table shows them side by side.

Ingest (--ingest): the real controller on a bound RouterChannel, 8 replicas' dealers in a second
process answering every prompt with its group's trajectories at once (256 prompt tokens, `--tokens`
generated, typed arrays as the rollout leader sends them), and the main thread standing in for the
trainer (next_batch, publish_version). Trajectories/s and tokens/s admitted over `--seconds`, the
controller's CPU per trajectory and its share of one core, and the trainer thread's CPU in next_batch
per trajectory handed over, for each mode (`--modes`): the controller as a thread of this process,
alone, beside a thread spinning pure Python (the trainer's Python on rank 0 shares the GIL), and the
same with the GIL's switch interval cut from 5 ms to 0.5 ms; and the controller in its own process
(what a run uses), alone and beside the spinning thread. The modes run back to back, `--repeats` times
(medians shown). The spinning thread stands for a trainer always in Python; it never pauses (the worst
case for a controller thread), except in "process, busy, pauses", where it stops while the main thread
is in next_batch: a trainer's one thread either runs its Python or receives a batch, where here the
two would fight over this process's GIL for every group message received. Throughput is wall-clock:
on a loaded machine read the CPU per trajectory (what one core of its own allows) and the ratios
between the modes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
PROMPT_TOKENS = 256
VOCAB = 151_936
CPU_PER_ITEM_S = 0.3  # CPU seconds a scale item may use per repeat (at least MIN_CALLS calls)
MIN_CALLS = 3


# ---------------------------------------------------------------- scale (runs under --code)


class NullSocket:
    """Takes frames and does nothing: the cost measured stops at the kernel's door."""

    def send_multipart(self, frames, flags=0, copy=True):
        pass

    def close(self, linger=None):
        pass


def rl_config(batch_size: int, group_size: int, eta: int, max_new_tokens: int) -> SimpleNamespace:
    return SimpleNamespace(batch_size=batch_size, group_size=group_size, eta=eta, max_concurrent_rollouts=None,
                           filter_equal_groups=False, temperature=1.0, top_p=1.0, top_k=0,
                           max_new_tokens=max_new_tokens, seed=0, reward_bound=1e6)


def controller(replicas: int, batch_size: int, send: bool = False):
    """A controller whose R replicas have all connected; with send=False its socket sends nothing."""
    from hexrl.comm.channel import RouterChannel, new_secret
    from hexrl.control.controller import Controller, ReplicaInfo
    from hexrl.control.dataset import DatasetCursor
    from hexrl.data.problems import Problem

    problems = [Problem(f"{i}+{i}=", str(2 * i), id=i, kind="synthetic") for i in range(4096)]
    router = RouterChannel(new_secret())
    router.sock.close(linger=0)
    router.sock = NullSocket()
    infos = [ReplicaInfo(i, 1.0 + (i % 4)) for i in range(replicas)]  # a mix of GPU types
    router.routes = {r.name: r.name.encode() for r in infos}
    prompt = list(range(1000, 1000 + PROMPT_TOKENS))
    ctl = Controller(rl_config(batch_size, 16, 0, 1024), DatasetCursor(problems, seed=0), lambda text: prompt,
                     infos, router, vocab_size=VOCAB)
    for r in ctl.replicas:
        ctl.heartbeats.expect(r)
    return ctl


def per_call_cpu(fn, calls: int | None = None) -> float:
    """CPU seconds of this thread per call of fn(), over `calls` calls (or as many as fit the budget)."""
    if calls is None:
        t0 = time.thread_time()
        fn()
        first = time.thread_time() - t0
        calls = max(MIN_CALLS, min(10_000, int(CPU_PER_ITEM_S / max(first, 1e-7))))
    t0 = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - t0) / calls


def idle_pass(ctl) -> None:
    """One controller loop pass with nothing to send, receive or hand out."""
    ctl._flush_outbox()
    with ctl.lock:
        ctl._dispatch()
    ctl._check_replicas()


def time_dispatch(replicas: int, groups: int) -> float:
    """CPU seconds per group for `_dispatch` handing out `groups` groups (gate: exactly that many)."""
    ctl = controller(replicas, batch_size=groups)
    t0 = time.thread_time()
    with ctl.lock:
        ctl._dispatch()
    spent = time.thread_time() - t0
    assert ctl.next_group == groups, ctl.next_group
    return spent / groups


def time_pick(replicas: int, groups: int) -> float:
    """CPU seconds per group for Dispatcher.assign + done, `groups` in flight around the clock."""
    from hexrl.control.dispatch import Dispatcher

    d = Dispatcher({i: 1.0 + (i % 4) for i in range(replicas)})
    for gid in range(groups):
        d.assign(gid)
    gids = iter(range(groups, 10**9))

    def step():
        gid = next(gids)
        d.done(gid - groups)
        d.assign(gid)
    return per_call_cpu(step)


def time_publish(replicas: int) -> float:
    ctl = controller(replicas, batch_size=1)
    versions = iter(range(1, 10**9))

    def publish():
        ctl.publish_version(next(versions))
        ctl._flush_outbox()
    cost = per_call_cpu(publish)
    assert ctl.delivered > 0 and ctl.router.sent == ctl.delivered * replicas
    return cost


def scale_run(replicas: list[int], repeats: int, groups: int) -> dict:
    """{R: {item: [seconds per unit, one per repeat]}} for the hexrl on sys.path."""
    import hexrl

    print(f"  measuring {Path(hexrl.__file__).parent}", file=sys.stderr, flush=True)
    out = {}
    for r in replicas:
        ctl = controller(r, batch_size=1)
        ctl.gate.running = 1  # the gate is shut: a pass hands nothing out
        items = {"flush": [], "pass": [], "dispatch": [], "pick": [], "publish": []}
        for _ in range(repeats):
            items["flush"].append(per_call_cpu(ctl._flush_outbox))
            items["pass"].append(per_call_cpu(lambda: idle_pass(ctl)))  # noqa: B023
            items["dispatch"].append(time_dispatch(r, groups))
            items["pick"].append(time_pick(r, groups))
            items["publish"].append(time_publish(r))
        out[r] = items
        print(f"  R {r} done", file=sys.stderr, flush=True)
    return out


# ---------------------------------------------------------------- ingest


def sender(endpoint: str, secret_hex: str, replicas: int, tokens: int) -> None:
    """Dealers for `replicas` replicas: answer every prompt with n trajectories (each encoded once
    per group, sealed per message) until stdin closes."""
    import numpy as np
    import zmq

    from hexrl.comm.channel import DealerChannel
    from hexrl.comm.wire import encode, message, trajectory_to_msg
    from hexrl.trajectory import Trajectory

    secret = bytes.fromhex(secret_hex)
    dealers = [DealerChannel(f"replica-{i}", secret) for i in range(replicas)]
    for i, d in enumerate(dealers):
        d.connect(endpoint)
        d.send(message("heartbeat", rank=i, time=0.0))
    rng = np.random.default_rng(0)
    completion = rng.integers(0, VOCAB, tokens).tolist()
    logprobs = (-rng.random(tokens)).tolist()
    poller = zmq.Poller()
    for d in dealers:
        poller.register(d.sock, zmq.POLLIN)
    threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
    while True:
        for sock, _ in poller.poll(100):
            d = next(d for d in dealers if d.sock is sock)
            msg = d.recv(0)
            if msg is None or msg["type"] != "prompt":
                continue
            traj = Trajectory(msg["group_id"], msg["prompt_ids"], completion, logprobs, [msg["version"]] * tokens,
                              reward=1.0, finish_reason="length", problem_id=msg["problem_id"],
                              start_version=msg["version"])
            payload = encode(trajectory_to_msg(traj))  # typed arrays, as the rollout leader sends them
            for _ in range(msg["n"]):
                d.sock.send_multipart([d.auth.seal(payload), payload], copy=False)


def spin(stop: threading.Event, training: threading.Event) -> None:
    """Pure Python, never releasing the GIL of its own accord (a trainer's Python between kernels), while
    `training` is set (a mode clears it while the main thread receives a batch)."""
    x = 0
    while not stop.is_set():
        if training.is_set():
            x += 1
        else:
            training.wait(0.1)


# mode -> (where the controller runs, the GIL switch interval of a busy trainer thread beside it or None,
# whether that thread pauses while the main thread is in next_batch)
INGEST_MODES = {"thread, alone": ("thread", None, False), "thread, busy trainer": ("thread", 0.005, False),
                "thread, busy, switch 0.5 ms": ("thread", 0.0005, False), "process, alone": ("process", None, False),
                "process, busy trainer": ("process", 0.005, False),
                "process, busy, pauses": ("process", 0.005, True)}


def ingest_controller(where: str, tokens: int, replicas: int):
    """(controller, the endpoint its replicas connect to): a Controller thread on a bound router, or a
    ControllerProcess (hexrl/control/controller_process.py), with the same settings."""
    from hexrl.comm.channel import RouterChannel, new_secret
    from hexrl.control.controller import Controller, ReplicaInfo
    from hexrl.control.controller_process import ControllerProcess, ControllerSetup
    from hexrl.control.dataset import DatasetCursor
    from hexrl.data.problems import Problem

    secret = new_secret()
    problems = [Problem(f"{i}+{i}=", str(2 * i), id=i, kind="synthetic") for i in range(4096)]
    prompt = list(range(1000, 1000 + PROMPT_TOKENS))
    rl, infos = rl_config(16, 8, 2, tokens), [ReplicaInfo(i, 1.0) for i in range(replicas)]
    if where == "process":
        ctl = ControllerProcess(ControllerSetup(rl, problems, [prompt] * len(problems), infos, VOCAB, secret))
        return ctl, ctl.endpoint, secret
    router = RouterChannel(secret)
    endpoint = router.bind("127.0.0.1")
    return Controller(rl, DatasetCursor(problems, seed=0), lambda text: prompt, infos, router,
                      vocab_size=VOCAB), endpoint, secret


def controller_cpu(ctl):
    """A function giving the controller's CPU seconds so far: its thread's, or its whole process's."""
    if hasattr(ctl, "pid"):
        tick = os.sysconf("SC_CLK_TCK")

        def process_cpu() -> float:
            fields = open(f"/proc/{ctl.pid}/stat").read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        return process_cpu
    clock = time.pthread_getcpuclockid(ctl._thread.ident)
    return lambda: time.clock_gettime(clock)


def ingest_run(tokens: int, mode: str, seconds: float, replicas: int = 8) -> dict:
    """Trajectories/s admitted by the controller (a thread here or its own process), alone or beside a
    spinning thread (under the default GIL switch interval of 5 ms, or a shorter one); and the trainer's
    CPU in next_batch per trajectory handed over."""
    where, switch, pauses = INGEST_MODES[mode]
    ctl, endpoint, secret = ingest_controller(where, tokens, replicas)
    proc = subprocess.Popen([sys.executable, __file__, "--sender", endpoint, secret.hex(), str(replicas), str(tokens)],
                            stdin=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    ctl.start()
    stop, training, version, handover = threading.Event(), threading.Event(), 0, [0.0, 0]
    training.set()
    spinner = threading.Thread(target=spin, args=(stop, training), daemon=True)

    def train_until(deadline: float) -> None:
        nonlocal version
        while time.monotonic() < deadline:
            if pauses:
                training.clear()
            t0 = time.thread_time()
            batch = ctl.next_batch(timeout_s=60)
            handover[0] += time.thread_time() - t0
            training.set()
            handover[1] += sum(len(g.trajectories) for g in batch)
            version += 1
            ctl.publish_version(version)

    try:
        train_until(time.monotonic() + 2)  # everyone connected and the pipeline full
        if switch is not None:
            sys.setswitchinterval(switch)
            spinner.start()
        cpu = controller_cpu(ctl)
        tok0, handover[:] = ctl.counters()["completion_tokens"], [0.0, 0]
        cpu0, t0 = cpu(), time.monotonic()
        train_until(t0 + seconds)
        got = (ctl.counters()["completion_tokens"] - tok0) / tokens
        wall, used = time.monotonic() - t0, cpu() - cpu0
        rejected = ctl.counters()["rejected_messages"]
    finally:
        stop.set()
        training.set()
        sys.setswitchinterval(0.005)
        proc.stdin.close()
        proc.wait(timeout=30)
        ctl.stop()
        if where == "thread":
            ctl.router.close()
    assert rejected == 0, f"{rejected} trajectories rejected: the bench's messages are wrong"
    return {"tokens": tokens, "mode": mode, "traj_s": got / wall, "tok_s": got * tokens / wall,
            "cpu_us_per_traj": 1e6 * used / max(got, 1), "cpu_share": used / wall,
            "handover_us_per_traj": 1e6 * handover[0] / max(handover[1], 1)}


# ---------------------------------------------------------------- reports


def fmt_s(s: float) -> str:
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def scale_report(results: dict[str, dict], replicas: list[int]) -> None:
    names = list(results)
    print("\nCPU per unit, min / median over repeats (" + ", ".join(names) + ")")
    ratio = "   old/new (median)" if len(names) > 1 else ""
    print(f"{'R':>6} {'item':<9}" + "".join(f" {n:>24}" for n in names) + ratio)
    for r in replicas:
        for item in ("flush", "pass", "dispatch", "pick", "publish"):
            cells, meds = [], []
            for n in names:
                xs = results[n][str(r)][item]
                meds.append(statistics.median(xs))
                cells.append(f"{fmt_s(min(xs))} / {fmt_s(meds[-1])}")
            ratio = f"   {meds[1] / meds[0]:,.{0 if meds[1] > 100 * meds[0] else 1}f}x" if len(names) > 1 else ""
            print(f"{r:>6} {item:<9}" + "".join(f" {c:>24}" for c in cells) + ratio)


def ingest_report(rows: list[dict]) -> None:
    """Medians over repeats; "1-core traj/s" is what the controller's CPU per trajectory allows on a core of
    its own; "next_batch us/traj" is the trainer thread's CPU per trajectory handed over."""
    print(f"{'tokens':>7} {'controller':>28} {'traj/s':>8} {'M tok/s':>8} {'CPU us/traj':>12} "
          f"{'CPU share':>10} {'1-core traj/s':>14} {'next_batch us/traj':>19}")
    keys = ("traj_s", "tok_s", "cpu_us_per_traj", "cpu_share", "handover_us_per_traj")
    for tokens in dict.fromkeys(r["tokens"] for r in rows):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            mine = [r for r in rows if r["tokens"] == tokens and r["mode"] == mode]
            med = {k: statistics.median(r[k] for r in mine) for k in keys}
            print(f"{tokens:>7} {mode:>28} {med['traj_s']:>8.0f} {med['tok_s'] / 1e6:>8.2f} "
                  f"{med['cpu_us_per_traj']:>12.0f} {med['cpu_share']:>10.0%} {1e6 / med['cpu_us_per_traj']:>14.0f} "
                  f"{med['handover_us_per_traj']:>19.1f}")


def run_code(code: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--repeats", str(args.repeats), "--groups", str(args.groups),
           "--replicas", *map(str, args.replicas)]
    out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(code)}, stdout=subprocess.PIPE, text=True)
    if out.returncode:
        sys.exit(f"the bench failed on {code}")
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path, help="a checkout of older code to run side by side")
    ap.add_argument("--replicas", type=int, nargs="+", default=[64, 1024, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--groups", type=int, default=512, help="groups per dispatch measurement")
    ap.add_argument("--ingest", action="store_true", help="measure ingest capacity instead")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--modes", nargs="+", choices=list(INGEST_MODES), default=list(INGEST_MODES),
                    help="--ingest: which controller placements to run (default all)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sender", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.sender:
        endpoint, secret_hex, replicas, tokens = args.sender
        return sender(endpoint, secret_hex, int(replicas), int(tokens))
    if args.worker:  # the hexrl imported is whichever PYTHONPATH names
        return print(json.dumps(scale_run(args.replicas, args.repeats, args.groups)))
    if args.ingest:  # this process's hexrl: run from the repository's root (python -m tools.bench...)
        rows = [ingest_run(t, mode, args.seconds) for t in args.tokens for _ in range(args.repeats)
                for mode in args.modes]  # the modes back to back, so the machine's load hits each alike
        ingest_report(rows)
        results = {"ingest": rows}
    else:
        results = {"new": run_code(ROOT, args)}
        if args.old:
            results["old"] = run_code(args.old.resolve(), args)
        scale_report(results, args.replicas)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
