"""The plan schema: a job plus a role for every global rank, the trainer layout, the rollout replicas.

`load_plan` reads and checks plan.json (and, under torchrun, that it fits the world it runs
in) and reports every problem at once, before any process group is created.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from hexrl.gpus import CATALOGUE, canonical_name
from hexrl.ranges import MAX_RANKS
from hexrl.schema.colocate import FRACTIONS, RANKS_PER_DEVICE, fraction_problems
from hexrl.schema.fields import ConfigError, Reader, plural, short
from hexrl.schema.job import Job, known_types, parse_job, read_source
from hexrl.schema.knobs import ROLLOUT_KEYS, TRAIN_KEYS, RolloutKnobs, TrainKnobs, read_rollout_knobs, read_train_knobs
from hexrl.schema.layout import Stage, TrainerLayout

_PLAN_KEYS = {"ranks", "trainer", "rollout", "predicted"}


ROLES = ("train", "rollout")


@dataclass
class RankInfo:
    rank: int
    node: int
    local_rank: int
    gpu_type: str
    role: str  # train | rollout
    dp: int | None = None
    pp: int | None = None
    tp: int | None = None
    replica: int | None = None
    device: int | None = None  # the node's GPU this rank computes on; None: its local_rank (one GPU each)

    @property
    def device_index(self) -> int:
        return self.local_rank if self.device is None else self.device

    def to_dict(self) -> dict:
        keys = ("dp", "pp", "tp") if self.role == "train" else ("replica", "tp")
        d = {k: getattr(self, k) for k in ("rank", "node", "local_rank", "gpu_type", "role")}
        d.update({k: getattr(self, k) for k in keys})
        if self.device is not None:
            d["device"] = self.device
        return d


@dataclass
class Replica:
    id: int
    gpu_type: str
    tp: int
    ranks: list[int]  # ranks[i] holds TP shard i; ranks[0] leads
    share: float  # fraction of prompts this replica should receive
    knobs: RolloutKnobs = field(default_factory=RolloutKnobs)  # the engine's settings, as the planner costed them
    long_tail: bool = False  # serves the groups predicted longest (the job's long_tail section); else the rest

    def to_dict(self) -> dict:
        return {"id": self.id, "gpu_type": self.gpu_type, "tp": self.tp, "ranks": list(self.ranks),
                "share": self.share, **self.knobs.to_dict(), **({"long_tail": True} if self.long_tail else {})}


def default_dtype(gpu_types) -> str:
    """Compute dtype on these devices: float32 on the CPU stand-in, else bfloat16."""
    return "float32" if all(t == "cpu" for t in gpu_types) else "bfloat16"


@dataclass
class Plan:
    job: Job
    ranks: list[RankInfo]
    trainer: TrainerLayout
    replicas: list[Replica]
    predicted: dict = field(default_factory=dict)
    train_knobs: TrainKnobs = field(default_factory=TrainKnobs)  # the trainer's settings, as costed

    def __post_init__(self):
        # the rank table places every trainer slot; give the layout those ranks (if it covers the grid)
        slot = {(x.pp, x.dp, x.tp): x.rank for x in self.ranks if x.role == "train"}
        if all(c in slot for c in self.trainer.slots()):
            self.trainer.ranks = [slot[c] for c in self.trainer.slots()]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def gpus_per_node(self) -> int:
        return self.job.cluster.gpus_per_node

    @property
    def ranks_per_node(self) -> int:
        """torchrun's --nproc_per_node: GPUs per node, or both roles' ranks on a shared GPU."""
        return self.job.ranks_per_node

    def device_ranks(self) -> dict[tuple[int, int], list[int]]:
        """(node, device) -> the global ranks computing on it (two where the roles share a GPU)."""
        out: dict[tuple[int, int], list[int]] = {}
        for x in self.ranks:
            out.setdefault((x.node, x.device_index), []).append(x.rank)
        return out

    def train_ranks(self) -> list[int]:
        return [x.rank for x in self.ranks if x.role == "train"]

    def rollout_ranks(self) -> list[int]:
        return [x.rank for x in self.ranks if x.role == "rollout"]

    def to_dict(self) -> dict:
        d = self.job.to_dict()
        d["ranks"] = [x.to_dict() for x in self.ranks]
        d["trainer"] = {**self.trainer.to_dict(), **self.train_knobs.to_dict()}
        d["rollout"] = {"replicas": [x.to_dict() for x in self.replicas]}
        d["predicted"] = self.predicted
        return d

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def _read_ranks(r: Reader, raw) -> list[RankInfo]:
    if not isinstance(raw, list) or not raw or len(raw) > MAX_RANKS:
        r.bad("ranks", f"must be a non-empty list with one object per global rank (at most {MAX_RANKS:,})")
        return []
    out, seen = [], {}
    for i, x in enumerate(raw):
        w = f"ranks[{i}]"
        x = r.section(x, w, {"rank", "node", "local_rank", "gpu_type", "role", "dp", "pp", "tp", "replica", "device"})
        if not x:
            continue
        ints = {k: r.num(x, k, w, None, integer=True, lo=0, hi=MAX_RANKS,
                         required=k in ("rank", "node", "local_rank", "tp"))
                for k in ("rank", "node", "local_rank", "dp", "pp", "tp", "replica", "device")}
        if ints["rank"] in seen:
            r.bad(f"{w}.rank", f"rank {ints['rank']} listed twice (also ranks[{seen[ints['rank']]}])")
            continue
        seen.setdefault(ints["rank"], i)
        role = x.get("role")
        if role not in ROLES:
            r.bad(f"{w}.role", f"unknown role {role!r} (known: {', '.join(ROLES)})")
            continue
        need = ("dp", "pp") if role == "train" else ("replica",)
        for k in need:
            if ints[k] is None and k not in x:
                r.bad(f"{w}.{k}", f"missing (required for role {role!r})")
        gt = canonical_name(x.get("gpu_type"))
        if gt is None:
            r.bad(f"{w}.gpu_type", f"unknown GPU type {x.get('gpu_type')!r} (known: {known_types()})")
        if None in (ints["rank"], ints["node"], ints["local_rank"], ints["tp"], gt) or \
                any(ints[k] is None for k in need):
            continue
        out.append(RankInfo(ints["rank"], ints["node"], ints["local_rank"], gt, role,
                            ints["dp"] if role == "train" else None, ints["pp"] if role == "train" else None,
                            ints["tp"], ints["replica"] if role == "rollout" else None, ints["device"]))
    return out


def _read_trainer(r: Reader, raw, max_seq: int) -> tuple[TrainerLayout | None, TrainKnobs]:
    t = r.section(raw, "trainer", {"dp", "stages"} | TRAIN_KEYS, required=True)
    dp = r.num(t, "dp", "trainer", None, integer=True, lo=1, hi=MAX_RANKS, required=bool(t))
    stages = []
    raw_stages = t.get("stages")
    if t and (not isinstance(raw_stages, list) or not raw_stages):
        r.bad("trainer.stages", "must be a non-empty list of {gpu_type, tp, layers}")
        raw_stages = []
    for i, s in enumerate(raw_stages or []):
        w = f"trainer.stages[{i}]"
        s = r.section(s, w, {"gpu_type", "tp", "layers"})
        gt = canonical_name(s.get("gpu_type"))
        if gt is None:
            r.bad(f"{w}.gpu_type", f"unknown GPU type {s.get('gpu_type')!r} (known: {known_types()})")
        tp = r.num(s, "tp", w, None, integer=True, lo=1, hi=MAX_RANKS, required=True)
        lay = s.get("layers")
        if not (isinstance(lay, list) and len(lay) == 2 and all(isinstance(v, int) for v in lay)):
            r.bad(f"{w}.layers", f"must be [start, end] integers, got {lay!r}")
            lay = None
        if gt and tp and lay:
            stages.append(Stage(gt, tp, (lay[0], lay[1])))
    base = TrainKnobs(micro_batch_tokens=max_seq, dtype=default_dtype([s.gpu_type for s in stages]))
    knobs = read_train_knobs(r, t, "trainer", base)
    if dp is None or len(stages) != len(raw_stages or []):
        return None, knobs
    if dp * sum(s.tp for s in stages) > MAX_RANKS:  # before anything enumerates the grid
        r.bad("trainer", f"dp {dp} x stage tp {[s.tp for s in stages][:8]} = {dp * sum(s.tp for s in stages):,} "
              f"ranks; at most {MAX_RANKS:,}")
        return None, knobs
    return TrainerLayout(dp, stages), knobs


def _read_replicas(r: Reader, raw) -> list[Replica]:
    roll = r.section(raw, "rollout", {"replicas"}, required=True)
    reps = roll.get("replicas")
    if roll and not isinstance(reps, list):
        r.bad("rollout.replicas", "must be a list of {id, gpu_type, tp, ranks, share}")
        return []
    out = []
    for i, x in enumerate(reps or []):
        w = f"rollout.replicas[{i}]"
        x = r.section(x, w, {"id", "gpu_type", "tp", "ranks", "share", "long_tail"} | ROLLOUT_KEYS)
        rid = r.num(x, "id", w, None, integer=True, lo=0, hi=MAX_RANKS, required=True)
        tp = r.num(x, "tp", w, None, integer=True, lo=1, hi=MAX_RANKS, required=True)
        share = r.num(x, "share", w, None, lo=0, hi=1, required=True)
        gt = canonical_name(x.get("gpu_type"))
        if gt is None:
            r.bad(f"{w}.gpu_type", f"unknown GPU type {x.get('gpu_type')!r} (known: {known_types()})")
        ranks = x.get("ranks")
        if not (isinstance(ranks, list) and ranks and all(isinstance(v, int) for v in ranks)):
            r.bad(f"{w}.ranks", f"must be a non-empty list of global ranks, got {ranks!r}")
            ranks = None
        knobs = read_rollout_knobs(r, x, w, RolloutKnobs(dtype=default_dtype([gt])))
        tail = r.boolean(x, "long_tail", w, False)
        if None not in (rid, tp, share, gt, ranks):
            out.append(Replica(rid, gt, tp, ranks, float(share), knobs, tail))
    return out


def check_plan(plan: Plan) -> list[str]:
    """Every inconsistency between a plan's ranks, trainer grid, replicas and cluster."""
    p: list[str] = []
    _check_rank_table(plan, p)
    _check_trainer(plan, p, plan.job.model.config.num_hidden_layers)
    _check_replicas(plan, p)
    p += shared_device_problems(plan)
    if not plan.train_ranks():
        p.append("ranks: no rank has role 'train'")
    if not plan.rollout_ranks():
        p.append("ranks: no rank has role 'rollout'")
    return p


