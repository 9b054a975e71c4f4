"""Search phase, rollout side: the AReaL-Hex MILP over replica configurations, on HiGHS.

Paper (§4.2.2): integer replica counts y_psi, rollouts x_psi per configuration, makespan Theta;
minimise Theta s.t. sum x_psi = B, x_psi * len <= Theta * y_psi * h_psi, GPU counts.

Linearisation. The product Theta * y_psi is bilinear. We substitute u = 1/Theta and the
token rate r_psi = x_psi * len * u (a Charnes-Cooper change of variables): the constraints
become sum r_psi = B * len * u and r_psi <= h_psi * y_psi, both linear, and minimising Theta
is maximising U = B * len * u, the total token rate. The substitution is exact (u > 0 at any
feasible point), so no bisection over Theta and no big-M are needed; Theta = B * len / U and
x_psi = r_psi / len * Theta are read back from the solution.

What makes it more than a knapsack: a configuration psi = (GPU type, TP, decode batch), and
the running sequences of all replicas together are capped by the staleness gate,
(eta + 1) * B rollouts; when that cap binds, fewer, fuller replicas beat many half-empty ones.
TP stays inside a node: per group of like nodes, TP sizes (powers of two) are packed with the
exact condition for divisible sizes: for every size s, sum_{tp >= s} tp * y_tp <= nodes * s * floor(free / s);
for s = 1 it is an equality, because every rank of the plan needs a role.

The long tail (a job's long_tail section, cost_rollout.TailSplit): each column also names a length
class, and the token rate of each class's columns must be its share of the step's tokens times U
(one row per class in place of sum r = U), so both classes end together. The long tail's columns run at
one batch cap on one GPU type: one MILP per cap in the job's caps and GPU type, and the plan that
generates a step soonest (the throughput makespan or the wave, as the gate lets them bind:
CostModel.gen_s) is kept, or within 1% of it the one whose long tail ends soonest. A try whose
relaxed MILP cannot come within that 1% is not solved (solve_rollout).
"""

import ctypes
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain

import highspy
import numpy as np

from hexrl.plan.cost import CostModel
from hexrl.plan.cost_rollout import DecodePoint
from hexrl.plan.placement import FreeClass


@dataclass(slots=True)  # a plan of a large cluster holds tens of thousands
class RolloutReplica:
    gpu_type: str
    tp: int
    batch: int
    node: int
    locals: list[int]
    tokens_per_s: float
    share: float  # fraction of the step's prompts
    long_tail: bool = False  # serves the long-tail class (its share is of all prompts, like the others')


@dataclass(slots=True)
class ReplicaKind:
    """`count` replicas that differ only in where they sit. A plan holds its replicas as runs of
    kinds and places them when asked: a search costs thousands of plans it never writes."""

    gpu_type: str
    tp: int
    batch: int
    tokens_per_s: float
    share: float  # each replica's
    count: int
    long_tail: bool = False  # serves the long-tail class


@dataclass
class RolloutPlan:
    kinds: list[ReplicaKind]  # the replicas in runs of one kind, in order
    theta_s: float  # makespan of one step's rollouts, KV recompute after the weight update included
    gen_s: float  # the throughput makespan (the gate's long tail is added in candidate.py)
    tokens_per_s: float  # generated tokens/s of all replicas
    wave_s: float = 0.0  # one step's groups generated from idle (CostModel.rollout_wave)
    reward_s: float = 0.0  # reward work of the busiest replica per step (overlaps its decoding)
    nodes: tuple[int, ...] = ()  # the nodes its replicas sit on
    slots: Callable[[], list[tuple[int, list[int]]]] = field(default=list, repr=False)  # (node, locals) of each

    @cached_property
    def replicas(self) -> list[RolloutReplica]:
        """Every replica in order, placed (built on first use)."""
        where = iter(self.slots())
        return [RolloutReplica(k.gpu_type, k.tp, k.batch, *next(where), k.tokens_per_s, k.share, k.long_tail)
                for k in self.kinds for _ in range(k.count)]

    @property
    def count(self) -> int:
        """How many replicas."""
        return sum(k.count for k in self.kinds)

    @staticmethod
    def placed(cm: CostModel, replicas: list[RolloutReplica], theta_s: float) -> "RolloutPlan":
        """A plan of replicas already placed (a given layout), each its own kind."""
        kinds = [ReplicaKind(r.gpu_type, r.tp, r.batch, r.tokens_per_s, r.share, 1, r.long_tail) for r in replicas]
        slots = [(r.node, r.locals) for r in replicas]
        return RolloutPlan(kinds, theta_s, theta_s, cm.w.gen_tokens / theta_s, *cm.rollout_wave(kinds),
                           tuple(dict.fromkeys(r.node for r in replicas)), lambda: slots)


