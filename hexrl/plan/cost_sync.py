"""The sync and reward room of the cost model: the weight sync from the trainer's stages to the
rollout ranks after each step (as hexrl/comm/weights.py does it), and the reward work of a replica's
scoring workers.

Every trainer rank of a stage is a source: its TP shard of its DP replica's buckets, broadcast over
its own group (a pipelined ring through one rank of each rollout replica). A replica's TP ranks split
the sources between their links and share what they took over NVLink; so a rollout GPU's link
carries the stage's bytes over min(sources, rollout TP) and each source's link its 1/sources, and the
rings run at once. The buckets queue back to back (no host read between them, a delta's sizes go
ahead in one message), so a stage pays its rings' fill once: a chunk crossing each hop before the
last member sees it. With a delta, a bucket carries a bitmap (one bit per element) and the changed
values; "auto" sends it dense once that would be smaller.

    sync_stage_s(StageSync(bytes=3e9, sources=8, split=2, link_Bps=4e9, intra_Bps=360e9, hops=16))
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from hexrl.plan.cost_inputs import Workload, active_replicas
from hexrl.schema import ClusterSpec

# The rollout leader hands a finished group to its RewardPool (hexrl/rollout/rollout_rank.py, default
# reward_workers=2) and decodes on: scoring overlaps decoding; only the step's last group, and any
# backlog when scoring is slower than decoding, comes after it.
REWARD_WORKERS = 2
# Share of a link's rate a large (64 MB bucket) NCCL broadcast reaches; an assumption (nccl-tests
# bus bandwidth on TCP/RoCE NICs), not a measurement of this cluster: a profile of the weight
# sync would replace it.
NCCL_EFFICIENCY = 0.8
FILL_CHUNK_BYTES = 512 << 10  # NCCL's ring slice (4 MiB buffer / 8 steps): what each hop forwards before the next


@dataclass
class StageSync:
    """One stage's sync, in the terms its time depends on."""

    bytes: float  # the stage's weights in the sync dtype
    sources: int  # trainer ranks sending (the stage's TP x DP)
    split: int  # the smallest rollout replica TP: that many ranks share each replica's download
    link_Bps: float  # the slowest link on a ring, at NCCL's efficiency
    intra_Bps: float  # a replica's NVLink, for sharing what its ranks took
    hops: int  # inter-node hops on one source's ring (the nodes it passes through)
    elem_bytes: int = 2  # bytes per element in the sync dtype
    delta: bool | str = False  # the job's sync.delta
    changed_fraction: float = 0.0  # share of elements that change per version (job sync.changed_fraction)


def wire_fraction(delta: bool | str, changed_fraction: float, elem_bytes: int) -> float:
    """Bytes a delta sends per dense byte: a bit per element plus the changed values (dense if off,
    or under "auto" when that is smaller)."""
    if not delta:
        return 1.0
    frac = 1 / (8 * elem_bytes) + changed_fraction
    return min(frac, 1.0) if delta == "auto" else frac


def stage_links(cluster, node: int, rollout_nodes: set[int]) -> tuple[float, float, int]:
    """(link_Bps, intra_Bps, hops) of a stage led from `node` to the rollout on `rollout_nodes`
    (a ClusterSpec): the slowest link from the stage to a rollout node at NCCL_EFFICIENCY (links
    depend only on node types: one node of each will do), the slowest NVLink among the rollout's
    node types, and the rollout nodes a ring passes besides the source's own."""
    by_type: dict[str, list[int]] = {}
    for r in rollout_nodes:
        by_type.setdefault(cluster.nodes[r].gpu_type, []).append(r)
    near = [node] if node in rollout_nodes else []
    near += [next((r for r in rs if r != node), node) for rs in by_type.values()]
    link = min(cluster.link_GBps(node, r) for r in near) * 1e9 * NCCL_EFFICIENCY
    intra = min(cluster.intra_GBps(t) for t in by_type) * 1e9 if by_type else link
    return link, intra, len(rollout_nodes) - (node in rollout_nodes)


def sync_stage_s(s: StageSync) -> float:
    """Seconds for one stage: the busiest link's bytes, the replicas' NVLink share, and the fill."""
    wire = s.bytes * wire_fraction(s.delta, s.changed_fraction, s.elem_bytes)
    split = max(1, min(s.sources, s.split))
    network = wire / split / s.link_Bps  # a rollout GPU's share (each source's is no larger: sources >= split)
    share = wire * (1 - 1 / split) / s.intra_Bps
    return network + share + fill_s(s.hops, s.link_Bps)


def fill_s(hops: int, link_Bps: float) -> float:
    """A ring's pipeline fill: one chunk across each hop."""
    return hops * FILL_CHUNK_BYTES / link_Bps


def funnel_stage_s(nbytes: float, tp: int, link_Bps: float, intra_Bps: float, hops: int = 0) -> float:
    """The former sync, for comparison: the stage's (dp 0, tp 0) rank gathers its TP shards and
    broadcasts everything to every rollout rank (hops > 0 adds the fill the cost model left out)."""
    gather = (tp - 1) / tp * nbytes / intra_Bps
    return nbytes / link_Bps + gather + fill_s(hops, link_Bps)


class SyncCost:
    """Weight-sync and reward costs of one job on its cluster (`sync`: the job's sync section)."""

    def __init__(self, cluster: ClusterSpec, w: Workload, sync):
        self.cluster, self.w, self.spec = cluster, w, sync

    def sync_s(self, stage_bytes: list[tuple[int, float, int]], rollout_nodes: set[int], dp: int = 1,
               split: int = 1) -> float:
        """Weight sync: every trainer rank of a stage sends its part.

        stage_bytes: (leader node, bytes, tp) per stage; dp: the trainer's DP degree; split: the
        smallest rollout replica TP. A rollout rank takes the stages one after the other, so they add
        up; each ring runs at NCCL_EFFICIENCY of its slowest link and passes every rollout node.
        """
        spec = self.spec
        return sum(sync_stage_s(StageSync(nbytes, tp * dp, split, *stage_links(self.cluster, node, rollout_nodes),
                                          2, spec.delta, spec.changed_fraction))
                   for node, nbytes, tp in stage_bytes)

    def group_reward_s(self) -> float:
        """Seconds a replica's reward workers take to score one finished group (G samples on
        REWARD_WORKERS)."""
        return math.ceil(self.w.group / REWARD_WORKERS) * self.w.reward_s

    def busiest_reward_s(self, replicas) -> float:
        """The reward work of the busiest replica over a step (its groups times group_reward_s),
        which its reward workers do while it decodes."""
        return max(r.share for r in active_replicas(replicas)) * self.w.gen_samples / self.w.group \
            * self.group_reward_s()
