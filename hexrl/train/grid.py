"""The trainer's process grid: DP x PP x TP with per-stage TP degrees and layer ranges.

A layout is `{"dp": D, "stages": [{"tp": 2, "layers": [0, 3]}, {"tp": 1, "layers": [3, 4]}]}`
(extra stage keys such as `gpu_type` are ignored), optionally with `"ranks"`: the global rank
of every grid slot in stage-major, then dp, then tp order. Without it the slots take ranks
0, 1, ... in that order.

Pipeline peers with mixed TP degrees: the activations leaving a stage are replicated across
its TP group (row-parallel layers all-reduce), and so are the gradients of a stage's input.
Any one rank's copy suffices, so each receiver reads from one mapped peer: next-stage TP rank
t' receives activations from previous-stage TP rank `t' % tp_prev`, and previous-stage TP
rank t receives gradients from next-stage TP rank `t % tp_next`. Senders serve every
receiver mapped to them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from hexrl.model.parallel import TPGroup


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: its TP degree and decoder layers [start, end)."""

    tp: int
    layers: tuple[int, int]


@dataclass
class Layout:
    """Shape of the trainer grid and the global rank of each slot."""

    dp: int
    stages: list[StageSpec]
    ranks: list[int] | None = None  # explicit global ranks, stage-major then dp then tp

    @classmethod
    def from_dict(cls, d: dict, num_layers: int | None = None) -> "Layout":
        """Parse and validate a layout dict; ValueError lists every problem."""
        problems = []
        dp = d.get("dp") if isinstance(d, dict) else None
        if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
            problems.append(f"layout.dp: must be an integer >= 1, got {dp!r}")
        stages = []
        raw = d.get("stages") if isinstance(d, dict) else None
        if not isinstance(raw, list) or not raw:
            problems.append("layout.stages: must be a non-empty list of {tp, layers: [start, end]}")
            raw = []
        for i, s in enumerate(raw):
            tp, lay = (s.get("tp"), s.get("layers")) if isinstance(s, dict) else (None, None)
            if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
                problems.append(f"layout.stages[{i}].tp: must be an integer >= 1, got {tp!r}")
            if not (isinstance(lay, (list, tuple)) and len(lay) == 2 and all(isinstance(v, int) for v in lay)):
                problems.append(f"layout.stages[{i}].layers: must be [start, end] integers, got {lay!r}")
                lay = None
            stages.append(StageSpec(tp if isinstance(tp, int) else 1, tuple(lay) if lay else (0, 0)))
        layout = cls(dp if isinstance(dp, int) else 1, stages, d.get("ranks") if isinstance(d, dict) else None)
        if not problems:
            problems = layout.problems(num_layers)
        if problems:
            raise ValueError("invalid trainer layout:\n  " + "\n  ".join(problems))
        return layout

    def to_dict(self) -> dict:
        d = {"dp": self.dp, "stages": [{"tp": s.tp, "layers": list(s.layers)} for s in self.stages]}
        if self.ranks is not None:
            d["ranks"] = list(self.ranks)
        return d

    def problems(self, num_layers: int | None = None) -> list[str]:
        """Every inconsistency: layer ranges must tile [0, num_layers) in order, ranks be distinct."""
        out, expect = [], 0
        for i, s in enumerate(self.stages):
            start, end = s.layers
            if start != expect or end <= start:
                out.append(f"layout.stages[{i}].layers: [{start}, {end}) must start at {expect} and be non-empty")
            expect = end
        if num_layers is not None and expect != num_layers:
            out.append(f"layout.stages: layers end at {expect} but the model has {num_layers} layers")
        if self.ranks is not None:
            if not isinstance(self.ranks, list) or not all(isinstance(r, int) and r >= 0 for r in self.ranks):
                out.append("layout.ranks: must be a list of global ranks (integers >= 0)")
            elif len(self.ranks) != self.world_size:
                out.append(f"layout.ranks: {len(self.ranks)} ranks given, the grid has {self.world_size} slots")
            elif len(set(self.ranks)) != len(self.ranks):
                out.append("layout.ranks: a global rank appears twice")
        return out

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def world_size(self) -> int:
        return self.dp * sum(s.tp for s in self.stages)

    def slots(self) -> list[tuple[int, int, int]]:
        """All (stage, dp, tp) coordinates in rank order."""
        return [(s, d, t) for s, st in enumerate(self.stages) for d in range(self.dp) for t in range(st.tp)]

    def rank(self, stage: int, dp: int, tp: int) -> int:
        """Global rank of grid slot (stage, dp, tp)."""
        i = sum(self.dp * s.tp for s in self.stages[:stage]) + dp * self.stages[stage].tp + tp
        return self.ranks[i] if self.ranks is not None else i

    def coord(self, rank: int) -> tuple[int, int, int] | None:
        """(stage, dp, tp) of a global rank, or None if the rank is not in the grid."""
        for c in self.slots():
            if self.rank(*c) == rank:
                return c
        return None

    # Pipeline peers (see the module docstring for the mapping).
    def act_source(self, stage: int, dp: int, tp: int) -> int | None:
        """The rank this slot receives its input activations from (None on the first stage)."""
        return None if stage == 0 else self.rank(stage - 1, dp, tp % self.stages[stage - 1].tp)

    def act_targets(self, stage: int, dp: int, tp: int) -> list[int]:
        """The ranks this slot sends its output activations to."""
        if stage == self.pp - 1:
            return []
        return [self.rank(stage + 1, dp, t) for t in range(self.stages[stage + 1].tp) if t % self.stages[stage].tp == tp]

    def grad_source(self, stage: int, dp: int, tp: int) -> int | None:
        """The rank this slot receives the gradient of its output from (None on the last stage)."""
        return None if stage == self.pp - 1 else self.rank(stage + 1, dp, tp % self.stages[stage + 1].tp)

    def grad_targets(self, stage: int, dp: int, tp: int) -> list[int]:
        """The ranks this slot sends the gradient of its input to."""
        if stage == 0:
            return []
        return [self.rank(stage - 1, dp, t) for t in range(self.stages[stage - 1].tp) if t % self.stages[stage].tp == tp]


