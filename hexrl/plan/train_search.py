"""Search phase, training side: constrained enumeration of DP x PP x TP layouts (Metis-style).

Constraints (AReaL-Hex §4.2.1): TP and DP groups use one GPU type; pipeline stages may
differ in type; all stages share one DP degree D; stages of one type share one TP degree.
Given the training GPUs of each type, a layout is (TP per type, D, order of the types
along the pipeline); the stage count of a type follows as n_t / (D * tp_t). Layers go to
stages so that the slowest stage is as fast as possible within each stage's memory.
"""

import heapq
import math
from dataclasses import dataclass
from itertools import product

from hexrl.plan.cost import CostModel, StageCoeffs
from hexrl.plan.placement import counts_of, train_slots


@dataclass
class TrainStage:
    gpu_type: str
    tp: int
    layers: int
    slots: list[tuple[int, int]]  # (node, local) of its dp*tp GPUs, dp-major, tp-minor
    time_s: float


@dataclass
class TrainPlan:
    dp: int
    stages: list[TrainStage]
    recompute: bool
    time_s: float  # C_T: one RL step of training (all PPO minibatches)

    @property
    def pp(self) -> int:
        return len(self.stages)


def assign_layers(coeffs: list[StageCoeffs], n_layers: int) -> list[int] | None:
    """Layers per stage minimising the slowest stage (greedy is exact for linear stage times)."""
    if any(c.max_layers < 1 for c in coeffs) or sum(c.max_layers for c in coeffs) < n_layers:
        return None
    if len(coeffs) > n_layers:
        return None
    layers = [1] * len(coeffs)
    heap = [(c.per_layer * 2 + c.fixed, i) for i, c in enumerate(coeffs) if c.max_layers > 1]
    heapq.heapify(heap)
    for _ in range(n_layers - len(coeffs)):
        _, i = heapq.heappop(heap)
        layers[i] += 1
        c = coeffs[i]
        if layers[i] < c.max_layers:
            heapq.heappush(heap, (c.per_layer * (layers[i] + 1) + c.fixed, i))
    return layers


def _orders(types: list[str], cm: CostModel) -> list[list[str]]:
    """Type orders along the pipeline: each type once as the last (it carries the output head);
    the others by memory, largest first (early stages hold the most in-flight micro-batches)."""
    if len(types) == 1:
        return [types]
    out = []
    for last in types:
        rest = sorted((t for t in types if t != last), key=lambda t: -cm.gpus[t].hbm_bytes)
        out.append(rest + [last])
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _span(slots: list[tuple[int, int]]) -> set[int]:
    return {node for node, _ in slots}


def _send_GBps(cm: CostModel, nodes: set[int], nxt: set[int]) -> float:
    """Link from one stage to the next: NVLink within one node, else the link between two distinct
    nodes of theirs (a stage's GPUs are all of one type, and links depend only on node types)."""
    a, b = min(nodes), min(nxt)
    if nodes == nxt and len(nodes) == 1:
        return cm.cluster.link_GBps(a, a)
    ta, tb = cm.cluster.nodes[a].gpu_type, cm.cluster.nodes[b].gpu_type
    return cm.cluster.cross_GBps(ta, tb) if ta != tb else cm.cluster.inter_node_GBps


def cost_layout(cm: CostModel, chunks: list[tuple[str, int, list]], dp: int, recompute: bool,
                layers: list[int] | None = None) -> TrainPlan | None:
    """Cost a layout given as stages (gpu type, tp, slots); balance layers unless given.

    None when the model does not fit in the stages' memory.
    """
    pp = len(chunks)
    spans = [_span(slots) for _, _, slots in chunks]
    coeffs = []
    for i, (t, tp, _) in enumerate(chunks):
        send = _send_GBps(cm, spans[i], spans[i + 1]) if i + 1 < pp else None
        coeffs.append(cm.stage_coeffs(t, tp, dp, pp, i, len(spans[i]), send, recompute))
    if layers is None:
        layers = assign_layers(coeffs, cm.m.num_hidden_layers)
    elif any(l > c.max_layers for l, c in zip(layers, coeffs)):
        layers = None
    if layers is None:
        return None
    stages = [TrainStage(t, tp, l, slots, c.per_layer * l + c.fixed)
              for (t, tp, slots), l, c in zip(chunks, layers, coeffs)]
    return TrainPlan(dp, stages, recompute, max(s.time_s for s in stages))


def _layout(cm: CostModel, order, tps, dp, slots_by_type) -> TrainPlan | None:
    """Stages of each type in `order`, layers balanced; activation recompute only if needed."""
    chunks = []  # (type, tp, slots)
    for t in order:
        size = dp * tps[t]
        s = slots_by_type[t]
        chunks += [(t, tps[t], s[i:i + size]) for i in range(0, len(s), size)]
    return cost_layout_fitting(cm, chunks, dp)


def cost_layout_fitting(cm: CostModel, chunks: list[tuple[str, int, list]], dp: int,
                        layers: list[int] | None = None) -> TrainPlan | None:
    """`cost_layout` without activation recompute if that fits, else with it; a job that sets
    runtime.trainer.activation_checkpointing gets only that choice."""
    forced = cm.job.runtime.get("trainer", {}).get("activation_checkpointing")
    for recompute in (False, True) if forced is None else (forced,):
        plan = cost_layout(cm, chunks, dp, recompute, layers)
        if plan is not None:
            return plan
    return None


def search_train(cm: CostModel, per_node: tuple[int, ...]) -> TrainPlan | None:
    """The fastest training layout on the training GPUs `per_node` (None if nothing fits)."""
    counts = {t: n for t, n in counts_of(cm.cluster, per_node).items() if n > 0}
    if not counts:
        return None
    types = list(counts)
    slots = {t: train_slots(cm.cluster, per_node, t) for t in types}
    best = None
    tp_choices = [[tp for tp in cm.tp_options(t) if counts[t] % tp == 0] for t in types]
    for combo in product(*tp_choices):
        tps = dict(zip(types, combo))
        g = 0
        for t in types:
            g = math.gcd(g, counts[t] // tps[t])
        for dp in _divisors(g):
            if sum(counts[t] // (dp * tps[t]) for t in types) > cm.m.num_hidden_layers:
                continue
            for order in _orders(types, cm):
                plan = _layout(cm, order, tps, dp, slots)
                if plan and (best is None or plan.time_s < best.time_s):
                    best = plan
    return best
