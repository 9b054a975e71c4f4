"""The planner: job -> plan. Checks feasibility, runs the two-phase search (or a baseline,
or fills in a user-fixed layout) and writes ranks, trainer grid, replicas and predictions."""

from hexrl.plan import baselines, fixed, partition, shared_gpu
from hexrl.plan.budget import affordable_subsets
from hexrl.plan.candidate import Candidate, Evaluator
from hexrl.plan.candidate_knobs import replica_knobs, train_knobs
from hexrl.plan.cost import CostModel
from hexrl.plan.cost_train import BYTES_PER_PARAM_TRAIN
from hexrl.plan.progress import quiet
from hexrl.schema import ConfigError, Job, Plan, RankInfo, Replica, Stage, TrainerLayout

METHODS = {
    "two-phase": partition.two_phase,
    "exhaustive": partition.exhaustive,
    "homogeneous": baselines.homogeneous,
    "uniform": baselines.uniform,
}


def feasibility_problems(cm: CostModel) -> list[str]:
    """What makes the job impossible on this cluster, each with what would fix it."""
    p = []
    c = cm.cluster
    if c.world_size < 2:
        p.append(f"cluster: {c.world_size} GPU; needs at least 2 (one trains, one generates); add GPUs")
    total = sum(cm.usable_bytes(n.gpu_type) * n.gpus for n in c.nodes)
    need = cm.train_memory_floor()
    if need > total:
        p.append(f"model: needs at least {_gb(need)} GB of GPU memory for training "
                 f"({cm.m.num_params / 1e9:.2f}B parameters x 18 bytes) but the whole cluster offers "
                 f"{_gb(total)} GB; add GPUs or use a smaller model")
    fits = [(t, tp) for t in c.types() for tp in cm.tp_options(t) if cm.max_decode_batch(t, tp) > 0]
    if not fits:
        weights = 2 * cm.m.num_params / 1e9
        kv = cm.m.kv_bytes_per_token() * cm.w.max_seq / 1e9
        best = max(cm.usable_bytes(t) * c.gpus_per_node for t in c.types()) / 1e9
        p.append(f"model: a rollout replica (TP inside one node) needs {weights:.1f} GB of weights plus "
                 f"{kv:.1f} GB of KV cache for one longest sequence ({cm.w.max_seq} tokens) but the "
                 f"largest node offers {best:.0f} GB; use nodes with more GPU memory, a smaller model "
                 f"or a smaller rl.max_new_tokens")
    return p


def memory_by_type(cm: CostModel) -> str:
    """What each GPU type offers against what training and a rollout replica need, in GB."""
    need = cm.train_memory_floor()
    parts = [f"training needs at least {_gb(need)} GB ({cm.m.num_params / 1e9:.2f}B parameters x "
             f"{BYTES_PER_PARAM_TRAIN} bytes) plus activations"]
    for t in cm.cluster.types():
        n, per_gpu = cm.cluster.count(t), cm.usable_bytes(t)
        fits = [tp for tp in cm.tp_options(t) if cm.max_decode_batch(t, tp) > 0]
        tp = fits[0] if fits else max(cm.tp_options(t))
        replica = 2 * cm.m.num_params / tp + cm.kv_bytes_per_token(tp) * cm.w.max_seq
        parts.append(f"{n} x {t} offer {_gb(n * per_gpu)} GB for training, {_gb(per_gpu)} GB per GPU where a "
                     f"rollout replica at TP {tp} needs {_gb(replica)} GB per GPU"
                     + ("" if fits else " (no TP fits)"))
    return "; ".join(parts)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g}" if nbytes < 10e9 else f"{nbytes / 1e9:,.0f}"


def search(cm: CostModel, method: str = "two-phase", progress=quiet) -> tuple[Candidate, dict]:
    """Best candidate by `method`; ConfigError says why none fits. progress: (phase, done, total)."""
    ev = Evaluator(cm, progress)
    best, log = METHODS[method](ev)
    if best is None:
        raise ConfigError([
            f"cluster: no split of the {cm.cluster.world_size} GPUs fits both a training layout and rollout "
            f"replicas on the other GPUs; {memory_by_type(cm)}; add GPUs, use GPUs with more memory, "
            f"or use a smaller model"], "infeasible job")
    info = {"method": method, "evaluations": log.evaluations, "wall_s": round(log.wall_s, 3)}
    return best, info


