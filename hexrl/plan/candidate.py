"""The search phase for one split: best training layout, rollout MILP, weight sync, step time."""

import math
from dataclasses import dataclass, replace

from hexrl.plan.cost import CostModel
from hexrl.plan.placement import counts_of, free_classes, train_per_node
from hexrl.plan.progress import quiet
from hexrl.plan.rollout_milp import RolloutPlan, combine, decode_point, makespan, solve_rollout
from hexrl.plan.train_search import TrainPlan, search_train, train_bound

# what the memos may hold (dropping an entry only costs computing it again): nodes of rollout plans
# (a plan holds its replica kinds and its nodes until it is placed), about 0.2 GB, and training GPUs
# of training plans (each lists its GPUs), about 0.4 GB
HELD_NODES = 1 << 22
HELD_TRAIN_GPUS = 1 << 22


@dataclass
class Candidate:
    """A split of the cluster with both execution plans and its predicted costs (seconds per step)."""

    per_node: tuple[int, ...]  # training GPUs on each node
    train: TrainPlan
    rollout: RolloutPlan
    C_T: float  # training, with the trainer's batch hand-off before it
    C_gen: float  # rollout generation (makespan, tail, KV recompute, any reward backlog)
    C_reward: float  # the step's last group, scored after its decode ends
    C_sync: float  # weight update
    step_s: float
    stretch: float = 1.0  # colocated: both roles' slowdown on the shared GPU (hexrl/plan/shared_gpu.py)
    device_busy: float | None = None  # colocated: the share of its time the replica's kernels hold the GPU
    C_handoff: float = 0.0  # the trainer's batch hand-off (part of C_T)

    @property
    def C_I(self) -> float:
        """Rollout side cost as in the paper's eq. (1): generation + reward + update."""
        return self.C_gen + self.C_reward + self.C_sync


class Memo:
    """A memo that drops its least recently used entries past `limit` in all by `weight(key, value)`
    (a sweep of a 4,096-node type computes thousands of plans); a dropped one is computed again."""

    def __init__(self, limit: int, weight):
        self.limit, self.weight = limit, weight
        self.entries: dict = {}  # oldest use first
        self.held = 0

    def get(self, key, make):
        """The value of `key`, from make() the first time (or after it was dropped)."""
        if key in self.entries:
            self.entries[key] = value = self.entries.pop(key)  # now the most recently used
            return value
        self.entries[key] = value = make()
        self.held += self.weight(key, value)
        while self.held > self.limit and len(self.entries) > 1:
            old = next(iter(self.entries))
            self.held -= self.weight(old, self.entries.pop(old))
        return value


