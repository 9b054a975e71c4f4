"""Which plan node a process runs on, checked against what torchrun made of it.

torchrun numbers nodes and ranks; the plan names the node (and its address) of every rank.
They agree only if each launcher was started with the right node rank:

    global rank = node rank * nproc_per_node + local rank        (torchrun, equal nproc per node)
    plan.ranks[global rank].node == node rank                    (the plan, same formula)

With `--rdzv-backend static` the node rank is `--node-rank`; with `c10d` it is the order in
which launchers joined, so it can differ from run to run. A launcher may say which plan node
it is (`hexrl.main --node-name NAME`); otherwise the plan node's address must be an address of
this machine. Every rank checks this before it takes a role, and a mismatch ends the job
naming the node, the address and the launch flag to fix.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path

from hexrl.schema import Plan


def is_local_address(address: str) -> bool:
    """True if this machine can bind `address` (an IP or a hostname resolving to one of its own)."""
    try:
        ip = socket.gethostbyname(address)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


def bind_host(address: str) -> str:
    """The IP to bind for a plan node's `address` (ZeroMQ binds IPs, not hostnames)."""
    return socket.gethostbyname(address)


def node_label(plan: Plan, node: int) -> str:
    """'node 1 'B' (127.0.0.2)': how messages name a plan node."""
    n = plan.job.cluster.nodes[node]
    return f"node {node} {n.name!r} ({n.address})"


def address_problems(plan: Plan) -> list[str]:
    """A multi-node plan needs one distinct address per node (they are where peers connect)."""
    nodes = plan.job.cluster.nodes
    if len(nodes) < 2:
        return []
    p, first = [], {}
    for i, n in enumerate(nodes):
        if n.address in first:
            p.append(f"cluster.nodes[{i}].address: {n.address} is also node {first[n.address]}'s address; "
                     f"a multi-node run needs each node's own address (loopback tries: 127.0.0.1, 127.0.0.2, ...)")
        first.setdefault(n.address, i)
    return p


def placement_problems(plan: Plan, rank: int, local_rank: int, node_rank: int, node_name: str | None) -> list[str]:
    """Every way this rank's torchrun placement contradicts its plan entry (empty when it matches)."""
    x, nodes = plan.ranks[rank], plan.job.cluster.nodes
    fix = "start each node's launcher with --rdzv-backend static --node-rank <its index in cluster.nodes>"
    if (x.node, x.local_rank) != (node_rank, local_rank):
        return [f"rank {rank}: torchrun placed it on node rank {node_rank}, local rank {local_rank}, but the plan "
                f"puts rank {rank} on {node_label(plan, x.node)}, local rank {x.local_rank}; {fix}"]
    if node_name is not None and node_name not in (nodes[node_rank].name, nodes[node_rank].address):
        named = [i for i, n in enumerate(nodes) if node_name in (n.name, n.address)]
        where = f"plan node {named[0]}" if named else "no plan node"
        return [f"rank {rank}: this launcher was started as --node-name {node_name} ({where}), but torchrun made it "
                f"node rank {node_rank}, which the plan places at {node_label(plan, node_rank)}; {fix}"]
    if len(nodes) > 1 and not is_local_address(nodes[node_rank].address):
        return [f"rank {rank}: torchrun made this launcher node rank {node_rank}, which the plan places at "
                f"{node_label(plan, node_rank)}, but {nodes[node_rank].address} is not an address of this machine "
                f"({socket.gethostname()}); {fix}, on the machine at that address"]
    return []


def plan_digest(path: str, steps: int | None, running: dict | None = None) -> str:
    """A short fingerprint of plan.json's content (key order and spacing aside), the --steps override
    and the plan this attempt runs where it is another (an elastic round's, a recorded switch's): every
    node must run the same plan."""
    text = json.dumps([json.loads(Path(path).read_text()), steps, *([running] if running else [])], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def node_rank_from_env() -> int:
    """torchrun's node rank (GROUP_RANK) of this launcher."""
    return int(os.environ.get("GROUP_RANK", "0"))
