"""A two-node job on one machine: one torchrun launcher per node, nodes at 127.0.0.1 and 127.0.0.2.

Node A runs the trainer ranks (and the controller, bound to A's address from the plan), node B
the rollout ranks, which connect to it; the rendezvous store lives in A's launcher.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_utils import free_port
from runtime_utils import ROOT, metrics, torchrun, torchrun_node, wait_for, worker_pids, write_job
from safetensors.torch import load_file

from hexrl.runtime.nodes import address_problems, placement_problems, plan_digest
from hexrl.runtime.watchdog import Watchdog
from hexrl.schema import ConfigError, load_job, load_plan
from hexrl.train import warm_start

A, B = "127.0.0.1", "127.0.0.2"
TWO_NODES = [{"name": "A", "gpu_type": "cpu", "gpus": 2, "address": A},
             {"name": "B", "gpu_type": "cpu", "gpus": 2, "address": B}]
# a trainer pipeline split across the nodes: stage 0 on A (rank 0), stage 1 on B (rank 2)
PP_ACROSS = {"train_ranks": [0, 2],
             "trainer": {"dp": 1, "stages": [{"gpu_type": "cpu", "tp": 1, "layers": [0, 2]},
                                             {"gpu_type": "cpu", "tp": 1, "layers": [2, 4]}]},
             "rollout_replicas": [{"tp": 1, "ranks": [1], "share": 0.5}, {"tp": 1, "ranks": [3], "share": 0.5}]}


def launch(plan: Path, run: Path, *args: str, node_ranks=(0, 1)) -> dict:
    """Node A's and node B's launchers (node_ranks: what each is told with --node-rank)."""
    rdzv = f"{A}:{free_port()}"
    return {name: torchrun_node(plan, run, nr, 2, 2, rdzv, addr, "--node-name", name, *args)
            for name, nr, addr in (("A", node_ranks[0], A), ("B", node_ranks[1], B))}


def finish(procs: dict, timeout_s: float = 300) -> dict:
    out = {}
    for name, p in procs.items():
        text, _ = p.communicate(timeout=timeout_s)
        out[name] = (p.returncode, text)
    return out


def balanced(r: dict) -> bool:
    return r["trajectories_produced"] == (r["trajectories_trained"] + r["trajectories_filtered"] +
                                          r["trajectories_dropped"] + r["trajectories_pending"])


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on `port` (from /proc/net/tcp)."""
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        ip_hex, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:
            out.add(".".join(str(int(ip_hex[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return out


# ------------------------------------------------------------------ placement checks, no launch


def test_placement_is_checked_against_torchrun_node_rank_name_and_address(tmp_path):
    plan = load_plan(write_job(tmp_path, nodes=TWO_NODES, layout={"train_gpus": 2, "dp": 2}))
    assert [(x.rank, x.node, x.local_rank, x.role) for x in plan.ranks] == \
        [(0, 0, 0, "train"), (1, 0, 1, "train"), (2, 1, 0, "rollout"), (3, 1, 1, "rollout")]
    assert placement_problems(plan, 2, 0, 1, "B") == []
    assert placement_problems(plan, 2, 0, 1, B) == []  # a node may be named by its address
    assert placement_problems(plan, 2, 0, 1, None) == []  # 127.0.0.2 is an address of this machine
    swapped = placement_problems(plan, 0, 0, 0, "B")
    assert len(swapped) == 1 and "started as --node-name B (plan node 1)" in swapped[0]
    assert "node rank 0, which the plan places at node 0 'A' (127.0.0.1)" in swapped[0]
    assert "--node-rank" in swapped[0]
    wrong = placement_problems(plan, 2, 0, 0, None)  # rank 2 is not on node rank 0 in the plan
    assert len(wrong) == 1 and "the plan puts rank 2 on node 1 'B' (127.0.0.2)" in wrong[0]
    # an address that is not this machine's (TEST-NET-1: never bindable here): the launcher is on the wrong host
    far = load_plan(write_job(tmp_path, nodes=[TWO_NODES[0], {**TWO_NODES[1], "address": "192.0.2.7"}],
                              layout={"train_gpus": 2, "dp": 2}))
    lost = placement_problems(far, 2, 0, 1, None)
    assert len(lost) == 1 and "192.0.2.7 is not an address of this machine" in lost[0]


def test_a_multi_node_plan_needs_one_address_per_node_and_one_plan(tmp_path):
    same = [TWO_NODES[0], {**TWO_NODES[1], "address": A}]
    plan = load_plan(write_job(tmp_path, nodes=same, layout={"train_gpus": 2, "dp": 2}))
    (p,) = address_problems(plan)
    assert p.startswith("cluster.nodes[1].address: 127.0.0.1 is also node 0's address")
    path = tmp_path / "plan.json"
    assert plan_digest(path, None) == plan_digest(path, None) != plan_digest(path, 5)
    reordered = tmp_path / "same.json"
    reordered.write_text(json.dumps(dict(reversed(json.loads(path.read_text()).items())), indent=3))
    assert plan_digest(reordered, None) == plan_digest(path, None)  # content, not formatting
    # a restarted attempt runs the run's newest recorded plan: a node that read another one is told apart
    switched = json.loads(path.read_text())
    assert plan_digest(path, None, switched) != plan_digest(path, None)
    assert plan_digest(path, None, switched) != plan_digest(path, None, {**switched, "ranks": []})


def test_a_node_address_is_never_a_wildcard():
    job = {"model": {"preset": "tiny"}, "data": {"synthetic": {"task": "arithmetic", "n": 10}},
           "cluster": {"nodes": [{"name": "A", "gpu_type": "cpu", "gpus": 2, "address": "0.0.0.0"}]}}
    with pytest.raises(ConfigError) as e:
        load_job(job)
    assert "cluster.nodes[0].address: must be the node's own address or hostname, not the wildcard '0.0.0.0'" \
        in str(e.value)


def test_watchdog_names_a_lost_nodes_ranks_together():
    from torch.distributed import HashStore

    nodes = {0: "node 0 'A' (127.0.0.1)", 1: "node 0 'A' (127.0.0.1)", 2: "node 1 'B' (127.0.0.2)",
             3: "node 1 'B' (127.0.0.2)"}
    store, seen = HashStore(), []
    dogs = [Watchdog(store, r, 4, {r: f"r{r}" for r in range(4)}, interval_s=0.05, timeout_s=0.5,
                     on_failure=seen.append, nodes=nodes).start() for r in range(4)]
    dogs[2].stop()
    dogs[3].stop()  # node B's launcher killed: both its ranks fall silent together
    assert wait_for(lambda: len(seen) >= 2, 5)
    assert seen[0].startswith("ranks 2, 3 on node 1 'B' (127.0.0.2) (all its ranks) are gone: no heartbeat for")
    # a rank whose collective broke finds the silent ranks by watching heartbeats, not itself
    assert dogs[1].lost_peers(wait_s=0.2).startswith("ranks 2, 3 on node 1 'B'")
    for d in dogs:
        d.stop()


# ------------------------------------------------------------------ two launchers


def test_two_node_demo_script_runs_and_balances(tmp_path):
    """tools/multinode_demo.py, as a user runs it, on a tiny job: node A trains, node B generates."""
    write_job(tmp_path, steps=3, eta=1, nodes=TWO_NODES, layout={"train_gpus": 2, "dp": 2})
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "tools/multinode_demo.py", "--job", str(tmp_path / "job.json"),
                          "--run", str(run)], cwd=ROOT, capture_output=True, text=True, timeout=400,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "exit codes {'A': 0, 'B': 0}" in out.stdout
    assert (run / "controller_endpoint").read_text().startswith(f"tcp://{A}:")  # node A's address, from the plan
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(balanced(r) for r in rows) and rows[-1]["trajectories_trained"] == 3 * 2 * 2
    assert "(balanced)" in out.stdout
    ids = [i for r in rows for i in r["problem_ids"]]
    assert len(ids) == len(set(ids))


def test_a_launcher_on_the_wrong_node_rank_ends_the_job_naming_it(tmp_path):
    plan = write_job(tmp_path, steps=2, nodes=TWO_NODES, layout={"train_gpus": 2, "dp": 2})
    t0 = time.time()
    res = finish(launch(plan, tmp_path / "run", node_ranks=(1, 0)), timeout_s=120)  # A and B swapped
    assert time.time() - t0 < 120
    assert all(code != 0 for code, _ in res.values())
    text = res["A"][1] + res["B"][1]
    assert "started as --node-name B (plan node 1), but torchrun made it node rank 0" in text, text[-3000:]
    assert "--rdzv-backend static --node-rank" in text
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def kill_node_b(tmp_path, workers_too: bool):
    """Run 40 steps (enough that a fast machine is still mid-run); after 2, SIGKILL node B's launcher
    (and with workers_too its ranks, as when the machine dies). Node A must end within 60 s naming node B's
    ranks. Returns (plan, run)."""
    plan = write_job(tmp_path, steps=40, eta=1, checkpoint_every=1, nodes=TWO_NODES, layout={"train_gpus": 2, "dp": 2})
    run = tmp_path / "run"
    procs = launch(plan, run)
    assert wait_for(lambda: len(metrics(run)) >= 2, 300, procs["A"]), procs["A"].communicate()[0][-3000:]
    port = int((run / "controller_endpoint").read_text().strip().rsplit(":", 1)[1])
    assert listening_addresses(port) == {A}  # bound to node A's address only, never 0.0.0.0
    ranks_b = worker_pids(procs["B"])
    assert sorted(ranks_b) == [2, 3]
    os.kill(procs["B"].pid, signal.SIGKILL)  # torchrun's agent (its workers run in sessions of their own)
    if workers_too:
        for pid in ranks_b.values():
            os.kill(pid, signal.SIGKILL)
    t0 = time.time()
    code, out = finish({"A": procs["A"]}, timeout_s=120)["A"]
    ended = time.time() - t0
    procs["B"].wait()
    assert code != 0 and ended < 60, (ended, out[-3000:])
    assert "ranks 2, 3 on node 1 'B' (127.0.0.2)" in out, out[-3000:]
    print(f"node A ended {ended:.1f} s after the kill:", *[x for x in out.splitlines() if "gone" in x][:2], sep="\n")
    assert wait_for(lambda: not any(alive(pid) for pid in ranks_b.values()), 30)  # no orphans left running
    return plan, run


def alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return False


@pytest.mark.slow
def test_killing_node_b_launcher_ends_node_a_naming_its_ranks_then_both_resume(tmp_path):
    plan, run = kill_node_b(tmp_path, workers_too=False)
    done = max(r["step"] for r in metrics(run))
    saved = json.loads((run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
                        / "meta.json").read_text())["version"]
    res = finish(launch(plan, run, "--resume", str(run / "checkpoints")))
    assert all(c == 0 for c, _ in res.values()), res["A"][1][-3000:] + res["B"][1][-2000:]
    rows = metrics(run)
    steps = [r["step"] for r in rows]
    assert steps == sorted(steps) and steps[-1] == 40 and len(steps) == len(set(steps)), steps
    assert [r for r in rows if r["step"] > saved][0]["version"] == saved + 1  # continued, not restarted
    ids = [i for r in rows for i in r["problem_ids"]]
    assert len(ids) == len(set(ids)) and done >= 2
    assert all(balanced(r) for r in rows)


@pytest.mark.slow
def test_losing_node_b_machine_ends_node_a_naming_its_ranks(tmp_path):
    kill_node_b(tmp_path, workers_too=True)


@pytest.mark.slow
def test_pipeline_split_across_nodes_equals_the_single_node_run(tmp_path):
    """PP=2, stage 0 on node A and stage 1 on node B, against the same ranks on one node. With
    eta=0 every step trains the same groups, sampled with per-group seeds, so it is deterministic."""
    # a model that sometimes answers right (a random one never does: zero advantages, no update)
    warm_start.main([str(tmp_path / "model"), "--digits", "1", "1", "--target-acc", "0.3", "--n-train", "90",
                     "--n-heldout", "10", "--n-dev", "40", "--batch", "32", "--layers", "4", "--hidden", "64",
                     "--intermediate", "128", "--threads", "1", "--eval-every", "10"])
    one, two = tmp_path / "one", tmp_path / "two"
    for d in (one, two):
        shutil.copytree(tmp_path / "model", d / "model")
    kw = dict(steps=3, eta=0, group_size=4, layout=PP_ACROSS)
    single = write_job(one, nodes=[{"name": "A", "gpu_type": "cpu", "gpus": 4, "address": A}], **kw)
    split = write_job(two, nodes=TWO_NODES, **kw)
    assert [(x.node, x.role, x.pp) for x in load_plan(split).ranks] == \
        [(0, "train", 0), (0, "rollout", None), (1, "train", 1), (1, "rollout", None)]
    proc = torchrun(single, one / "run", nproc=4)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    res = finish(launch(split, two / "run"))
    assert all(c == 0 for c, _ in res.values()), res["A"][1][-3000:] + res["B"][1][-2000:]
    a, b = metrics(one / "run"), metrics(two / "run")
    keys = ("step", "version", "problem_ids", "reward_mean", "trajectories_trained", "loss", "grad_norm")
    assert [{k: r[k] for k in keys} for r in a] == [{k: r[k] for k in keys} for r in b]
    assert all(r["grad_norm"] > 0 for r in a)
    wa, wb = load_file(one / "run/final/model.safetensors"), load_file(two / "run/final/model.safetensors")
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)
    w0 = load_file(tmp_path / "model/model.safetensors")
    assert any(not (w0[k] == wa[k]).all() for k in wa)  # it trained: the equality is not of untouched weights