def plan_candidate(cm: CostModel, plan: Plan) -> Candidate:
    """The candidate a finished plan describes, to cost (or simulate) exactly this placement."""
    return shared_gpu.recost(cm, plan) if plan.job.colocate is not None else fixed.recost(cm, plan)


def plan_job(job: Job, method: str = "two-phase", use_profiles: bool = True, progress=quiet) -> Plan:
    """Plan a job: a fixed layout if the job has one, else the search `method` (progress: called
    with the search's phase and how far along it is, hexrl/plan/progress.py).

    Over budget, the best affordable subset of whole nodes is planned (see budget.py). A job with
    `colocate` puts both roles on its one GPU (hexrl/plan/shared_gpu.py).
    """
    if job.colocate is not None:
        if job.budget is not None and job.price_per_hour() > job.budget + 1e-9:
            raise ConfigError([f"budget: the one GPU costs ${job.price_per_hour():.2f}/h, over the budget "
                               f"${job.budget:.2f}/h; raise the budget"], "infeasible job")
        return colocated_plan(*shared_gpu.best_colocated(job, use_profiles))
    if job.budget is not None and job.price_per_hour() > job.budget + 1e-9:
        return _plan_within_budget(job, method, use_profiles, progress)
    return _plan(job, method, use_profiles, progress)


def _plan_within_budget(job: Job, method: str, use_profiles: bool, progress) -> Plan:
    over = (f"budget: the cluster costs ${job.price_per_hour():.2f}/h, over the budget "
            f"${job.budget:.2f}/h")
    if job.layout is not None:
        raise ConfigError([over + "; a fixed layout uses every node, so remove nodes or raise the budget"],
                          "infeasible job")
    best, problems = None, []
    for sub in affordable_subsets(job):
        try:
            plan = _plan(sub, method, use_profiles, progress)
        except ConfigError as e:
            problems = problems or e.problems
            continue
        if best is None or plan.predicted["tokens_per_s"] > best.predicted["tokens_per_s"]:
            best = plan
    if best is None:
        detail = f" (the largest affordable subset: {problems[0]})" if problems else ""
        raise ConfigError([over + f", and no affordable subset of whole nodes can run the job{detail}; "
                           "raise the budget or use cheaper GPUs"], "infeasible job")
    used = {n.name for n in best.job.cluster.nodes}
    best.predicted["unused_nodes"] = [n.name for n in job.cluster.nodes if n.name not in used]
    return best


def _plan(job: Job, method: str, use_profiles: bool, progress=quiet) -> Plan:
    cm = CostModel(job, use_profiles)
    problems = feasibility_problems(cm)
    if problems:
        raise ConfigError(problems, "infeasible job")
    if job.layout is not None:
        cand, info = fixed.fixed_candidate(cm, job.layout), {"method": "fixed layout"}
    else:
        cand, info = search(cm, method, progress)
    return materialize(cm, cand, info)