def _check_rank_table(plan: Plan, p: list[str]):
    c, per = plan.job.cluster, plan.ranks_per_node
    n = per * len(c.nodes)
    what = f"{n} ranks: {len(c.nodes)} node(s) x {per}" if per != c.gpus_per_node else f"cluster has {n} GPUs"
    seen: dict[int, int] = {}  # duplicates were reported while reading the ranks
    for i, x in enumerate(plan.ranks):
        seen[x.rank] = i
        if not 0 <= x.rank < n:
            p.append(f"ranks[{i}].rank: {x.rank} outside 0..{n - 1} ({what})")
            continue
        node, local = divmod(x.rank, per)
        if (x.node, x.local_rank) != (node, local):
            p.append(f"ranks[{i}]: rank {x.rank} must be node {node} local_rank {local} "
                     f"(rank = node * {per} + local_rank), got node {x.node} local_rank {x.local_rank}")
        elif x.gpu_type != c.nodes[node].gpu_type:
            p.append(f"ranks[{i}].gpu_type: {x.gpu_type} but node {c.nodes[node].name} has {c.nodes[node].gpu_type}")
        elif not 0 <= x.device_index < c.gpus_per_node:
            p.append(f"ranks[{i}].device: {x.device_index} but node {c.nodes[node].name} has GPUs "
                     f"0..{c.gpus_per_node - 1}")
    missing = sorted(set(range(n)) - set(seen))
    if missing:
        p.append(f"ranks: missing global ranks {short(missing)} ({what})")


