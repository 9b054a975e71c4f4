"""Elastic membership: under `torchrun --nnodes MIN:MAX --rdzv-backend c10d` the nodes present at each
start agree through the store on who they are, rank 0 plans exactly them, and every rank takes its
role from that plan (hexrl/runtime/elastic.py). Two "nodes" are launchers at 127.0.0.1 and 127.0.0.2.
"""
import json
import os
import signal
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from dist_utils import free_port
from runtime_utils import ROOT, metrics, wait_for, write_job
from test_multinode import TWO_NODES, balanced

from hexrl.runtime import elastic
from hexrl.runtime.elastic import Hello, Launch
from hexrl.schema import load_plan

A, B = "127.0.0.1", "127.0.0.2"


def two_node_plan(tmp_path: Path, **rl):
    return write_job(tmp_path, nodes=TWO_NODES, layout={"train_gpus": 2, "dp": 2}, **rl)


def hello(rank: int, node_rank: int, node: str, job: str = "j", pid: int | None = None) -> Hello:
    return Hello(rank, node_rank, node, "cpu", pid or 1000 + rank, job)


# ------------------------------------------------------------------ the agreement, over a real TCPStore


def test_every_rank_takes_the_plan_rank_0_made_for_the_nodes_that_said_hello():
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    # a dead round's leader and result: a restarted rank must not take them for this round's
    store.set(elastic.PREFIX + "leader", "old")
    store.set(elastic.PREFIX + "result/old", json.dumps({"round": 0, "pids": {"1": 9, "2": 9, "3": 9},
                                                         "plan": "stale"}))
    hellos = [hello(0, 0, "B"), hello(1, 0, "B"), hello(2, 1, "A"), hello(3, 1, "A")]
    seen, results = [], {}

    def plan_round(round_no, got):
        seen.extend(got)
        return {"plan": {"nodes": elastic.present_nodes(got)}, "reason": "r"}

    def rank(h):
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
        results[h.rank] = elastic.follow(client, h, timedelta(seconds=60))

    threads = [threading.Thread(target=rank, args=(h,)) for h in hellos[1:]]
    for t in threads:
        t.start()
    results[0] = elastic.lead(store, hellos[0], 4, plan_round)
    for t in threads:
        t.join(60)
    assert seen == hellos
    assert set(results) == {0, 1, 2, 3}
    assert all(r == (0, results[0][1]) for r in results.values())
    assert results[0][1]["plan"] == {"nodes": ["B", "A"]}  # node-rank order, not cluster order
    # the next round gets the next number
    assert elastic.lead(store, hello(0, 0, "A"), 1, plan_round)[0] == 1


# ------------------------------------------------------------------ what rank 0 plans


def test_the_cluster_is_restricted_to_the_nodes_present_in_node_rank_order(tmp_path):
    plan = load_plan(two_node_plan(tmp_path))
    alone = elastic.restrict(plan, ["B"])
    assert [n["name"] for n in alone["cluster"]["nodes"]] == ["B"]
    assert "layout" not in alone  # written for both nodes: the planner searches one for B alone
    both = elastic.restrict(plan, ["B", "A"])
    assert [n["address"] for n in both["cluster"]["nodes"]] == [B, A] and "layout" in both
    assert [n.name for n in plan.job.cluster.nodes] == ["A", "B"]  # the job's plan is left as it was
    assert elastic.reason(["A"], ["A", "B"], 3) == "round 3: nodes A (in node-rank order); left: B"


def test_a_round_on_one_node_is_planned_and_recorded_with_its_reason(tmp_path):
    plan = load_plan(two_node_plan(tmp_path))
    run = tmp_path / "run"
    out = elastic.plan_round(plan, "j", run, 1, [hello(0, 0, "A"), hello(1, 0, "A")])
    assert out["reason"] == "round 1: nodes A (in node-rank order); left: B"
    recorded = json.loads((run / "plans" / "1.json").read_text())
    assert recorded == out["plan"]
    assert [n["name"] for n in recorded["cluster"]["nodes"]] == ["A"]
    assert sorted(r["role"] for r in recorded["ranks"]) == ["rollout", "train"]
    assert recorded["predicted"]["elastic"] == {"round": 1, "nodes": ["A"], "reason": out["reason"]}
    assert load_plan(recorded, world=(2, 2)).world_size == 2  # every rank loads it as it is shared


def test_a_round_the_gpus_left_cannot_run_ends_with_what_is_missing(tmp_path):
    two = [{**n, "gpus": 1} for n in TWO_NODES]  # one GPU each: one node alone cannot train and generate
    plan = load_plan(write_job(tmp_path, nodes=two, layout={"train_gpus": 1, "dp": 1}))
    out = elastic.plan_round(plan, "j", tmp_path / "run", 1, [hello(0, 0, "B")])
    assert "plan" not in out
    assert out["error"].startswith("the nodes present (B) cannot run this job without A: ")
    assert "needs at least 2 (one trains, one generates)" in out["error"]