def _columns(cm: CostModel, classes: list[FreeClass], concurrency: float, long_tail: tuple[int, str] | None = None):
    """One column (free class, operating point, long tail?) per (class, tp, operating point); all
    batch sizes only if the gate can bind. long_tail (cap, GPU type): the long tail's columns too,
    at that batch cap on that type's GPUs."""
    regular = cm.rollout if long_tail is None else cm.tail.regular
    # the regular class's batches are the largest (its samples are the shortest): past this cap the
    # gate cannot bind, whatever the plan
    cap = sum(len(c.nodes) * c.free * max((regular.max_decode_batch(c.gpu_type, tp) / tp
                                             for tp in cm.tp_options(c.gpu_type)), default=0)
              for c in classes)
    all_batches = concurrency < cap
    cols = []
    for ci, c in enumerate(classes):
        for tp in cm.tp_options(c.gpu_type):
            if tp > c.free:
                continue
            for pt in regular.decode_points(c.gpu_type, tp, all_batches):
                cols.append((ci, pt, False))
            if long_tail is not None and c.gpu_type == long_tail[1]:
                cols += [(ci, pt, True) for pt in cm.tail.long.capped_points(c.gpu_type, tp, long_tail[0])]
    return cols, all_batches


def _idle_columns(cm: CostModel, classes: list[FreeClass]):
    """Replicas that get no work (share 0, batch 0 here): where the gate's cap on running
    sequences keeps fewer replicas busy than the free GPUs hold (a large cluster, a small batch),
    the rest still need a role. One column per class, at the smallest TP that fits."""
    cols = []
    for ci, c in enumerate(classes):
        fits = [tp for tp in cm.tp_options(c.gpu_type) if tp <= c.free and cm.max_decode_batch(c.gpu_type, tp) > 0]
        if fits:
            cols.append((ci, DecodePoint(c.gpu_type, fits[0], 0, 0.0, 0.0, 0.0), False))
    return cols


def solve_rollout(cm: CostModel, classes: list[FreeClass], rounds: int = 4,
                  period: float | None = None) -> RolloutPlan | None:
    """The rollout plan with the shortest makespan on these free GPUs (None if nothing fits); with
    a long tail, the best of one plan per batch cap and GPU type (see the module's docstring)."""
    if cm.tail is None:
        return _solve_rollout(cm, classes, rounds, period)
    tries = [(cap, kind) for cap in cm.tail.caps for kind in dict.fromkeys(c.gpu_type for c in classes)]
    # a try's generation (eta != 0) is at least its makespan, at least the step's tokens / its MILP's
    # relaxed token rate: solve the most promising first and skip those that cannot come within 1%
    bound = {t: 0.0 if cm.w.eta == 0 else _makespan_floor(cm, classes, t) for t in tries}
    solved = {}  # try -> (plan, generation)
    for t in sorted(tries, key=bound.get):
        if solved and bound[t] > 1.01 * min(g for _, g in solved.values()):
            break  # sorted: no later try comes within 1% either
        if (p := _solve_rollout(cm, classes, rounds, period, t)) is not None:
            solved[t] = p, cm.gen_s(p.gen_s, p.wave_s, 0.0, 0.0)
    if not solved:
        return None
    plans, gen = zip(*(solved[t] for t in tries if t in solved))  # in the order of the tries: ties go as before
    # within 1% of the shortest generation, the plan whose long tail ends soonest: its tokens are the freshest
    return min((p for p, g in zip(plans, gen) if g <= 1.01 * min(gen)), key=cm.long_tail_wave_s)