def shared_device_problems(plan: Plan) -> list[str]:
    """Ranks that share a GPU: only under `colocate`, at most one trainer rank and one rollout
    replica of TP 1 per device, and their memory fractions fitting the device."""
    p, col = [], plan.job.colocate
    index = {x.rank: i for i, x in enumerate(plan.ranks)}
    for (node, dev), ranks in sorted(plan.device_ranks().items()):
        if len(ranks) < 2:
            continue
        where = f"ranks[{index[ranks[-1]]}].device"
        nodes = plan.job.cluster.nodes
        here = f"device {dev} of node {nodes[node].name if node < len(nodes) else node}"
        if col is None:
            p.append(f"{where}: ranks {ranks} share {here}; ranks share a GPU only under the job's colocate "
                     "section (one rank per GPU otherwise)")
        elif len(ranks) > RANKS_PER_DEVICE:
            p.append(f"{where}: {len(ranks)} ranks {ranks} on {here}, more than a shared device holds "
                     f"({RANKS_PER_DEVICE}: one trainer rank and one rollout replica)")
        elif sorted(plan.ranks[index[r]].role for r in ranks) != ["rollout", "train"]:
            p.append(f"{where}: ranks {ranks} on {here} must be one trainer rank and one rollout rank")
    if col is not None:
        p += [f"colocate.{k}: missing; plan the job (python -m hexrl.plan) to fill it in"
              for k in FRACTIONS if getattr(col, k) is None]
        p += fraction_problems(col)
        p += [f"rollout.replicas[{i}].tp: {r.tp} on a shared GPU; a colocated replica has TP 1"
              for i, r in enumerate(plan.replicas) if r.tp != 1]
        if col.kv_fraction is not None:
            p += _kv_pool_problems(plan, col.kv_fraction)
    return p