def test_a_plan_from_another_job_and_a_node_started_twice_are_refused(tmp_path):
    plan = load_plan(two_node_plan(tmp_path))
    hellos = [hello(0, 0, "A"), hello(1, 0, "A"), hello(2, 1, "A", job="other"), hello(3, 1, "A")]
    out = elastic.plan_round(plan, "j", tmp_path / "run", 0, hellos)
    assert "rank 2 (node A) read a plan from another job (digest other, rank 0's j)" in out["error"]
    assert "node A: two launchers (node ranks 0 and 1) were started as it" in out["error"]
    assert not (tmp_path / "run" / "plans" / "0.json").exists()


# ------------------------------------------------------------------ the launch, checked before any rank meets


def test_nnodes_bounds_the_cluster_cannot_satisfy_are_refused_naming_the_flag(tmp_path):
    plan = load_plan(two_node_plan(tmp_path))
    assert elastic.bounds_problems(Launch(1, 2, "c10d"), plan, 2) == []
    (p,) = elastic.bounds_problems(Launch(1, 3, "c10d"), plan, 2)
    assert p.startswith("--nnodes 1:3: the job's cluster.nodes lists 2 nodes, so at most 2 can take part")
    (p,) = elastic.bounds_problems(Launch(1, 2, "c10d"), plan, 3)
    assert p.startswith("--nproc_per_node 3: every node of cluster.nodes runs 2 ranks")
    assert elastic.own_node(plan, "B") == ("B", [])
    assert elastic.own_node(plan, "C")[1][0].startswith("--node-name C: no node of cluster.nodes")


def test_only_a_dynamic_rendezvous_with_a_node_range_is_elastic():
    assert Launch(1, 2, "c10d").elastic
    assert not Launch(2, 2, "c10d").elastic  # a fixed node count: the plan as given (today's check)
    assert not Launch(1, 2, "static").elastic
    torchrun = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "torch.distributed.run",
                                 "--nnodes=1:2", "--rdzv-backend=c10d", "--nproc_per_node=2", "-m", "hexrl.main",
                                 "plan.json"])
    try:
        assert wait_for(lambda: Path(f"/proc/{torchrun.pid}/cmdline").read_bytes().count(b"\0") > 3, 10)
        assert elastic.launcher_args(torchrun.pid) == Launch(1, 2, "c10d")
    finally:
        torchrun.kill()
        torchrun.wait()
    assert elastic.launcher_args(os.getpid()) is None  # pytest is not torchrun


def test_an_elastic_launch_with_more_nodes_than_the_cluster_is_refused_on_every_rank(tmp_path):
    plan = two_node_plan(tmp_path)
    res = subprocess.run(elastic_cmd(plan, tmp_path / "run", A, f"{A}:{free_port()}", "A", nnodes="1:3"),
                         cwd=ROOT, capture_output=True, text=True, timeout=120, env=env())
    assert res.returncode != 0
    assert "--nnodes 1:3: the job's cluster.nodes lists 2 nodes" in res.stdout + res.stderr


# ------------------------------------------------------------------ two nodes on loopback


def env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def elastic_cmd(plan: Path, run: Path, address: str, rdzv: str, name: str, nnodes: str = "1:2",
                restarts: int = 3) -> list[str]:
    """One node's launcher of an elastic job (the command docs/multinode.md gives)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc_per_node=2",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv}", "--rdzv-conf=last_call_timeout=5",
            f"--local-addr={address}", f"--max-restarts={restarts}",
            "-m", "hexrl.main", str(plan), "--run-dir", str(run), "--node-name", name]


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


@pytest.mark.slow
def test_node_b_leaves_after_the_first_checkpoint_and_node_a_finishes_alone(tmp_path):
    steps = 8
    plan = two_node_plan(tmp_path, steps=steps, checkpoint_every=2)
    run, rdzv = tmp_path / "run", f"{A}:{free_port()}"
    a = start(elastic_cmd(plan, run, A, rdzv, "A"))
    b = start(elastic_cmd(plan, run, B, rdzv, "B"))
    assert wait_for(lambda: (run / "checkpoints" / "latest").is_file(), 600, a), a.communicate()[0][-4000:]
    os.killpg(b.pid, signal.SIGKILL)  # node B's launcher and its ranks: the machine is gone
    b.wait()
    out, _ = a.communicate(timeout=900)
    assert a.returncode == 0, out[-5000:]
    plans = sorted(int(p.name.split(".")[0]) for p in (run / "plans").glob("*[0-9].json"))
    first, last = (json.loads((run / "plans" / f"{r}.json").read_text()) for r in (plans[0], plans[-1]))
    assert [n["name"] for n in first["cluster"]["nodes"]] in (["A", "B"], ["B", "A"])
    assert [n["name"] for n in last["cluster"]["nodes"]] == ["A"]
    assert "left: B" in last["predicted"]["elastic"]["reason"]
    rows = metrics(run)
    assert [r["step"] for r in rows][-1] == steps
    assert all(balanced(r) for r in rows)
    summary = subprocess.run([sys.executable, "-m", "hexrl.control.summary", str(run)], cwd=ROOT,
                             capture_output=True, text=True, env=env())
    assert "(balanced)" in summary.stdout, summary.stdout
