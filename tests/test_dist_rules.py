"""Strict collectives (hexrl/runtime/dist_rules.py): each NCCL rule breaks loudly on gloo too, naming itself.

conftest.py turns strict mode on for every test, so these worlds run with the wrapper installed.
"""
import os

import pytest
import torch
import torch.distributed as dist
from dist_utils import WorldError, run_world

from hexrl.runtime import dist_rules


def p2p_without_group(rank, world):
    t = torch.zeros(2)
    op = dist.P2POp(dist.isend if rank == 0 else dist.irecv, t, 1 - rank)
    for w in dist.batch_isend_irecv([op]):
        w.wait()


def first_p2p_missing_a_member(rank, world):
    group = dist.new_group([0, 1, 2])
    if rank == 2:  # a member that never takes part: NCCL would wait for it forever
        return None
    ops = [dist.P2POp(dist.isend, torch.zeros(1), 1 - rank, group),
           dist.P2POp(dist.irecv, torch.zeros(1), 1 - rank, group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()


def warmed_up_group(rank, world):
    group = dist.new_group([0, 1])
    dist_rules.warm_up([group], torch.device("cpu"))  # a collective first: the communicator exists
    got = torch.full((1,), float(rank))
    ops = [dist.P2POp(dist.isend, got.clone(), 1 - rank, group), dist.P2POp(dist.irecv, got, 1 - rank, group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return got.item()


def object_collective(rank, world):
    dist.broadcast_object_list([{"a": 1}], src=0)


def tensor_off_the_compute_device(rank, world):
    dist_rules.declare_device("meta")  # pretend this rank computes elsewhere: a CPU tensor must be refused
    dist.all_reduce(torch.zeros(1))


def host_collective_is_allowed_when_asked(rank, world):
    dist_rules.declare_device("meta")
    with dist_rules.host_collective():
        t = torch.ones(1)
        dist.all_reduce(t)
    return t.item()


@pytest.mark.parametrize("worker,rule", [
    (p2p_without_group, "names no group"),
    (object_collective, "pickles Python objects"),
    (tensor_off_the_compute_device, "computes on meta"),
])
def test_each_rule_raises_at_the_call(worker, rule):
    with pytest.raises(WorldError, match=rule):
        run_world(worker, 2)


def test_a_member_missing_from_the_first_p2p_is_named(monkeypatch):
    monkeypatch.setenv("HEXRL_STRICT_TIMEOUT_S", "3")  # read by the spawned ranks at import
    with pytest.raises(WorldError, match=r"group \[0, 1, 2\] but ranks \[2\] did not"):
        run_world(first_p2p_missing_a_member, 3, timeout=60)


def test_what_follows_the_rules_runs():
    assert run_world(warmed_up_group, 2) == [1.0, 0.0]
    assert run_world(host_collective_is_allowed_when_asked, 2) == [2.0, 2.0]


def test_strict_mode_is_on_in_the_test_suite():
    assert os.environ.get(dist_rules.ENV) == "1"


# ---------------------------------------------------------------- GPU: the device rule bites

def dp2_step_on_one_gpu(rank, world, model_path):
    """Two DP ranks sharing cuda:0 over gloo (NCCL refuses a shared device): every collective
    tensor must be on cuda:0, also the gradient-norm sum of the replica that counts nothing."""
    from test_train_parallel import make_batch

    from hexrl.train import TrainConfig, Trainer

    dist_rules.declare_device("cuda:0")
    t = Trainer(model_path, {"dp": 2, "stages": [{"tp": 1, "layers": [0, 2]}]},
                TrainConfig(micro_batch_tokens=32, ppo_minibatches=2), device="cuda:0")
    return t.step(make_batch(0))["grad_norm"]


def weight_buckets_stay_on_the_gpu(rank, world):
    from hexrl.comm.weights import ShardSender, SyncLink, receive_shards, shard_layout
    from hexrl.model.config import ModelConfig
    from hexrl.model.tiny import tiny_config

    dist_rules.declare_device("cuda:0")
    cfg = ModelConfig.from_hf(tiny_config(tie=False))
    lay = shard_layout(cfg, (0, cfg.num_hidden_layers), 1, 1, torch.bfloat16)
    link = SyncLink(0, dist.new_group([0, 1]))
    if rank == 0:
        state = {s.name: torch.randn(s.shape, device="cuda:0") for s in lay.specs}
        sender = ShardSender(lay, 0, 0, delta=True)
        for _ in range(2):  # dense, then a delta encoded on the device
            sender.send(state.get, link, torch.bfloat16)
            state["model.norm.weight"] += 1
        return None
    devices = set()
    for _ in range(2):
        receive_shards(lay, [link], None, torch.bfloat16, torch.device("cuda:0"),
                       lambda part: devices.update(str(v.device) for v in part.values()),
                       lambda name, full: full.zero_())
    return devices


@pytest.mark.gpu
def test_dp2_on_one_gpu_keeps_every_collective_on_the_device(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from hexrl.model.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "m", layers=2, tie=False)
    a, b = run_world(dp2_step_on_one_gpu, 2, path)
    assert a == b > 0


@pytest.mark.gpu
def test_weight_sync_buckets_stay_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert run_world(weight_buckets_stay_on_the_gpu, 2)[1] == {"cuda:0"}
