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
from pause_points import PAUSE_ENV
from runtime_utils import ROOT, metrics, wait_for, write_job
from test_multinode import PP_ACROSS, TWO_NODES, balanced

from hexrl.runtime import elastic
from hexrl.runtime.elastic import Hello, Launch
from hexrl.schema import load_plan
from hexrl.train import checkpoint

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
    results[0] = elastic.lead(store, hellos[0], 4, 0, plan_round)
    for t in threads:
        t.join(60)
    assert seen == hellos
    assert set(results) == {0, 1, 2, 3}
    assert all(r == (0, results[0][1]) for r in results.values())
    assert results[0][1]["plan"] == {"nodes": ["B", "A"]}  # node-rank order, not cluster order
    # the next round, a rank alone (its store still holds this round's keys)
    assert elastic.lead(store, hello(0, 0, "A"), 1, 1, plan_round)[1]["plan"] == {"nodes": ["A"]}


def test_rounds_are_numbered_by_the_plans_recorded_in_the_run_directory(tmp_path):
    assert elastic.next_round(tmp_path / "plans") == 0
    (tmp_path / "plans").mkdir()
    for name in ("0.json", "0.job.json", "1.job.json", "1.json", "2.job.json"):  # round 2's planner failed
        (tmp_path / "plans" / name).write_text("{}")
    assert elastic.next_round(tmp_path / "plans") == 2


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


def test_a_round_on_the_nodes_of_the_newest_recorded_plan_keeps_that_plan(tmp_path):
    """A switch of plans records the plan it restarts into (hexrl/train/replanning.py); the elastic round
    of that restart, on the same nodes in the same order, runs it rather than planning the job afresh."""
    plan = load_plan(two_node_plan(tmp_path))
    run = tmp_path / "run"
    switched = plan.to_dict()
    switched["predicted"]["marked"] = True  # not what the planner makes
    elastic.record_plan(run / "plans", switched, 3, "drift: at step 40, ...")
    both = [hello(0, 0, "A"), hello(1, 0, "A"), hello(2, 1, "B"), hello(3, 1, "B")]
    out = elastic.plan_round(plan, "j", run, 4, both)
    assert out["reason"] == "round 4: nodes A, B (in node-rank order); no node left or joined; the plan of round 3 kept"
    assert out["plan"]["predicted"]["marked"]
    assert json.loads((run / "plans" / "4.json").read_text())["predicted"]["elastic"]["plan_of"] == 3
    assert elastic.plan_round(plan, "j", run, 5, both)["reason"].endswith("the plan of round 3 kept")
    swapped = [hello(0, 0, "B"), hello(1, 0, "B"), hello(2, 1, "A"), hello(3, 1, "A")]
    out = elastic.plan_round(plan, "j", run, 6, swapped)  # other node ranks: the planner plans them
    assert "kept" not in out["reason"] and "marked" not in out["plan"]["predicted"]


def test_a_round_refuses_a_newest_recorded_plan_of_another_job_naming_it(tmp_path):
    plan = load_plan(two_node_plan(tmp_path))
    run = tmp_path / "run"
    other = plan.to_dict()
    other["name"] = "someone-else"
    elastic.record_plan(run / "plans", other, 3, "drift: at step 40, ...")
    both = [hello(0, 0, "A"), hello(1, 0, "A"), hello(2, 1, "B"), hello(3, 1, "B")]
    out = elastic.plan_round(plan, "j", run, 4, both)
    assert out["error"].startswith(f"{run / 'plans' / '3.json'}: the plan of another job (name differ")
    assert not (run / "plans" / "4.json").exists()


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



def test_a_node_whose_gpus_are_not_the_clusters_type_is_refused(tmp_path):
    h100 = [{**n, "gpu_type": "H100"} for n in TWO_NODES]
    plan = load_plan(write_job(tmp_path, nodes=h100, layout={"train_gpus": 2, "dp": 2}))
    seen = [Hello(0, 0, "A", "H100", 1, "j"), Hello(1, 1, "B", "A100-80G", 2, "j")]
    assert elastic.membership_problems(plan, seen, "j") == [
        "node B: cluster.nodes says its GPUs are H100 but rank 1 computes on A100-80G"]
    assert elastic.membership_problems(plan, seen[:1], "j") == []

# ------------------------------------------------------------------ the launch, checked before any rank meets


