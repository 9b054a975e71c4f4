"""Repartition phase (AReaL-Hex §4.3) and the two-phase iteration (Algorithm 1).

Graph partition: choose the training set D_T maximising
    (bandwidth of edges inside D_T) / (all edges) + (HBM bandwidth of D_I) / (all HBM bandwidth)
with D_T's share of FLOP/s in [gamma_L, gamma_H]. Splits are training GPU counts per type
packed node by node (see placement.py), so the objective has a closed form per split and is
evaluated for a whole grid of splits at once. gamma is bisected on C_T vs C_I: training faster
than rollout -> give training less compute.

Last, a sweep over the other splits. Costing a split exactly takes a rollout MILP over all its
free GPUs; an estimate (Evaluator.estimate) takes the exact training plan and one small MILP per
GPU type, shared by every split with the same count of that type. Splits are costed exactly in
order of their estimates while those stay within MARGIN of the best; splits whose lower bound
cannot beat the best are skipped. Lower bounds alone rank the optimum poorly (docs/planner.md),
so the sweep goes by the estimates.
"""

import heapq
import time
from dataclasses import dataclass, field
from itertools import product

import numpy as np

from hexrl.plan.candidate import Candidate, Evaluator, step_times
from hexrl.plan.cost_sync import NCCL_EFFICIENCY
from hexrl.plan.placement import NodeIndex, train_per_node

GRID_POINTS = 200_000  # splits scored per repartition (vectorised)
# counts of one GPU type the grid holds at most: the sweep solves a rollout MILP for each count of a
# type it estimates, and one type of 65,536 GPUs would otherwise offer 65,537 (docs/planner.md, the ceiling)
TYPE_POINTS = 2_049
ESTIMATES = 4_000  # splits the final sweep estimates at most (about 1.5 ms each)
# The final sweep costs splits whose estimate is within MARGIN of the best step time: on the
# clusters of tools/experiments/plan_quality.py the median estimate is the exact step time, most are within a
# few percent, and the misses that matter (pessimistic ones) are rare
MARGIN = 0.1


@dataclass
class SearchLog:
    method: str
    evaluations: int = 0
    wall_s: float = 0.0
    gammas: list[float] = field(default_factory=list)
    history: list[float] = field(default_factory=list)  # best step time after each iteration