def _makespan_floor(cm: CostModel, classes: list[FreeClass], long_tail: tuple[int, str]) -> float:
    """A lower bound on the makespan of every plan _solve_rollout can return for long_tail (cap, type):
    the step's tokens over its MILP's token rate relaxed (replica counts real, no recompute). A plan's
    slower class takes at least its tokens / its replicas' rate, and the rates its replicas give
    every class in proportion are a point of that relaxation; inf where it has none."""
    w = cm.w
    concurrency = float("inf") if w.eta is None else (w.eta + 1) * w.samples
    cols, all_batches = _columns(cm, classes, concurrency, long_tail)
    cols += _idle_columns(cm, classes)  # more columns only relax it further
    _, sol = _solve(cm, classes, cols, [pt.tokens_per_s for _, pt, _ in cols],
                    concurrency if all_batches else None, integer=False)
    tokens = cm.tail.regular.w.gen_tokens + cm.tail.long.w.gen_tokens
    return math.inf if sol is None else tokens / sol[-1] * (1 - 1e-9)


def _solve_rollout(cm: CostModel, classes: list[FreeClass], rounds: int, period: float | None,
                   long_tail: tuple[int, str] | None = None) -> RolloutPlan | None:
    """The rollout plan with the shortest makespan; long_tail (batch cap, GPU type): the long tail's
    replicas, all at that cap on that type.

    After each weight update a replica re-prefills its running batch (KV recompute, R_psi
    seconds), so over a step of length T it decodes at h_psi * (1 - R_psi / T). T is the
    makespan itself: a fixed point on T, one MILP per round. For a fixed choice of replicas the
    fixed point has a closed form, T = (tokens + sum h R) / sum h (each replica loses R once
    per step), which is the next round's T: the replica choice settles in two or three rounds.
    period: start from this T instead of none (no recompute); with rounds=1, the best plan for a
    step of that length.
    """
    w = cm.w
    concurrency = float("inf") if w.eta is None else (w.eta + 1) * w.samples
    cols, all_batches = _columns(cm, classes, concurrency, long_tail)
    if not cols:
        return None
    y, sol, theta, done = None, None, None, 0
    while done < rounds:
        rates = [pt.tokens_per_s * (1.0 if period is None else max(0.0, 1 - pt.recompute_s / period))
                 for _, pt, _ in cols]
        y_new, sol_new = _solve(cm, classes, cols, rates, concurrency if all_batches else None)
        if y_new is None and y is None and all_batches and not any(pt.batch == 0 for _, pt, _ in cols):
            cols = cols + _idle_columns(cm, classes)  # more GPUs than the gate keeps busy: let some idle
            continue
        done += 1
        if y_new is None:
            break
        y, sol = y_new, sol_new
        used = [j for j in range(len(cols)) if sol[len(cols) + j] > 1e-9 * sol[-1]]
        # the makespan this choice really has, its recompute priced at that makespan: when the
        # rounds run out with the choice still changing, the MILP's own tokens / U would price
        # recompute at another step length (it under-predicted a step by 27% so)
        theta = makespan(cm, [cols[j][1] for j in used], [y[j] for j in used], [cols[j][2] for j in used])
        if period is not None and abs(w.gen_tokens / sol[-1] - period) <= 1e-2 * period:
            break
        period = theta
    return None if y is None else _assemble(cm, classes, cols, y, sol, theta)


def quiet_highs() -> highspy.Highs:
    """A HiGHS instance that prints nothing. Its first construction in a process prints a copyright
    banner from C++ before any option can be set, so stdout's descriptor points at /dev/null then."""
    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    try:
        h = highspy.Highs()
    finally:
        ctypes.CDLL(None).fflush(None)  # the banner may sit in C's stdout buffer: flush it while it is null
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)
    h.setOptionValue("output_flag", False)
    return h


