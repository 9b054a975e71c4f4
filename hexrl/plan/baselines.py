"""The paper's comparison points: AReaL's homogeneous recipe and uniform allocation.

Both fix the split of GPUs between training and rollout by a rule, then let the search phase
pick the best layouts on that split (as AReaL does with its parallel configs).
- homogeneous: AReaL's default, 3/4 of the GPUs generate; the first quarter in rank order
  trains, blind to GPU types.
- uniform: half of every GPU type trains, half generates (the paper's "AReaL (u)").
When the rule's split does not fit (e.g. too little memory to train), the nearest split by
total training GPUs that fits is used.
"""

import time

from hexrl.plan.candidate import Candidate, Evaluator
from hexrl.plan.partition import SearchLog
from hexrl.plan.placement import train_per_node


def _rank_prefix(ev: Evaluator, k: int) -> tuple[int, ...]:
    """Training on global ranks 0..k-1 (node by node)."""
    out = []
    for n in ev.cm.cluster.nodes:
        take = min(n.gpus, k)
        out.append(take)
        k -= take
    return tuple(out)


def _proportional(ev: Evaluator, k: int) -> tuple[int, ...]:
    """k training GPUs spread over types in proportion to how many each type has."""
    c = ev.cm.cluster
    total = c.world_size
    counts = {t: int(c.count(t) * k // total) for t in c.types()}
    rest = k - sum(counts.values())
    for t in sorted(c.types(), key=lambda t: -(c.count(t) * k / total - counts[t])):
        if rest > 0 and counts[t] < c.count(t):
            counts[t] += 1
            rest -= 1
    return train_per_node(c, counts)


def _nearest(ev: Evaluator, target: int, split) -> Candidate | None:
    n = ev.cm.cluster.world_size
    for d in range(n):
        for k in (target + d, target - d) if d else (target,):
            if 0 < k < n:
                cand = ev(split(ev, k))
                if cand is not None:
                    return cand
    return None


def homogeneous(ev: Evaluator) -> tuple[Candidate | None, SearchLog]:
    t0 = time.perf_counter()
    cand = _nearest(ev, round(ev.cm.cluster.world_size / 4), _rank_prefix)
    return cand, SearchLog("homogeneous", ev.evaluations, time.perf_counter() - t0)


def uniform(ev: Evaluator) -> tuple[Candidate | None, SearchLog]:
    t0 = time.perf_counter()
    cand = _nearest(ev, ev.cm.cluster.world_size // 2, _proportional)
    return cand, SearchLog("uniform", ev.evaluations, time.perf_counter() - t0)
