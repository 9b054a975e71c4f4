"""Helpers for tests that launch the whole job with torchrun on this machine."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from hexrl.control.metrics import read_metrics
from hexrl.model.tiny import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def write_job(tmp: Path, steps: int = 3, eta: int | None = 1, nproc: int = 3, train_gpus: int = 2,
              heldout: int = 0, runtime: dict | None = None, nodes: list[dict] | None = None,
              layout: dict | None = None, colocate: dict | None = None, env: dict | None = None,
              gpu_type: str = "cpu", model_kw: dict | None = None, **rl) -> Path:
    """A tiny CPU job (2 trainer ranks + 1 rollout rank by default), planned into plan.json.

    runtime: the job's runtime overrides; nodes: cluster.nodes (default one node of `nproc`);
    layout: a fixed layout (default `train_gpus` data-parallel trainer ranks, the rest rollout);
    colocate: the job's colocate section (then one `gpu_type` device, no layout: both roles share it);
    env: the job's env section (multi-turn episodes); model_kw: the tiny model's shape (make_tiny_model's
    keywords)."""
    model = tmp / "model"
    if not model.exists():
        make_tiny_model(model, tokenizer="char", **(model_kw or {}))
    job = {
        "name": "test", "model": {"path": str(model)},
        "data": {"synthetic": {"task": "arithmetic", "n": 100 - heldout, "n_heldout": heldout, "seed": 0,
                               "digits": [1, 1], "ops": "+"}},
        "reward": {"name": "exact", "timeout_s": 5},
        "rl": {"batch_size": 2, "group_size": 2, "eta": eta, "lr": 1e-3, "max_new_tokens": 3, "steps": steps,
               "seed": 0, "filter_equal_groups": False, **rl},
        "cluster": {"nodes": nodes or [{"name": "local", "gpu_type": "cpu", "gpus": nproc}]},
        "layout": layout or {"train_gpus": train_gpus, "dp": train_gpus},
        **({"runtime": runtime} if runtime else {}),
        **({"env": env} if env else {}),
    }
    if colocate is not None:
        job.update(colocate=colocate, cluster={"nodes": [{"name": "local", "gpu_type": gpu_type, "gpus": 1}]})
        if layout is None:
            del job["layout"]
    (tmp / "job.json").write_text(json.dumps(job))
    subprocess.run([sys.executable, "-m", "hexrl.plan", str(tmp / "job.json"), "-o", str(tmp / "plan.json")],
                   check=True, capture_output=True)
    return tmp / "plan.json"


def torchrun(plan: Path, run_dir: Path, *args: str, nproc: int = 3, restarts: int = 0) -> subprocess.Popen:
    """Start `torchrun --standalone [--max-restarts restarts] -m hexrl.main` in its own process group."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           f"--max-restarts={restarts}", "-m", "hexrl.main", str(plan), "--run-dir", str(run_dir), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def torchrun_node(plan: Path, run_dir: Path, node_rank: int, nnodes: int, nproc: int, rdzv: str, address: str,
                  *args: str) -> subprocess.Popen:
    """One node's launcher of a multi-node job (static rendezvous at `rdzv`, node rank given),
    in its own process group, its output captured."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={nproc}",
           f"--node-rank={node_rank}", "--rdzv-backend=static", f"--rdzv-endpoint={rdzv}", f"--local-addr={address}",
           "-m", "hexrl.main", str(plan), "--run-dir", str(run_dir), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def metrics(run_dir: Path) -> list[dict]:
    """The run's step rows so far (its events, such as re-planning decisions, left out)."""
    path = run_dir / "metrics.jsonl"
    return read_metrics(path) if path.exists() else []


def wait_for(cond, timeout_s: float, proc: subprocess.Popen | None = None) -> bool:
    end = time.time() + timeout_s
    while time.time() < end:
        if cond():
            return True
        if proc is not None and proc.poll() is not None:
            return cond()
        time.sleep(0.2)
    return False


def worker_pids(proc: subprocess.Popen) -> dict[int, int]:
    """RANK -> pid of torchrun's worker processes (read from /proc)."""
    out = {}
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            stat = (pid_dir / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            env = (pid_dir / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == proc.pid:
            for kv in env:
                if kv.startswith(b"RANK="):
                    out[int(kv[5:])] = int(pid_dir.name)
    return out
