"""Elastic membership: under `torchrun --nnodes MIN:MAX --rdzv-backend c10d`, the nodes present at each
(re)start agree on who they are and run a plan made for exactly them.

torchrun numbers nodes in the order their launchers joined the round, and a round may have any
number of nodes from MIN to MAX; the job's plan.json lists every node that may take part. At each
start the ranks meet in the store (raw JSON bytes, never pickle):

    rank 0:      leader = a fresh round id (its store keys from earlier rounds may still be there)
    every rank:  hello/<round id>/<rank> = its node (--node-name), GPU type, pid and plan digest
    rank 0:      plans the nodes present, in node-rank order (`python -m hexrl.plan` on the job's cluster
                 restricted to them), records RUN_DIR/plans/<round>.json with the reason, and sets
                 result/<round id> = {"round", "plan"} or {"error"}
    every rank:  takes the result that lists its own pid (a leader key from a dead round leads to a
                 result without it, or to none: it reads the leader again) and its role from that plan

A rank's hello names its node; the node's address must be this machine's, as for a static launch
(hexrl/runtime/nodes.py). A round that cannot run (a node named twice, a plan from another job, the
model no longer fits on the GPUs left) ends on every rank with one message naming what is missing.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

from hexrl.gpus import canonical_name, gpu_type_name
from hexrl.runtime.files import write_json_atomic
from hexrl.runtime.nodes import is_local_address
from hexrl.schema import ConfigError, Job, Plan, load_plan

PREFIX = "hexrl/elastic/"
PLAN_TIMEOUT = timedelta(minutes=10)  # rank 0 runs the planner while the others wait
POLL = timedelta(seconds=1)  # how long a rank waits on a result before it reads the leader key again
SWITCH_EXIT = 3  # every rank's exit code when the job switches plans: torchrun restarts the workers


@dataclass
class Launch:
    """What this node's torchrun was started with (its rendezvous and node-count bounds)."""

    min_nodes: int
    max_nodes: int
    backend: str

    @property
    def elastic(self) -> bool:
        """Node ranks follow join order and the node count may change: the plan is made per round."""
        return self.backend != "static" and self.max_nodes > self.min_nodes


@dataclass
class Hello:
    """What each rank tells rank 0 about itself at the start of a round."""

    rank: int
    node_rank: int  # torchrun's GROUP_RANK: the launcher's place in this round's join order
    node: str  # the cluster node's name (from --node-name, or the one local address)
    gpu_type: str  # what the rank sees: "cpu", or the canonical name of its GPU
    pid: int  # unique among this round's ranks on a machine: tells this round's result from an old one
    job: str  # plan digest (hexrl.runtime.nodes.plan_digest): every node must run the same job


def launcher_args(pid: int | None = None) -> Launch | None:
    """This worker's torchrun arguments, read back from its agent's command line and parsed by torchrun's
    own parser; None when the parent is not torchrun (or its command line cannot be read)."""
    try:
        argv = Path(f"/proc/{pid or os.getppid()}/cmdline").read_bytes().decode().split("\0")[:-1]
    except OSError:
        return None
    start = next((i + 1 for i, a in enumerate(argv)
                  if a == "torch.distributed.run" or Path(a).name == "torchrun"), None)
    if start is None:
        return None
    from torch.distributed.run import get_args_parser, parse_min_max_nnodes

    try:
        args = get_args_parser().parse_args(argv[start:])
        lo, hi = parse_min_max_nnodes(args.nnodes)
    except (SystemExit, ValueError, RuntimeError):
        return None
    return Launch(lo, hi, "c10d" if args.standalone else args.rdzv_backend)


