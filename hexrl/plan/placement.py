"""Where a split's GPUs sit: training GPUs packed node by node, rollout takes the rest.

A split is the number of training GPUs per GPU type. Nodes of one type are interchangeable
(torchrun gives every node the same GPU count, links depend only on node types), so packing
the training GPUs of a type into as few nodes as possible loses nothing: it keeps TP and DP
groups on NVLink, and the rollout side only sees how many GPUs each node has left.
Training GPUs take the lowest local ranks of a node; rollout takes the highest.
"""

from dataclasses import dataclass

from hexrl.schema import ClusterSpec


@dataclass(frozen=True)
class FreeClass:
    """Nodes of one GPU type with the same number of GPUs left for rollout."""

    gpu_type: str
    free: int  # rollout GPUs per node
    nodes: tuple[int, ...]


def train_per_node(cluster: ClusterSpec, counts: dict[str, int]) -> tuple[int, ...]:
    """Training GPUs on each node when `counts[type]` training GPUs are packed node by node."""
    left = dict(counts)
    out = []
    for n in cluster.nodes:
        take = min(n.gpus, left.get(n.gpu_type, 0))
        left[n.gpu_type] = left.get(n.gpu_type, 0) - take
        out.append(take)
    return tuple(out)


def counts_of(cluster: ClusterSpec, per_node: tuple[int, ...]) -> dict[str, int]:
    out = {t: 0 for t in cluster.types()}
    for n, k in zip(cluster.nodes, per_node):
        out[n.gpu_type] += k
    return out


def train_slots(cluster: ClusterSpec, per_node: tuple[int, ...], gpu_type: str) -> list[tuple[int, int]]:
    """(node, local_rank) of every training GPU of one type, in packing order."""
    return [(i, j) for i, n in enumerate(cluster.nodes) if n.gpu_type == gpu_type
            for j in range(per_node[i])]


def free_classes(cluster: ClusterSpec, per_node: tuple[int, ...]) -> list[FreeClass]:
    """Rollout GPUs grouped by (type, GPUs left per node)."""
    groups: dict[tuple[str, int], list[int]] = {}
    for i, n in enumerate(cluster.nodes):
        free = n.gpus - per_node[i]
        if free > 0:
            groups.setdefault((n.gpu_type, free), []).append(i)
    return [FreeClass(t, f, tuple(nodes)) for (t, f), nodes in groups.items()]

