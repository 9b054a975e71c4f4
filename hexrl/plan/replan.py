"""Re-planning on measurements: should a running job switch to a new plan?

What a run measures (its metrics.jsonl rows) is set against what the running plan assumed:

1. `measure`: the last rows' medians: the trainer's seconds per step and tokens per step, the
   step's seconds, the rollout's generated tokens/s (all replicas, and each replica's), the trainer's
   wait, and the output lengths (a row's `output_len_mean` and its median, 90th percentile and
   longest where the run records them, else its trained tokens per sample less the prompt).
2. `calibrate`: the job with the measured output lengths (`drifted_job`), and speed factors the way a
   kernel profile calibrates the catalogue (hexrl/gpus.py `scaled_entry`): training by the
   predicted over the measured training time; decode by the measured over the predicted generation
   rate, one factor per rollout GPU type from its replicas' rates (the one factor of all replicas
   together for a type none of them measured). The run shows its decode speed only when generation
   is the bottleneck (the trainer waits). When the trainer is the bottleneck the rollout generates
   only what training consumes, which says nothing of its speed: decode stays as the model has it.
3. `decide`: the planner reruns on the calibrated cost model and the running plan is priced on the
   same model. The switch is taken when the new plan's tokens/s, after `switch_s` seconds without
   progress spread over the payback time, beats the running plan's by more than `min_gain`, and no
   switch was taken within `horizon_s` (hysteresis). The payback time is `horizon_s`, or the time the
   run has left (its remaining steps at the measured step time) where that is shorter. Every
   decision, taken or not, is one dict for metrics.jsonl.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field, replace

from hexrl.gpus import scaled_entry
from hexrl.plan.cost import CostModel
from hexrl.plan.lengths import quantile_samples
from hexrl.plan.planner import feasibility_problems, materialize, plan_candidate, search
from hexrl.schema import ConfigError, Job, Plan
from hexrl.schema.replan_spec import ReplanSpec

WINDOW = 20  # metrics rows a decision looks at: the last ones, medians (one slow step does not decide)
GEN_BOUND_WAIT = 0.05  # the trainer waits this share of its step or more: generation is the bottleneck
FIT_BOUND = 1e6  # a speed factor beyond it either way is no calibration (the CPU stand-in fits ~300x slower)
MEASURED_KEYS = ("train_s", "tokens_trained", "rollout_tokens_per_s", "wait_s", "step_s")


@dataclass(frozen=True)
class Measured:
    """What the run measured over its last rows (medians)."""

    rows: int
    train_s: float  # the trainer's seconds per step
    tokens_trained: float  # tokens (prompt + output) trained per step
    rollout_tokens_per_s: float  # tokens generated per second, all replicas together
    wait_share: float  # share of a step the trainer waited for its batch
    output_len_mean: float  # mean generated tokens per sample
    step_s: float  # a step's seconds, start to end
    last_step: int  # the newest step measured: the run has rl.steps less it left
    # the median, 90th percentile and longest generated tokens per sample; None where the rows lack them
    output_len_p50: float | None = None
    output_len_p90: float | None = None
    output_len_max: float | None = None
    replica_tokens_per_s: dict = field(default_factory=dict)  # {replica id (a string): tokens/s}

    @property
    def quantiles(self) -> tuple[float, float, float] | None:
        """(median, 90th percentile, longest) output length, or None where the rows do not give all three."""
        q = (self.output_len_p50, self.output_len_p90, self.output_len_max)
        return None if None in q else q


@dataclass(frozen=True)
class Calibration:
    """Speed factors against the cost model (1: as predicted; 2: twice as fast)."""

    decode: float  # all rollout replicas together; the factor of every GPU type not in decode_by_type
    train: float
    generation_bound: bool  # the trainer waited: the decode factor is measured (else 1)
    decode_by_type: dict = field(default_factory=dict)  # {GPU type: decode factor} from its replicas' rates

    def decode_of(self, gpu_type: str) -> float:
        return self.decode_by_type.get(gpu_type, self.decode)


def measurement(value, zero_ok: bool = False) -> float | None:
    """`value` as a float if it is a finite number above 0 (or 0 itself, where `zero_ok`), not a bool;
    else None: a metrics row is read from a file anyone may have edited."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        x = float(value)
    except OverflowError:  # an int beyond a float
        return None
    return x if math.isfinite(x) and (x > 0 or zero_ok and x == 0) else None