def launch_problems(launch: Launch, plan: Plan, local_world: int, shared_store: bool) -> list[str]:
    """What in `--nnodes MIN:MAX` / `--nproc_per_node` the job's cluster cannot satisfy, and a store
    shared with torchrun's agent (TORCHELASTIC_USE_AGENT_STORE): torch keeps it on the node that
    hosted it first, so when rank 0 moves to another node (a node joining) the launchers wait forever."""
    n, per, p = len(plan.job.cluster.nodes), plan.ranks_per_node, []
    if shared_store:
        p.append("TORCH_DISABLE_SHARE_RDZV_TCP_STORE: set it to 1 in every launcher's environment of an "
                 "elastic job (torchrun's shared store does not follow rank 0 to another node)")
    if launch.max_nodes > n:
        p.append(f"--nnodes {launch.min_nodes}:{launch.max_nodes}: the job's cluster.nodes lists {n} node"
                 f"{'s' if n != 1 else ''}, so at most {n} can take part; launch with --nnodes "
                 f"{min(launch.min_nodes, n)}:{n} or add the nodes to cluster.nodes")
    if local_world != per:
        p.append(f"--nproc_per_node {local_world}: every node of cluster.nodes runs {per} ranks; "
                 f"launch with --nproc_per_node {per}")
    return p


def own_node(plan: Plan, node_name: str | None) -> tuple[str | None, list[str]]:
    """This launcher's cluster node (its name): the one --node-name names, else the only one whose
    address is this machine's. Its address must be this machine's either way."""
    nodes = plan.job.cluster.nodes
    if node_name is not None:
        named = [n for n in nodes if node_name in (n.name, n.address)]
        if not named:
            return None, [f"--node-name {node_name}: no node of cluster.nodes has that name or address "
                          f"(known: {', '.join(n.name for n in nodes)})"]
    else:
        named = [n for n in nodes if is_local_address(n.address)]
        if len(named) != 1:
            return None, [f"--node-name: {len(named)} nodes of cluster.nodes have an address of this machine "
                          f"({', '.join(n.name for n in named) or 'none'}); name this launcher's node"]
    node = named[0]
    if not is_local_address(node.address):
        return None, [f"--node-name {node.name}: its address {node.address} (cluster.nodes) is not an address "
                      f"of this machine; start the launcher on the machine at that address"]
    return node.name, []


def detected_gpu_type() -> str:
    """The device this rank computes on, named as cluster.nodes names GPU types ("cpu" without CUDA)."""
    import torch

    return gpu_type_name(torch.cuda.get_device_name()) if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------- the agreement


def _wait_all(store, keys: list[str], timeout: timedelta) -> bool:
    """True once every key exists, False after `timeout`."""
    try:
        store.wait([PREFIX + k for k in keys], timeout)
        return True
    except RuntimeError:  # DistStoreError (a timeout) is a RuntimeError
        return False


def next_round(plans_dir: Path) -> int:
    """The run's next round number: one past its newest recorded plan (RUN_DIR/plans/<round>.json).
    Counted in the run directory, not the store: a round's store may be new (torchrun hosts it anew
    when rank 0 moves to another node)."""
    done = [int(p.stem) for p in plans_dir.glob("*.json") if p.stem.isdigit()] if plans_dir.is_dir() else []
    return max(done, default=-1) + 1


# what a recorded plan may change of its job: the nodes a round has (and so the layout), the output
# lengths a switch measured; the rest is what the job trains, and another value is another job
ROUND_FIELDS = ("cluster", "layout", "workload", "prices")


def read_recorded_plan(path: Path, job: Job) -> dict:
    """The plan recorded at `path` (plan.json as a dict) for a run of `job`; ValueError naming the file
    when it is not a valid plan (torn, edited) or is another job's: a restart must never run it."""
    try:
        plan = load_plan(path, check_paths=False)
    except ConfigError as e:
        raise ValueError(f"{path}: not a valid plan, refusing to run it: {'; '.join(e.problems[:3])}") from None
    mine, theirs = job.to_dict(), plan.job.to_dict()
    differ = sorted(k for k in mine.keys() | theirs.keys() if k not in ROUND_FIELDS and mine.get(k) != theirs.get(k))
    known = {json.dumps(n, sort_keys=True) for n in mine["cluster"]["nodes"]}
    if any(json.dumps(n, sort_keys=True) not in known for n in theirs["cluster"]["nodes"]):
        differ.append("cluster.nodes")
    if differ:
        raise ValueError(f"{path}: the plan of another job ({', '.join(differ)} differ from this job's), "
                         "refusing to run it; move it out of the run directory or give the run its own --run-dir")
    return json.loads(path.read_text())


