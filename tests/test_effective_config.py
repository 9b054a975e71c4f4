"""The plan drives the runtime: every knob the cost model assumes is in plan.json, and the run
uses exactly those values (RUN_DIR/effective_config.json, written by rank 0, says so)."""
import json
import os
import signal

import pytest
from runtime_utils import ROOT, torchrun, wait_for, write_job
from test_plan import hetero_job

from hexrl.model.tiny import make_tiny_model
from hexrl.plan.cost import CostModel
from hexrl.plan.cost_inputs import MIN_MICRO_TOKENS
from hexrl.plan.planner import plan_candidate, plan_job
from hexrl.schema import ConfigError, load_job, load_plan
from hexrl.train import TrainConfig


def long_job(max_new: int, **over) -> dict:
    """14B on four H20s (TP 4): activations of 16k-token micro-batches fit only with recompute."""
    job = hetero_job(layout={"train_gpus": 4, "train_gpu_type": "H20", "tp": 4, "pp": 1, "dp": 1, "rollout_tp": 1},
                     model={"preset": "r1-distill-qwen-14b"}, **over)
    job["rl"]["max_new_tokens"] = max_new
    job["workload"]["output_len"] = {"mean": max_new / 3, "max": max_new}
    return job


@pytest.mark.parametrize("max_new,recompute", [(4096, False), (16384, True)])
def test_plan_records_the_knobs_the_cost_model_assumed(max_new, recompute):
    plan = plan_job(load_job(long_job(max_new)))
    k = plan.train_knobs
    assert k.activation_checkpointing is recompute is plan.predicted["activation_recompute"]
    assert k.micro_batch_tokens == max(4096, 256 + max_new)  # the longest sequence, short ones packed to 4096
    assert MIN_MICRO_TOKENS == TrainConfig().micro_batch_tokens  # the planner's floor is the trainer's default
    assert (k.dtype, k.grad_reduce_dtype) == ("bfloat16", "float32")
    cm = CostModel(plan.job)
    costed = plan_candidate(cm, plan)  # re-costing the written plan gives the same replicas
    for rep, r in zip(plan.replicas, costed.rollout.replicas):
        assert rep.knobs.max_running == r.batch
        assert rep.knobs.max_batch_tokens >= rep.knobs.max_running
        page = cm.kv_bytes_per_token(rep.tp) * rep.knobs.page_size
        assert rep.knobs.kv_pages * page <= cm.usable_bytes(rep.gpu_type)  # within the KV memory costed
    again = load_plan(plan.to_dict(), check_paths=False)  # plan.json round trip
    assert again.train_knobs == k and [r.knobs for r in again.replicas] == [r.knobs for r in plan.replicas]


def test_job_overrides_are_costed_and_recorded():
    runtime = {"trainer": {"micro_batch_tokens": 8192, "activation_checkpointing": True},
               "rollout": {"max_running": 16, "page_size": 32}}
    plan = plan_job(load_job(long_job(4096, runtime=runtime)))
    assert plan.train_knobs.micro_batch_tokens == 8192 and plan.train_knobs.activation_checkpointing
    assert plan.predicted["activation_recompute"] is True  # the cost model ran with the override
    assert CostModel(plan.job).w.micro_tokens == 8192
    assert all((r.knobs.max_running, r.knobs.page_size) == (16, 32) for r in plan.replicas)
    assert plan.to_dict()["runtime"] == runtime  # the plan keeps the job's request too


def test_bad_knobs_are_refused_naming_each_field():
    job = long_job(4096, runtime={"trainer": {"dtype": "fp8", "grad_reduce_dtype": "bfloat16"},
                                  "rollout": {"max_runing": 4}})
    with pytest.raises(ConfigError) as e:
        load_job(job)
    text = str(e.value)
    for field in ("runtime.trainer.dtype", "runtime.trainer.grad_reduce_dtype", "runtime.rollout.max_runing"):
        assert field in text, text
    plan = plan_job(load_job(long_job(4096))).to_dict()
    plan["rollout"]["replicas"][0]["max_batch_tokens"] = plan["rollout"]["replicas"][0]["max_running"] - 1
    plan["trainer"]["micro_batch_tokens"] = 0
    with pytest.raises(ConfigError) as e:
        load_plan(plan, check_paths=False)
    assert "rollout.replicas[0].max_batch_tokens" in str(e.value) and "trainer.micro_batch_tokens" in str(e.value)


