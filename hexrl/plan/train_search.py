"""Search phase, training side: constrained enumeration of DP x PP x TP layouts (Metis-style).

Constraints (AReaL-Hex §4.2.1): TP and DP groups use one GPU type; pipeline stages may
differ in type; all stages share one DP degree D; stages of one type share one TP degree.
Given the training GPUs of each type, a layout is (TP per type, D, order of the types
along the pipeline); the stage count of a type follows as n_t / (D * tp_t). Layers go to
stages so that the slowest stage is as fast as possible within each stage's memory.
"""

import bisect
import heapq
import math
from dataclasses import dataclass
from itertools import product
from operator import itemgetter

import numpy as np

from hexrl.plan.cost import CostModel
from hexrl.plan.cost_train import StageCoeffs
from hexrl.plan.placement import NodeIndex, counts_of, train_slots


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
    """n's divisors in increasing order (by pairs up to sqrt(n): n is up to a type's GPU count)."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


def _span(slots: list[tuple[int, int]]) -> tuple[int, int]:
    """(first node, nodes) of a stage's GPUs."""
    nodes = set(map(itemgetter(0), slots))
    return min(nodes), len(nodes)


def _send_GBps(cm: CostModel, span: tuple[int, int], nxt: tuple[int, int]) -> float:
    """Link from one stage to the next: NVLink within one node, else the link between two distinct
    nodes of theirs (a stage's GPUs are all of one type, and links depend only on node types)."""
    a, b = span[0], nxt[0]
    if span == nxt and span[1] == 1:
        return cm.cluster.link_GBps(a, a)
    ta, tb = cm.cluster.nodes[a].gpu_type, cm.cluster.nodes[b].gpu_type
    return cm.cluster.cross_GBps(ta, tb) if ta != tb else cm.cluster.inter_node_GBps


def _stage_times(cm: CostModel, stages: list[tuple[str, int]], spans: list[tuple[int, int]], dp: int,
                 recompute: bool, layers: list[int] | None = None):
    """(layers, per-stage coefficients) of stages (gpu type, tp) spanning `spans`; layers balanced
    unless given. None when the model does not fit in the stages' memory."""
    pp = len(stages)
    coeffs = []
    for i, (t, tp) in enumerate(stages):
        send = _send_GBps(cm, spans[i], spans[i + 1]) if i + 1 < pp else None
        coeffs.append(cm.stage_coeffs(t, tp, dp, pp, i, spans[i][1], send, recompute))
    if layers is None:
        layers = assign_layers(coeffs, cm.m.num_hidden_layers)
    elif any(n > c.max_layers for n, c in zip(layers, coeffs)):
        layers = None
    return None if layers is None else (layers, coeffs)


def cost_layout(cm: CostModel, chunks: list[tuple[str, int, list]], dp: int, recompute: bool,
                layers: list[int] | None = None) -> TrainPlan | None:
    """Cost a layout given as stages (gpu type, tp, slots); balance layers unless given.

    None when the model does not fit in the stages' memory.
    """
    fit = _stage_times(cm, [(t, tp) for t, tp, _ in chunks], [_span(s) for _, _, s in chunks], dp, recompute,
                       layers)
    if fit is None:
        return None
    stages = [TrainStage(t, tp, n, slots, c.per_layer * n + c.fixed)
              for (t, tp, slots), n, c in zip(chunks, *fit)]
    return TrainPlan(dp, stages, recompute, max(s.time_s for s in stages))


def cost_layout_fitting(cm: CostModel, chunks: list[tuple[str, int, list]], dp: int,
                        layers: list[int] | None = None) -> TrainPlan | None:
    """`cost_layout` without activation recompute if that fits, else with it; a job that sets
    runtime.trainer.activation_checkpointing gets only that choice."""
    for recompute in _recompute_choices(cm):
        plan = cost_layout(cm, chunks, dp, recompute, layers)
        if plan is not None:
            return plan
    return None


def _recompute_choices(cm: CostModel) -> tuple[bool, ...]:
    forced = cm.job.runtime.get("trainer", {}).get("activation_checkpointing")
    return (False, True) if forced is None else (forced,)


class _Packing:
    """Where the i-th training GPU of a type sits (per_node's order), by arithmetic: a stage's
    span without listing its GPUs (the hot path of a search over thousands of GPUs)."""

    def __init__(self, cm: CostModel, per_node: np.ndarray, gpu_type: str):
        ix = NodeIndex.of(cm.cluster)
        nodes = ix.of_type[ix.types.index(gpu_type)]
        nodes = nodes[per_node[nodes] > 0]
        self.nodes = nodes.tolist()
        self.ends = np.cumsum(per_node[nodes]).tolist()

    def span(self, a: int, b: int) -> tuple[int, int]:
        """(first node, nodes) of GPUs a..b-1."""
        first, last = bisect.bisect_right(self.ends, a), bisect.bisect_right(self.ends, b - 1)
        return self.nodes[first], last - first + 1