def newest_plan(plans_dir: Path, job: Job) -> tuple[int, dict] | None:
    """(round, plan.json as a dict) of the run's newest recorded plan (RUN_DIR/plans/<round>.json), the one
    the job ran last; None when none is recorded. ValueError naming the file when it cannot be `job`'s
    (read_recorded_plan)."""
    round_no = next_round(plans_dir) - 1
    if round_no < 0:
        return None
    return round_no, read_recorded_plan(plans_dir / f"{round_no}.json", job)


def record_plan(plans_dir: Path, plan: dict, round_no: int, why: str, **more) -> Path:
    """Write `plan` as RUN_DIR/plans/<round_no>.json, its nodes and `why` under predicted.elastic (with
    `more`), complete or not at all (a rename): the newest recorded plan is what a restart runs."""
    names = [n["name"] for n in plan["cluster"]["nodes"]]
    plan["predicted"]["elastic"] = {"round": round_no, "nodes": names, "reason": why, **more}
    path = plans_dir / f"{round_no}.json"
    write_json_atomic(path, plan)
    return path


def lead(store, hello: Hello, world: int, round_no: int, plan_round) -> tuple[int, dict]:
    """Rank 0's side: a fresh round id, every rank's hello, then `plan_round(round_no, hellos)` (a dict
    with "plan" or "error") shared as this round's result. Returns (round_no, result)."""
    rid = f"{round_no}-{hello.pid}-{time.time_ns()}"
    store.set(PREFIX + f"hello/{rid}/0", json.dumps(asdict(hello)).encode())
    store.set(PREFIX + "leader", rid)
    keys = [f"hello/{rid}/{r}" for r in range(world)]
    if not _wait_all(store, keys, PLAN_TIMEOUT):
        raise TimeoutError(f"not every rank of this round said hello within {PLAN_TIMEOUT}")
    hellos = [Hello(**json.loads(store.get(PREFIX + k))) for k in keys]
    result = {"round": round_no, "pids": {str(h.rank): h.pid for h in hellos}, **plan_round(round_no, hellos)}
    store.set(PREFIX + f"result/{rid}", json.dumps(result).encode())
    return round_no, result


def follow(store, hello: Hello, timeout: timedelta = PLAN_TIMEOUT) -> tuple[int, dict]:
    """Every other rank's side: hello under the current leader's round id, then that round's result,
    once it lists this rank's pid. Returns (round, result)."""
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        if not _wait_all(store, ["leader"], POLL):
            continue
        rid = store.get(PREFIX + "leader").decode()
        store.set(PREFIX + f"hello/{rid}/{hello.rank}", json.dumps(asdict(hello)).encode())
        while time.monotonic() < deadline and store.get(PREFIX + "leader").decode() == rid:
            if _wait_all(store, [f"result/{rid}"], POLL):
                result = json.loads(store.get(PREFIX + f"result/{rid}"))
                if result["pids"].get(str(hello.rank)) == hello.pid:
                    return result["round"], result
                time.sleep(POLL.total_seconds())  # a dead round's result: its leader key is stale
                break
    raise TimeoutError(f"rank {hello.rank}: no plan for this round from rank 0 within {timeout}")


# ---------------------------------------------------------------- rank 0 plans the round


def membership_problems(plan: Plan, hellos: list[Hello], job: str) -> list[str]:
    """Every way this round's ranks disagree with each other or with the job's cluster."""
    p, by_node, types = [], {}, {n.name: n.gpu_type for n in plan.job.cluster.nodes}
    for h in hellos:
        if h.job != job:
            p.append(f"rank {h.rank} (node {h.node}) read a plan from another job (digest {h.job}, rank 0's "
                     f"{job}); give every node the same plan.json and the same hexrl.main flags")
        by_node.setdefault(h.node_rank, set()).add(h.node)
        want = canonical_name(types[h.node]) or types[h.node]
        if want != "cpu" and h.gpu_type != want:  # the CPU stand-in runs on whatever device there is
            p.append(f"node {h.node}: cluster.nodes says its GPUs are {types[h.node]} but rank {h.rank} "
                     f"computes on {h.gpu_type}")
    for nr, names in sorted(by_node.items()):
        if len(names) > 1:
            p.append(f"node rank {nr}: its ranks name different nodes ({', '.join(sorted(names))})")
    seen: dict[str, int] = {}
    for nr, names in sorted(by_node.items()):
        for name in names:
            if name in seen:
                p.append(f"node {name}: two launchers (node ranks {seen[name]} and {nr}) were started as it; "
                         f"give each its own --node-name")
            seen.setdefault(name, nr)
    return p


