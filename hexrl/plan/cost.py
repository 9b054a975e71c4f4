"""Cost models of one asynchronous RL step: training time per layout, rollout throughput per
replica configuration, weight-sync time, reward time.

Everything is seconds for one RL step (B prompts x G samples). The numbers come from the GPU
catalogue (peak FLOP/s, HBM, NVLink) and the cluster's link bandwidths; nothing is fitted
here, so a measured profile (profiles/<gpu>.json) is the way to make predictions sharper.

The models live in three rooms over shared inputs (cost_inputs.py: the workload, parameter
counts, memory); CostModel builds them for one job and puts them behind one object:

    cost_train.py    TrainCost: stage coefficients, 1F1B's bubble, DP and optimizer, stage memory
    cost_rollout.py  RolloutCost: decode and prefill points, waves, the gate's generation time
    cost_sync.py     SyncCost: the weight sync (every trainer rank a source; deltas), the reward workers
    cost_host.py     HostCost: the trainer's batch hand-off, the controller's work on its core
"""

from dataclasses import dataclass

from hexrl.gpus import GPU, gpu, host_costs
from hexrl.plan.cost_host import HostCost
from hexrl.plan.cost_inputs import Memory, Params, Workload, replicas_in, tp_degrees, workload_of
from hexrl.plan.cost_rollout import RolloutCost, gate_fixed_point, replica_kinds, tail_split
from hexrl.plan.cost_sync import SyncCost
from hexrl.plan.cost_train import TrainCost
from hexrl.schema import Job


@dataclass(frozen=True)
class ClassReplica:
    """A rollout replica as one length class's costs see it: its share is of the class's groups."""

    gpu_type: str
    tp: int
    batch: int
    share: float  # each replica's
    count: int = 1  # replicas it stands for (a ReplicaKind's count)