def measured_row(r: dict) -> dict | None:
    """A step row's measured keys as floats, or None when one is missing or is no measurement (each
    finite and above 0; the trainer's wait may be 0); its step, output-length quantiles and
    per-replica rates beside them, each kept only where it is a measurement."""
    got = {k: measurement(r.get(k), zero_ok=k == "wait_s") for k in MEASURED_KEYS}
    if None in got.values():
        return None
    step, rates = r.get("step"), r.get("replica_tokens_per_s")
    rates = rates if isinstance(rates, dict) else {}
    return {**got, "step": step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else 0,
            **{k: measurement(r.get(k)) for k in ("output_len_mean", "output_len_p50", "output_len_p90",
                                                   "output_len_max")},
            "replica_tokens_per_s": {str(rid): x for rid, v in rates.items()
                                     if (x := measurement(v, zero_ok=True)) is not None}}


def measure(records: list[dict], job: Job, window: int = WINDOW) -> Measured | None:
    """The medians of the last `window` step rows that carry every measured key; None if none do."""
    rows = [m for m in map(measured_row, records) if m is not None][-window:]
    if not rows:
        return None
    samples = job.rl.batch_size * job.rl.group_size
    context = job.workload.prompt_len + (job.workload.turns - 1) * job.workload.obs_len

    def out_len(r: dict) -> float:
        given = r["output_len_mean"]
        return given if given is not None else r["tokens_trained"] / samples - context

    med = statistics.median
    return Measured(
        rows=len(rows), train_s=med(r["train_s"] for r in rows),
        tokens_trained=med(r["tokens_trained"] for r in rows),
        rollout_tokens_per_s=med(r["rollout_tokens_per_s"] for r in rows),
        wait_share=med(r["wait_s"] / r["step_s"] for r in rows),
        output_len_mean=max(1.0, med(out_len(r) for r in rows)),
        step_s=med(r["step_s"] for r in rows), last_step=int(rows[-1].get("step", 0)),
        output_len_p50=median_of(rows, "output_len_p50"), output_len_p90=median_of(rows, "output_len_p90"),
        output_len_max=median_of(rows, "output_len_max"), replica_tokens_per_s=replica_medians(rows))


def median_of(rows: list[dict], key: str) -> float | None:
    """The median of the rows' numbers under `key`; None where no row has one."""
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def replica_medians(rows: list[dict]) -> dict[str, float]:
    """{replica id: median tokens/s} over the rows' `replica_tokens_per_s`, each over the rows that name it."""
    rates: dict[str, list[float]] = {}
    for r in rows:
        for rid, v in (r.get("replica_tokens_per_s") or {}).items():
            if isinstance(v, (int, float)):
                rates.setdefault(str(rid), []).append(v)
    return {rid: statistics.median(v) for rid, v in sorted(rates.items())}


def drifted_job(job: Job, mean_out: float, quantiles: tuple[float, float, float] | None = None) -> Job:
    """The job with its output lengths replaced by the measured ones: lengths that match the measured
    mean and `quantiles` (median, 90th percentile, longest) where given, else a long tail of the mean."""
    longest = float(job.rl.max_new_tokens * (job.env.max_turns if job.env else 1))
    if quantiles is not None:
        p50, p90, top = (min(max(1.0, q), longest) for q in quantiles)
        spec = {"samples": quantile_samples(min(mean_out, top), p50, p90, top)}
    else:
        spec = {"mean": round(min(mean_out, 0.95 * longest), 2), "max": longest}  # a tail needs room above its mean
    return replace(job, workload=replace(job.workload, output_len=spec))