def test_nnodes_bounds_the_cluster_cannot_satisfy_are_refused_naming_the_flag(tmp_path):
    plan = load_plan(two_node_plan(tmp_path))
    assert elastic.launch_problems(Launch(1, 2, "c10d"), plan, 2, shared_store=False) == []
    (p,) = elastic.launch_problems(Launch(1, 3, "c10d"), plan, 2, shared_store=False)
    assert p.startswith("--nnodes 1:3: the job's cluster.nodes lists 2 nodes, so at most 2 can take part")
    (p,) = elastic.launch_problems(Launch(1, 2, "c10d"), plan, 3, shared_store=False)
    assert p.startswith("--nproc_per_node 3: every node of cluster.nodes runs 2 ranks")
    (p,) = elastic.launch_problems(Launch(1, 2, "c10d"), plan, 2, shared_store=True)
    assert p.startswith("TORCH_DISABLE_SHARE_RDZV_TCP_STORE: set it to 1")
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
    cmd = elastic_cmd(plan, tmp_path / "run", A, f"{A}:{free_port()}", "A", nnodes="1:3", restarts=0, last_call_s=1)
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env())
    assert res.returncode != 0
    assert "--nnodes 1:3: the job's cluster.nodes lists 2 nodes" in res.stdout + res.stderr


# ------------------------------------------------------------------ two nodes on loopback


def env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def elastic_cmd(plan: Path, run: Path, address: str, rdzv: str, name: str, nnodes: str = "1:2",
                restarts: int = 3, last_call_s: int = 5, nproc: int = 2, pausable: bool = False) -> list[str]:
    """One node's launcher of an elastic job (the command docs/multinode.md gives). On loopback every
    launcher's address is this machine's, so only the endpoint's node may host the rendezvous store.
    pausable: its ranks run hexrl.main through tests/pause_points.py (armed by `start(..., pause=)`)."""
    host = int(address == rdzv.split(":")[0])
    entry = [str(ROOT / "tests" / "pause_points.py")] if pausable else ["-m", "hexrl.main"]
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={nproc}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv}", f"--local-addr={address}",
            f"--rdzv-conf=last_call_timeout={last_call_s},is_host={host}", f"--max-restarts={restarts}",
            *entry, str(plan), "--run-dir", str(run), "--node-name", name]


