"""User-fixed layouts: the job's `layout` section names the placement; the planner fills in the
rest (layer split, shares, predictions) and checks it, reporting every problem at once.

Forms (all fields optional, combined as given):
  {"train_gpus": N, "train_gpu_type": T, "tp": t, "pp": p, "dp": d, "rollout_tp": r}
  {"train_ranks": [...], "trainer": {"dp": D, "stages": [{"gpu_type", "tp", "layers"}]},
   "rollout_replicas": [{"tp", "ranks", "share", "max_running"}]}
Training ranks fill the trainer grid stage by stage, dp-major, tp-minor.
"""

import math

from hexrl.plan.candidate import Candidate, candidate
from hexrl.plan.cost import CostModel
from hexrl.plan.rollout_milp import RolloutPlan, RolloutReplica, makespan
from hexrl.plan.train_search import TrainPlan, cost_layout_fitting
from hexrl.schema import ConfigError, Plan, Stage, TrainerLayout


def fixed_candidate(cm: CostModel, layout: dict) -> Candidate:
    """The candidate a fixed layout describes; ConfigError lists every problem with it."""
    p: list[str] = []
    train = _train_ranks(cm, layout, p)
    chunks, dp, layers = _trainer(cm, layout, train, p) if train else (None, None, None)
    rest = sorted(set(range(cm.cluster.world_size)) - set(train or []))
    reps = _replicas(cm, layout, rest, p) if train else None
    tplan = _train_plan(cm, chunks, dp, layers, p) if chunks else None
    rplan = _rollout_plan(cm, reps, p) if reps else None
    if p or tplan is None or rplan is None:
        raise ConfigError(p or ["layout: cannot be placed"], "invalid layout")
    per_node = tuple(sum(1 for r in train if r // cm.gpn == i) for i in range(len(cm.cluster.nodes)))
    return candidate(cm, per_node, tplan, rplan)


def recost(cm: CostModel, plan: Plan) -> Candidate:
    """The candidate a finished (not colocated) plan describes, to cost exactly this placement."""
    t, p = plan.trainer, []
    chunks = [(st.gpu_type, st.tp, [divmod(r, cm.gpn) for r in t.stage_ranks(s)]) for s, st in enumerate(t.stages)]
    tplan = _train_plan(cm, chunks, t.dp, [b - a for a, b in (st.layers for st in t.stages)], p)
    reps = [(r.gpu_type, r.tp, r.ranks, r.share, r.knobs.max_running, r.long_tail) for r in plan.replicas]
    rplan = _rollout_plan(cm, reps, p)
    if p or tplan is None or rplan is None:
        raise ConfigError(p or ["plan: cannot be costed"], "invalid plan")
    per_node = tuple(sum(1 for r in t.ranks if r // cm.gpn == i) for i in range(len(cm.cluster.nodes)))
    return candidate(cm, per_node, tplan, rplan)


def _type(cm: CostModel, rank: int) -> str:
    return cm.cluster.nodes[rank // cm.gpn].gpu_type


def _train_ranks(cm: CostModel, layout: dict, p: list[str]) -> list[int] | None:
    n = cm.cluster.world_size
    if "train_ranks" in layout:
        ranks = list(layout["train_ranks"])
        bad = [r for r in ranks if r >= n]
        if bad:
            p.append(f"layout.train_ranks: ranks {bad} do not exist (the cluster has ranks 0..{n - 1})")
        if len(set(ranks)) != len(ranks):
            p.append("layout.train_ranks: a rank is listed twice")
        ranks = [r for r in dict.fromkeys(ranks) if r < n]
    else:
        k = layout.get("train_gpus")
        if k is None and isinstance(layout.get("trainer"), dict):
            st = layout["trainer"].get("stages") or []
            k = layout["trainer"].get("dp", 1) * sum(s.get("tp", 1) for s in st if isinstance(s, dict))
        if k is None:
            p.append("layout: give train_ranks, train_gpus or trainer")
            return None
        want = layout.get("train_gpu_type")
        pool = [r for r in range(n) if want is None or _type(cm, r).lower() == str(want).lower()]
        if k > len(pool):
            p.append(f"layout.train_gpus: {k} requested but the cluster has {len(pool)} "
                     f"{want or 'GPUs'}")
            return None
        ranks = pool[:k]
    if not ranks or len(ranks) >= n:
        p.append(f"layout: {len(ranks)} training ranks leave {n - len(ranks)} for rollout; "
                 "both roles need at least one")
        return None
    return ranks


def _trainer(cm: CostModel, layout: dict, train: list[int], p: list[str]):
    """Stages as (type, tp, slots), the DP degree and the layers (or None to balance)."""
    t = layout.get("trainer")
    if isinstance(t, dict):
        dp = t.get("dp", 1)
        specs = [s for s in t.get("stages") or [] if isinstance(s, dict)]
        tps = [s.get("tp", 1) for s in specs]
        layers = [s.get("layers") for s in specs]
        types = [s.get("gpu_type") for s in specs]
        where = "layout.trainer"
    else:
        tp, pp = layout.get("tp", 1), layout.get("pp", 1)
        dp = layout.get("dp", len(train) // (tp * pp) or 1)
        tps, layers, types, where = [tp] * pp, [None] * pp, [None] * pp, "layout"
    if not tps:
        p.append(f"{where}.stages: needs at least one stage")
        return None, None, None
    if dp * sum(tps) != len(train):
        p.append(f"{where}: dp={dp} x tp {tps} needs {dp * sum(tps)} GPUs but {len(train)} training ranks are given")
        return None, None, None
    chunks, pos = [], 0
    for i, tp in enumerate(tps):
        ranks = train[pos:pos + dp * tp]
        pos += dp * tp
        kinds = {_type(cm, r) for r in ranks}
        if len(kinds) > 1:
            p.append(f"{where}: stage {i} mixes GPU types {sorted(kinds)}; TP and DP groups use one type")
            continue
        kind = kinds.pop()
        if types[i] is not None and str(types[i]).lower() != kind.lower():
            p.append(f"{where}.stages[{i}].gpu_type: {types[i]} but its ranks are {kind}")
        if cm.m.num_attention_heads % tp:
            p.append(f"{where}: tp={tp} does not divide num_attention_heads {cm.m.num_attention_heads}")
        for g in range(0, len(ranks), tp):
            if len({r // cm.gpn for r in ranks[g:g + tp]}) > 1:
                p.append(f"{where}: stage {i} TP group {ranks[g:g + tp]} spans nodes; TP stays inside a node")
                break
        chunks.append((kind, tp, [divmod(r, cm.gpn) for r in ranks]))
    fixed = _check_layers(cm, layers, where, p)
    return (chunks if len(chunks) == len(tps) else None), dp, fixed


def _check_layers(cm: CostModel, layers, where: str, p: list[str]) -> list[int] | None:
    """Layer counts per stage if every stage names its layers (and they tile the model), else None."""
    if any(l is None for l in layers):
        return None
    bad = [i for i, l in enumerate(layers) if not (isinstance(l, list) and len(l) == 2)]
    if bad:
        p.append(f"{where}.stages[{bad[0]}].layers: {layers[bad[0]]!r} must be [start, end]")
        return None
    grid = TrainerLayout(1, [Stage(None, 1, (a, b)) for a, b in layers])
    problems = grid.problems(cm.m.num_hidden_layers, where)
    p += problems
    return None if problems else [b - a for a, b in layers]


def _replicas(cm: CostModel, layout: dict, rest: list[int], p: list[str]):
    """Rollout replicas as (type, tp, ranks, share or None, max_running or None, long tail: False)."""
    if "rollout_replicas" in layout:
        out, seen = [], []
        for i, r in enumerate(layout["rollout_replicas"]):
            w = f"layout.rollout_replicas[{i}]"
            ranks = r.get("ranks") if isinstance(r, dict) else None
            if not isinstance(ranks, list) or not ranks:
                p.append(f"{w}.ranks: must be a non-empty list of ranks")
                continue
            tp = r.get("tp", len(ranks))
            if tp != len(ranks):
                p.append(f"{w}: tp={tp} but {len(ranks)} ranks")
            if len({x // cm.gpn for x in ranks}) > 1:
                p.append(f"{w}.ranks: {ranks} span nodes; a replica's TP stays inside a node")
            seen += ranks
            out.append((ranks, r.get("share"), r.get("max_running")))
        if sorted(seen) != rest:
            p.append(f"layout.rollout_replicas: replicas cover ranks {sorted(seen)} but the ranks "
                     f"left after training are {rest}")
            return None
    else:
        tp = layout.get("rollout_tp", 1)
        out = []
        for node in sorted({r // cm.gpn for r in rest}):
            mine = [r for r in rest if r // cm.gpn == node]
            if len(mine) % tp:
                p.append(f"layout.rollout_tp: node {cm.cluster.nodes[node].name} has {len(mine)} rollout "
                         f"GPUs, not a multiple of rollout_tp={tp}")
                return None
            out += [(mine[i:i + tp], None, None) for i in range(0, len(mine), tp)]
    reps = []
    for i, (ranks, share, max_running) in enumerate(out):
        kind, tp = _type(cm, ranks[0]), len(ranks)
        if cm.m.num_attention_heads % tp:
            p.append(f"rollout replica {i}: tp={tp} does not divide num_attention_heads {cm.m.num_attention_heads}")
        elif cm.max_decode_batch(kind, tp) < 1:
            p.append(f"rollout replica {i}: {tp} x {kind} cannot hold the weights plus the KV cache of "
                     f"one longest sequence ({cm.w.max_seq} tokens)")
        reps.append((kind, tp, ranks, share, max_running, False))
    return reps


def _train_plan(cm: CostModel, chunks, dp, layers, p: list[str]) -> TrainPlan | None:
    plan = cost_layout_fitting(cm, chunks, dp, layers)
    if plan is None:
        need = cm.train_memory_floor() / 1e9
        p.append(f"layout: the trainer's {sum(dp * tp for _, tp, _ in chunks)} GPUs cannot hold the model "
                 f"(needs at least {need:.1f} GB for weights, gradients and Adam, plus activations)")
    return plan


def _rollout_plan(cm: CostModel, reps, p: list[str]) -> RolloutPlan | None:
    """Makespan of fixed replicas at their largest (or given) batch; shares as given or by throughput."""
    if p:
        return None
    given = [s for _, _, _, s, _, _ in reps]
    if any(s is not None for s in given) and any(s is None for s in given):
        p.append("layout.rollout_replicas: give a share for every replica or for none")
        return None
    # running sequences per replica: KV memory, the given max_running, and the replica's part of
    # the (eta + 1) * B * G sequences the gate lets run at once (the dispatcher deals groups by
    # share; without shares, evenly; a replica of share 0 gets no work and keeps its knobs)
    parts = [float(s) / sum(map(float, given)) for s in given] if given[0] is not None else [1 / len(reps)] * len(reps)
    # (a long-tail replica keeps its cap: the plan chose it, and it holds whole groups)
    gate = [math.inf if cm.w.eta is None or f == 0 or long else math.ceil((cm.w.eta + 1) * cm.w.samples * f)
            for f, (*_, long) in zip(parts, reps)]
    # a plan whose replicas serve the long tail prices each for its class's lengths (cost_rollout.TailSplit)
    split = cm.tail is not None and any(long for *_, long in reps)
    costs = [cm.tail.of(long) if split else cm.rollout for *_, long in reps]
    pts = [cost.decode_point(k, tp, int(max(1, min(cm.max_decode_batch(k, tp), mb or math.inf, g))))
           for cost, (k, tp, _, _, mb, _), g in zip(costs, reps, gate)]
    # each replica loses its KV recompute R once per step and decodes at h otherwise
    h, R, tokens = [pt.tokens_per_s for pt in pts], [pt.recompute_s for pt in pts], cm.w.gen_tokens
    if given[0] is not None:
        total = sum(float(s) for s in given)
        shares = [float(s) / total for s in given]
        # a class's replicas generate its tokens: tokens per share of the step's groups
        per_share = [cost.w.gen_tokens / cm.tail.prompt_share(long) if split else tokens
                     for cost, (*_, long) in zip(costs, reps)]
        theta = max(s * t / hj + rj for s, t, hj, rj in zip(shares, per_share, h, R) if s > 0)
    else:  # shares by throughput: all used replicas finish together
        used = set(range(len(pts)))
        while True:
            theta = makespan(cm, [pts[j] for j in sorted(used)])
            late = {j for j in used if R[j] >= theta}
            if not late or late == used:
                break
            used -= late
        shares = [h[j] * (theta - R[j]) / tokens if j in used else 0.0 for j in range(len(pts))]
    replicas = [RolloutReplica(k, tp, pt.batch, ranks[0] // cm.gpn, [r % cm.gpn for r in ranks],
                               pt.tokens_per_s, s, long)
                for (k, tp, ranks, _, _, long), pt, s in zip(reps, pts, shares)]
    return RolloutPlan.placed(cm, replicas, theta)