def demo_plan(tmp_path):
    """tools/configs/cpu_demo.json on the tiny model (the demo's warm start is not needed here)."""
    job = json.loads((ROOT / "tools" / "configs" / "cpu_demo.json").read_text())
    make_tiny_model(tmp_path / "model", tokenizer="char")
    job["model"] = {"path": str(tmp_path / "model")}
    plan = plan_job(load_job(job))
    plan.save(tmp_path / "plan.json")
    return tmp_path / "plan.json"


def expected(plan: dict) -> dict:
    """What effective_config.json must hold: the plan's values under the plan's key names."""
    train = {k: plan["trainer"][k] for k in ("activation_checkpointing", "micro_batch_tokens", "dtype",
                                              "grad_reduce_dtype")}
    train.update({k: plan["rl"][k] for k in ("lr", "grad_clip", "warmup_steps", "lr_decay_steps", "lr_final_frac",
                                           "weight_decay", "ppo_minibatches")})
    keys = ("id", "max_running", "max_batch_tokens", "kv_pages", "page_size", "dtype")
    return {"train": train, "rollout": {"replicas": [{k: r[k] for k in keys} for r in plan["rollout"]["replicas"]]},
            "groups": expected_groups(plan)}


def expected_groups(plan: dict) -> list[dict]:
    """Every process group of a data-parallel trainer plan on CPU, in creation order: all gloo. Each
    trainer rank (a DP replica) sends its share of the weights over its own group."""
    train = [r["rank"] for r in plan["ranks"] if r["role"] == "train"]
    roll = [r["rank"] for r in plan["ranks"] if r["role"] == "rollout"]
    gloo = [{"name": "world", "ranks": sorted(train + roll)}, {"name": f"trainer{train}", "ranks": train},
            {"name": f"dp{train}", "ranks": train}]
    gloo += [{"name": "weight_sync/stage0" + (f"/source{s}" if s else ""), "ranks": sorted([src, *roll]),
              "weights": "broadcast"} for s, src in enumerate(train)]
    return [{**g, "backend": "gloo"} for g in gloo]


@pytest.mark.parametrize("which", ["cpu demo", "activation checkpointing"])
def test_effective_config_equals_the_plan(tmp_path, which):
    if which == "cpu demo":
        path = demo_plan(tmp_path)
    else:
        path = write_job(tmp_path, runtime={"trainer": {"activation_checkpointing": True}}, warmup_steps=3,
                         lr_decay_steps=20, lr_final_frac=0.25, weight_decay=0.01, grad_clip=0.5)
    plan = json.loads(path.read_text())
    assert (plan["trainer"]["activation_checkpointing"] is True) == (which == "activation checkpointing")
    run = tmp_path / "run"
    proc = torchrun(path, run)
    try:  # rank 0 writes the file once every role has built its trainer or engine; no step is needed
        assert wait_for(lambda: (run / "effective_config.json").exists(), 240, proc), proc.stdout.read()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher (its ranks run in sessions of their own)
        proc.wait()
        proc.stdout.close()  # the ranks' stderr now leads nowhere: they must end all the same
    assert json.loads((run / "effective_config.json").read_text()) == expected(plan)
    # the orphaned ranks notice their launcher is gone and exit (they once ran on for 30 minutes:
    # the watchdog's message to the closed pipe raised, and its thread died before os._exit)
    assert wait_for(lambda: not ranks_running(str(path)), 30), ranks_running(str(path))


def ranks_running(plan_path: str) -> list[int]:
    """Pids of live processes whose command line names this plan."""
    pids = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if plan_path.encode() in f.read() and d.isdigit():
                    pids.append(int(d))
        except OSError:
            continue
    return pids


def test_dp_all_reduce_is_costed_in_the_dtype_the_trainer_reduces_in():
    cm = CostModel(load_job(long_job(4096)))
    assert cm.train.grad_reduce_bytes == 4  # plan.trainer.grad_reduce_dtype == "float32"
    args = ("H800", 2, 4, 1, 0, 1, None, False)  # tp 2, dp 4, one stage, all on one node
    fp32 = cm.stage_coeffs(*args).per_layer
    cm = CostModel(load_job(long_job(4096)))  # a fresh one: the model caches its stage times
    cm.train.grad_reduce_bytes = 2
    bf16 = cm.stage_coeffs(*args).per_layer
    nvlink = cm.cluster.intra_GBps("H800") * 1e9  # ring all-reduce: 2 (dp - 1) / dp of the bytes, per minibatch
    extra = cm.w.minibatches * 2 * 3 / 4 * (4 - 2) / 2 / nvlink * cm.layer_params
    assert fp32 - bf16 == pytest.approx(extra, rel=1e-9)