@dataclass
class Grid:
    """This rank's slot in the layout and the process groups it belongs to.

    Groups of size one are None (no communication). `trainer_group` spans every trainer rank
    (metrics, gradient norm, checkpoint agreement); `tied_group` spans the first and last
    stage of this DP replica when embeddings are tied and PP > 1.
    """

    layout: Layout
    rank: int
    stage: int
    dp_rank: int
    tp_rank: int
    tp: TPGroup | None = None
    dp_group: object = None
    trainer_group: object = None
    tied_group: object = None
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


def build_grid(layout: Layout, rank: int | None = None, tied_embeddings: bool = False) -> Grid | None:
    """Create every process group of the layout and return this rank's Grid (None if not in it).

    Collective: `dist.new_group` must be called by every process of the default group in the
    same order, so every process of the job (trainer or not) calls this with the same layout.
    Without an initialised process group the layout must be a single slot.
    """
    if not dist.is_initialized():
        if layout.world_size != 1:
            raise RuntimeError(f"layout has {layout.world_size} slots but torch.distributed is not initialised")
        return Grid(layout, layout.rank(0, 0, 0), 0, 0, 0)
    rank = dist.get_rank() if rank is None else rank
    groups = {}

    def make(name, ranks):
        g = dist.new_group(sorted(ranks)) if len(ranks) > 1 else None  # every process calls new_group
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
    coord = L.coord(rank)
    if coord is None:
        return None
    s, d, t = coord
    tp = TPGroup(groups["tp"], t, L.stages[s].tp) if L.stages[s].tp > 1 else None
    return Grid(L, rank, s, d, t, tp, groups["dp"], groups["trainer"], groups.get("tied"), groups)
