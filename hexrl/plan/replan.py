"""Re-planning on measurements: should a running job switch to a new plan?

What a run measures (its metrics.jsonl rows) is set against what the running plan assumed:

1. `measure`: the last rows' medians: the trainer's seconds per step and tokens per step, the
   rollout's generated tokens/s, the trainer's wait, and the mean output length (a row's
   `output_len_mean` where the run records it, else its trained tokens per sample less the prompt).
2. `calibrate`: the job with the measured output length, and one speed factor per role, the way a
   kernel profile calibrates the catalogue (hexrl/gpus.py `scaled_entry`): training by the
   predicted over the measured training time; decode by the measured over the predicted generation
   rate, which the run shows only when generation is the bottleneck (the trainer waits). When the
   trainer is the bottleneck the rollout generates only what training consumes, which says nothing
   of its speed: decode stays as the model has it.
3. `decide`: the planner reruns on the calibrated cost model and the running plan is priced on the
   same model. The switch is taken when the new plan's tokens/s, after `switch_s` seconds without
   progress spread over `horizon_s`, beats the running plan's by more than `min_gain`, and no switch
   was taken within the horizon (hysteresis). Every decision, taken or not, is one dict for
   metrics.jsonl.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, replace

from hexrl.gpus import scaled_entry
from hexrl.plan.cost import CostModel
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


@dataclass(frozen=True)
class Calibration:
    """Speed factors against the cost model (1: as predicted; 2: twice as fast)."""

    decode: float
    train: float
    generation_bound: bool  # the trainer waited: the decode factor is measured (else 1)


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
    finite and above 0; the trainer's wait may be 0)."""
    got = {k: measurement(r.get(k), zero_ok=k == "wait_s") for k in MEASURED_KEYS}
    if None in got.values():
        return None
    return {**got, "output_len_mean": measurement(r.get("output_len_mean"))}


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
        output_len_mean=max(1.0, med(out_len(r) for r in rows)))


def drifted_job(job: Job, mean_out: float) -> Job:
    """The job with its output lengths replaced by a long tail of the measured mean."""
    longest = float(job.rl.max_new_tokens * (job.env.max_turns if job.env else 1))
    mean = min(mean_out, 0.95 * longest)  # a long tail needs room above its mean
    return replace(job, workload=replace(job.workload, output_len={"mean": round(mean, 2), "max": longest}))


def calibrated_model(job: Job, cal: Calibration, use_profiles: bool = True) -> CostModel:
    """The cost model of `job` with every GPU type sped up by the calibration's factors."""
    cm = CostModel(job, use_profiles)
    for t, g in list(cm.gpus.items()):
        cm.gpus[t] = scaled_entry(g, decode=cal.decode, train=cal.train)  # before any prediction is cached
    return cm


def calibrate(plan: Plan, m: Measured, use_profiles: bool = True) -> tuple[Job, Calibration]:
    """The job with the measured lengths, and the speed factors that make the running plan's
    predictions match the measurements on it."""
    job = drifted_job(plan.job, m.output_len_mean)
    cm = CostModel(job, use_profiles)
    cand = plan_candidate(cm, plan)
    train = cand.C_T * m.tokens_trained / cm.w.tokens / m.train_s
    ratio = m.rollout_tokens_per_s / (cm.w.gen_tokens / cand.C_I)
    bound = m.wait_share >= GEN_BOUND_WAIT
    return job, Calibration(decode=ratio if bound else 1.0, train=train, generation_bound=bound)


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
    far = [f"{role} x{x:.3g}" for role, x in (("train", cal.train), ("decode", cal.decode))
           if not 1 / FIT_BOUND <= x <= FIT_BOUND]
    return (f"the measurements do not fit the running plan ({', '.join(far)} against the cost model, beyond "
            f"{FIT_BOUND:,.0f}x either way)") if far else None


def replanned(plan: Plan, records: list[dict], use_profiles: bool = True) -> tuple[Plan, float, dict] | str:
    """(new plan, running plan's tokens/s, what was measured and fitted) on the calibrated cost
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
    return materialize(cm, cand, info), running_tps, {"measured": asdict(m), "calibration": asdict(cal)}


def worth_switching(new_tps: float, old_tps: float, spec: ReplanSpec, switch_s: float) -> float:
    """The gain over the horizon after paying the switch: new tokens in (horizon - switch) over
    old tokens in the horizon, less 1."""
    return new_tps * max(0.0, spec.horizon_s - switch_s) / (old_tps * spec.horizon_s) - 1


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
    new, old_tps, fit = found
    new_tps = new.predicted["tokens_per_s"]
    gain, net = new_tps / old_tps - 1, worth_switching(new_tps, old_tps, spec, switch_s)
    row.update(fit, running_tokens_per_s=round(old_tps, 2), new_tokens_per_s=round(new_tps, 2),
               predicted_gain=round(gain, 4), amortised_gain=round(net, 4), new_split=split_of(new))
    why = "the new plan is the running one" if layout_of(new) == layout_of(plan) else reason(
        row, spec, now_s, last_switch_s)
    taken = why is None
    why = why or f"amortised gain {net:.1%} is above replan.min_gain {spec.min_gain:.0%}"
    return {**row, "taken": taken, "why": why}, (new if taken else None)


def reason(row: dict, spec: ReplanSpec, now_s: float, last_switch_s: float | None) -> str | None:
    """Why the decision in `row` is not to switch; None when it is to switch."""
    if row["amortised_gain"] <= spec.min_gain:
        return (f"amortised gain {row['amortised_gain']:.1%} (predicted {row['predicted_gain']:.1%} less the "
                f"switch) is not above replan.min_gain {spec.min_gain:.0%}")
    if last_switch_s is not None and now_s - last_switch_s < spec.horizon_s:
        return f"switched {now_s - last_switch_s:.0f} s ago, within replan.horizon_s {spec.horizon_s:g} s"
    return None
