"""One GPU runs the whole loop: a trainer rank and a rollout replica colocated on one device.

Planned (roles, devices, the memory split, the shared-device step time), refused with the field
named when it cannot fit, launched under torchrun on CPU (two ranks declaring one device, gloo),
and the CUDA IPC handle that carries weights between the two processes on a GPU.
"""
import json
import math
import os
import signal
import sys

import msgpack
import pytest
import torch
from runtime_utils import ROOT, metrics, torchrun, write_job

from hexrl.comm import cuda_ipc
from hexrl.gpus import CATALOGUE
from hexrl.model.tiny import make_tiny_model
from hexrl.plan.planner import plan_job
from hexrl.plan.shared_gpu import shared_step
from hexrl.plan.simulate import simulate
from hexrl.schema import ConfigError, load_job, load_plan
from hexrl.schema.plan import _world_problems
from tools import one_gpu


def colocated_job(tmp_path, gpu_type: str = "cpu", **colocate) -> dict:
    model = tmp_path / "model"
    if not model.exists():
        make_tiny_model(model, tokenizer="char")
    return {
        "name": "colocated", "model": {"path": str(model)},
        "data": {"synthetic": {"task": "arithmetic", "n": 100, "seed": 0, "digits": [1, 1], "ops": "+"}},
        "reward": {"name": "exact"},
        "rl": {"batch_size": 8, "group_size": 4, "eta": 1, "max_new_tokens": 3, "steps": 3},
        "cluster": {"nodes": [{"name": "box", "gpu_type": gpu_type, "gpus": 1}]},
        "colocate": colocate,
    }


def page_bytes(plan) -> int:
    """One KV page of the replica, by hand from the model's shape: K and V, every layer."""
    c, k = plan.job.model.config, plan.replicas[0].knobs
    elem = 4 if k.dtype == "float32" else 2
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * k.page_size * elem


@pytest.mark.parametrize("gpu_type", ["cpu", "H100"])
def test_colocated_plan_puts_both_roles_on_one_device_and_splits_its_memory(tmp_path, gpu_type):
    plan = plan_job(load_job(colocated_job(tmp_path, gpu_type)))
    assert [(x.rank, x.role, x.node, x.local_rank, x.device) for x in plan.ranks] == \
        [(0, "train", 0, 0, 0), (1, "rollout", 0, 1, 0)]
    assert plan.ranks_per_node == 2 and plan.device_ranks() == {(0, 0): [0, 1]}
    assert (plan.trainer.dp, plan.trainer.pp, plan.trainer.stages[0].tp) == (1, 1, 1)
    assert [(r.tp, r.ranks, r.share) for r in plan.replicas] == [(1, [1], 1.0)]
    col, hbm = plan.job.colocate, CATALOGUE[gpu_type].hbm_bytes
    assert col.complete and col.train_fraction + col.rollout_fraction <= 1 and col.kv_fraction < col.rollout_fraction
    assert plan.replicas[0].knobs.kv_pages * page_bytes(plan) <= col.kv_fraction * hbm  # the pool fits its share
    assert plan.job.model.config.num_params * 18 <= col.train_fraction * hbm  # weights, grads and Adam fit
    again = load_plan(plan.to_dict(), check_paths=False)  # plan.json round trip, devices and split included
    assert [x.device for x in again.ranks] == [0, 0] and again.job.colocate == col


def test_shared_device_step_is_priced_from_the_breakdown(tmp_path):
    """step = max(train, gen + reward, train + u gen) + sync with eta >= 1, from the plan's own numbers."""
    plan = plan_job(load_job(colocated_job(tmp_path)))
    pr = plan.predicted
    b, u = pr["breakdown"], pr["colocate"]["rollout_device_busy"]
    gen = b["rollout_s"] + b["reward_s"]
    shared = max(b["train_s"], gen, b["train_s"] + u * b["rollout_s"])
    assert 0 < u <= 1
    assert pr["step_time_s"] == pytest.approx(shared + b["weight_sync_s"], rel=1e-3)
    assert pr["colocate"]["stretch"] == pytest.approx(shared / max(b["train_s"], gen), rel=1e-3)
    assert pr["step_time_s"] > max(b["train_s"], gen) + b["weight_sync_s"]  # each role slows the other
    res = simulate(plan, steps=8, warmup=2)  # the simulator runs the shared plan (both roles stretched)
    assert res.predicted_step_s == pytest.approx(pr["step_time_s"], rel=1e-3)
    assert res.step_time_s > 0


class _Eta:
    def __init__(self, eta):
        self.w = type("W", (), {"eta": eta})()