def calibrated_model(job: Job, cal: Calibration, use_profiles: bool = True) -> CostModel:
    """The cost model of `job` with every GPU type sped up by the calibration's factors."""
    cm = CostModel(job, use_profiles)
    for t, g in list(cm.gpus.items()):  # before any prediction is cached
        cm.gpus[t] = scaled_entry(g, decode=cal.decode_of(t), train=cal.train)
    return cm


def calibrate(plan: Plan, m: Measured, use_profiles: bool = True) -> tuple[Job, Calibration]:
    """The job with the measured lengths, and the speed factors that make the running plan's
    predictions match the measurements on it."""
    job = drifted_job(plan.job, m.output_len_mean, m.quantiles)
    cm = CostModel(job, use_profiles)
    cand = plan_candidate(cm, plan)
    train = cand.C_T * m.tokens_trained / cm.w.tokens / m.train_s
    predicted = cm.w.gen_tokens / cand.C_I  # generated tokens/s, all replicas together
    bound = m.wait_share >= GEN_BOUND_WAIT
    if not bound:
        return job, Calibration(decode=1.0, train=train, generation_bound=False)
    by_type = decode_by_type(plan, m.replica_tokens_per_s, predicted)
    return job, Calibration(decode=float(m.rollout_tokens_per_s / predicted), train=train, generation_bound=True,
                            decode_by_type=by_type)


def decode_by_type(plan: Plan, rates: dict[str, float], predicted: float) -> dict[str, float]:
    """{GPU type: its replicas' measured tokens/s over their part of the `predicted` rate}, a replica's
    part being its share of the groups; a type none of whose replicas measured is left out. Empty for a
    plan with a long-tail class, whose replicas' shares are of their class's groups, not of the tokens."""
    if any(r.long_tail for r in plan.replicas):
        return {}
    total = sum(r.share for r in plan.replicas)
    measured: dict[str, float] = {}
    expected: dict[str, float] = {}
    for r in plan.replicas:
        if str(r.id) in rates:
            measured[r.gpu_type] = measured.get(r.gpu_type, 0.0) + rates[str(r.id)]
            expected[r.gpu_type] = expected.get(r.gpu_type, 0.0) + r.share / total * predicted
    return {t: float(measured[t] / expected[t]) for t in sorted(measured) if expected[t] > 0}


def split_of(plan: Plan) -> dict:
    """GPUs per role and type: {"train": {"H800": 16}, "rollout": {"H800": 8, "H20": 24}}."""
    out: dict[str, dict[str, int]] = {"train": {}, "rollout": {}}
    for r in plan.ranks:
        out[r.role][r.gpu_type] = out[r.role].get(r.gpu_type, 0) + 1
    return out


def layout_of(plan: Plan) -> tuple:
    """What a switch would change: each rank's role and coordinates."""
    return tuple((r.role, r.dp, r.pp, r.tp, r.replica) for r in plan.ranks)


def implausible(cal: Calibration) -> str | None:
    """Why a calibration cannot describe the running plan (a factor beyond FIT_BOUND either way: the
    rows are another plan's, or edited); None when it can."""
    factors = [("train", cal.train), ("decode", cal.decode),
               *((f"decode on {t}", x) for t, x in cal.decode_by_type.items())]
    far = [f"{role} x{x:.3g}" for role, x in factors if not 1 / FIT_BOUND <= x <= FIT_BOUND]
    return (f"the measurements do not fit the running plan ({', '.join(far)} against the cost model, beyond "
            f"{FIT_BOUND:,.0f}x either way)") if far else None