def start(cmd: list[str], pause: str | None = None) -> subprocess.Popen:
    """Start a launcher in its own process group; pause: HEXRL_TEST_PAUSE for its ranks
    (tests/pause_points.py)."""
    return subprocess.Popen(cmd, cwd=ROOT, env={**env(), **({PAUSE_ENV: pause} if pause else {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def plans(run: Path) -> list[dict]:
    """RUN_DIR/plans/<round>.json, oldest round first."""
    rounds = sorted(int(p.name.split(".")[0]) for p in (run / "plans").glob("*[0-9].json"))
    return [json.loads((run / "plans" / f"{r}.json").read_text()) for r in rounds]


def nodes_of(plan: dict) -> list[str]:
    return [n["name"] for n in plan["cluster"]["nodes"]]


def check_finished(run: Path, steps: int, eta: int = 1, problems: int = 100, group_size: int = 2) -> None:
    """Every step trained once (each row's trained count is its steps' worth: none counted twice across
    a restart), each problem once per pass over the data (`problems` of them, less those of groups
    dropped as too stale: a dropped group uses its problem up), the staleness gate held across the
    switches, the accounting balanced at every step and in the summary, every checkpoint whole."""
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    per_step = rows[0]["trajectories_trained"]
    assert [r["trajectories_trained"] for r in rows] == [per_step * r["step"] for r in rows]
    per_pass, seen = problems - rows[-1]["trajectories_dropped"] // group_size, set()
    for r in rows:  # a step's problem ids are sorted: a pass may end inside one
        again = [i for i in r["problem_ids"] if i in seen]
        seen |= set(r["problem_ids"]) - set(again)
        if again:  # a new pass: the last one trained every problem but the dropped ones first
            assert len(seen) >= per_pass, (r["step"], again, len(seen))
            seen = set(again)
    assert max(r["max_staleness"] for r in rows) <= eta
    assert all(balanced(r) for r in rows)
    summary = subprocess.run([sys.executable, "-m", "hexrl.control.summary", str(run)], cwd=ROOT,
                             capture_output=True, text=True, env=env())
    assert "(balanced)" in summary.stdout, summary.stdout
    check_checkpoints(run / "checkpoints")


def check_checkpoints(root: Path) -> None:
    """`latest` names a whole checkpoint, so does every other one kept, and no temporary one is left."""
    assert checkpoint.problems(root) == []
    assert checkpoint.resolve_complete(root) == (checkpoint.latest(root), [])
    kept = [p for p in root.glob("step*") if p.is_dir()]
    assert kept and [p for p in kept if checkpoint.incomplete(p)] == []
    assert list(root.glob(".tmp-*")) == []


def lose_node_b(tmp_path: Path, steps: int, after_step: int = 2):
    """Both nodes start; once step `after_step` is recorded (2: the first checkpoint; 3: the step after
    it is running) node B's launcher and ranks are killed (its machine is gone) and node A's restarted
    ranks plan a round of their own. Returns (A's launcher, plan, run, rendezvous endpoint)."""
    plan = two_node_plan(tmp_path, steps=steps, checkpoint_every=2)
    run, rdzv = tmp_path / "run", f"{A}:{free_port()}"
    a = start(elastic_cmd(plan, run, A, rdzv, "A"))
    b = start(elastic_cmd(plan, run, B, rdzv, "B"))
    assert wait_for(lambda: len(metrics(run)) >= after_step, 600, a), a.communicate()[0][-4000:]
    os.killpg(b.pid, signal.SIGKILL)
    b.wait()
    assert wait_for(lambda: (run / "plans").is_dir() and nodes_of(plans(run)[-1]) == ["A"], 300, a)
    return a, plan, run, rdzv


@pytest.mark.slow
@pytest.mark.parametrize("after_step", [2, 3])
def test_node_b_leaves_after_the_first_checkpoint_and_node_a_finishes_alone(tmp_path, after_step):
    a, _, run, _ = lose_node_b(tmp_path, steps=20, after_step=after_step)
    out, _ = a.communicate(timeout=900)
    assert a.returncode == 0, out[-5000:]
    first, last = plans(run)[0], plans(run)[-1]
    assert sorted(nodes_of(first)) == ["A", "B"] and len(first["ranks"]) == 4
    assert nodes_of(last) == ["A"] and sorted(r["role"] for r in last["ranks"]) == ["rollout", "train"]
    assert last["predicted"]["elastic"]["reason"].endswith("nodes A (in node-rank order); left: B")
    assert "resuming from" in out  # the new plan continued from the checkpoint, not from scratch
    check_finished(run, 20)


@pytest.mark.slow
def test_node_b_rejoins_and_the_job_takes_it_back(tmp_path):
    a, plan, run, rdzv = lose_node_b(tmp_path, steps=400)
    b = start(elastic_cmd(plan, run, B, rdzv, "B"))  # node B back: node A's launcher restarts its ranks
    outs = {name: p.communicate(timeout=1200)[0] for name, p in (("A", a), ("B", b))}
    assert (a.returncode, b.returncode) == (0, 0), outs["A"][-4000:] + outs["B"][-3000:]
    last = plans(run)[-1]
    assert sorted(nodes_of(last)) == ["A", "B"] and len(last["ranks"]) == 4
    assert "joined: B" in last["predicted"]["elastic"]["reason"]
    check_finished(run, 400)


# ------------------------------------------------------------- nothing lost: a node leaves or joins at a moment named


def lose_node_b_at(tmp_path: Path, point: str, n: int, steps: int = 8):
    """The trainer's pipeline spans both nodes (a stage on each), so node B writes checkpoint shards and
    sends weights. Node B's ranks pause at the n-th `point` (tests/pause_points.py); once one has, node
    B's launcher and ranks are to be killed (`finish_alone`). Returns (A's launcher, B's, run directory)
    at that moment, frozen while B's rank sleeps."""
    plan = write_job(tmp_path, nodes=TWO_NODES, layout=PP_ACROSS, steps=steps, checkpoint_every=2)
    run, rdzv, marker = tmp_path / "run", f"{A}:{free_port()}", tmp_path / "paused"
    a = start(elastic_cmd(plan, run, A, rdzv, "A"))
    b = start(elastic_cmd(plan, run, B, rdzv, "B", pausable=True), pause=f"{point}:{n}:{marker}")
    if not wait_for(marker.exists, 600, b):
        os.killpg(a.pid, signal.SIGKILL)
        pytest.fail(f"node B never paused at {point} {n}:\n{b.communicate()[0][-4000:]}")
    return a, b, run


def finish_alone(a: subprocess.Popen, b: subprocess.Popen, run: Path, steps: int = 8) -> str:
    """Kill node B; node A must finish every step alone, resumed from a checkpoint, and exit 0."""
    os.killpg(b.pid, signal.SIGKILL)
    b.wait()
    out, _ = a.communicate(timeout=900)
    assert a.returncode == 0, out[-5000:]
    assert [nodes_of(p) for p in plans(run)][-1] == ["A"]
    assert "resuming from" in out
    check_finished(run, steps)
    return out


@pytest.mark.slow
def test_node_b_lost_mid_checkpoint_leaves_the_last_whole_one_named(tmp_path):
    a, b, run = lose_node_b_at(tmp_path, "shard", 2)  # step 4's checkpoint, B's shard written, its RNG not
    root = run / "checkpoints"
    assert checkpoint.latest(root).name == "step00000002"
    assert list((root / ".tmp-step00000004").glob("model-*.pt"))  # the half-written one
    assert len(metrics(run)) == 4  # its step's row is written before the checkpoint: redone on resume
    out = finish_alone(a, b, run)
    assert "(its newest complete checkpoint, step00000002)" in out


@pytest.mark.slow
def test_node_b_lost_mid_weight_sync(tmp_path):
    # version 3: B's stage not sent, A's sent or on its way (its trainer may have logged step 3 already)
    a, b, run = lose_node_b_at(tmp_path, "sync", 3)
    assert len(metrics(run)) in (2, 3) and checkpoint.latest(run / "checkpoints").name == "step00000002"
    finish_alone(a, b, run)


@pytest.mark.slow
def test_node_b_lost_mid_step(tmp_path):
    a, b, run = lose_node_b_at(tmp_path, "step", 4)  # step 4 begun on both stages' ranks
    assert len(metrics(run)) == 3
    finish_alone(a, b, run)


@pytest.mark.slow
def test_node_b_joins_while_a_step_runs(tmp_path):
    plan = two_node_plan(tmp_path, steps=8, checkpoint_every=2)
    run, rdzv, marker = tmp_path / "run", f"{A}:{free_port()}", tmp_path / "paused"
    a = start(elastic_cmd(plan, run, A, rdzv, "A", pausable=True), pause=f"step:3:{marker}")  # A alone
    assert wait_for(marker.exists, 600, a), a.communicate()[0][-4000:]
    assert nodes_of(plans(run)[-1]) == ["A"] and len(metrics(run)) == 2
    b = start(elastic_cmd(plan, run, B, rdzv, "B"))  # node A's launcher restarts its ranks mid-step 3
    outs = {name: p.communicate(timeout=900)[0] for name, p in (("A", a), ("B", b))}
    assert (a.returncode, b.returncode) == (0, 0), outs["A"][-4000:] + outs["B"][-3000:]
    last = plans(run)[-1]
    assert sorted(nodes_of(last)) == ["A", "B"] and "joined: B" in last["predicted"]["elastic"]["reason"]
    assert "resuming from" in outs["A"] + outs["B"]
    check_finished(run, 8)


@pytest.mark.slow
def test_a_node_slow_to_leave_at_the_end_is_not_restarted_alone(tmp_path):
    """Rank 0 hosts the store of an elastic launch: node B's ranks, 5 s late out of the last collective
    (their watchdogs beat twice meanwhile), must still find it, so the job ends in the round it ran."""
    plan = two_node_plan(tmp_path, steps=3)
    run, rdzv, marker = tmp_path / "run", f"{A}:{free_port()}", tmp_path / "leaving"
    a = start(elastic_cmd(plan, run, A, rdzv, "A"))
    b = start(elastic_cmd(plan, run, B, rdzv, "B", pausable=True), pause=f"leave:5:{marker}")
    outs = {name: p.communicate(timeout=600)[0] for name, p in (("A", a), ("B", b))}
    assert marker.exists()
    assert (a.returncode, b.returncode) == (0, 0), outs["A"][-3000:] + outs["B"][-3000:]
    assert [sorted(nodes_of(p)) for p in plans(run)] == [["A", "B"]], outs["B"][-3000:]
    check_finished(run, 3)