def materialize(cm: CostModel, cand: Candidate, info: dict) -> Plan:
    """Turn a candidate into a Plan: every global rank's role and coordinates, the runtime knobs
    the cost model assumed (hexrl.plan.candidate_knobs), plus predictions."""
    gpn = cm.gpn
    roles: dict[int, RankInfo] = {}
    stages = []
    pos = 0
    for s_i, s in enumerate(cand.train.stages):
        for i, (node, local) in enumerate(s.slots):
            rank = node * gpn + local
            roles[rank] = RankInfo(rank, node, local, s.gpu_type, "train", dp=i // s.tp, pp=s_i, tp=i % s.tp)
        stages.append(Stage(s.gpu_type, s.tp, (pos, pos + s.layers)))
        pos += s.layers
    replicas = []
    for r_i, r in enumerate(cand.rollout.replicas):
        ranks = [r.node * gpn + loc for loc in r.locals]
        for k, rank in enumerate(ranks):
            roles[rank] = RankInfo(rank, r.node, r.locals[k], r.gpu_type, "rollout", tp=k, replica=r_i)
        replicas.append(Replica(r_i, r.gpu_type, r.tp, ranks, round(r.share, 6),
                                replica_knobs(cm, r.gpu_type, r.tp, r.batch, r.long_tail), r.long_tail))
    _fix_shares(replicas)
    ranks = [roles[k] for k in sorted(roles)]
    trainer = TrainerLayout(cand.train.dp, stages)
    return Plan(cm.job, ranks, trainer, replicas, predictions(cm, cand, info), train_knobs(cm, cand.train))


def colocated_plan(cm: CostModel, cand: Candidate, job: Job) -> Plan:
    """Rank 0 trains, rank 1 runs the one replica, both on device 0 of the one node; `job`
    carries the memory split (its colocate section filled in)."""
    t, r = job.cluster.nodes[0].gpu_type, cand.rollout.replicas[0]
    ranks = [RankInfo(0, 0, 0, t, "train", dp=0, pp=0, tp=0, device=0),
             RankInfo(1, 0, 1, t, "rollout", tp=0, replica=0, device=0)]
    trainer = TrainerLayout(1, [Stage(t, 1, (0, cm.m.num_hidden_layers))])
    replicas = [Replica(0, t, 1, [1], 1.0, replica_knobs(cm, t, 1, r.batch))]
    pred = predictions(cm, cand, {"method": "colocated"})
    pred["colocate"] = {**job.colocate.to_dict(), "stretch": round(cand.stretch, 4),
                        "rollout_device_busy": round(cand.device_busy, 4)}
    return Plan(job, ranks, trainer, replicas, pred, train_knobs(cm, cand.train))


def _fix_shares(replicas: list[Replica]) -> None:
    """Rounded shares sum to exactly 1 (the largest absorbs the rounding)."""
    if replicas:
        big = max(replicas, key=lambda r: r.share)
        big.share = round(1.0 - sum(r.share for r in replicas if r is not big), 6)


def predictions(cm: CostModel, cand: Candidate, info: dict) -> dict:
    w, job = cm.w, cm.job
    price = job.price_per_hour()
    tokens_s = w.tokens / cand.step_s
    train_gpus: dict[str, int] = {}
    for s in cand.train.stages:
        train_gpus[s.gpu_type] = train_gpus.get(s.gpu_type, 0) + len(s.slots)
    roll_gpus: dict[str, int] = {}
    for r in cand.rollout.replicas:
        roll_gpus[r.gpu_type] = roll_gpus.get(r.gpu_type, 0) + r.tp
    out = {
        "step_time_s": round(cand.step_s, 4),
        "tokens_per_s": round(tokens_s, 2),
        "gen_tokens_per_s": round(w.gen_tokens / cand.step_s, 2),
        "cost_per_hour": round(price, 4),
        "tokens_per_dollar": round(tokens_s * 3600 / price, 2) if price > 0 else None,
        "C_T": round(cand.C_T, 4),
        "C_I": round(cand.C_I, 4),
        "breakdown": {
            "train_s": round(cand.C_T, 4), "rollout_s": round(cand.C_gen, 4),
            "makespan_s": round(cand.rollout.theta_s, 4), "reward_s": round(cand.C_reward, 4),
            "weight_sync_s": round(cand.C_sync, 4),
        },
        "train_gpus": train_gpus,
        "rollout_gpus": roll_gpus,
        "activation_recompute": cand.train.recompute,
        "rollout_capacity_tokens_per_s": round(cand.rollout.tokens_per_s, 2),
        "workload": {"samples_per_step": w.samples, "tokens_per_step": round(w.tokens),
                     "mean_output_len": round(w.mean_out, 2), "prompt_len": w.prompt_len},
        "host": cm.host.report(cand.step_s, len(cand.rollout.replicas)),
        "search": info,
    }
    if any(r.long_tail for r in cand.rollout.replicas):
        out["long_tail"] = long_tail_prediction(cm, cand)
    return out


def long_tail_prediction(cm: CostModel, cand: Candidate) -> dict:
    """The plan's length classes: groups and mean output length of each, and the long tail's replicas."""
    tail, long = cm.tail, [r for r in cand.rollout.replicas if r.long_tail]
    return {"alpha": cm.job.long_tail.alpha, "groups": tail.groups, "batch_size": cm.job.rl.batch_size,
            "long_mean_output_len": round(tail.long.w.mean_out, 2),
            "regular_mean_output_len": round(tail.regular.w.mean_out, 2),
            "replicas": len(long), "gpus": sum(r.tp for r in long),
            "max_running": sorted({r.batch for r in long})}