class CostModel:
    """Cost models for one job: its rooms (train, rollout, sync, host) and the shared inputs they read.
    The rooms' methods the planner calls are bound here under their own names (cm.decode_point
    is cm.rollout.decode_point); what combines two rooms is defined here."""

    def __init__(self, job: Job, use_profiles: bool = True):
        self.job, self.m, self.cluster = job, job.model.config, job.cluster
        self.gpn = self.cluster.gpus_per_node
        self.gpus: dict[str, GPU] = {t: gpu(t, job.prices[t], use_profiles) for t in self.cluster.types()}
        self.memory = Memory(self.gpus)  # colocated roles' shares: share_memory
        self.params = Params.of(self.m)
        self.layer_params = self.params.layer  # hot in the searches
        w = workload_of(job)
        self.train = TrainCost(job, w, self.gpus, self.memory, self.params)
        self.rollout = RolloutCost(job, w, self.gpus, self.memory, self.params)
        self.tail = tail_split(job, w, self.gpus, self.memory, self.params)  # two length classes, or None
        self.sync = SyncCost(self.cluster, w, job.sync)
        self.host = HostCost(host_costs(job.workload.host, use_profiles), w)
        self.w = w
        self.lengths = self.rollout.lengths  # the output length distribution (the simulator samples it)
        self._bound_cache: dict = {}  # train_search._type_part

        # the rooms' methods, under the names callers use
        mem, t, r, s = self.memory, self.train, self.rollout, self.sync
        self.usable_bytes, self.workspace_bytes = mem.usable_bytes, mem.workspace_bytes
        self.edge_params = self.params.edge
        self.stage_coeffs, self.per_layer_s, self.send_s = t.stage_coeffs, t.per_layer_s, t.send_s
        self.train_flops, self.train_memory_floor = t.train_flops, t.train_memory_floor
        self.kv_bytes_per_token, self.max_decode_batch = r.kv_bytes_per_token, r.max_decode_batch
        self.decode_point, self.decode_points = r.decode_point, r.decode_points
        self.decode_coeffs, self.decode_fixed_s, self.prefill_s = r.decode_coeffs, r.decode_fixed_s, r.prefill_s
        self.decode_rate_bound, self.gen_s = r.decode_rate_bound, r.gen_s
        self.wave_s, self.joined_wave_s = r.wave_s, r.joined_wave_s
        self.sync_s, self.group_reward_s = s.sync_s, s.group_reward_s
        self.handoff_s, self.controller_floor_s = self.host.handoff_s, self.host.controller_floor_s

    @property
    def w(self) -> Workload:
        """The step's workload, which every room reads."""
        return self._w

    @w.setter
    def w(self, w: Workload) -> None:
        # a probe may swap it before pricing anything (tools/bench): every room sees the new one
        self._w = self.train.w = self.rollout.w = self.sync.w = self.host.w = w

    def tp_options(self, gpu_type: str) -> list[int]:
        """TP degrees: powers of two that divide GPUs per node and attention heads."""
        return tp_degrees(self.gpn, self.m.num_attention_heads)

    def share_memory(self, role_bytes: dict[str, float]) -> None:
        """Colocated: training and rollout may each fill only their bytes of the one GPU
        (hexrl/plan/shared_gpu.py); stage layer caps priced before are priced again."""
        self.memory.role_bytes = role_bytes
        self.train.clear_stage_cache()

    def rollout_wave(self, replicas) -> tuple[float, float]:
        """(wave_s, reward_s) for replicas (objects with gpu_type, tp, batch, share, or ReplicaKinds): the time an idle
        rollout needs to generate one step's B groups dealt out by share (RolloutCost.idle_wave_s),
        and the reward work of the busiest replica over a step, which its reward workers do while
        it decodes (SyncCost.busiest_reward_s)."""
        parts = self.by_length_class(replicas)
        wave = (self.rollout.idle_wave_s(replicas) if parts is None
                else max(cost.idle_wave_s(mine) for cost, mine in parts))
        return wave, self.sync.busiest_reward_s(replicas)

    def long_tail_wave_s(self, plan) -> float:
        """Seconds the long tail's replicas of a rollout plan need for a step's long groups from idle."""
        parts = self.by_length_class(plan.kinds)
        return 0.0 if parts is None else parts[-1][0].idle_wave_s(parts[-1][1])

    def joined_wave(self, replicas, join_s: float, pause_s: float) -> float:
        """RolloutCost.joined_wave; with a long tail, the slower of the two classes' waves."""
        parts = self.by_length_class(replicas)
        if parts is None:
            return self.rollout.joined_wave(replicas, join_s, pause_s)
        return max(cost.joined_wave(mine, join_s, pause_s) for cost, mine in parts)

    def gated_gen_s(self, replicas, train_s: float, sync_s: float, at_least: float) -> float:
        """RolloutCost.gated_gen_s; with a long tail, per length class. Of the groups the gate lets run,
        each class holds as many as make both classes' generation take equally long: by Little's law a
        class whose groups run longer holds more of the gate's slots (long groups 8x as long at 25% of
        those handed out are 73% of those running), not its share of the groups handed out. Where the
        long tail's replicas cannot run that many at their caps the rest queue, holding slots the
        regular class then lacks: the step waits for the long class at its replicas' full rate."""
        parts = self.by_length_class(replicas)
        if parts is None:
            return self.rollout.gated_gen_s(replicas, train_s, sync_s, at_least)
        classes = [(cost, replica_kinds([r for r in mine if r.share > 0])) for cost, mine in parts]
        if self.w.eta in (0, None) or len(classes) < 2 or not all(kinds for _, kinds in classes):
            return self.rollout.gated_gen_s(replicas, train_s, sync_s, at_least)
        (reg, reg_kinds), (long, long_kinds) = classes

        def gen_at(gen: float) -> float:  # both classes' generation at the balance of the running groups
            running = self.rollout.gate_running(gen, train_s, sync_s)
            def times(n_long: float) -> tuple[float, float]:
                return (long.w.gen_tokens / long.running_rate(long_kinds, n_long),
                        reg.w.gen_tokens / reg.running_rate(reg_kinds, running - n_long))
            lo, hi = 0.0, running  # the long class's running groups: its time falls as they grow
            while hi - lo > 1e-4 * running:
                mid = (lo + hi) / 2
                t_long, t_reg = times(mid)
                lo, hi = (mid, hi) if t_long > t_reg else (lo, mid)
            return min(max(times(lo)), max(times(hi)))

        return gate_fixed_point(gen_at, at_least)

    def by_length_class(self, replicas) -> list[tuple[RolloutCost, list[ClassReplica]]] | None:
        """Where some replica serves the long tail: each length class's costs with its replicas, their
        shares of the class's groups (each class is a rollout of its own); None otherwise."""
        if self.tail is None or not any(getattr(r, "long_tail", False) for r in replicas):
            return None
        parts = []
        for long in (False, True):
            mine = [r for r in replicas if getattr(r, "long_tail", False) == long]
            total = sum(r.share * replicas_in(r) for r in mine) or 1.0  # all idle: shares stay 0
            if mine:
                shares = [ClassReplica(r.gpu_type, r.tp, r.batch, r.share / total, replicas_in(r)) for r in mine]
                parts.append((self.tail.of(long), shares))
        return parts

    def step_s(self, train_s: float, gen_s: float, sync_s: float) -> float:
        """Step time: async overlaps generation and training; eta=0 runs them back to back."""
        if self.w.eta == 0:
            return train_s + gen_s + sync_s
        return max(train_s, gen_s) + sync_s
