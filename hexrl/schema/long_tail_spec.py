"""The job's `long_tail` section: which share of a batch's groups the plan treats as the long tail.

    "long_tail": {"alpha": 0.2, "caps": [8, 16, 32, 64]}

Groups are ranked by predicted output length (hexrl/control/length_predictor.py); the longest
`alpha` of each batch are the long-tail class, costed at the length distribution's P90, the rest at
its P50. The planner chooses which rollout replicas serve which class, and for the long-tail ones
their batch cap (`max_running`) from `caps`: a small batch decodes each token sooner. alpha 0 (the
default) is off: one class, exactly the plan and dispatch of a job without the section.
"""

from dataclasses import dataclass

from hexrl.schema.fields import Reader

MAX_CAP = 4096  # sequences decoding at once on one replica: above it a cap is no cap
MAX_CAPS = 16  # caps to choose from: the planner solves one rollout MILP per cap and GPU type


@dataclass(frozen=True)
class LongTailSpec:
    alpha: float = 0.0  # share of a batch's groups predicted longest; 0: off
    caps: tuple[int, ...] = (8, 16, 32, 64)  # batch caps the planner may give a long-tail replica

    @property
    def on(self) -> bool:
        return self.alpha > 0

    def to_dict(self) -> dict:
        return {"alpha": self.alpha, "caps": list(self.caps)}


def read_long_tail(r: Reader, d) -> LongTailSpec:
    """Parse `long_tail` (off if absent); every problem names its field."""
    d = r.section(d, "long_tail", {"alpha", "caps"})
    base = LongTailSpec()
    alpha = r.num(d, "alpha", "long_tail", base.alpha, lo=0, hi=1)
    if alpha == 1:
        r.bad("long_tail.alpha", "1 marks every group long: no regular class is left; use a value in [0, 1)")
        alpha = base.alpha
    caps = d.get("caps", list(base.caps))
    if not (isinstance(caps, list) and caps and all(isinstance(c, int) and not isinstance(c, bool) for c in caps)):
        r.bad("long_tail.caps", f"must be a non-empty list of whole numbers of sequences, got {caps!r}")
        caps = list(base.caps)
    elif len(caps) > MAX_CAPS:
        r.bad("long_tail.caps", f"{len(caps)} caps; give at most {MAX_CAPS} (the planner solves one rollout "
              "problem per cap and GPU type)")
        caps = list(base.caps)
    elif any(not 1 <= c <= MAX_CAP for c in caps):
        r.bad("long_tail.caps", f"each cap must be in 1..{MAX_CAP} sequences, got {caps}")
        caps = list(base.caps)
    elif len(set(caps)) != len(caps):
        r.bad("long_tail.caps", f"caps repeat: {caps}")
        caps = list(base.caps)
    return LongTailSpec(float(alpha), tuple(sorted(caps)))
