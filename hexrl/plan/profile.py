"""A measured GPU profile turned into the planner's keys: checks, probe jobs, and the fit.

`tools/bench/bench_kernels.py` measures a GPU and calls `calibrate(profile)` to write the keys the
planner reads (hbm_efficiency, decode_mfu, decode_overhead_s, prefill_mfu, train_mfu; train_mfu net of
the measured train_overhead_s, which the cost model adds per micro-batch). Every prediction asks the
planner's own cost model (`CostModel`) about a one-GPU probe job of the profile's model shape, so the
fitted numbers mean exactly what the planner does with them. `tools/bench/compare_cost_model.py` prints
predicted against measured with these.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np

from hexrl.gpus import CATALOGUE, GPU, canonical_name, read_profile
from hexrl.plan.cost import CostModel
from hexrl.schema import Job, load_job

STAND_IN = "H100"  # catalogue type a job names when the profile's GPU is not in the catalogue
# the decode fit's search grid: HBM efficiency (of the measured bandwidth) x decode MFU (of the
# measured peak); the per-step overhead is then chosen per pair (prediction = overhead + rest)
HBM_EFF = np.geomspace(0.02, 1.25, 65)  # 6.7% apart
DECODE_MFU = np.geomspace(0.01, 1.0, 33)  # 15% apart
REQUIRED = ("gpu", "model_config", "hbm_TBps", "bf16_tflops", "decode", "train")


# ----------------------------------------------------------------------------- profile

def problems(profile: dict) -> list[str]:
    """Everything missing or malformed in a profile, all at once (empty if usable)."""
    out = [f"missing key {k!r}" for k in REQUIRED if k not in profile]
    for key, keys in (("decode", ("batch", "context", "step_s")), ("train", ("seq_len", "s_per_token")),
                        ("prefill", ("batch", "prompt_len", "seconds"))):
        rows = profile.get(key, [])
        if not isinstance(rows, list) or (key != "prefill" and not rows):
            out.append(f"{key}: must be a non-empty list of measured points")
            continue
        for i, row in enumerate(rows):
            bad = [f for f in keys if not _positive(row.get(f) if isinstance(row, dict) else None)]
            if bad:
                out.append(f"{key}[{i}]: needs positive numbers for {', '.join(bad)}")
    return out


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def load_profile(path: str | Path) -> dict:
    """Read and check a profile JSON; raises ValueError naming every problem."""
    path = Path(path)
    try:
        profile = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a profile: {e}") from None
    if not isinstance(profile, dict):
        raise ValueError(f"{path}: a profile is a JSON object")
    bad = problems(profile)
    if bad:
        raise ValueError(f"{path}: invalid profile: " + "; ".join(bad))
    return profile


def host_type(profile: dict) -> str:
    """The catalogue type the probe jobs name (the profile's own type, or a stand-in)."""
    return canonical_name(profile["gpu"]) or STAND_IN


def catalogue_gpu(profile: dict) -> GPU:
    """What the planner knows without the profile: the catalogue entry (or, for a GPU type the
    catalogue lacks, the measured peaks with the catalogue's default efficiencies)."""
    canon = canonical_name(profile["gpu"])
    if canon is not None:
        return CATALOGUE[canon]
    total = profile.get("hbm_GB") or CATALOGUE[STAND_IN].hbm_GB
    return GPU(str(profile["gpu"]), float(profile["bf16_tflops"]), float(total), float(profile["hbm_TBps"]), 0.0, 0.0)


def measured_peaks(profile: dict) -> GPU:
    """The catalogue's view with the profile's measured peaks (TFLOP/s, HBM bandwidth): what the fit scales."""
    return replace(catalogue_gpu(profile), bf16_tflops=float(profile["bf16_tflops"]),
                   hbm_TBps=float(profile["hbm_TBps"]))


def profile_gpu(profile: dict, path: str | Path | None = None) -> GPU:
    """The planner's view with the profile applied: catalogue entry + the keys `read_profile` takes."""
    if path is not None:
        path = Path(path)
        keys = read_profile(path.stem, path.parent)  # the planner's reader: the same keys, the same filter
    else:
        known = {f.name for f in fields(GPU)} - {"name"}
        keys = {k: float(v) for k, v in profile.items() if k in known and isinstance(v, (int, float))}
    return replace(catalogue_gpu(profile), **keys)


# ----------------------------------------------------------------------------- probe jobs

def probe_job(model_config: dict, gpu_type: str, prompt_len: int, output_len: float, batch_size: int = 1,
              group_size: int = 2) -> Job:
    """A one-GPU job whose workload has fixed prompt and output lengths (so the cost model's
    average decode context is prompt_len + output_len / 2 and every trained sequence has
    prompt_len + output_len tokens). Naive PPO, no KL: training is exactly one fwd+bwd."""
    return load_job({
        "name": "probe", "model": {"config": dict(model_config)}, "data": {"synthetic": {"task": "arithmetic"}},
        "rl": {"batch_size": batch_size, "group_size": group_size, "max_new_tokens": int(math.ceil(output_len)) + 1,
               "decoupled": False, "kl_coef": 0.0, "filter_equal_groups": False},
        "workload": {"prompt_len": int(prompt_len), "output_len": {"samples": [float(output_len)]}},
        "cluster": {"nodes": [{"name": "n0", "gpu_type": gpu_type, "gpus": 1}]},
    }, check_paths=False)


def context_job(model_config: dict, gpu_type: str, context: float) -> Job:
    """A probe job whose average decode context is exactly `context` tokens."""
    prompt = max(1, round(context) - 1)
    return probe_job(model_config, gpu_type, prompt, max(1.0, 2 * (context - prompt)))


def cost_model(job: Job, g: GPU) -> CostModel:
    """The planner's cost model for `job` with GPU entry `g` in place of the catalogue's."""
    cm = CostModel(job, use_profiles=False)
    (gpu_type,) = cm.gpus  # probe jobs have one GPU type
    cm.gpus[gpu_type] = g  # before any prediction is cached
    return cm


def predict_decode_s(job: Job, g: GPU, batch: int) -> float:
    """Predicted seconds of one decode step of `batch` sequences (context from the job)."""
    cm = cost_model(job, g)
    return cm.decode_point(next(iter(cm.gpus)), 1, int(batch)).step_s


def predict_prefill_s(job: Job, g: GPU, batch: int) -> float:
    """Predicted seconds to prefill `batch` sequences of the job's decode context (the cost
    model's KV recompute of a running batch is exactly that)."""
    cm = cost_model(job, g)
    return cm.decode_point(next(iter(cm.gpus)), 1, int(batch)).recompute_s


def predict_train_step_s(model_config: dict, g: GPU, seq_len: int, n_seqs: int, host: str) -> tuple[float, int]:
    """(predicted seconds, tokens) of one training step on one GPU (no TP/PP/DP) over `n_seqs`
    sequences of `seq_len` tokens: one fwd+bwd of all of them and one optimizer step."""
    job = probe_job(model_config, host, max(1, seq_len - 1), 1.0, batch_size=1, group_size=n_seqs)
    cm = cost_model(job, g)
    cm.w = replace(cm.w, micro_tokens=max(cm.w.micro_tokens, seq_len * n_seqs))  # bench_kernels: one micro-batch
    sc = cm.stage_coeffs(host, 1, 1, 1, 0, 1, None, False)
    return sc.per_layer * cm.m.num_hidden_layers + sc.fixed, int(round(cm.w.tokens))


def predict_train_s_per_token(model_config: dict, g: GPU, seq_len: int, host: str) -> float:
    """Predicted fwd+bwd seconds per trained token for sequences of `seq_len` tokens: the
    slope of the step time between 2 and 4 sequences (the optimizer's per-step time cancels)."""
    (t1, n1), (t2, n2) = (predict_train_step_s(model_config, g, seq_len, n, host) for n in (2, 4))
    return (t2 - t1) / (n2 - n1)


# ----------------------------------------------------------------------------- calibration

@dataclass
class DecodeFit:
    hbm_efficiency: float
    decode_mfu: float
    decode_overhead_s: float


def _decode_base(profile: dict, base: GPU) -> np.ndarray:
    """[len(HBM_EFF) * len(DECODE_MFU), points] predicted step time without the per-step overhead."""
    host, cfg = host_type(profile), profile["model_config"]
    jobs = {c: context_job(cfg, host, c) for c in {float(r["context"]) for r in profile["decode"]}}
    out = []
    for e in HBM_EFF:
        for u in DECODE_MFU:
            g = replace(base, hbm_efficiency=float(e), decode_mfu=float(u), decode_overhead_s=0.0)
            out.append([predict_decode_s(jobs[float(r["context"])], g, r["batch"]) for r in profile["decode"]])
    return np.asarray(out)


def _overheads(measured: np.ndarray) -> np.ndarray:
    return np.concatenate([[0.0], np.geomspace(1e-6, max(measured.max(), 2e-6), 160)])


def _fit_decode(base: np.ndarray, measured: np.ndarray, use: np.ndarray) -> tuple[int, int]:
    """(pair index, overhead index) minimising the squared log error over the points in `use`."""
    oh = _overheads(measured)
    pred = base[:, None, :] + oh[None, :, None]
    loss = (np.log(pred[:, :, use] / measured[use]) ** 2).sum(-1)
    k, j = np.unravel_index(np.argmin(loss), loss.shape)
    return int(k), int(j)


def _fit_of(k: int, j: int, measured: np.ndarray) -> DecodeFit:
    e, u = HBM_EFF[k // len(DECODE_MFU)], DECODE_MFU[k % len(DECODE_MFU)]
    return DecodeFit(float(e), float(u), float(_overheads(measured)[j]))


def calibrate_decode(profile: dict, base: GPU) -> tuple[DecodeFit, list[float]]:
    """Best (hbm_efficiency, decode_mfu, decode_overhead_s) over the whole decode grid, and each
    point's leave-one-out relative error (fit on the other points, predict this one)."""
    measured = np.asarray([float(r["step_s"]) for r in profile["decode"]])
    table = _decode_base(profile, base)
    oh = _overheads(measured)
    fit = _fit_of(*_fit_decode(table, measured, np.ones(len(measured), bool)), measured)
    loo = []
    for i in range(len(measured)):
        use = np.arange(len(measured)) != i
        if not use.any():
            break
        k, j = _fit_decode(table, measured, use)
        loo.append(float((table[k, i] + oh[j]) / measured[i] - 1))
    return fit, loo


def net_s_per_token(profile: dict, r: dict) -> float:
    """A train row's seconds per token less the measured fixed cost of its one micro-batch
    (train_overhead_s, which the cost model adds apart): what train_mfu prices."""
    overhead, seconds = float(profile.get("train_overhead_s", 0.0)), r.get("seconds")
    if not overhead or seconds is None or seconds <= overhead:
        return float(r["s_per_token"])
    return (float(seconds) - overhead) / float(r["tokens"])


def calibrate(profile: dict) -> dict[str, float]:
    """The planner's keys fitted to a profile's measurements (relative to its measured peaks):
    decode_overhead_s, hbm_efficiency and decode_mfu from the decode grid; prefill_mfu and
    train_mfu as the median ratio of ideal (efficiency 1) to measured time."""
    bad = problems(profile)
    if bad:
        raise ValueError("cannot calibrate: " + "; ".join(bad))
    base = measured_peaks(profile)
    fit, _ = calibrate_decode(profile, base)
    out = {"hbm_efficiency": fit.hbm_efficiency, "decode_mfu": fit.decode_mfu,
           "decode_overhead_s": fit.decode_overhead_s}
    host, cfg = host_type(profile), profile["model_config"]
    ideal = replace(base, prefill_mfu=1.0, train_mfu=1.0)
    if profile.get("prefill"):
        out["prefill_mfu"] = statistics.median(
            predict_prefill_s(context_job(cfg, host, r["prompt_len"]), ideal, r["batch"]) / r["seconds"]
            for r in profile["prefill"])
    out["train_mfu"] = statistics.median(
        predict_train_s_per_token(cfg, ideal, int(r["seq_len"]), host) / net_s_per_token(profile, r)
        for r in profile["train"])
    return {k: float(f"{v:.6g}") for k, v in out.items()}