class Evaluator:
    """Search phase with memoisation: per_node split -> Candidate (or None if infeasible)."""

    def __init__(self, cm: CostModel, progress=quiet):
        self.cm = cm
        self.progress = progress  # (phase, done, total): hexrl/plan/progress.py
        self._train = Memo(HELD_TRAIN_GPUS, lambda per_node, plan: sum(per_node))
        self._roll = Memo(HELD_NODES, lambda key, plan: len(plan.nodes) if plan else 0)
        self._cand: dict = {}
        self.evaluations = 0
        self.last_failure = ""  # "train" or "rollout": which side did not fit

    def train(self, per_node: tuple[int, ...]) -> TrainPlan | None:
        return self._train.get(per_node, lambda: search_train(self.cm, per_node))

    def train_bound(self, per_node: tuple[int, ...]) -> float:
        """A lower bound on train(per_node).time_s without the search (train_search.train_bound)."""
        if per_node in self._train.entries:
            plan = self._train.entries[per_node]
            return math.inf if plan is None else plan.time_s
        return train_bound(self.cm, per_node)

    def rollout(self, per_node: tuple[int, ...]) -> RolloutPlan | None:
        return self._solve(free_classes(self.cm.cluster, per_node))

    def _solve(self, classes, period: float | None = None) -> RolloutPlan | None:
        """The rollout MILP's plan on `classes`, memoised (past HELD_NODES nodes in all, the least
        recently used are dropped)."""
        key = (tuple((c.gpu_type, c.free, c.nodes) for c in classes), period)
        return self._roll.get(key, lambda: solve_rollout(self.cm, classes, 1 if period else 4, period)
                              if classes else None)

    def combined_rollout(self, per_node: tuple[int, ...]) -> RolloutPlan | None:
        """A rollout plan put together from one MILP per GPU type (rollout_milp.combine), so that a
        sweep over all splits solves a few hundred small MILPs, not one per split. A type's MILP
        depends on its own count and on the step's length (which sets how much of it KV
        recompute takes): each type is solved alone first, then again for the step length of
        all types together, rounded down to a power of 2^(1/4). Each type may use the gate's
        whole cap on running sequences, so where the cap binds the estimate can miss either
        way (splitting the cap by decode rate made it pessimistic more often: docs/planner.md, plan
        quality). None if a type's free GPUs hold no replica (the joint MILP fails then too); with a long
        tail, where a type cannot hold both classes, the joint MILP's own plan."""
        cm = self.cm
        classes = free_classes(cm.cluster, per_node)
        by_type = [[c for c in classes if c.gpu_type == t] for t in dict.fromkeys(c.gpu_type for c in classes)]
        alone = [self._solve(cs) for cs in by_type]
        if not alone or None in alone:
            # a type too small for both length classes may still serve one of them in the joint plan
            return self.rollout(per_node) if alone and cm.tail is not None else None
        kinds = [k for p in alone for k in p.kinds]
        split = any(k.long_tail for k in kinds)
        step = makespan(cm, [decode_point(cm, k, split) for k in kinds], [k.count for k in kinds],
                        [k.long_tail for k in kinds])
        period = 2 ** (math.floor(4 * math.log2(step)) / 4)
        plans = [self._solve(cs, period) or replace(p, tokens_per_s=0.0)  # None: too slow to use at this period
                 for cs, p in zip(by_type, alone)]
        return combine(cm, plans)

    def estimate(self, per_node: tuple[int, ...], roll: RolloutPlan) -> float:
        """Step time of the split's exact training plan beside `roll` (inf if training does not fit)."""
        train = self.train(per_node)
        return math.inf if train is None else candidate(self.cm, per_node, train, roll).step_s

    def __call__(self, per_node: tuple[int, ...]) -> Candidate | None:
        if per_node in self._cand:
            return self._cand[per_node]
        self.evaluations += 1
        cand = None
        train = self.train(per_node)
        roll = self.rollout(per_node) if train else None
        self.last_failure = "train" if train is None else ("rollout" if roll is None else "")
        if train and roll:
            cand = self._cost(per_node, train, roll)
        self._cand[per_node] = cand
        return cand

    def counts(self, counts: dict[str, int]) -> Candidate | None:
        return self(train_per_node(self.cm.cluster, counts))

    def counts_of(self, per_node: tuple[int, ...]) -> dict[str, int]:
        return counts_of(self.cm.cluster, per_node)

    def _cost(self, per_node, train: TrainPlan, roll: RolloutPlan) -> Candidate:
        return candidate(self.cm, per_node, train, roll)


def candidate(cm: CostModel, per_node: tuple[int, ...], train: TrainPlan, roll: RolloutPlan) -> Candidate:
    """Put both plans together: weight sync from every trainer rank to the rollout nodes, step time.
    The trainer's batch hand-off comes before its step; the controller's work on its share of a
    core bounds the step from below (cost_host.py)."""
    split = min((k.tp for k in roll.kinds), default=1)  # the smallest replica downloads through the fewest links
    sync = cm.sync_s(stage_sync_bytes(cm, train), set(roll.nodes), train.dp, split)
    handoff = cm.handoff_s()
    gen, reward, step = step_times(cm, train.time_s + handoff, sync, roll)
    step = max(step, cm.controller_floor_s(roll.count))
    return Candidate(per_node, train, roll, train.time_s + handoff, gen, reward, sync, step, C_handoff=handoff)


def stage_sync_bytes(cm: CostModel, train: TrainPlan) -> list[tuple[int, float, int]]:
    """(leader node, bytes in bf16, tp) of each stage's weights, what CostModel.sync_s prices."""
    layer_bytes = 2 * cm.layer_params
    return [(s.slots[0][0], s.layers * layer_bytes + cm.edge_params(i, train.pp) * 2, s.tp)
            for i, s in enumerate(train.stages)]


def step_times(cm: CostModel, train_s: float, sync_s: float, roll: RolloutPlan,
               joined: bool = True) -> tuple[float, float, float]:
    """(C_gen, C_reward, step time) of a rollout plan beside training of train_s and a weight sync
    of sync_s. joined=False prices the gate's wave from idle (CostModel.gen_s): a lower bound,
    nondecreasing in train_s and sync_s, so bounds on them bound the step."""
    # scoring overlaps decoding: a step's generation lasts at least its reward work, and the last
    # group is scored after its decode ends (the tail, C_reward)
    reward = cm.group_reward_s()
    wave = roll.wave_s
    if joined and cm.w.eta not in (0, None):  # the next step's groups join when training ends
        wave = cm.joined_wave(roll.kinds, train_s + sync_s, sync_s)
    theta, wave = max(roll.gen_s, roll.reward_s - reward), max(wave, roll.reward_s - reward)
    gen = cm.gen_s(theta + reward, wave + reward, train_s, sync_s) - reward
    if joined:  # the gate may cap what runs at once (filtered groups)
        gen = cm.gated_gen_s(roll.kinds, train_s, sync_s, at_least=gen)
    return gen, reward, cm.step_s(train_s, gen + reward, sync_s)