def present_nodes(hellos: list[Hello]) -> list[str]:
    """The round's node names in node-rank order (torchrun numbers ranks node by node in that order)."""
    return [name for _, name in sorted({(h.node_rank, h.node) for h in hellos})]


def restrict(plan: Plan, names: list[str]) -> dict:
    """The job (as job.json) on exactly the named nodes, in that order. A fixed layout was written for
    the whole cluster, so with nodes missing the planner searches a new one."""
    job = plan.job.to_dict()
    by_name = {n["name"]: n for n in job["cluster"]["nodes"]}
    if len(names) < len(by_name):
        job.pop("layout", None)
    job["cluster"]["nodes"] = [by_name[n] for n in names]
    return job


def reason(names: list[str], before: list[str], round_no: int) -> str:
    """Which nodes take part in this round and what changed since the last plan."""
    left = [n for n in before if n not in names]
    joined = [n for n in names if n not in before]
    change = "; ".join(x for x in (f"left: {', '.join(left)}" if left else "",
                                   f"joined: {', '.join(joined)}" if joined else "") if x)
    return f"round {round_no}: nodes {', '.join(names)} (in node-rank order); " + (change or "no node left or joined")


def recorded(plan: dict, key: str, default):
    """`key` of the plan's predicted.elastic (what record_plan wrote), else `default`."""
    info = plan["predicted"].get("elastic")
    return info.get(key, default) if isinstance(info, dict) else default


def run_planner(job: dict, out: Path) -> tuple[dict | None, str]:
    """`python -m hexrl.plan` (its public command) on `job`, written next to `out`: (plan, "") or
    (None, the planner's message)."""
    job_path = out.with_suffix(".job.json")
    job_path.write_text(json.dumps(job, indent=1) + "\n")
    res = subprocess.run([sys.executable, "-m", "hexrl.plan", str(job_path), "-o", str(out), "--json"],
                         capture_output=True, text=True)
    if res.returncode != 0:
        return None, (res.stderr.strip() or res.stdout.strip())
    return json.loads(out.read_text()), ""


def plan_round(plan: Plan, job: str, run_dir: Path, round_no: int, hellos: list[Hello]) -> dict:
    """Rank 0's plan for this round: {"plan": plan.json as a dict} or {"error": what is missing}. The
    nodes of the newest recorded plan, in its order, keep that plan (a switch re-planned it on the
    run's measurements); otherwise the planner plans the job for the nodes present."""
    if problems := membership_problems(plan, hellos, job):
        return {"error": "\n  ".join(problems)}
    names = present_nodes(hellos)
    plans = run_dir / "plans"
    plans.mkdir(parents=True, exist_ok=True)
    try:
        newest, kept = newest_plan(plans, plan.job), {}
    except ValueError as e:
        return {"error": str(e)}
    before = [n["name"] for n in (newest[1]["cluster"] if newest else plan.job.to_dict()["cluster"])["nodes"]]
    why = reason(names, before, round_no)
    if newest is not None and before == names:
        new = newest[1]
        kept = {"plan_of": recorded(new, "plan_of", newest[0])}  # the round that made it
        why += f"; the plan of round {kept['plan_of']} kept"
    else:
        new, message = run_planner(restrict(plan, names), plans / f"{round_no}.json")
        if new is None:
            missing = [n.name for n in plan.job.cluster.nodes if n.name not in names]
            return {"error": f"the nodes present ({', '.join(names)}) cannot run this job"
                             + (f" without {', '.join(missing)}" if missing else "") + f": {message}"}
    record_plan(plans, new, round_no, why, **kept)
    return {"plan": new, "reason": why}
