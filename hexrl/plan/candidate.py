"""The search phase for one split: best training layout, rollout MILP, weight sync, step time."""

from dataclasses import dataclass

from hexrl.plan.cost import CostModel
from hexrl.plan.placement import counts_of, free_classes, train_per_node
from hexrl.plan.rollout_milp import RolloutPlan, solve_rollout
from hexrl.plan.train_search import TrainPlan, search_train


@dataclass
class Candidate:
    """A split of the cluster with both execution plans and its predicted costs (seconds per step)."""

    per_node: tuple[int, ...]  # training GPUs on each node
    train: TrainPlan
    rollout: RolloutPlan
    C_T: float  # training
    C_gen: float  # rollout generation (makespan, tail, KV recompute, any reward backlog)
    C_reward: float  # the step's last group, scored after its decode ends
    C_sync: float  # weight update
    step_s: float

    @property
    def C_I(self) -> float:
        """Rollout side cost as in the paper's eq. (1): generation + reward + update."""
        return self.C_gen + self.C_reward + self.C_sync


class Evaluator:
    """Search phase with memoisation: per_node split -> Candidate (or None if infeasible)."""

    def __init__(self, cm: CostModel):
        self.cm = cm
        self._train: dict = {}
        self._roll: dict = {}
        self._cand: dict = {}
        self.evaluations = 0
        self.last_failure = ""  # "train" or "rollout": which side did not fit

    def train(self, per_node: tuple[int, ...]) -> TrainPlan | None:
        if per_node not in self._train:
            self._train[per_node] = search_train(self.cm, per_node)
        return self._train[per_node]

    def rollout(self, per_node: tuple[int, ...]) -> RolloutPlan | None:
        classes = free_classes(self.cm.cluster, per_node)
        key = tuple((c.gpu_type, c.free, c.nodes) for c in classes)
        if key not in self._roll:
            self._roll[key] = solve_rollout(self.cm, classes) if classes else None
        return self._roll[key]

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
    """Put both plans together: weight sync from the stage leaders to the rollout nodes, step time."""
    layer_bytes = 2 * cm.layer_params
    stage_bytes = []
    for i, s in enumerate(train.stages):
        edge = cm.head_params() * ((i == 0) + (i == train.pp - 1)) * 2
        stage_bytes.append((s.slots[0][0], s.layers * layer_bytes + edge))
    sync = cm.sync_s(stage_bytes, {r.node for r in roll.replicas})
    # scoring overlaps decoding: a step's generation lasts at least its reward work, and the last
    # group is scored after its decode ends (the tail, C_reward)
    reward = cm.group_reward_s()
    theta, wave = max(roll.gen_s, roll.reward_s - reward), max(roll.wave_s, roll.reward_s - reward)
    gen = cm.gen_s(theta + reward, wave + reward, train.time_s, sync) - reward
    step = cm.step_s(train.time_s, gen + reward, sync)
    return Candidate(per_node, train, roll, train.time_s, gen, reward, sync, step)
