"""Vocab-parallel log-probs and bucketed DP gradient all-reduce in a 2-process gloo world."""

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_world

from hexrl.comm import wire
from hexrl.model.parallel import TPGroup
from hexrl.model.tiny import make_tiny_model
from hexrl.train import TrainConfig, Trainer
from hexrl.train.checkpoint import gather_stage
from hexrl.train.data_parallel import GradBuckets
from hexrl.train.handoff import share_batch
from hexrl.train.linear_logprobs import linear_logprobs
from hexrl.trajectory import Trajectory

# Two PPO mini-batches of one sequence each: with DP 2 one rank has no micro-batch at all.
IDLE_RANK_BATCH = [Trajectory(0, [1, 2, 3], [4, 5, 6, 7], [-4.0] * 4, [0] * 4, reward=1.0),
                   Trajectory(0, [8, 9], [10, 11, 12], [-4.5] * 3, [0] * 3, reward=0.0)]
IDLE_RANK_CONFIG = dict(lr=1e-2, ppo_minibatches=2, bucket_mb=0.01)


def reference(logits, targets, temperature):
    """Full-vocabulary log-probs, entropy and gradient of sum(c * logp) by plain autograd."""
    x = logits.clone().requires_grad_()
    logp = torch.log_softmax(x / temperature, -1)
    out = logp.gather(-1, targets[:, None])[:, 0]
    (out * torch.arange(1.0, len(out) + 1, dtype=out.dtype)).sum().backward()
    entropy = -(logp.exp() * logp).sum(-1)
    return out.detach(), entropy.detach(), x.grad


def case(n=7, vocab=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 3
    targets = torch.tensor([0, 4, 5, 9, 2, 7, 5])[:n]  # both halves of the vocabulary
    return logits, targets


def _vocab_parallel_worker(rank, world):
    logits, targets = case()
    half = logits.shape[1] // world
    x = logits.clone().requires_grad_()
    head = torch.eye(logits.shape[1], dtype=logits.dtype)[rank * half:(rank + 1) * half]  # its logits: x's half
    tp = TPGroup(dist.group.WORLD, rank, world)
    logp, entropy = linear_logprobs(x, head, targets, tp, temperature=0.7, chunk_rows=3)
    (logp * torch.arange(1.0, len(logp) + 1, dtype=logp.dtype)).sum().backward()
    return logp.detach(), entropy, x.grad


def _buckets_worker(rank, world):
    torch.manual_seed(0)  # same initial weights on both ranks
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    buckets = GradBuckets(list(model.parameters()), dist.group.WORLD, bucket_mb=50 * 4 / 2**20)  # 50 floats: 2 buckets
    data = [torch.randn(5, 8, generator=torch.Generator().manual_seed(10 * r + k))
            for r in range(world) for k in range(2)]
    buckets.zero()
    for k in range(2):  # two micro-batches; sync only during the second backward
        buckets.sync = k == 1
        model(data[2 * rank + k]).pow(2).sum().backward()
    launched_in_backward = buckets.launched
    buckets.wait()
    expected = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    expected.load_state_dict(model.state_dict())
    sum(expected(x).pow(2).sum() for x in data).backward()  # every rank's micro-batches
    return {"buckets": len(buckets.buckets), "launched_in_backward": launched_in_backward,
            "grads": [p.main_grad.clone() for p in model.parameters()],
            "expected": [p.grad for p in expected.parameters()],
            "grad_attr_cleared": all(p.grad is None for p in model.parameters())}


def _idle_rank_worker(rank, world, model_path):
    trainer = Trainer(model_path, {"dp": 2, "stages": [{"tp": 1, "layers": [0, 2]}]}, TrainConfig(**IDLE_RANK_CONFIG))
    # as a run hands it over: the controller rank's batch came over the wire (typed arrays), share_batch sends each
    # DP rank its part
    received = [wire.msg_to_trajectory(wire.decode(wire.encode(wire.trajectory_to_msg(t)))) for t in IDLE_RANK_BATCH]
    shared = [(t.completion_ids.dtype.name, t.logprobs.dtype.name, t == u) for t, u in zip(received, IDLE_RANK_BATCH)]
    share = share_batch(received if rank == 0 else None, trainer)
    return trainer.step(share), gather_stage(trainer.model, trainer.grid), shared


def _world_worker(rank, world, model_path):
    return _vocab_parallel_worker(rank, world), _buckets_worker(rank, world), _idle_rank_worker(rank, world, model_path)


def test_vocab_parallel_logprobs_dp_buckets_and_an_idle_dp_rank(tmp_path):
    path = make_tiny_model(tmp_path / "m", layers=2)
    results = run_world(_world_worker, 2, str(path))
    torch.set_num_threads(1)
    single = Trainer(path, {"dp": 1, "stages": [{"tp": 1, "layers": [0, 2]}]}, TrainConfig(**IDLE_RANK_CONFIG))
    metrics = single.step(IDLE_RANK_BATCH)
    (dp_metrics, dp_weights, _) = results[0][2]
    assert [r[2][2] for r in results] == [[("int32", "float32", True)] * 2] * 2  # every rank: the same arrays
    assert dp_metrics["loss"] == pytest.approx(metrics["loss"], abs=1e-6) and dp_metrics["optimizer_steps"] == 2
    for name, w in single.model.state_dict().items():
        torch.testing.assert_close(dp_weights[name], w, rtol=0, atol=1e-6)
    logits, targets = case()
    want_logp, want_entropy, want_grad = reference(logits, targets, 0.7)
    for (logp, entropy, grad), _, _ in results:
        torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-12)  # float64 end to end
        torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=1e-12)
        torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-12)  # the shards' gradients all-reduced
    for _, b, _ in results:
        assert b["buckets"] > 1 and b["launched_in_backward"] == b["buckets"]  # all started inside backward
        assert b["grad_attr_cleared"]
        for got, want in zip(b["grads"], b["expected"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

