"""The helpers of tools/gpu_e2e.sh (one GPU runs the whole loop: rollout, training, weight sync).

    python tools/one_gpu.py gpu                                # this machine's catalogue GPU type
    python tools/one_gpu.py job CONFIG RUN_DIR GPU_TYPE        # RUN_DIR/job.json: the config on this GPU
    python tools/one_gpu.py report RUN_DIR [--launch-s S] [--total-s S]

`report` prints the run's summary (hexrl.control.summary: held-out before -> after, trajectory
accounting), the measured step time (wall time after WARMUP steps, evaluation excluded, the last
step and its final checkpoint left out), decode tokens/s, trainer MFU, weight-sync seconds, and
the step time `python -m hexrl.plan simulate` predicted (RUN_DIR/simulate.json) beside the
measured one, then each target of the one-GPU run (`checks`) with its verdict.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from hexrl.control.metrics import read_metrics
from hexrl.control.summary import read_evals, summarize
from hexrl.gpus import GPU, canonical_name, gpu_type_name, profile_path, read_profile

WARMUP = 2  # steps left out of the measured step time, as `hexrl.plan simulate --warmup` does
TARGETS = {"wall_s": 240.0, "heldout_gain": 0.10, "step_error": 0.15}


def gpu_type() -> str:
    """The catalogue name of CUDA device 0 (from its name: 'NVIDIA H100 80GB HBM3' -> H100), else H100."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0)
    if canonical_name(found := gpu_type_name(name)):
        return found
    print(f"one_gpu: {name!r} is not in the GPU catalogue; costing it as an H100", file=sys.stderr)
    return "H100"


SMALL = {"batch_size": 16, "group_size": 4, "ppo_minibatches": 2, "eval_every": 2}  # the CPU smoke run's rl
# The warm-started model of gpu_e2e.sh (tools/warm_start.py's flags): the CPU demo's width with 2 heads of 64,
# a head_dim FlashInfer dispatches (hexrl.model.ops.HEAD_DIMS), so the bf16 run goes through FlashInfer, CUDA
# graphs, the split sampler and overlap. On CPU its warm start reached dev 0.445 / held-out 0.416 at step 1000
# (the 4-head demo model's recipe, unchanged otherwise); hidden 256 x 4 heads was still at dev 0.08 at step 775
WARM_SHAPE = ["--hidden", "128", "--heads", "2", "--kv-heads", "1", "--intermediate", "256"]


def write_job(config: Path, run: Path, gpu: str, small: bool = False) -> Path:
    """The config with this run's model, out_dir and GPU type; `small`: SMALL's batch (a CPU smoke run).
    On CPU the dtypes become float32 (the config's bf16 is the GPU's rollout path)."""
    job = json.loads(config.read_text())
    if gpu == "cpu":
        for role in ("trainer", "rollout"):
            job.setdefault("runtime", {}).setdefault(role, {})["dtype"] = "float32"
    if small:
        job["rl"].update(SMALL)
        job["data"]["synthetic"]["n_heldout"] = 100  # the warm start's --n-heldout: the same split
    job["model"] = {"path": str((run / "model").resolve())}
    job["out_dir"] = str(run)
    job["cluster"]["nodes"][0]["gpu_type"] = gpu
    (run / "job.json").write_text(json.dumps(job, indent=1) + "\n")
    return run / "job.json"


def measured_step_s(rows: list[dict]) -> float | None:
    """Wall seconds per step after WARMUP steps (wall_s leaves evaluation out), the last step (its
    final checkpoint and export) left out; None with too few steps."""
    if len(rows) < WARMUP + 2:
        return None
    return (rows[-2]["wall_s"] - rows[WARMUP - 1]["wall_s"]) / (len(rows) - 1 - WARMUP)


def trainer_mfu(plan, rows: list[dict]) -> tuple[float, float]:
    """(MFU, training FLOP/s): measured training tokens/s times the cost model's FLOPs per trained
    token, over the catalogue's bf16 peak of the plan's GPU (the planner's denominator)."""
    from hexrl.plan.cost import CostModel

    cm = CostModel(plan.job)
    flops_per_token = cm.train_flops() / cm.w.tokens
    after = rows[WARMUP:] or rows
    rate = sum(r["train_tokens_per_s"] for r in after) / len(after)
    achieved = rate * flops_per_token
    return achieved / cm.gpus[plan.ranks[0].gpu_type].flops, achieved


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def priced_by(gpu_type: str) -> str:
    """Which profile (the one hexrl.gpus.gpu reads) and which of its keys priced the plan; the rest
    are catalogue figures (train_overhead_s among them: 0 when the profile lacks it)."""
    path = profile_path(gpu_type)
    if path is None:
        return "cost model: catalogue figures (no profile: tools/bench/bench_kernels.py writes one)"
    keys = read_profile(gpu_type)
    rest = sorted({f.name for f in fields(GPU)} - {"name"} - set(keys))
    return (f"cost model: the measured profile {path}, keys " + ", ".join(f"{k}={v:.4g}" for k, v in keys.items())
            + f"; catalogue: {', '.join(rest)}")


