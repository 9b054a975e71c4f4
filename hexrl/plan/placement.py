"""Where a split's GPUs sit: training GPUs packed node by node, rollout takes the rest.

A split is the number of training GPUs per GPU type. Nodes of one type are interchangeable
(torchrun gives every node the same GPU count, links depend only on node types), so packing
the training GPUs of a type into as few nodes as possible loses nothing: it keeps TP and DP
groups on NVLink, and the rollout side only sees how many GPUs each node has left.
Training GPUs take the lowest local ranks of a node; rollout takes the highest.
"""

from dataclasses import dataclass

import numpy as np

from hexrl.schema import ClusterSpec


@dataclass(frozen=True)
class FreeClass:
    """Nodes of one GPU type with the same number of GPUs left for rollout."""

    gpu_type: str
    free: int  # rollout GPUs per node
    nodes: tuple[int, ...]


@dataclass(frozen=True)
class NodeIndex:
    """A cluster's nodes as arrays, so that placing a split is arithmetic over types, not a loop over
    every node (a search places thousands of splits of clusters of up to 4,096 nodes)."""

    types: tuple[str, ...]  # in first-appearance order
    type_of: np.ndarray  # each node's type, an index into types
    gpus: np.ndarray  # each node's GPU count
    of_type: tuple[np.ndarray, ...]  # the nodes of each type, in order
    slots: tuple[list[tuple[int, int]], ...]  # (node, local rank) of every GPU of each type, in order
    first: tuple[np.ndarray, ...]  # where each node of a type starts in its slots

    @staticmethod
    def of(cluster: ClusterSpec) -> "NodeIndex":
        """The cluster's index, memoised on it (a loaded cluster's nodes do not change)."""
        got = cluster.__dict__.get("_node_index")
        if got is None or len(got.gpus) != len(cluster.nodes):
            types = tuple(dict.fromkeys(n.gpu_type for n in cluster.nodes))
            type_of = np.array([types.index(n.gpu_type) for n in cluster.nodes], dtype=np.int64)
            gpus = np.array([n.gpus for n in cluster.nodes], dtype=np.int64)
            of_type = tuple(np.flatnonzero(type_of == k) for k in range(len(types)))
            got = NodeIndex(types, type_of, gpus, of_type,
                            tuple([(i, j) for i in nodes.tolist() for j in range(cluster.nodes[i].gpus)]
                                  for nodes in of_type),
                            tuple(np.cumsum(gpus[nodes]) - gpus[nodes] for nodes in of_type))
            cluster.__dict__["_node_index"] = got
        return got


def train_per_node(cluster: ClusterSpec, counts: dict[str, int]) -> tuple[int, ...]:
    """Training GPUs on each node when `counts[type]` training GPUs are packed node by node."""
    ix = NodeIndex.of(cluster)
    out = np.zeros(len(ix.gpus), dtype=np.int64)
    for t, nodes in zip(ix.types, ix.of_type):
        gpus = ix.gpus[nodes]
        before = np.cumsum(gpus) - gpus  # taken by the earlier nodes of the type, had each taken all
        out[nodes] = np.clip(counts.get(t, 0) - before, 0, gpus)
    return tuple(out.tolist())


def counts_of(cluster: ClusterSpec, per_node: tuple[int, ...]) -> dict[str, int]:
    ix = NodeIndex.of(cluster)
    sums = np.bincount(ix.type_of, weights=np.asarray(per_node, dtype=np.int64), minlength=len(ix.types))
    return {t: int(n) for t, n in zip(ix.types, sums)}


def train_slots(cluster: ClusterSpec, per_node: tuple[int, ...], gpu_type: str) -> list[tuple[int, int]]:
    """(node, local_rank) of every training GPU of one type, in packing order: the first per_node[i]
    of each node's slots (shared tuples: a training plan of 50,000 GPUs lists them all)."""
    ix = NodeIndex.of(cluster)
    if gpu_type not in ix.types:
        return []
    k = ix.types.index(gpu_type)
    taken = np.asarray(per_node, dtype=np.int64)[ix.of_type[k]]
    at = np.repeat(ix.first[k] - (np.cumsum(taken) - taken), taken) + np.arange(int(taken.sum()))
    return list(map(ix.slots[k].__getitem__, at.tolist()))


def free_classes(cluster: ClusterSpec, per_node: tuple[int, ...]) -> list[FreeClass]:
    """Rollout GPUs grouped by (type, GPUs left per node), in the order of their first node."""
    ix = NodeIndex.of(cluster)
    free = ix.gpus - np.asarray(per_node, dtype=np.int64)
    nodes = np.flatnonzero(free > 0)
    width = int(ix.gpus.max()) + 1
    code = ix.type_of[nodes] * width + free[nodes]  # one number per (type, free)
    kinds, first = np.unique(code, return_index=True)
    return [FreeClass(ix.types[k // width], int(k % width), tuple(nodes[code == k].tolist()))
            for k in kinds[np.argsort(first)].tolist()]
