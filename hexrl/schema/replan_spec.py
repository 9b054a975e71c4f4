"""The job's `replan` section: when the planner is rerun on what the run measures, and when its answer
is worth a restart.

    "replan": {"every_s": 600, "min_gain": 0.1, "horizon_s": 3600, "switch_s": 300}

Every `every_s` seconds (0: never) the planner reruns with the cost model calibrated on the run's
measurements (hexrl/plan/replan.py). The run switches to the new plan when its predicted throughput,
less `switch_s` seconds without progress (checkpoint, restart, reload, warm-up) spread over
`horizon_s`, beats the running plan's by more than `min_gain`; after a switch it does not switch
again within `horizon_s`.
"""

from dataclasses import dataclass, fields

from hexrl.schema.fields import Reader


@dataclass(frozen=True)
class ReplanSpec:
    every_s: float = 600.0  # seconds between two decisions; 0: off
    min_gain: float = 0.10  # the amortised gain a switch must beat
    horizon_s: float = 3600.0  # the switch cost is spread over it; no second switch within it
    switch_s: float = 300.0  # seconds a switch costs when the run has not measured one

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def on(self) -> bool:
        return self.every_s > 0


def read_replan(r: Reader, d) -> ReplanSpec:
    """Parse `replan` (the defaults if absent); every problem names its field."""
    d = r.section(d, "replan", {f.name for f in fields(ReplanSpec)})
    base = ReplanSpec()
    every = r.num(d, "every_s", "replan", base.every_s, lo=0)
    gain = r.num(d, "min_gain", "replan", base.min_gain, lo=0, hi=10)
    horizon = r.num(d, "horizon_s", "replan", base.horizon_s, lo=0, lo_open=True)
    switch = r.num(d, "switch_s", "replan", base.switch_s, lo=0)
    if switch >= horizon:
        r.bad("replan.switch_s", f"{switch:g} s is not shorter than replan.horizon_s {horizon:g} s: "
              "no switch could ever pay for itself; lengthen the horizon")
    return ReplanSpec(float(every), float(gain), float(horizon), float(switch))