def test_shared_step_by_hand():
    # asynchronous: the device must do both roles' device work; each is stretched by the same k
    assert shared_step(_Eta(1), 2.0, 1.0, 0.0, 0.1, 0.5) == pytest.approx((2.5 + 0.1, 1.25))
    assert shared_step(_Eta(1), 2.0, 1.0, 0.0, 0.1, 0.0) == pytest.approx((2.1, 1.0))  # all host work: no contention
    assert shared_step(_Eta(None), 1.0, 3.0, 0.0, 0.0, 1.0) == pytest.approx((4.0, 4 / 3))
    assert shared_step(_Eta(1), 1.0, 1.0, 1.0, 0.0, 0.5) == pytest.approx((2.0, 1.0))  # the reward is host work
    assert shared_step(_Eta(0), 2.0, 1.0, 0.5, 0.1, 1.0) == pytest.approx((3.6, 1.0))  # in turn: no overlap


def test_a_fixed_kv_fraction_is_kept_and_bounds_the_pool(tmp_path):
    plan = plan_job(load_job(colocated_job(tmp_path, "H100", kv_fraction=0.01)))
    assert plan.job.colocate.kv_fraction == 0.01
    assert plan.replicas[0].knobs.kv_pages * page_bytes(plan) <= 0.01 * CATALOGUE["H100"].hbm_bytes


def problems(fn, *args) -> str:
    with pytest.raises(ConfigError) as e:
        fn(*args)
    return str(e.value)


def test_bad_colocations_name_the_field(tmp_path):
    job = colocated_job(tmp_path, train_fraction=0.7, rollout_fraction=0.4)
    text = problems(load_job, job)
    assert "colocate.train_fraction, colocate.rollout_fraction" in text and "at most 1" in text, text
    job = colocated_job(tmp_path, kv_fraction=0.3, rollout_fraction=0.2)
    assert "colocate.kv_fraction" in problems(load_job, job)
    job = colocated_job(tmp_path)
    job["cluster"]["nodes"][0]["gpus"] = 2
    assert "colocate: " in problems(load_job, job)
    job = colocated_job(tmp_path)
    job["layout"] = {"train_gpus": 2}
    text = problems(plan_job, load_job(job))
    assert "layout.train_gpus" in text and "more ranks than the device holds" in text, text
    job = colocated_job(tmp_path)
    job["runtime"] = {"rollout": {"kv_pages": None}}
    assert "runtime.rollout.kv_pages" in problems(plan_job, load_job(job))
    job = colocated_job(tmp_path, kv_fraction=0.9)  # leaves the trainer no room on a 4 GB CPU stand-in
    assert "colocate: " in problems(plan_job, load_job(job))


def test_bad_colocated_plans_name_the_field(tmp_path):
    good = plan_job(load_job(colocated_job(tmp_path))).to_dict()
    crowded = json.loads(json.dumps(good))  # a second replica on the shared device: three ranks on it
    crowded["ranks"].append({"rank": 2, "node": 0, "local_rank": 2, "gpu_type": "cpu", "role": "rollout",
                             "replica": 1, "tp": 0, "device": 0})
    crowded["rollout"]["replicas"][0]["share"] = 0.5
    crowded["rollout"]["replicas"].append({**crowded["rollout"]["replicas"][0], "id": 1, "ranks": [2]})
    text = problems(load_plan, crowded, False)
    assert "ranks[2].device" in text and "more than a shared device holds" in text, text
    over = json.loads(json.dumps(good))
    over["colocate"]["train_fraction"] = 0.99
    text = problems(load_plan, over, False)
    assert "colocate.train_fraction, colocate.rollout_fraction" in text, text
    pool = json.loads(json.dumps(good))
    pool["rollout"]["replicas"][0]["kv_pages"] *= 1000
    assert "rollout.replicas[0].kv_pages" in problems(load_plan, pool, False)
    pool["rollout"]["replicas"][0]["kv_pages"] = None  # the engine would take 80% of what is free
    assert "rollout.replicas[0].kv_pages: must be set on a shared GPU" in problems(load_plan, pool, False)
    unplanned = json.loads(json.dumps(good))
    del unplanned["colocate"]["kv_fraction"]
    assert "colocate.kv_fraction: missing" in problems(load_plan, unplanned, False)
    shared = json.loads(json.dumps(good))  # two ranks on one device without colocate
    del shared["colocate"]
    shared["cluster"]["nodes"][0]["gpus"] = 2
    text = problems(load_plan, shared, False)
    assert "ranks[1].device" in text and "only under the job's colocate" in text, text
    plan = load_plan(good, check_paths=False)
    text = " ".join(_world_problems(2, plan.job, 2, 1))
    assert "--nproc_per_node 2" in text and "2 ranks on 1 shared GPU" in text, text


