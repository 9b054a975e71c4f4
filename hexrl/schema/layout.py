"""The trainer layout: a DP x PP x TP grid whose stages may differ in GPU type, TP degree and layers.

This is the one description of the trainer grid: the plan stores it, the planner's simulator
costs it, and `hexrl.train.grid` builds process groups from it. Grid slots are addressed as
(stage, dp, tp), always in that order, and stored stage-major, then dp, then tp.

Pipeline peers with mixed TP degrees: the activations leaving a stage are replicated across
its TP group (row-parallel layers all-reduce), and so are the gradients of a stage's input.
Any one rank's copy suffices, so each receiver reads from one mapped peer: next-stage TP rank
t' receives activations from previous-stage TP rank `t' % tp_prev`, and previous-stage TP
rank t receives gradients from next-stage TP rank `t % tp_next`. Senders serve every
receiver mapped to them.
"""

from dataclasses import dataclass

from hexrl.ranges import MAX_RANKS, number_problem


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its GPU type, TP degree and decoder layers [start, end)."""

    gpu_type: str | None
    tp: int
    layers: tuple[int, int]

    def to_dict(self) -> dict:
        d = {"tp": self.tp, "layers": list(self.layers)}
        return {"gpu_type": self.gpu_type, **d} if self.gpu_type else d


@dataclass
class TrainerLayout:
    """The trainer grid and, once placed, the global rank of every slot."""

    dp: int
    stages: list[Stage]
    ranks: list[int] | None = None  # global ranks, stage-major then dp then tp; None: 0, 1, ...

    @classmethod
    def from_dict(cls, d: dict, num_layers: int | None = None) -> "TrainerLayout":
        """`{"dp": D, "stages": [{"tp", "layers", "gpu_type"?}], "ranks"?: [...]}`; ValueError lists every problem."""
        problems = []
        dp = d.get("dp") if isinstance(d, dict) else None
        if not _positive_int(dp):
            problems.append(f"layout.dp: must be an integer >= 1, got {dp!r}")
        raw = d.get("stages") if isinstance(d, dict) else None
        if not isinstance(raw, list) or not raw:
            problems.append("layout.stages: must be a non-empty list of {tp, layers: [start, end]}")
            raw = []
        stages = []
        for i, s in enumerate(raw):
            tp, lay = (s.get("tp"), s.get("layers")) if isinstance(s, dict) else (None, None)
            if not _positive_int(tp):
                problems.append(f"layout.stages[{i}].tp: must be an integer >= 1, got {tp!r}")
            if not _is_range(lay):
                problems.append(f"layout.stages[{i}].layers: must be [start, end] integers, got {lay!r}")
            gpu_type = s.get("gpu_type") if isinstance(s, dict) else None
            stages.append(Stage(gpu_type, tp if _positive_int(tp) else 1, tuple(lay) if _is_range(lay) else (0, 0)))
        layout = cls(dp if _positive_int(dp) else 1, stages, d.get("ranks") if isinstance(d, dict) else None)
        if not problems and layout.world_size > MAX_RANKS:  # before anything enumerates the grid
            problems.append(f"layout: dp x stage tp = {layout.world_size:,} ranks; at most {MAX_RANKS:,}")
        problems = problems or layout.problems(num_layers)
        if problems:
            raise ValueError("invalid trainer layout:\n  " + "\n  ".join(problems))
        return layout

    def to_dict(self) -> dict:
        """The plan's `trainer` section (ranks live in the plan's rank table, not here)."""
        return {"dp": self.dp, "stages": [s.to_dict() for s in self.stages]}

    def problems(self, num_layers: int | None = None, where: str = "layout") -> list[str]:
        """Every inconsistency: layer ranges must tile [0, num_layers) in order, ranks be distinct."""
        out, expect = [], 0
        for i, s in enumerate(self.stages):
            start, end = s.layers
            if start != expect or end <= start:
                out.append(f"{where}.stages[{i}].layers: [{start}, {end}) must start at {expect} and be non-empty")
            expect = max(expect, end)
        if num_layers is not None and self.stages and expect != num_layers:
            out.append(f"{where}.stages: layers cover [0, {expect}) but the model has {num_layers} layers")
        if self.ranks is not None:
            if not isinstance(self.ranks, list) or not all(_is_rank(r) for r in self.ranks):
                out.append(f"{where}.ranks: must be a list of global ranks (integers >= 0)")
            elif len(self.ranks) != self.world_size:
                out.append(f"{where}.ranks: {len(self.ranks)} ranks given, the grid has {self.world_size} slots")
            elif len(set(self.ranks)) != len(self.ranks):
                out.append(f"{where}.ranks: a global rank appears twice")
        return out

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def world_size(self) -> int:
        """Number of grid slots (= trainer GPUs)."""
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

    def stage_ranks(self, stage: int) -> list[int]:
        """Every global rank holding a slot of this stage."""
        return [self.rank(stage, d, t) for d in range(self.dp) for t in range(self.stages[stage].tp)]

    # Pipeline peers (see the module docstring for the mapping).
    def act_source(self, stage: int, dp: int, tp: int) -> int | None:
        """The rank this slot receives its input activations from (None on the first stage)."""
        return None if stage == 0 else self.rank(stage - 1, dp, tp % self.stages[stage - 1].tp)

    def act_targets(self, stage: int, dp: int, tp: int) -> list[int]:
        """The ranks this slot sends its output activations to."""
        if stage == self.pp - 1:
            return []
        return [self.rank(stage + 1, dp, t) for t in range(self.stages[stage + 1].tp)
                if t % self.stages[stage].tp == tp]

    def grad_source(self, stage: int, dp: int, tp: int) -> int | None:
        """The rank this slot receives the gradient of its output from (None on the last stage)."""
        return None if stage == self.pp - 1 else self.rank(stage + 1, dp, tp % self.stages[stage + 1].tp)

    def grad_targets(self, stage: int, dp: int, tp: int) -> list[int]:
        """The ranks this slot sends the gradient of its input to."""
        if stage == 0:
            return []
        return [self.rank(stage - 1, dp, t) for t in range(self.stages[stage - 1].tp)
                if t % self.stages[stage].tp == tp]


def _positive_int(v) -> bool:
    return number_problem(v, 1, MAX_RANKS, integer=True) is None and isinstance(v, int)


def _is_rank(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_range(v) -> bool:
    return isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_int(x) for x in v)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
