"""The planner's cost model against a measured GPU profile: decode step and training time.

    python tools/bench/compare_cost_model.py profiles/H100.json

For every measured point of the profile (decode steps over batch x context, prefill batches,
training fwd+bwd per token) this asks the planner's own cost model (`hexrl.plan.cost.CostModel`)
for the same model shape on the same GPU type, twice: with the catalogue's datasheet numbers and
with the profile's numbers (read through the planner's `read_profile`, so exactly the keys the
planner uses). It prints predicted vs measured per point, the relative errors, their median and
worst, and the leave-one-out errors of a re-fit (the calibration predicting points it never saw).

The fit itself (`calibrate`, which `tools/bench/bench_kernels.py` calls to write the planner's keys) is
`hexrl.plan.profile`.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from hexrl.plan.profile import (
    DECODE_MFU,
    HBM_EFF,
    calibrate_decode,
    catalogue_gpu,
    context_job,
    host_type,
    load_profile,
    measured_peaks,
    predict_decode_s,
    predict_prefill_s,
    predict_train_s_per_token,
    predict_train_step_s,
    profile_gpu,
)

TARGET = 0.15  # the median relative error should be within 15%


# ----------------------------------------------------------------------------- comparison

@dataclass
class Row:
    kind: str  # decode (step) | prefill (batch) | train (fwd+bwd per token) | step (fwd+bwd + optimizer)
    point: str
    measured: float
    catalogue: float  # predicted with datasheet numbers
    profile: float  # predicted with the profile applied

    def error(self, which: str = "profile") -> float:
        return getattr(self, which) / self.measured - 1


def compare(profile: dict, path: str | Path | None = None) -> list[Row]:
    """Predicted (catalogue and profile) vs measured for every point of the profile."""
    host, cfg = host_type(profile), profile["model_config"]
    cat, prof = catalogue_gpu(profile), profile_gpu(profile, path)
    rows = []
    for r in profile["decode"]:
        job = context_job(cfg, host, float(r["context"]))
        rows.append(Row("decode", f"batch {r['batch']:>4} ctx {float(r['context']):>7.0f}", float(r["step_s"]),
                        predict_decode_s(job, cat, r["batch"]), predict_decode_s(job, prof, r["batch"])))
    for r in profile.get("prefill", []):
        job = context_job(cfg, host, float(r["prompt_len"]))
        rows.append(Row("prefill", f"batch {r['batch']:>4} len {r['prompt_len']:>7}", float(r["seconds"]),
                        predict_prefill_s(job, cat, r["batch"]), predict_prefill_s(job, prof, r["batch"])))
    for r in profile["train"]:  # the measured batch was one micro-batch: its fixed cost spread over its tokens
        s, n = int(r["seq_len"]), float(r.get("tokens", r["seq_len"]))
        rows.append(Row("train", f"seq_len {s:>6} (s/token)", float(r["s_per_token"]),
                        predict_train_s_per_token(cfg, cat, s, host) + cat.train_overhead_s / n,
                        predict_train_s_per_token(cfg, prof, s, host) + prof.train_overhead_s / n))
    opt = profile.get("optimizer") or []
    for r in profile["train"] if opt else []:  # a whole step: fwd+bwd of the batch, then the optimizer
        s, n = int(r["seq_len"]), max(1, int(r.get("tokens", r["seq_len"])) // int(r["seq_len"]))
        measured = float(r.get("seconds", r["s_per_token"] * s * n)) + float(opt[0]["seconds"])
        rows.append(Row("step", f"{n:>3} x {s:>5} tokens", measured, predict_train_step_s(cfg, cat, s, n, host)[0],
                        predict_train_step_s(cfg, prof, s, n, host)[0]))
    return rows


def summary(errors: list[float]) -> tuple[float, float]:
    """(median, worst) absolute relative error."""
    a = [abs(e) for e in errors]
    return statistics.median(a), max(a)


def report(profile: dict, rows: list[Row], loo: list[float]) -> str:
    lines = [f"cost model vs measured on {profile.get('device_name', profile['gpu'])} "
             f"(planner type {host_type(profile)}), model {profile.get('model', '?')}, {profile.get('date', '')}",
             f"{'kind':<8}{'point':<26}{'measured':>12}{'catalogue':>12}{'err':>8}{'profile':>12}{'err':>8}"]
    for r in rows:
        lines.append(f"{r.kind:<8}{r.point:<26}{r.measured:>12.4g}{r.catalogue:>12.4g}{r.error('catalogue'):>+8.1%}"
                     f"{r.profile:>12.4g}{r.error():>+8.1%}")
    lines.append("")
    for kind in ("decode", "prefill", "train", "step"):
        sel = [r for r in rows if r.kind == kind]
        if not sel:
            continue
        cm, cw = summary([r.error("catalogue") for r in sel])
        pm, pw = summary([r.error() for r in sel])
        lines.append(f"{kind:<8} median error {pm:6.1%}  worst {pw:6.1%}  with the profile   "
                     f"(catalogue only: median {cm:6.1%}, worst {cw:6.1%})")
    train = "step" if any(r.kind == "step" for r in rows) else "train"
    med, worst = summary([r.error() for r in rows if r.kind in ("decode", train)])
    verdict = "meets" if med <= TARGET else "MISSES"
    lines.append(f"decode step + training {'step' if train == 'step' else 'time per token'}: median error "
                 f"{med:.1%}, worst {worst:.1%} ({verdict} the {TARGET:.0%} median target)")
    if loo:
        lm, lw = summary(loo)
        lines.append(f"decode leave-one-out (refit without the point) median error {lm:.1%}, worst {lw:.1%}")
    for key, grid in (("hbm_efficiency", HBM_EFF), ("decode_mfu", DECODE_MFU)):
        if key in profile and not grid[0] * 1.001 < profile[key] < grid[-1] * 0.999:
            lines.append(f"note: {key} = {profile[key]:.4g} is at the edge of its search range "
                         f"[{grid[0]:.3g}, {grid[-1]:.3g}]: the decode model does not fit these measurements well")
    if not any(k in profile for k in ("hbm_efficiency", "decode_mfu", "decode_overhead_s")):
        lines.append("note: the profile carries no calibrated keys; 'profile' uses only its measured peaks")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile", help="a profile JSON written by tools/bench/bench_kernels.py")
    args = p.parse_args(argv)
    try:
        profile = load_profile(args.profile)
        rows = compare(profile, args.profile)  # a bad model_config raises the job loader's ConfigError
    except ValueError as e:
        print(f"compare_cost_model: {e}", file=sys.stderr)
        return 2
    loo = calibrate_decode(profile, measured_peaks(profile))[1] if len(profile["decode"]) > 3 else []
    print(report(profile, rows, loo))
    return 0


if __name__ == "__main__":
    sys.exit(main())