def measurements(run: Path, plan, rows: list[dict], step: float | None) -> list[str]:
    """Step time, decode tokens/s, trainer MFU, weight-sync seconds, predicted vs measured step."""
    engine = _read_json(run / "engine" / "replica0.json") or {}
    mfu, flops = trainer_mfu(plan, rows)
    syncs = [r["weight_sync_s"] for r in rows[:-1]] or [0.0]  # the last step sends nothing
    rollout = sum(r["rollout_tokens_per_s"] for r in rows) / len(rows)
    split = ", ".join(f"{k} {v:g}" for k, v in plan.job.colocate.to_dict().items())
    lines = [f"device: {plan.ranks[0].gpu_type}, trainer rank 0 and rollout rank 1 on device 0; memory split {split}",
             f"step time: {step:.3f} s measured (steps {WARMUP + 1}..{len(rows) - 1})" if step
             else "step time: too few steps to measure"]
    if engine.get("seconds"):
        lines.append(f"decode: {engine['generated_tokens'] / engine['seconds']:.0f} generated tokens/s while the "
                     f"engine steps (mean batch {engine['mean_batch']:.1f}); {rollout:.0f} tokens/s over the run")
    lines += [f"trainer: MFU {mfu:.2%} of the bf16 peak ({flops / 1e9:.2f} GFLOP/s)",
              f"weight sync: {sum(syncs) / len(syncs):.4f} s mean, {max(syncs):.4f} s max per step",
              mismatch_line(rows)]
    after = rows[WARMUP:-1] or rows
    b = plan.predicted["breakdown"]
    lines.append(f"per step, measured vs planned: train {sum(r['train_s'] for r in after) / len(after):.4f} s vs "
                 f"{b['train_s']:.4f} s, waiting for rollouts {sum(r['wait_s'] for r in after) / len(after):.4f} s "
                 f"(planned rollout {b['rollout_s']:.4f} s), sync vs {b['weight_sync_s']:.4f} s")
    lines.append(priced_by(plan.ranks[0].gpu_type))
    sim = _read_json(run / "simulate.json")
    if sim and step:
        lines.append(f"predicted vs measured step: cost model {sim['predicted_step_s']:.3f} s, simulator "
                     f"{sim['step_time_s']:.3f} s, measured {step:.3f} s "
                     f"(cost model {sim['predicted_step_s'] / step - 1:+.1%})")
    return lines


def mismatch_line(rows: list[dict]) -> str:
    """The rollout-trainer log-prob mismatch over the run's lag-0 tokens (token-weighted mean, worst p99)."""
    got = [r for r in rows if r.get("logprob_mismatch_tokens")]
    if not got:
        return "rollout-trainer log-prob mismatch: no lag-0 tokens measured"
    n = sum(r["logprob_mismatch_tokens"] for r in got)
    mean = sum(r["logprob_mismatch_mean"] * r["logprob_mismatch_tokens"] for r in got) / n
    return (f"rollout-trainer log-prob mismatch |behaviour - proximal| over {n} lag-0 tokens: mean {mean:.2e}, "
            f"p99 <= {max(r['logprob_mismatch_p99'] for r in got):.2e} (worst step)")


def checks(run: Path, rows: list[dict], step: float | None, total_s: float | None) -> list[tuple[str, bool, str]]:
    """(target, met, detail) for each target of the one-GPU run."""
    evals, sim = read_evals(run), _read_json(run / "simulate.json")
    gain = evals[-1]["heldout_accuracy"] - evals[0]["heldout_accuracy"] if len(evals) > 1 else None
    last, parts = rows[-1], ("trained", "filtered", "dropped", "pending")
    error = abs(sim["predicted_step_s"] / step - 1) if sim and step else None
    return [
        ("wall time <= 240 s", total_s is not None and total_s <= TARGETS["wall_s"], f"{total_s} s"),
        ("held-out gain >= 10 points", gain is not None and gain >= TARGETS["heldout_gain"],
         f"{gain:+.3f}" if gain is not None else "no evaluations"),
        ("trajectory accounting balances",
         last["trajectories_produced"] == sum(last[f"trajectories_{k}"] for k in parts), ""),
        ("predicted step within 15%", error is not None and error <= TARGETS["step_error"],
         f"{error:.1%} off" if error is not None else "not measured"),
    ]


def report(run: Path, launch_s: float | None, total_s: float | None) -> tuple[str, bool]:
    """The report's text and whether every target was met."""
    from hexrl.schema import load_plan

    plan = load_plan(run / "plan.json", check_paths=False)
    rows = read_metrics(run / "metrics.jsonl") if (run / "metrics.jsonl").is_file() else []
    if not rows:
        return summarize(run, launch_s), False
    step = measured_step_s(rows)
    found = checks(run, rows, step, total_s)
    verdicts = "; ".join(f"{name}: {'MET' if ok else 'NOT MET'}{f' ({why})' if why else ''}" for name, ok, why in found)
    lines = [summarize(run, launch_s), *measurements(run, plan, rows, step), "targets: " + verdicts]
    return "\n".join(lines), all(ok for _, ok, _ in found)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tools/one_gpu.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("gpu")
    sub.add_parser("warm-shape", help="the warm start's model-shape flags")
    j = sub.add_parser("job")
    j.add_argument("config", type=Path)
    j.add_argument("run", type=Path)
    j.add_argument("gpu_type")
    j.add_argument("--small", action="store_true", help="a small batch and frequent evaluation (CPU smoke run)")
    r = sub.add_parser("report")
    r.add_argument("run", type=Path)
    r.add_argument("--launch-s", type=float, default=None)
    r.add_argument("--total-s", type=float, default=None)
    a = p.parse_args(argv)
    if a.cmd == "gpu":
        print(gpu_type())
    elif a.cmd == "warm-shape":
        print(" ".join(WARM_SHAPE))
    elif a.cmd == "job":
        print(write_job(a.config, a.run, a.gpu_type, a.small))
    else:
        text, _ = report(a.run, a.launch_s, a.total_s)
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
