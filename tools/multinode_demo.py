"""The two-node demo on one machine: one job, one torchrun launcher per node, over loopback.

    python tools/multinode_demo.py                  # the CPU demo's job on node A (127.0.0.1: 2 trainer
                                                    # ranks) and node B (127.0.0.2: 2 rollout ranks)
    python tools/multinode_demo.py --single-node    # the same ranks and roles on one node, to compare
                                                    # (in its own run directory: OUT_DIR-single-node)
    python tools/multinode_demo.py --job J.json --run DIR [hexrl.main flags, e.g. --resume DIR/checkpoints]

Every address in 127.0.0.0/8 reaches this machine, so a "node" is a launcher started with its
plan node's address (`--local-addr`) and index (`--node-rank`); node 0's launcher hosts the
rendezvous store at its address. Each launcher runs exactly the command docs/multinode.md
gives for a real machine (printed before it starts). The warm-started model of tools/demo.sh
(runs/demo/model) is made first if missing. Writes RUN/plan.json, RUN/metrics.jsonl, RUN/A.log, ...
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from hexrl.control.summary import summarize
from hexrl.schema.fields import plural

ROOT = Path(__file__).resolve().parents[1]

FRESH = ("metrics.jsonl", "eval.jsonl", "checkpoints", "final", "eval_model", "controller_endpoint")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", default=str(ROOT / "tools/configs/cpu_two_node.json"))
    p.add_argument("--run", default=None, help="run directory (default: the job's out_dir, with -single-node "
                   "appended for --single-node)")
    p.add_argument("--single-node", action="store_true", help="all ranks on one node at node 0's address")
    p.add_argument("--grace-s", type=float, default=90.0,
                   help="after one launcher fails, wait this long for the others")
    return p.parse_known_args(argv)


def prepare_job(job_path: Path, run: Path, single_node: bool) -> Path:
    """RUN/job.json: the job with an absolute model path (and, for --single-node, one node)."""
    job = json.loads(job_path.read_text())
    model = Path(job["model"]["path"])
    job["model"]["path"] = str(model if model.is_absolute() else (job_path.parent / model).resolve())
    if single_node:
        nodes = job["cluster"]["nodes"]
        job["cluster"]["nodes"] = [{**nodes[0], "gpus": sum(n["gpus"] for n in nodes)}]
    run.mkdir(parents=True, exist_ok=True)
    (run / "job.json").write_text(json.dumps(job, indent=1) + "\n")
    return Path(job["model"]["path"])


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def launcher_cmd(plan: dict, node: int, rdzv: str, run: Path, extra: list[str]) -> list[str]:
    """The command node `node` runs (on a real machine: the same, with its own address)."""
    nodes = plan["cluster"]["nodes"]
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(nodes)}",
            f"--nproc_per_node={nodes[node]['gpus']}", f"--node-rank={node}", "--rdzv-backend=static",
            f"--rdzv-endpoint={rdzv}", f"--local-addr={nodes[node]['address']}",
            "-m", "hexrl.main", str(run / "plan.json"), "--run-dir", str(run), "--node-name", nodes[node]["name"],
            *extra]


def _relay(proc: subprocess.Popen, name: str, log: Path) -> None:
    """Copy a launcher's output to RUN/<name>.log and to the console, each line tagged [name]."""
    with open(log, "w") as f:
        for line in proc.stdout:
            f.write(line)
            f.flush()
            print(f"[{name}] {line}", end="", flush=True)


def run_launchers(cmds: dict[str, list[str]], run: Path, grace_s: float) -> dict[str, int]:
    """Start every launcher in its own process group; once one fails, give the others `grace_s`
    to end by themselves (the watchdog's job), then kill them. Returns exit codes by node."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    procs, relays = {}, []
    for name, cmd in cmds.items():
        print(f"== node {name}: {shlex.join(cmd)}", flush=True)
        procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, start_new_session=True)
        relays.append(threading.Thread(target=_relay, args=(procs[name], name, run / f"{name}.log"), daemon=True))
        relays[-1].start()
    failed_at = None
    while any(p.poll() is None for p in procs.values()):
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs.values()):
            failed_at = time.time()
        if failed_at is not None and time.time() - failed_at > grace_s:
            for name, p in procs.items():
                if p.poll() is None:
                    print(f"== node {name} still running {grace_s:.0f} s after a failure: killing it", flush=True)
                    os.killpg(p.pid, signal.SIGKILL)
        time.sleep(0.2)
    for t in relays:
        t.join(timeout=5)
    return {name: p.returncode for name, p in procs.items()}


def main(argv=None) -> int:
    args, extra = parse_args(argv)
    job_path = Path(args.job).resolve()
    run = Path(args.run or json.loads(job_path.read_text()).get("out_dir", "runs/multinode")
               + ("-single-node" if args.single_node else ""))  # never over the two-node run's directory
    run = run if run.is_absolute() else ROOT / run
    model = prepare_job(job_path, run, args.single_node)
    if not (model / "config.json").exists():
        print(f"== warm start into {model}", flush=True)
        subprocess.run([sys.executable, str(ROOT / "tools/warm_start.py"), str(model)], cwd=ROOT, check=True)
    if "--resume" not in extra:  # a fresh run each time
        for name in FRESH:
            subprocess.run(["rm", "-rf", str(run / name)], check=True)
    subprocess.run([sys.executable, "-m", "hexrl.plan", str(run / "job.json"), "-o", str(run / "plan.json")],
                   cwd=ROOT, check=True)
    plan = json.loads((run / "plan.json").read_text())
    nodes = plan["cluster"]["nodes"]
    rdzv = f"{nodes[0]['address']}:{free_port(nodes[0]['address'])}"
    cmds = {n["name"]: launcher_cmd(plan, i, rdzv, run, extra) for i, n in enumerate(nodes)}
    t0 = time.time()
    codes = run_launchers(cmds, run, args.grace_s)
    wall = time.time() - t0
    print(f"== {plural(len(nodes), 'node')}, exit codes {codes}, wall {wall:.1f} s (launch to exit)")
    print(summarize(run, launch_s=wall))
    return max(abs(c) for c in codes.values())


if __name__ == "__main__":
    sys.exit(main())