def test_cuda_ipc_handle_is_checked_msgpack_never_pickle():
    good = {"size": [4, 2], "stride": [2, 1], "offset": 0, "dtype": "bfloat16", "device": 0, "handle": b"h" * 64,
            "storage_size": 16, "storage_offset": 0, "ref_handle": b"r" * 8, "ref_offset": 0,
            "event_handle": b"e" * 64, "event_sync": True}
    assert cuda_ipc.decode(cuda_ipc.encode(good)) == good
    for key, bad in [("dtype", "object"), ("handle", "text"), ("size", [4, -1]), ("device", True),
                     ("event_sync", 1), ("stride", [1])]:
        with pytest.raises(ValueError, match=key.split("_")[0]):
            cuda_ipc.decode(cuda_ipc.encode({**good, key: bad}))
    with pytest.raises(ValueError, match="fields"):
        cuda_ipc.decode(cuda_ipc.encode({**good, "rebuild": "os.system"}))


def test_cuda_ipc_handle_of_wrong_types_or_past_its_storage_is_refused_before_mapping():
    """A handle with unhashable dtypes is named (not a raw TypeError); a view past the storage is never mapped."""
    good = {"size": [4, 2], "stride": [2, 1], "offset": 0, "dtype": "bfloat16", "device": 0, "handle": b"h" * 64,
            "storage_size": 16, "storage_offset": 0, "ref_handle": b"r" * 8, "ref_offset": 0,
            "event_handle": None, "event_sync": False}
    assert cuda_ipc.decode(cuda_ipc.encode({**good, "size": [0, 99], "stride": [99, 99]}))  # an empty view
    for key, bad in [("dtype", ["bfloat16"]), ("dtype", {"a": 1}), ("dtype", None), ("size", [4, 3]),
                     ("stride", [3, 1]), ("offset", 1), ("size", [4, 2, 1]), ("storage_size", 15),
                     ("offset", 1 << 63), ("size", [1] * 100), ("storage_size", (1 << 64) - 1)]:
        with pytest.raises(ValueError, match="CUDA IPC handle: bad field"):
            cuda_ipc.decode(cuda_ipc.encode({**good, key: bad}))
    for garbage in (b"\xc1", b"\x92\x01", b""):
        with pytest.raises(ValueError, match="CUDA IPC handle"):
            cuda_ipc.decode(garbage)
    import pickle
    with pytest.raises((ValueError, msgpack.exceptions.ExtraData, msgpack.exceptions.UnpackException)):
        cuda_ipc.decode(pickle.dumps(good))  # a pickle is not read as one
    with pytest.raises(ValueError, match="CUDA tensor"):
        cuda_ipc.export_handle(torch.zeros(2))


def launch_colocated(tmp_path, steps: int, gpu_type: str = "cpu", model_kw: dict | None = None):
    """torchrun with two ranks declaring one device (gloo); returns (plan dict, run dir, output)."""
    path = write_job(tmp_path, steps=steps, colocate={}, eta=1, gpu_type=gpu_type, model_kw=model_kw)
    run = tmp_path / "run"
    proc = torchrun(path, run, nproc=2)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    return json.loads(path.read_text()), run, out