def replanned(plan: Plan, records: list[dict], use_profiles: bool = True
              ) -> tuple[Plan, float, Measured, Calibration] | str:
    """(new plan, running plan's tokens/s, what was measured, what was fitted) on the calibrated cost
    model; or why there is none (nothing measured yet, or measurements that cannot be this plan's)."""
    m = measure(records, plan.job)
    if m is None:
        return "no step measured yet"
    job, cal = calibrate(plan, m, use_profiles)
    if why := implausible(cal):
        return why
    cm = calibrated_model(job, cal, use_profiles)
    running_tps = cm.w.tokens / plan_candidate(cm, plan).step_s
    cm = calibrated_model(job, cal, use_profiles)  # the search on a model of its own, as plan_job does
    problems = feasibility_problems(cm)
    if problems:
        raise ConfigError(problems, "infeasible job")
    cand, info = search(cm)
    return materialize(cm, cand, info), running_tps, m, cal


def worth_switching(new_tps: float, old_tps: float, payback_s: float, switch_s: float) -> float:
    """The gain over `payback_s` seconds after paying the switch: new tokens in (payback - switch) over
    old tokens in the payback time, less 1 (-1 when the switch takes all of it)."""
    return new_tps * max(0.0, payback_s - switch_s) / (old_tps * payback_s) - 1 if payback_s > 0 else -1.0


def run_left_s(job: Job, m: Measured) -> float:
    """Seconds the run has left: its steps after the newest measured one, at the measured step time."""
    return max(0, job.rl.steps - m.last_step) * m.step_s


def decide(plan: Plan, records: list[dict], now_s: float, last_switch_s: float | None = None,
           switch_s: float | None = None, use_profiles: bool = True) -> tuple[dict, Plan | None]:
    """One re-planning decision at run time `now_s`: (the decision as a metrics row, the plan to
    switch to or None). `last_switch_s`: when the run last switched (None: never); `switch_s`: the
    measured cost of a switch (None: the job's replan.switch_s)."""
    spec = plan.job.replan
    switch_s = spec.switch_s if switch_s is None else switch_s
    row = {"event": "replan", "time_s": round(now_s, 3), "switch_s": switch_s, "horizon_s": spec.horizon_s,
           "min_gain": spec.min_gain, "running_split": split_of(plan)}
    if plan.job.layout is not None or plan.job.colocate is not None:
        return {**row, "taken": False, "why": "the job fixes its layout"}, None
    found = replanned(plan, records, use_profiles)
    if isinstance(found, str):
        return {**row, "taken": False, "why": found}, None
    new, old_tps, m, cal = found
    new_tps, left_s = new.predicted["tokens_per_s"], run_left_s(plan.job, m)
    payback_s = min(spec.horizon_s, left_s)
    gain, net = new_tps / old_tps - 1, worth_switching(new_tps, old_tps, payback_s, switch_s)
    row.update(measured=asdict(m), calibration=asdict(cal), running_tokens_per_s=round(old_tps, 2),
               new_tokens_per_s=round(new_tps, 2), predicted_gain=round(gain, 4), amortised_gain=round(net, 4),
               run_left_s=round(left_s, 3), payback_s=round(payback_s, 3), new_split=split_of(new))
    why = "the new plan is the running one" if layout_of(new) == layout_of(plan) else reason(
        row, spec, now_s, last_switch_s)
    taken = why is None
    why = why or f"amortised gain {net:.1%} is above replan.min_gain {spec.min_gain:.0%}"
    return {**row, "taken": taken, "why": why}, (new if taken else None)


def reason(row: dict, spec: ReplanSpec, now_s: float, last_switch_s: float | None) -> str | None:
    """Why the decision in `row` is not to switch; None when it is to switch."""
    if row["amortised_gain"] <= spec.min_gain:
        over = ("" if row["payback_s"] >= spec.horizon_s else
                f" over the {row['payback_s']:.0f} s the run has left, short of replan.horizon_s {spec.horizon_s:g} s")
        return (f"amortised gain {row['amortised_gain']:.1%} (predicted {row['predicted_gain']:.1%} less the "
                f"switch{over}) is not above replan.min_gain {spec.min_gain:.0%}")
    if last_switch_s is not None and now_s - last_switch_s < spec.horizon_s:
        return f"switched {now_s - last_switch_s:.0f} s ago, within replan.horizon_s {spec.horizon_s:g} s"
    return None
