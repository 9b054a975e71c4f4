"""The trainer's process groups: this rank's slot in the layout and the TP/DP/tied/pipeline groups it joins.

The layout itself (stages, TP degrees, layer ranges, slot ranks, pipeline peers) is
`hexrl.schema.TrainerLayout`, the same object the plan holds.

NCCL rules kept here (hexrl/runtime/dist_rules.py checks them under HEXRL_STRICT_COLLECTIVES=1): every
process of the job creates every group, in one fixed order, member or not; each DP replica's
pipeline has its own group, named on every p2p, so NCCL never builds the world's communicator
(which rollout ranks never join); the Trainer warms every group up with a collective, in
creation order, before any p2p; tensors live on the rank's compute device; no object collectives.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from hexrl.model.parallel import TPGroup
from hexrl.schema.layout import TrainerLayout


@dataclass
class Grid:
    """This rank's slot in the layout and the process groups it belongs to.

    Groups of size one are None (no communication). `trainer_group` spans every trainer rank
    (metrics, gradient norm, checkpoint agreement, HF export); `tied_group` spans the first and
    last stage of this DP replica when embeddings are tied and PP > 1; `pp_group` spans every
    slot of this DP replica when PP > 1 (its activations and gradients travel in it).
    """

    layout: TrainerLayout
    rank: int
    stage: int
    dp_rank: int
    tp_rank: int
    tp: TPGroup | None = None
    dp_group: object = None
    trainer_group: object = None
    tied_group: object = None
    pp_group: object = None
    groups: dict = field(default_factory=dict, repr=False)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.layout.pp - 1

    @property
    def tp_size(self) -> int:
        return self.layout.stages[self.stage].tp

    @property
    def layers(self) -> tuple[int, int]:
        return self.layout.stages[self.stage].layers

    @property
    def coord(self) -> tuple[int, int, int]:
        return self.stage, self.dp_rank, self.tp_rank

    @property
    def leader(self) -> int:
        """Global rank of slot (0, 0, 0): writes checkpoint metadata and HF exports."""
        return self.layout.rank(0, 0, 0)

    def act_source(self):
        return self.layout.act_source(*self.coord)

    def act_targets(self):
        return self.layout.act_targets(*self.coord)

    def grad_source(self):
        return self.layout.grad_source(*self.coord)

    def grad_targets(self):
        return self.layout.grad_targets(*self.coord)


def build_grid(layout: TrainerLayout, rank: int | None = None, tied_embeddings: bool = False,
               created: list | None = None) -> Grid | None:
    """Create every process group of the layout and return this rank's Grid (None if not in it).

    Collective: `dist.new_group` must be called by every process of the default group in the
    same order, so every process of the job (trainer or not) calls this with the same layout.
    Without an initialised process group the layout must be a single slot. `created`, if given,
    receives (name, ranks, group) of every group made (on every process), for effective_config.json.
    """
    if not dist.is_initialized():
        if layout.world_size != 1:
            raise RuntimeError(f"layout has {layout.world_size} slots but torch.distributed is not initialised")
        return Grid(layout, layout.rank(0, 0, 0), 0, 0, 0)
    rank = dist.get_rank() if rank is None else rank
    groups = {}

    def make(name, ranks):
        g = dist.new_group(sorted(ranks)) if len(ranks) > 1 else None  # every process calls new_group
        if g is not None and created is not None:
            created.append((f"{name}{sorted(ranks)}", sorted(ranks), g))
        if rank in ranks:
            groups[name] = g

    L = layout
    make("trainer", [L.rank(*c) for c in L.slots()])
    for s, st in enumerate(L.stages):
        for d in range(L.dp):
            make("tp", [L.rank(s, d, t) for t in range(st.tp)])
        for t in range(st.tp):
            make("dp", [L.rank(s, d, t) for d in range(L.dp)])
    if tied_embeddings and L.pp > 1:
        for d in range(L.dp):
            make("tied", [L.rank(s, d, t) for s in (0, L.pp - 1) for t in range(L.stages[s].tp)])
    if L.pp > 1:
        for d in range(L.dp):
            make("pp", [L.rank(s, d, t) for s, st in enumerate(L.stages) for t in range(st.tp)])
    coord = L.coord(rank)
    if coord is None:
        return None
    s, d, t = coord
    tp = TPGroup(groups["tp"], t, L.stages[s].tp) if L.stages[s].tp > 1 else None
    return Grid(L, rank, s, d, t, tp, groups["dp"], groups["trainer"], groups.get("tied"), groups.get("pp"), groups)