def test_colocated_run_on_cpu(tmp_path):
    plan, run, out = launch_colocated(tmp_path, steps=4)
    assert [(r["role"], r["device"]) for r in plan["ranks"]] == [("train", 0), ("rollout", 0)]
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4], out
    last = rows[-1]
    assert last["trajectories_produced"] == (last["trajectories_trained"] + last["trajectories_filtered"]
                                             + last["trajectories_dropped"] + last["trajectories_pending"])
    assert all(math.isfinite(r["weight_sync_s"]) for r in rows)
    eff = json.loads((run / "effective_config.json").read_text())
    assert eff["colocate"] == plan["colocate"]  # the memory split the run used is the planned one
    assert eff["rollout"]["replicas"][0]["kv_pages"] == plan["rollout"]["replicas"][0]["kv_pages"]
    groups = {g["name"]: g for g in eff["groups"]}
    assert groups["world"] == {"name": "world", "ranks": [0, 1], "backend": "gloo"}
    # members share a device: gloo; on CPU the weights are broadcast over it (CUDA IPC on a GPU)
    assert groups["weight_sync/stage0"] == {"name": "weight_sync/stage0", "ranks": [0, 1], "backend": "gloo",
                                            "weights": "broadcast"}
    assert set(groups) == {"world", "weight_sync/stage0"}  # one trainer rank, TP 1: no other group
    # tools/gpu_e2e.sh's report on this run: the measured step is the wall time of steps 3 (after 2 of
    # warm-up) by hand, the simulator's prediction beside it, the accounting checked
    (run / "plan.json").write_text(json.dumps(plan))  # where gpu_e2e.sh keeps it
    (run / "simulate.json").write_text(json.dumps({"predicted_step_s": 0.5, "step_time_s": 0.6}))
    text, met = one_gpu.report(run, launch_s=30.0, total_s=300.0)
    step = rows[2]["wall_s"] - rows[1]["wall_s"]
    assert f"step time: {step:.3f} s measured (steps 3..3)" in text, text
    assert f"cost model 0.500 s, simulator 0.600 s, measured {step:.3f} s" in text, text
    assert "balanced" in text and "trajectory accounting balances: MET" in text, text
    assert "wall time <= 240 s: NOT MET" in text and not met
    lag0 = sum(r["logprob_mismatch_tokens"] for r in rows)  # the lag-0 mismatch: reported; ~0 on CPU (fp32 both sides)
    assert (f"log-prob mismatch |behaviour - proximal| over {lag0} lag-0 tokens" in text if lag0
            else "no lag-0 tokens measured" in text), text


@pytest.mark.gpu
def test_colocated_run_on_one_gpu_syncs_weights_by_cuda_ipc(tmp_path, monkeypatch):
    """Both transports on one GPU, side by side: CUDA IPC (the default) and a gloo broadcast
    through host memory (HEXRL_COLOCATED_SYNC=gloo); each one's mean weight-sync seconds printed. The device
    is the machine's GPU type, the model bf16 with head_dim 64 (gpu_e2e.sh's shape), so the rollout runs
    FlashInfer, CUDA graphs, the split sampler and overlap."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    shape = {k.lstrip("-").replace("-", "_"): int(v) for k, v in zip(one_gpu.WARM_SHAPE[::2], one_gpu.WARM_SHAPE[1::2])}
    for transport in ("cuda-ipc", "gloo"):
        monkeypatch.setenv("HEXRL_COLOCATED_SYNC", transport)
        (tmp_path / transport).mkdir()
        plan, run, out = launch_colocated(tmp_path / transport, steps=3, gpu_type=one_gpu.gpu_type(), model_kw=shape)
        assert plan["rollout"]["replicas"][0]["dtype"] == plan["trainer"]["dtype"] == "bfloat16", plan
        rows = metrics(run)
        assert [r["step"] for r in rows] == [1, 2, 3], out
        groups = {g["name"]: g for g in json.loads((run / "effective_config.json").read_text())["groups"]}
        assert groups["world"]["backend"] == groups["weight_sync/stage0"]["backend"] == "gloo"  # NCCL refuses
        assert groups["weight_sync/stage0"]["weights"] == ("cuda-ipc" if transport == "cuda-ipc" else "broadcast")
        syncs = [r["weight_sync_s"] for r in rows[:-1]]
        sys.__stderr__.write(f"\ncolocated weight sync by {transport}: {sum(syncs) / len(syncs):.4f} s mean over "
                             f"{len(syncs)} syncs\n")  # past pytest's capture: into gpu_check's pytest.log


def _ipc_child(payload: bytes, q) -> None:
    t = cuda_ipc.import_handle(payload)
    q.put((t.float().sum().item(), str(t.dtype), tuple(t.shape)))
    t.mul_(2)  # the mapping is the sender's memory: it sees this
    torch.cuda.synchronize()
    q.put("done")


@pytest.mark.gpu
def test_cuda_ipc_maps_the_senders_buffer_in_another_process():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import multiprocessing as mp

    src = torch.arange(12, dtype=torch.bfloat16, device="cuda").view(3, 4)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_ipc_child, args=(cuda_ipc.export_handle(src), q))
    p.start()
    total, dtype, shape = q.get(timeout=120)
    assert q.get(timeout=60) == "done"
    p.join(60)
    assert (total, dtype, shape) == (66.0, "torch.bfloat16", (3, 4))
    assert torch.equal(src.float(), torch.arange(12, device="cuda").view(3, 4).float() * 2)


def test_the_one_gpu_config_plans_the_gpu_rollout_path_on_an_h100(tmp_path):
    """tools/configs/one_gpu.json, as tools/gpu_e2e.sh plans it with warm_start's model shape: bf16 on both
    roles and head_dim 64, so the rollout takes FlashInfer, CUDA graphs, the split sampler and overlap; the
    CPU smoke run's job is float32."""
    from hexrl.model.config import ModelConfig
    from hexrl.model.ops import head_dim_problem

    shape = dict(zip(one_gpu.WARM_SHAPE[::2], one_gpu.WARM_SHAPE[1::2]))
    make_tiny_model(tmp_path / "model", hidden=int(shape["--hidden"]), heads=int(shape["--heads"]),
                    kv_heads=int(shape["--kv-heads"]), intermediate=int(shape["--intermediate"]), layers=3)
    assert head_dim_problem(ModelConfig.from_hf(json.loads((tmp_path / "model" / "config.json").read_text()))
                            .head_dim) is None
    config = ROOT / "tools" / "configs" / "one_gpu.json"
    plan = plan_job(load_job(json.loads(one_gpu.write_job(config, tmp_path, "H100").read_text())))
    assert [(x.role, x.device, x.gpu_type) for x in plan.ranks] == [("train", 0, "H100"), ("rollout", 0, "H100")]
    assert plan.train_knobs.dtype == plan.replicas[0].knobs.dtype == "bfloat16"
    assert plan.predicted["colocate"]["stretch"] >= 1 and plan.predicted["step_time_s"] > 0
    cpu = json.loads(one_gpu.write_job(config, tmp_path, "cpu", small=True).read_text())
    assert cpu["runtime"]["trainer"]["dtype"] == cpu["runtime"]["rollout"]["dtype"] == "float32"