class GraphScore:
    """Closed-form graph-partition objective and FLOP share for splits (counts per type)."""

    def __init__(self, ev: Evaluator):
        cm = ev.cm
        self.types = cm.cluster.types()
        self.total = np.array([cm.cluster.count(t) for t in self.types], dtype=float)
        self.gpn = cm.gpn
        self.flops = np.array([cm.gpus[t].flops for t in self.types])
        self.hbm = np.array([cm.gpus[t].hbm_Bps for t in self.types])
        self.intra = np.array([cm.cluster.intra_GBps(t) for t in self.types])
        self.link = np.array([[cm.cluster.inter_node_GBps if a == b else cm.cluster.cross_GBps(a, b)
                               for b in self.types] for a in self.types])
        self.all_bw = self._edges(self.total[None, :])[0]

    def _edges(self, n: np.ndarray) -> np.ndarray:
        """Sum of link bandwidths over GPU pairs inside a node-packed set; n: (splits, types)."""
        q, r = np.floor_divide(n, self.gpn), np.mod(n, self.gpn)
        sq = q * self.gpn ** 2 + r ** 2  # sum over nodes of (GPUs on node)^2
        intra = ((q * self.gpn * (self.gpn - 1) + r * (r - 1)) / 2 * self.intra).sum(1)
        cross = np.einsum("st,tu,su->s", n, self.link, n)
        same = (sq * np.diag(self.link)).sum(1)
        return intra + (cross - same) / 2

    def score(self, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(objective, training FLOP share) for splits n (splits, types)."""
        bw = self._edges(n) / max(self.all_bw, 1e-9)
        hbm = ((self.total - n) * self.hbm).sum(1) / (self.total * self.hbm).sum()
        flop = (n * self.flops).sum(1) / (self.total * self.flops).sum()
        return bw + hbm, flop


def lower_bounds(ev: Evaluator, types: list[str], grid: np.ndarray) -> np.ndarray:
    """A lower bound on the step time of every split in `grid` (splits, types), vectorised."""
    return _step_bound(ev, *bound_parts(ev, types, grid))


def _step_bound(ev: Evaluator, train: np.ndarray, gen: np.ndarray, sync: np.ndarray) -> np.ndarray:
    """CostModel.step_s on arrays of bounds: eta = 0 runs the parts back to back."""
    return train + gen + sync if ev.cm.w.eta == 0 else np.maximum(train, gen) + sync


def bound_parts(ev: Evaluator, types: list[str], grid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lower bounds on training, generation and weight-sync time of every split in `grid`.

    Training: its FLOPs plus the optimizer's HBM traffic (every parameter's weights, grads and
    Adam state once per minibatch) over the training GPUs' effective rates, weighting stages by
    their FLOP/s. Generation: the rollout GPUs' best per-GPU decode rates. Weight sync: the
    stages broadcast one after another, so all the weights cross a link no faster than the best
    one from a training type to the slowest rollout type. Bubbles, packing and the rest are
    ignored, so the bound never exceeds the cost model.
    """
    cm = ev.cm
    gpn = cm.gpn
    total = np.array([cm.cluster.count(t) for t in types], dtype=float)
    eff = np.array([cm.gpus[t].flops * cm.gpus[t].train_mfu for t in types])
    hbm = np.array([cm.gpus[t].hbm_Bps for t in types])
    train_rate = grid @ eff
    mem = grid @ np.array([cm.usable_bytes(t) for t in types])
    dec = (total - grid) @ np.array([_rate_bound(cm, t) for t in types])
    params = cm.m.num_hidden_layers * cm.layer_params + cm.edge_params(0, 1)  # the fewest: one stage
    # optimizer: a stage of GPU type t spends >= 32 B / hbm per parameter it holds, per minibatch
    opt = cm.w.minibatches * 32 * params * np.where(grid > 0, eff / hbm, np.inf).min(1)
    # weight sync: the stages' leaders send one after another, none faster than the best link
    # from a training type to the slowest rollout type
    link = np.array([[max(cm.cluster.inter_node_GBps, cm.cluster.intra_GBps(a)) if a == b
                      else cm.cluster.cross_GBps(a, b) for b in types] for a in types]) * 1e9
    rollout_nodes = total / gpn - np.floor(grid / gpn)
    best_link = np.where((rollout_nodes > 0)[:, None, :], link[None], np.inf).min(2)
    send = np.where((grid > 0) & np.isfinite(best_link), best_link, 0).max(1) * NCCL_EFFICIENCY
    with np.errstate(divide="ignore", invalid="ignore"):
        ok = (train_rate > 0) & (mem >= cm.train_memory_floor())
        lb_t = np.where(ok, (cm.train_flops() + opt) / train_rate, np.inf)
        lb_g = np.where(dec > 0, cm.w.gen_tokens / dec, np.inf)
        lb_s = np.where(send > 0, 2 * params / send, 0.0)
    return lb_t, lb_g, lb_s


def _rate_bound(cm, t: str) -> float:
    """An upper bound on one GPU of type t's generated tokens/s in any rollout plan: its best point
    per GPU (no recompute). With a long tail, of both classes: a class of short samples decodes faster."""
    if cm.tail is None:
        return cm.decode_rate_bound(t)
    return max((pt.tokens_per_s / pt.tp for pt in plan_points(cm, t)), default=0.0)


def split_grid(totals: list[int], limit: int = GRID_POINTS, per_type: int = TYPE_POINTS) -> np.ndarray:
    """Training-count splits per type on a grid of at most ~limit points and ~per_type counts of
    each type (step 1 when small)."""
    steps = [1] * len(totals)
    while np.prod([t // s + 1 for t, s in zip(totals, steps)]) > limit or \
            max(t // s + 1 for t, s in zip(totals, steps)) > per_type:
        i = int(np.argmax([t // s for t, s in zip(totals, steps)]))
        steps[i] *= 2
    axes = [list(range(0, t + 1, s)) + ([t] if t % s else []) for t, s in zip(totals, steps)]
    return np.array(list(product(*axes)), dtype=float)


def _as_counts(types, n) -> dict[str, int]:
    return {t: int(v) for t, v in zip(types, n)}


def repartition(ev: Evaluator, gs: GraphScore, grid, obj, flop, gamma: float, width: float,
                keep: int = 3, tries: int = 24) -> tuple[Candidate | None, str]:
    """Among splits whose FLOP share is (nearly) gamma, the `keep` best by the graph objective
    that fit; returns the fastest of them, or None and which side did not fit."""
    dist = np.abs(flop - gamma)
    ok = np.nonzero(dist <= dist.min() + width)[0]
    order = ok[np.argsort(-obj[ok], kind="stable")]
    failure, found = "", []
    for i in order[:tries]:
        cand = ev.counts(_as_counts(gs.types, grid[i]))
        if cand is not None:
            found.append(cand)
            if len(found) == keep:
                break
        else:
            failure = failure or ev.last_failure
    if not found:
        return None, failure
    return min(found, key=lambda c: c.step_s), ""


def two_phase(ev: Evaluator, max_bisect: int = 16) -> tuple[Candidate | None, SearchLog]:
    """AReaL-Hex Algorithm 1 (bisect gamma with graph partitions), then the estimate sweep."""
    t0 = time.perf_counter()
    log = SearchLog("two-phase")
    gs = GraphScore(ev)
    grid = split_grid([int(x) for x in gs.total])
    obj, flop = gs.score(grid)
    width = float(gs.flops.max() / (gs.total * gs.flops).sum())  # one GPU's share of FLOP/s
    best = _initial(ev, gs, log)
    q, r = 0.0, 1.0
    for it in range(max_bisect):
        ev.progress("bisecting the training share", it, max_bisect)
        gamma = (q + r) / 2
        log.gammas.append(gamma)
        cand, failure = repartition(ev, gs, grid, obj, flop, gamma, width)
        if cand is None:  # nothing fits near gamma: move towards the side that did not fit
            q, r = (gamma, r) if failure == "train" else (q, gamma)
        else:
            best = cand if best is None or cand.step_s < best.step_s else best
            q, r = (q, gamma) if cand.C_T < cand.C_gen + cand.C_reward else (gamma, r)
        log.history.append(best.step_s if best else float("inf"))
        if r - q < width / 4:
            break
    best = _sweep(ev, gs.types, grid, best, log)
    log.evaluations, log.wall_s = ev.evaluations, time.perf_counter() - t0
    return best, log


def wide_search(ev: Evaluator, factor: int = 10) -> Candidate | None:
    """A slower, wider search: the yardstick where exhaustive search is infeasible. The two-phase
    search, then its sweep again on a grid `factor` times finer, estimating `factor` times as many
    splits and costing every one whose estimate is within 30% of the best (tools/bench/bench_planner.py --wide)."""
    best, log = two_phase(ev)
    types = ev.cm.cluster.types()
    grid = split_grid([ev.cm.cluster.count(t) for t in types], factor * GRID_POINTS, factor * TYPE_POINTS)
    return _sweep(ev, types, grid, best, log, margin=0.3, budget=len(grid), estimates=factor * ESTIMATES)


def _sweep(ev: Evaluator, types, grid, best: Candidate | None, log: SearchLog, tol: float = 0.005,
           margin: float = MARGIN, budget: int | None = None, estimates: int = ESTIMATES) -> Candidate | None:
    """Cost the splits the two phases did not visit, best estimate (Evaluator.estimate) first,
    while an estimate is within `margin` of the best step time; at most `budget` of them (a
    twentieth of the splits, at least 32). Splits whose lower bound cannot beat the best by
    `tol` are skipped; the `estimates` lowest bounds are considered.

    An estimate needs a training search and a combined rollout plan, so each split climbs lazily
    through cheaper lower bounds of its estimate (`_raise`), and is raised only when its bound is
    the lowest left: splits come out in order of their estimates, and most are never estimated."""
    train_lb, gen_lb, sync_lb = bound_parts(ev, types, grid)
    lb = _step_bound(ev, train_lb, gen_lb, sync_lb)
    limit = best.step_s * (1 - tol) if best is not None else np.inf
    heap = [(float(lb[i]), int(i), 0, None) for i in np.argsort(lb, kind="stable")[:estimates] if lb[i] < limit]
    heapq.heapify(heap)
    budget = budget if budget is not None else max(32, len(grid) // 20)
    spent, raised, total = 0, 0, len(heap)
    while heap and spent < budget:
        ev.progress("sweeping splits", min(raised, total), total)
        est, i, level, nodes = heapq.heappop(heap)
        if level < 3:
            raised += level == 0
            up = _raise(ev, types, grid, i, level, nodes, train_lb[i], sync_lb[i])
            if up is not None:
                heapq.heappush(heap, up)
            continue
        if not np.isfinite(est) or (best is not None and est > best.step_s * (1 + margin)):
            break
        if best is not None and (lb[i] >= best.step_s * (1 - tol) or ev.train(nodes).time_s >= best.step_s):
            continue  # cannot win: its bound, or its training alone
        spent += 1
        cand = ev(nodes)
        if cand is not None and (best is None or cand.step_s < best.step_s):
            best = cand
    log.history.append(best.step_s if best else float("inf"))
    return best


def _raise(ev: Evaluator, types, grid, i: int, level: int, data, train_lb: float, sync_lb: float):
    """Split i's next heap entry (bound, i, level + 1, data), each bound no more than the estimate
    (so splits still come out in the order of their estimates): level 1 is training's own bound
    (train_search.train_bound) plus the sync bound, or, where the rollout has one GPU type, the
    exact training beside generation at makespan_bound's; level 2 the
    floor (the combined rollout plan beside training and sync at their bounds, generation from
    idle), level 3 the estimate. None: the split cannot run."""
    cm = ev.cm
    if level == 0:
        nodes = train_per_node(cm.cluster, _as_counts(types, grid[i]))
        train = max(train_lb, ev.train_bound(nodes))
        if not np.isfinite(train):
            return None
        free = {t: int(left) for t, left in zip(types, _totals(cm, types) - grid[i]) if left > 0}
        if len(free) != 1:
            return cm.step_s(train, 0.0, sync_lb), i, 1, (nodes, train)
        # one type: no per-type plans are shared between splits, so bound its plan beside the exact
        # training (the estimate needs both) before solving its MILPs
        exact = ev.train(nodes)
        if exact is None:
            return None
        reward = cm.group_reward_s()  # step_times with the wave from idle at its bound, zero
        gen = cm.gen_s(makespan_bound(cm, *free.popitem()) + reward, reward, exact.time_s, sync_lb)
        return cm.step_s(exact.time_s, gen, sync_lb), i, 1, (nodes, train)
    if level == 1:
        nodes, train = data
        roll = ev.combined_rollout(nodes)
        if roll is None:
            return None
        # the heap keeps the split, not its plan: thousands of plans would hold every replica of each
        return step_times(cm, train, sync_lb, roll, joined=False)[2], i, 2, nodes
    return ev.estimate(data, ev.combined_rollout(data)), i, 3, data


def _totals(cm, types) -> np.ndarray:
    """GPUs of each type (ClusterSpec.count loops over every node: a sweep asks once per split)."""
    ix = NodeIndex.of(cm.cluster)
    per_type = np.bincount(ix.type_of, weights=ix.gpus, minlength=len(ix.types))
    return np.array([per_type[ix.types.index(t)] for t in types])


def makespan_bound(cm, gpu_type: str, n: int) -> float:
    """A lower bound on the makespan T = (tokens + sum h R) / sum h (rollout_milp.makespan) of any
    rollout plan on n free GPUs of one type: the replica counts relaxed to the polytope of its
    MILP without TP packing (GPUs and the staleness gate's cap on running sequences: two rows),
    where the ratio is least at a vertex, and a vertex uses one or two configurations. With a long
    tail the polytope has both classes' columns: the slower class's T is at least the mediant
    (both classes' tokens + sum h R) / sum h over all replicas, which a vertex of it bounds."""
    cap = float("inf") if cm.w.eta is None else (cm.w.eta + 1) * cm.w.samples
    parts = _vertex_rates(cm, gpu_type, n, cap) if n > 0 else None
    if parts is None or parts[0].max() <= 0:
        return float("inf")
    rate, loss = parts
    tokens = cm.w.gen_tokens if cm.tail is None else cm.tail.regular.w.gen_tokens + cm.tail.long.w.gen_tokens
    # a hair under, so that rounding never lifts it over a plan whose makespan is the vertex's
    return float(((tokens + loss[rate > 0]) / rate[rate > 0]).min()) * (1 - 1e-9)


def _vertex_rates(cm, t: str, n: int, cap: float) -> tuple[np.ndarray, np.ndarray] | None:
    """(h.y, (h R).y) at every vertex y of type t's relaxed polytope on n GPUs (makespan_bound)."""
    points = plan_points(cm, t)
    if not points:
        return None
    h, r, a, b = (np.array([getattr(pt, f) for pt in points], dtype=float)
                  for f in ("tokens_per_s", "recompute_s", "tp", "batch"))
    y = _vertices(a, b, float(n), cap)
    return y @ h, y @ (h * r)


def plan_points(cm, t: str) -> list:
    """Every operating point a rollout plan may give a replica of type t: the one class's, or with a
    long tail the regular class's and the long tail's at each of its caps (priced for their lengths)."""
    regular = cm.rollout if cm.tail is None else cm.tail.regular
    points = {(pt.tp, pt.batch): pt for tp in cm.tp_options(t) for b in (False, True)
              for pt in regular.decode_points(t, tp, b)}
    long = [] if cm.tail is None else [pt for tp in cm.tp_options(t) for cap in cm.tail.caps
                                       for pt in cm.tail.long.capped_points(t, tp, cap)]
    return list(points.values()) + long


def _vertices(a: np.ndarray, b: np.ndarray, n: float, cap: float) -> np.ndarray:
    """Vertices (rows) of {y >= 0: a.y <= n, b.y <= cap} but the origin (a, b > 0): one column as
    far as either row allows, or two columns with both rows tight."""
    m = len(a)
    ys = [np.diag(np.minimum(n / a, cap / b))]
    if np.isfinite(cap):
        j, k = (g.ravel() for g in np.meshgrid(np.arange(m), np.arange(m), indexing="ij"))
        det = a[j] * b[k] - a[k] * b[j]
        ok = det != 0
        j, k, det = j[ok], k[ok], det[ok]
        yj, yk = (n * b[k] - cap * a[k]) / det, (a[j] * cap - b[j] * n) / det
        ok = (yj >= 0) & (yk >= 0)
        pair = np.zeros((int(ok.sum()), m))
        rows = np.arange(len(pair))
        pair[rows, j[ok]], pair[rows, k[ok]] = yj[ok], yk[ok]
        ys.append(pair)
    return np.vstack(ys)


def _initial(ev: Evaluator, gs: GraphScore, log: SearchLog) -> Candidate | None:
    """The initial allocation D_T^0 of Algorithm 1: GPUs ordered by comparative advantage for
    training (effective FLOP/s over decode rate), a prefix of k of them trains; k is bisected
    on C_T vs C_I and its neighbours are tried."""
    cm = ev.cm
    adv = {t: cm.gpus[t].flops * cm.gpus[t].train_mfu / max(cm.decode_rate_bound(t), 1e-9) for t in gs.types}
    order = sorted(gs.types, key=lambda t: -adv[t])

    def prefix(k: int) -> Candidate | None:
        counts = {}
        for t in order:
            counts[t] = min(k, cm.cluster.count(t))
            k -= counts[t]
        return ev.counts(counts)

    lo, hi, best = 1, cm.cluster.world_size - 1, None
    while lo <= hi:
        ev.progress("initial split", 0, 0)
        k = (lo + hi) // 2
        cand = prefix(k)
        if cand is None:  # too little memory on one side: move away from it
            lo, hi = (k + 1, hi) if ev.last_failure == "train" else (lo, k - 1)
            continue
        best = cand if best is None or cand.step_s < best.step_s else best
        lo, hi = (lo, k - 1) if cand.C_T < cand.C_gen + cand.C_reward else (k + 1, hi)
    for k in (lo - 1, lo, lo + 1):
        cand = prefix(k) if 0 < k < cm.cluster.world_size else None
        best = cand if cand and (best is None or cand.step_s < best.step_s) else best
    log.history.append(best.step_s if best else float("inf"))
    return best


def exhaustive(ev: Evaluator, prune: bool = True) -> tuple[Candidate | None, SearchLog]:
    """Every split of the GPUs by type counts, each with its best layouts (the quality yardstick).

    prune: skip the rollout MILP of splits whose training alone is slower than the best so far
    (exact: the answer is the same; prune=False costs every split, for timing comparisons).
    """
    t0 = time.perf_counter()
    log = SearchLog("exhaustive")
    types = ev.cm.cluster.types()
    best, total = None, n_splits(ev)
    for done, n in enumerate(product(*[range(ev.cm.cluster.count(t) + 1) for t in types])):
        ev.progress("exhaustive search", done, total)
        per_node = train_per_node(ev.cm.cluster, _as_counts(types, n))
        train = ev.train(per_node)
        if train is None or (prune and best is not None and train.time_s >= best.step_s):
            continue  # exact pruning: a step never takes less than its training
        cand = ev(per_node)
        if cand is not None and (best is None or cand.step_s < best.step_s):
            best = cand
    log.evaluations, log.wall_s = n_splits(ev), time.perf_counter() - t0
    return best, log


def n_splits(ev: Evaluator) -> int:
    return int(np.prod([ev.cm.cluster.count(t) + 1 for t in ev.cm.cluster.types()]))