def _type_part(cm: CostModel, t: str, tp: int, dp: int, pp: int, spans: tuple) -> tuple:
    """One type's stages in a pipeline of pp, for `_bound`: (sum 1/a, sum b/a and max a + b over all
    but its last stage, whose send depends on the type after it; the last stage's a)."""
    key = (t, tp, dp, pp, spans)
    if key not in cm._bound_cache:
        rate = lead = one = 0.0
        for span, nxt in zip(spans, spans[1:]):
            a = cm.per_layer_s(t, tp, dp, pp, span[1], False)
            b = cm.send_s(dp, pp, span[1], _send_GBps(cm, span, nxt))
            rate, lead, one = rate + 1 / a, lead + b / a, max(one, a + b)
        a = cm.per_layer_s(t, tp, dp, pp, spans[-1][1], False)
        cm._bound_cache[key] = (rate + 1 / a, lead, one, a)
    return cm._bound_cache[key]


def _bound(cm: CostModel, parts: dict, spans: dict, order: list[str], dp: int, pp: int) -> float:
    """A lower bound on the time of a layout (types in `order`, their `_type_part`s and spans), with or
    without recompute: stage i takes >= a_i * n_i + b_i over its n_i >= 1 layers (a_i its time per
    layer without recompute, b_i its activation sends), so the slowest takes at least
    (L + sum b_i / a_i) / sum 1 / a_i, and at least a_i + b_i."""
    rate = lead = one = 0.0
    for j, t in enumerate(order):
        r, ld, o, a = parts[t]
        b = cm.send_s(dp, pp, spans[t][-1][1], _send_GBps(cm, spans[t][-1], spans[order[j + 1]][0])) \
            if j + 1 < len(order) else 0.0
        rate, lead, one = rate + r, lead + ld + b / a, max(one, o, a + b)
    return max((cm.m.num_hidden_layers + lead) / rate, one) * (1 - 1e-9)  # margin for rounding


def _layouts(cm: CostModel, per_node: tuple[int, ...]) -> list[tuple]:
    """(lower bound, enumeration index, TP per type, DP, type order, spans per type) of every layout
    the search tries, in enumeration order."""
    counts = {t: n for t, n in counts_of(cm.cluster, per_node).items() if n > 0}
    on_node = np.asarray(per_node, dtype=np.int64)
    packing = {t: _Packing(cm, on_node, t) for t in counts}
    orders = _orders(list(counts), cm) if counts else []
    out, spans_of = [], {}  # many layouts share a type's stage size
    for combo in product(*[[tp for tp in cm.tp_options(t) if counts[t] % tp == 0] for t in counts]):
        tps = dict(zip(counts, combo))
        g, groups = 0, 0  # groups: the TP groups of all types, dp x pp of them
        for t in counts:
            g, groups = math.gcd(g, counts[t] // tps[t]), groups + counts[t] // tps[t]
        for dp in _divisors(g):
            pp = groups // dp
            if pp > cm.m.num_hidden_layers:
                continue
            spans, parts = {}, {}
            for t in counts:
                size = dp * tps[t]
                if (t, size) not in spans_of:
                    spans_of[t, size] = tuple(packing[t].span(a, a + size) for a in range(0, counts[t], size))
                spans[t] = spans_of[t, size]
                parts[t] = _type_part(cm, t, tps[t], dp, pp, spans[t])
            for order in orders:
                out.append((_bound(cm, parts, spans, order, dp, pp), len(out), tps, dp, order, spans))
    return out


def train_bound(cm: CostModel, per_node: tuple[int, ...]) -> float:
    """A lower bound on search_train's time for these training GPUs, without costing a layout
    (inf if there is none)."""
    return min((x[0] for x in _layouts(cm, per_node)), default=math.inf)


def search_train(cm: CostModel, per_node: tuple[int, ...]) -> TrainPlan | None:
    """The fastest training layout on the training GPUs `per_node` (None if nothing fits).

    Layouts are costed in order of their lower bound (`_bound`) until the bound passes the best
    time found; ties go to the first in enumeration order, so the answer is that of costing all."""
    layouts = sorted(_layouts(cm, per_node), key=lambda x: x[:2])
    best = None  # (time, index, order, tps, dp, recompute, layers)
    for bound, index, tps, dp, order, spans in layouts:
        if best is not None and bound > best[0]:
            break
        stages = [(t, tps[t]) for t in order for _ in spans[t]]
        for recompute in _recompute_choices(cm):  # recompute only if needed
            fit = _stage_times(cm, stages, [x for t in order for x in spans[t]], dp, recompute)
            if fit is not None:
                time_s = max(c.per_layer * n + c.fixed for n, c in zip(*fit))
                if best is None or (time_s, index) < best[:2]:
                    best = (time_s, index, order, tps, dp, recompute, fit[0])
                break
    if best is None:
        return None
    _, _, order, tps, dp, recompute, layers = best
    chunks = []  # (type, tp, slots)
    for t in order:
        size, slots = dp * tps[t], train_slots(cm.cluster, per_node, t)
        chunks += [(t, tps[t], slots[i:i + size]) for i in range(0, len(slots), size)]
    return cost_layout(cm, chunks, dp, recompute, layers)
