"""The job's `colocate` section: one GPU runs both roles, a trainer rank and a rollout replica.

    "colocate": {"kv_fraction": 0.2, "train_fraction": 0.5, "rollout_fraction": 0.3}

For single-GPU machines (a workstation, a test box); the production layout stays one process
per GPU. The cluster must be one node with one GPU; `torchrun --nproc_per_node 2` then starts
rank 0 (the trainer) and rank 1 (the rollout replica), both on device 0. Every fraction is of
the device's memory, what `torch.cuda.set_per_process_memory_fraction` takes: the trainer's
allocator may hold `train_fraction`, the rollout's `rollout_fraction` (its weights, its KV pool
of `kv_fraction` and its scratch). A job may give any of them (or `"colocate": {}`); the planner
fills in the rest (hexrl/plan/shared_gpu.py) and plan.json holds all three.
"""

from dataclasses import dataclass

from hexrl.schema.fields import Reader

FRACTIONS = ("kv_fraction", "train_fraction", "rollout_fraction")
RANKS_PER_DEVICE = 2  # one trainer rank and one rollout replica (TP 1) per shared device


@dataclass
class Colocate:
    kv_fraction: float | None = None  # the rollout replica's KV pool
    train_fraction: float | None = None  # the trainer's allocator cap
    rollout_fraction: float | None = None  # the rollout's allocator cap (weights + KV pool + scratch)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in FRACTIONS if getattr(self, k) is not None}

    @property
    def complete(self) -> bool:
        return all(getattr(self, k) is not None for k in FRACTIONS)


def read_colocate(r: Reader, d) -> Colocate | None:
    """Parse `colocate` (None if absent; `true` or `{}` lets the planner choose every fraction)."""
    if d is None or d is False:
        return None
    if d is True:
        return Colocate()
    d = r.section(d, "colocate", set(FRACTIONS))
    c = Colocate(**{k: r.num(d, k, "colocate", None, lo=0, lo_open=True, hi=1) for k in FRACTIONS})
    r.problems += fraction_problems(c)
    return c


def fraction_problems(c: Colocate) -> list[str]:
    """The fractions must fit one device: the two allocators' caps sum to at most 1, and the KV
    pool lies inside the rollout's share."""
    p = []
    if c.train_fraction is not None and c.rollout_fraction is not None and c.train_fraction + c.rollout_fraction > 1:
        p.append(f"colocate.train_fraction, colocate.rollout_fraction: {c.train_fraction:g} + "
                 f"{c.rollout_fraction:g} = {c.train_fraction + c.rollout_fraction:g} of the device's memory, "
                 "more than the device holds (must sum to at most 1)")
    if c.kv_fraction is not None and c.train_fraction is not None and c.kv_fraction + c.train_fraction > 1:
        p.append(f"colocate.kv_fraction, colocate.train_fraction: {c.kv_fraction:g} + {c.train_fraction:g} "
                 f"= {c.kv_fraction + c.train_fraction:g} of the device's memory, more than the device holds "
                 "(must sum to at most 1, with room left for the rollout's weights)")
    if c.kv_fraction is not None and c.rollout_fraction is not None and c.kv_fraction >= c.rollout_fraction:
        p.append(f"colocate.kv_fraction: {c.kv_fraction:g} must be below colocate.rollout_fraction "
                 f"{c.rollout_fraction:g} (the KV pool lies inside the rollout's share, beside its weights)")
    return p


def cluster_problems(c: Colocate, nodes) -> list[str]:
    """Colocation is for one GPU: a cluster of one node with one GPU."""
    if len(nodes) == 1 and nodes[0].gpus == 1:
        return []
    gpus = sum(n.gpus for n in nodes)
    return [f"colocate: shares one GPU between the trainer and a rollout replica, but cluster.nodes has "
            f"{len(nodes)} node(s) with {gpus} GPUs; give one node with gpus: 1, or drop colocate "
            "(with 2 or more GPUs each role gets its own)"]