def test_a_measured_train_overhead_prices_the_one_gpu_plan(tmp_path, monkeypatch):
    """The one-GPU config (64 x 8 samples of 6 + 3 tokens, 4 PPO minibatches of 1152 tokens: one
    micro-batch each, fwd+bwd and the proximal forward) planned with an H100 profile that has
    train_overhead_s 0.05 and train_fwd_overhead_s 0.02 trains 4 x 0.07 s longer than with the same
    profile without them; the report names the keys that priced it."""
    job = json.loads((ROOT / "tools" / "configs" / "one_gpu.json").read_text())
    job["model"] = {"preset": "tiny"}
    shipped = json.loads((ROOT / "hexrl" / "profiles" / "H100.json").read_text())
    monkeypatch.setenv("HEXRL_PROFILES", str(tmp_path))
    train_s = []
    for extra in ({}, {"train_overhead_s": 0.05, "train_fwd_overhead_s": 0.02}):
        (tmp_path / "H100.json").write_text(json.dumps({**shipped, **extra}))
        train_s.append(plan_job(load_job(job)).predicted["breakdown"]["train_s"])
    assert train_s[1] - train_s[0] == pytest.approx(4 * 0.07, abs=2e-4)  # the breakdown is rounded to 0.1 ms
    line = one_gpu.priced_by("H100")
    assert f"the measured profile {tmp_path / 'H100.json'}" in line and "train_overhead_s=0.05" in line, line
    (tmp_path / "H100.json").write_text(json.dumps(shipped))
    assert "catalogue: " in one_gpu.priced_by("H100") and "train_overhead_s" in one_gpu.priced_by("H100").split(
        "catalogue: ")[1]


@pytest.mark.slow
def test_gpu_e2e_script_cpu_mode(tmp_path):
    """tools/gpu_e2e.sh --cpu: the whole pipeline as a smoke run (a minute or two on a quiet 2-core box)."""
    import subprocess

    env = {**os.environ, "PYTHON": sys.executable, "RUN": str(tmp_path / "run")}
    out = subprocess.run(["bash", "tools/gpu_e2e.sh", "--cpu"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for line in ("held-out accuracy:", "(balanced)", "trainer: MFU", "weight sync:", "predicted vs measured step:",
                 "trajectory accounting balances: MET", "checks the pipeline", "s in all"):
        assert line in out.stdout, out.stdout[-3000:]


def test_groups_whose_ranks_share_a_gpu_are_gloo():
    """Rule 5 of dist_rules: NCCL refuses two ranks on one device; every other group keeps the default."""
    from hexrl.runtime.dist_rules import group_backend

    assert group_backend([(0, 0), (0, 0)]) == "gloo"  # trainer and rollout on device 0
    assert group_backend([(0, 0), (0, 1), (1, 0)]) is None  # one GPU each: NCCL on a GPU
    assert group_backend([(0, 1), (1, 0), (0, 1)]) == "gloo"