def _kv_pool_problems(plan: Plan, kv_fraction: float) -> list[str]:
    """A colocated replica's KV pool (kv_pages) must fit in kv_fraction of its device."""
    cfg, p = plan.job.model.config, []
    for i, r in enumerate(plan.replicas):
        if r.knobs.kv_pages is None:
            p.append(f"rollout.replicas[{i}].kv_pages: must be set on a shared GPU (the engine would size its "
                     "KV pool from the free memory, which the trainer needs); plan the job again")
        if r.knobs.kv_pages is None or r.gpu_type not in CATALOGUE:
            continue
        elem = 4 if r.knobs.dtype == "float32" else 2
        page = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * r.knobs.page_size * elem
        room = kv_fraction * CATALOGUE[r.gpu_type].hbm_bytes
        if r.knobs.kv_pages * page > room:
            p.append(f"rollout.replicas[{i}].kv_pages: {r.knobs.kv_pages} pages take "
                     f"{r.knobs.kv_pages * page / 1e9:.3g} GB, more than colocate.kv_fraction {kv_fraction:g} of "
                     f"the {r.gpu_type}'s memory ({room / 1e9:.3g} GB)")
    return p


def _check_trainer(plan: Plan, p: list[str], L: int):
    t = plan.trainer
    p += t.problems(L, "trainer")
    heads = plan.job.model.config.num_attention_heads
    for s_i, s in enumerate(t.stages):
        if heads % s.tp:
            p.append(f"trainer.stages[{s_i}].tp: {s.tp} does not divide num_attention_heads {heads}")
    grid: dict[tuple, int] = {}
    for x in plan.ranks:
        if x.role != "train":
            continue
        key = (x.dp, x.pp, x.tp)
        if key in grid:
            p.append(f"ranks: ranks {grid[key]} and {x.rank} both at trainer dp={x.dp} pp={x.pp} tp={x.tp}")
        grid[key] = x.rank
        if not (x.pp < len(t.stages) and x.dp < t.dp and x.tp < t.stages[x.pp].tp):
            p.append(f"ranks: rank {x.rank} at dp={x.dp} pp={x.pp} tp={x.tp} is outside the trainer grid")
        elif x.gpu_type != t.stages[x.pp].gpu_type:
            p.append(f"ranks: rank {x.rank} is {x.gpu_type} but trainer stage {x.pp} is {t.stages[x.pp].gpu_type}")
    want = {(d, s_i, k) for s_i, s in enumerate(t.stages) for d in range(t.dp) for k in range(s.tp)}
    holes = sorted(want - set(grid))
    if holes:
        p.append(f"trainer: no rank at grid positions (dp, pp, tp) {short(holes)}")


