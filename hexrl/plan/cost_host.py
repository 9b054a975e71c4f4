"""The host room of the cost model: CPU work around the GPUs that a step waits on. The trainer's
batch hand-off runs before its first forward, so it lengthens training; the controller takes in
every trajectory, hands out every group and publishes every version on its share of one core,
so a step can be no shorter than that work (hexrl/gpus.py's Host holds the measured costs)."""

from dataclasses import dataclass

from hexrl.gpus import Host
from hexrl.plan.cost_inputs import Workload

# a plan is called hand-off bound where the hand-off is at least this share of its step
HANDOFF_BOUND_SHARE = 0.5


@dataclass
class HostCost:
    """Host costs of one job's step."""

    host: Host
    w: Workload

    def handoff_s(self) -> float:
        """The trainer's batch hand-off: every trained token packed on the controller rank, then
        unpacked on the others, before the step's first forward."""
        h = self.host
        return self.w.tokens * (h.handoff_ns_per_token_rank0 + h.handoff_ns_per_token_other) * 1e-9

    def controller_s(self, replicas: int) -> float:
        """CPU seconds of the controller per step: every generated trajectory received (filtered
        groups too), every group handed out, the new version published to every replica."""
        h, w = self.host, self.w
        return (w.gen_samples * h.controller_us_per_traj * 1e-6 + w.gen_tokens * h.controller_ns_per_token * 1e-9
                + w.gen_samples / w.group * h.controller_us_per_group * 1e-6
                + replicas * h.publish_us_per_replica * 1e-6)

    def controller_floor_s(self, replicas: int) -> float:
        """The shortest step the controller allows: its work on its share of a core."""
        return self.controller_s(replicas) / self.host.controller_core_share

    def report(self, step_s: float, replicas: int) -> dict:
        """What the host costs of a plan with this step time: each term's seconds and share, and
        `bound`, the host terms that set or dominate the step ([] where none)."""
        control, handoff = self.controller_s(replicas), self.handoff_s()
        load = self.controller_floor_s(replicas) / step_s if step_s > 0 else 0.0
        bound = ["controller"] if load >= 1 - 1e-9 else []
        if step_s > 0 and handoff >= HANDOFF_BOUND_SHARE * step_s:
            bound.append("trainer hand-off")
        return {"controller_s": round(control, 4), "controller_core_share": self.host.controller_core_share,
                "controller_load": round(load, 4), "handoff_s": round(handoff, 4),
                "handoff_share": round(handoff / step_s, 4) if step_s > 0 else 0.0, "bound": bound}