def _solve(cm: CostModel, classes, cols, rates, concurrency, integer: bool = True):
    """Build and solve the MILP (integer=False: its relaxation); returns (replica count per column,
    the solution: counts, token rates, total token rate U)."""
    n = len(cols)
    # columns: y_0..y_{n-1} (integer), r_0..r_{n-1}, U
    nv = 2 * n + 1
    cost = np.zeros(nv)
    cost[-1] = -1.0  # maximise U
    lower = np.zeros(nv)
    upper = np.full(nv, highspy.kHighsInf)
    for j, (ci, pt, _) in enumerate(cols):
        c = classes[ci]
        upper[j] = len(c.nodes) * (c.free // pt.tp)
    rows, lo, hi = [], [], []
    split = cm.tail is not None and any(long for _, _, long in cols)
    if not split:
        rows.append({**{n + j: 1.0 for j in range(n)}, 2 * n: -1.0})  # sum r = U
        lo.append(0.0), hi.append(0.0)
    else:  # each length class generates its share of the tokens: sum of its r = share * U
        for long in (False, True):
            share = cm.tail.long_token_share if long else 1 - cm.tail.long_token_share
            rows.append({**{n + j: 1.0 for j, col in enumerate(cols) if col[2] == long}, 2 * n: -share})
            lo.append(0.0), hi.append(0.0)
    for j in range(n):  # r_psi <= h_psi * y_psi
        rows.append({n + j: 1.0, j: -rates[j]})
        lo.append(-highspy.kHighsInf), hi.append(0.0)
    for ci, c in enumerate(classes):  # TP groups packed into like nodes
        for s in cm.tp_options(c.gpu_type):
            if s > c.free:
                continue
            row = {j: float(pt.tp) for j, (cj, pt, _) in enumerate(cols) if cj == ci and pt.tp >= s}
            if not row:
                if s == 1:
                    return None, None  # nothing fits on these GPUs
                continue
            cap = float(len(c.nodes) * s * (c.free // s))
            rows.append(row)  # s == 1: every rollout GPU belongs to some replica
            lo.append(cap if s == 1 else -highspy.kHighsInf), hi.append(cap)
    if concurrency is not None:  # running sequences of all replicas <= staleness-gate capacity
        rows.append({j: float(pt.batch) for j, (_, pt, _) in enumerate(cols)})
        lo.append(-highspy.kHighsInf), hi.append(concurrency)
    # two length classes: presolve took 3/4 of the time of these small MILPs, and finds nothing
    h = _highs(cost, lower, upper, rows, lo, hi, n if integer else 0, presolve=not split)
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None, None
    sol = np.asarray(h.getSolution().col_value)
    y = np.rint(sol[:n]).astype(int)
    if sol[-1] <= 0:
        return None, None
    return y, sol


def _highs(cost, lower, upper, rows, lo, hi, n_int, presolve: bool = True) -> highspy.Highs:
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = len(cost), len(rows)
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = cost, lower, upper
    lp.row_lower_, lp.row_upper_ = np.asarray(lo), np.asarray(hi)
    cols: list[list[tuple[int, float]]] = [[] for _ in cost]
    for i, row in enumerate(rows):
        for j, v in row.items():
            cols[j].append((i, v))
    starts, index, value = [0], [], []
    for col in cols:
        index += [i for i, _ in col]
        value += [v for _, v in col]
        starts.append(len(index))
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.asarray(starts, dtype=np.int32)
    lp.a_matrix_.index_ = np.asarray(index, dtype=np.int32)
    lp.a_matrix_.value_ = np.asarray(value, dtype=float)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * n_int + \
        [highspy.HighsVarType.kContinuous] * (len(cost) - n_int)
    h = quiet_highs()
    h.setOptionValue("mip_rel_gap", 1e-6)
    if not presolve:
        h.setOptionValue("presolve", "off")
    h.passModel(lp)
    h.run()
    return h


def _assemble(cm: CostModel, classes, cols, y, sol, theta: float) -> RolloutPlan:
    """The solved replica counts as kinds (largest TP first in each class), each with its share;
    placed on nodes when the plan's replicas are asked for (`_place`)."""
    n = len(cols)
    U = float(sol[-1])
    rate = np.asarray(sol[n:2 * n])
    kinds = []
    for j in _order(classes, cols, y):
        pt: DecodePoint = cols[j][1]
        share = max(0.0, rate[j]) / y[j] / U
        kinds.append(ReplicaKind(pt.gpu_type, pt.tp, max(1, pt.batch), pt.tokens_per_s,
                                 share, int(y[j]), cols[j][2]))  # an idle one (batch 0) keeps the knobs of batch 1
    _prompt_shares(cm, kinds)
    nodes = tuple(chain.from_iterable(c.nodes for c in classes))
    return RolloutPlan(kinds, theta, theta, U, *cm.rollout_wave(kinds), nodes,
                       lambda: _place(cm, classes, cols, y))


def _prompt_shares(cm: CostModel, kinds: list[ReplicaKind]) -> None:
    """Token-rate shares -> shares of the step's groups, summing to 1 over the replicas (replicas the
    gate leaves idle keep share 0); with a long tail, each class's replicas share its groups by token rate."""
    split = any(k.long_tail for k in kinds)
    for long in (False, True):
        mine = [k for k in kinds if k.long_tail == long]
        total = repeated_sum([k.share for k in mine], [k.count for k in mine])
        for k in mine:
            k.share /= total
            if split:
                k.share *= cm.tail.prompt_share(long)


def _order(classes, cols, y) -> list[int]:
    """The columns with replicas, class by class, largest TP first: the order they are placed in."""
    return [j for ci in range(len(classes))
            for j in sorted((j for j in range(len(cols)) if cols[j][0] == ci and y[j] > 0),
                            key=lambda j: -cols[j][1].tp)]


def _place(cm: CostModel, classes, cols, y) -> list[tuple[int, list[int]]]:
    """(node, local ranks) of each replica in `_order`: a class's nodes filled one after another."""
    out, ci, free, at, tp = [], None, {}, 0, None
    for j in _order(classes, cols, y):
        cj, pt = cols[j][0], cols[j][1]
        c = classes[cj]
        if cj != ci:
            ci, at, tp = cj, 0, None
            free = {node: list(range(cm.cluster.nodes[node].gpus - c.free, cm.cluster.nodes[node].gpus))
                    for node in c.nodes}
        at = 0 if pt.tp != tp else at  # the first node that may have room: free GPUs only shrink, TP only falls
        tp = pt.tp
        for _ in range(y[j]):
            while len(free[c.nodes[at]]) < pt.tp:
                at += 1
            node = c.nodes[at]
            locs, free[node] = free[node][:pt.tp], free[node][pt.tp:]
            out.append((node, locs))
    return out


def repeated_sum(values, counts) -> float:
    """sum() of each value repeated its count of times, in order: the same additions one after
    another, bit for bit, without the list."""
    added = np.add.accumulate(np.repeat(np.asarray(values, dtype=float), counts))
    return float(added[-1]) if len(added) else 0.0


def makespan(cm: CostModel, points: list[DecodePoint], counts: list[int] | None = None,
             long: list[bool] | None = None) -> float:
    """Seconds for replicas (one DecodePoint each, or `counts` of each) to generate a step's tokens
    when each loses its KV recompute once per step: T = (tokens + sum h R) / sum h. long: which
    serve the long tail; then each length class does so for its own tokens, and the slower class
    ends the step."""
    counts = [1] * len(points) if counts is None else counts
    if cm.tail is None or not long or not any(long):
        return _class_makespan(cm.w.gen_tokens, points, counts)
    ends = []
    for kind in (False, True):
        mine = [(pt, n) for pt, n, k in zip(points, counts, long) if k == kind]
        tokens = cm.tail.of(kind).w.gen_tokens
        ends.append(_class_makespan(tokens, [pt for pt, _ in mine], [n for _, n in mine]) if mine else math.inf)
    return max(ends)


def _class_makespan(tokens: float, points: list[DecodePoint], counts: list[int]) -> float:
    h = np.array([pt.tokens_per_s for pt in points])
    rate = repeated_sum(h, counts)
    return (tokens + repeated_sum(h * [pt.recompute_s for pt in points], counts)) / rate if rate > 0 else math.inf


def decode_point(cm: CostModel, r, split: bool) -> DecodePoint:
    """Replica (or kind) r's operating point, priced for the lengths of the class it serves where the
    plan splits them (split: some replica serves the long tail)."""
    cost = cm.tail.of(r.long_tail) if split else cm.rollout
    return cost.decode_point(r.gpu_type, r.tp, r.batch)


def combine(cm: CostModel, plans: list[RolloutPlan]) -> RolloutPlan:
    """One plan from plans solved on disjoint GPUs (one per GPU type): their replicas side by side,
    shares by token rate, and the recompute fixed point redone for all of them. The staleness
    gate's cap on running sequences is not applied across the plans, so this estimates the joint
    MILP's plan; it is not one."""
    rate = sum(p.tokens_per_s for p in plans)
    kinds = [ReplicaKind(k.gpu_type, k.tp, k.batch, k.tokens_per_s, k.share * p.tokens_per_s / rate, k.count,
                         k.long_tail) for p in plans for k in p.kinds]
    busy, split = [k for k in kinds if k.share > 0], any(k.long_tail for k in kinds)
    theta = makespan(cm, [decode_point(cm, k, split) for k in busy], [k.count for k in busy],
                     [k.long_tail for k in busy])
    return RolloutPlan(kinds, theta, theta, cm.w.gen_tokens / theta, *cm.rollout_wave(kinds),
                       tuple(chain.from_iterable(p.nodes for p in plans)),
                       lambda: [s for p in plans for s in p.slots()])