def _check_replicas(plan: Plan, p: list[str]):
    by_rank = {x.rank: x for x in plan.ranks}
    ids = [r.id for r in plan.replicas]
    for rid in sorted({i for i in ids if ids.count(i) > 1}):
        p.append(f"rollout.replicas: id {rid} used more than once")
    covered = set()
    for i, rep in enumerate(plan.replicas):
        w = f"rollout.replicas[{i}]"
        if len(rep.ranks) != rep.tp:
            p.append(f"{w}.ranks: {len(rep.ranks)} ranks for tp={rep.tp}")
        if plan.job.model.config.num_attention_heads % rep.tp:
            heads = plan.job.model.config.num_attention_heads
            p.append(f"{w}.tp: {rep.tp} does not divide num_attention_heads {heads}")
        for k, rk in enumerate(rep.ranks):
            x = by_rank.get(rk)
            if rk in covered:
                p.append(f"{w}.ranks: rank {rk} belongs to two replicas")
            covered.add(rk)
            if x is None:
                p.append(f"{w}.ranks: rank {rk} not in ranks")
            elif (x.role, x.replica, x.tp, x.gpu_type) != ("rollout", rep.id, k, rep.gpu_type):
                p.append(f"{w}.ranks: rank {rk} must be role 'rollout', replica {rep.id}, tp {k}, "
                         f"{rep.gpu_type}; ranks says role {x.role!r}, replica {x.replica}, tp {x.tp}, {x.gpu_type}")
    orphans = sorted(x.rank for x in plan.ranks if x.role == "rollout" and x.rank not in covered)
    if orphans:
        p.append(f"ranks: rollout ranks {short(orphans)} belong to no replica")
    dtypes = sorted({r.knobs.dtype for r in plan.replicas})
    if len(dtypes) > 1:  # one weight broadcast reaches every replica
        p.append(f"rollout.replicas: dtype differs between replicas ({', '.join(dtypes)}); use one")
    total = sum(r.share for r in plan.replicas)
    if plan.replicas and abs(total - 1.0) > 1e-3:
        p.append(f"rollout.replicas: shares sum to {total:.4f}, must sum to 1")


def load_plan(path_or_dict, check_paths: bool = True, world: tuple[int, int] | None = None) -> Plan:
    """Read and validate a plan (job fields + ranks, trainer, rollout, predicted); ConfigError lists all problems.

    world: (WORLD_SIZE, LOCAL_WORLD_SIZE) of the torchrun job, checked in the same pass."""
    d, base = read_source(path_or_dict, "plan")
    r = Reader()
    job = parse_job(r, {k: v for k, v in d.items() if k not in _PLAN_KEYS}, base, check_paths)
    ranks = _read_ranks(r, d.get("ranks"))
    max_seq = job.workload.prompt_len + job.rl.max_new_tokens if job is not None else 4096
    trainer, train_knobs = _read_trainer(r, d.get("trainer"), max_seq)
    replicas = _read_replicas(r, d.get("rollout"))
    predicted = d.get("predicted", {})
    if not isinstance(predicted, dict):
        r.bad("predicted", "must be an object")
        predicted = {}
    n_ranks = len(d["ranks"]) if isinstance(d.get("ranks"), list) else 0
    problems = list(r.problems)
    if world is not None and job is not None:
        problems += _world_problems(n_ranks, job, *world)
    if job is not None and trainer is not None:  # also with bad rank entries: report the rest too
        plan = Plan(job, ranks, trainer, replicas, predicted, train_knobs)
        problems += check_plan(plan)
    if problems or job is None or trainer is None:
        raise ConfigError(problems or ["trainer: missing"], "invalid plan")
    return plan


def _world_problems(n_ranks: int, job: Job, world_size: int, local_world_size: int) -> list[str]:
    p, c, per = [], job.cluster, job.ranks_per_node
    runs = f"{c.gpus_per_node} GPUs" if per == c.gpus_per_node else f"{per} ranks on {c.gpus_per_node} shared GPU"
    if world_size != n_ranks:
        p.append(f"WORLD_SIZE={world_size} but the plan has {n_ranks} ranks "
                 f"({plural(len(c.nodes), 'node')} x {per}); launch with "
                 f"torchrun --nnodes {len(c.nodes)} --nproc_per_node {per}")
    if local_world_size != per:
        p.append(f"LOCAL_WORLD_SIZE={local_world_size} but every plan node runs {runs}; "
                 f"launch with --nproc_per_node {per}")
    return p


def validate_plan_against_world(plan: Plan, world_size: int, local_world_size: int) -> None:
    """Check the plan fits the torchrun world this process lives in; ConfigError lists every problem."""
    p = check_plan(plan) + _world_problems(plan.world_size, plan.job, world_size, local_world_size)
    if p:
        raise ConfigError(p, "plan does not match this torchrun world")
