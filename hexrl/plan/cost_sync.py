"""The sync and reward room of the cost model: the weight broadcast from the trainer's stages to
the rollout ranks after each step, and the reward work of a replica's scoring workers."""

import math

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


class SyncCost:
    """Weight-sync and reward costs of one job on its cluster."""

    def __init__(self, cluster: ClusterSpec, w: Workload):
        self.cluster, self.w = cluster, w

    def sync_s(self, stage_bytes: list[tuple[int, float, int]], rollout_nodes: set[int]) -> float:
        """Weight broadcast: each stage's leader (on node n) sends its bytes to all rollout ranks.

        stage_bytes: (leader node, bytes, tp) per stage. A rollout rank joins the stages' broadcasts
        one after the other (hexrl/rollout/rollout_rank.py), so the stages add up. NCCL's broadcast is a
        pipelined ring: each byte crosses the slowest link once, at NCCL_EFFICIENCY of its rate.
        """
        by_type: dict[str, list[int]] = {}  # links depend only on node types: one node of each will do
        for r in rollout_nodes:
            by_type.setdefault(self.cluster.nodes[r].gpu_type, []).append(r)
        total = 0.0
        for node, nbytes, tp in stage_bytes:
            near = [node] if node in rollout_nodes else []
            near += [next((r for r in rs if r != node), node) for rs in by_type.values()]
            bw = min(self.cluster.link_GBps(node, r) for r in near) * 1e9 * NCCL_EFFICIENCY
            t = self.cluster.nodes[node].gpu_type
            gather = (tp - 1) / tp * nbytes / (self.cluster.intra_GBps(t) * 1e9)  # the other TP shards to the leader
            total += nbytes / bw + gather
        return total

    def group_reward_s(self) -> float:
        """Seconds a replica's reward workers take to score one finished group (G samples on
        REWARD_WORKERS)."""
        return math.ceil(self.w.group / REWARD_WORKERS) * self.w.reward_s

    def busiest_reward_s(self, replicas) -> float:
        """The reward work of the busiest replica over a step (its groups times group_reward_s),
        which its reward workers do while it decodes."""
        return max(r.share for r in active_replicas(replicas)) * self.w.gen_samples / self.w.group \
            * self.group_reward_s()
