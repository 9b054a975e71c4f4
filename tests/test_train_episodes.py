"""Training on episodes: observation tokens are context. The trainer's step on multi-turn
trajectories (packed into several micro-batches, log-probs in row chunks) against the plain
single-process reference of test_train_parallel.py, which scores sampled tokens only."""
import random

import pytest
import torch
from test_train_parallel import CONFIG, TOL, reference_step

from hexrl.control.buffer import ReplayBuffer
from hexrl.control.gate import StalenessGate
from hexrl.model.tiny import make_tiny_model
from hexrl.train import TrainConfig, Trainer
from hexrl.train.checkpoint import gather_stage
from hexrl.train.loss import equal_reward_groups
from hexrl.train.packing import plan_step
from hexrl.trajectory import Trajectory


def episode(rng: random.Random, group: int) -> Trajectory:
    """Turns of 1-5 sampled tokens with observations of 1-6 tokens between them (the first turn may
    follow a first observation)."""
    ids, mask = [], []
    if rng.random() < 0.5:
        n = rng.randint(1, 4)
        ids, mask = [rng.randrange(64) for _ in range(n)], [0] * n
    for turn in range(rng.randint(1, 3)):
        if turn:
            n = rng.randint(1, 6)
            ids, mask = ids + [rng.randrange(64) for _ in range(n)], mask + [0] * n
        n = rng.randint(1, 5)
        ids, mask = ids + [rng.randrange(64) for _ in range(n)], mask + [1] * n
    g = sum(mask)
    return Trajectory(group, [rng.randrange(64) for _ in range(rng.randint(2, 6))], ids,
                      [rng.uniform(-6.5, -2.0) for _ in range(g)], [0] * g, reward=float(rng.random() < 0.5),
                      mask=mask)


def episodes(seed: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    out = [episode(rng, g) for g in range(4) for _ in range(4)]
    for t in out[:4]:
        t.reward = 1.0  # group 0: all equal, filtered
    out[5].reward, out[6].reward = 0.0, 1.0  # group 1 surely carries signal
    return out


def test_a_step_on_episodes_scores_sampled_tokens_only(tmp_path):
    path = make_tiny_model(tmp_path / "m", layers=2, tie=True)
    cfg = TrainConfig(**dict(CONFIG, logprob_chunk_rows=5))
    batch = episodes()
    assert any(t.mask[0] == 0 for t in batch) and sum(t.mask.count(0) for t in batch) > 30
    trainer = Trainer(path, {"dp": 1, "stages": [{"tp": 1, "layers": [0, 2]}]}, cfg, device="cpu")
    metrics = trainer.step(batch)
    loss, norm, ref_logprobs, ref_weights = reference_step(path, batch, cfg)
    assert metrics["loss"] == pytest.approx(loss, abs=2e-5) and metrics["grad_norm"] == pytest.approx(norm, rel=1e-4)
    filtered = equal_reward_groups([t.reward for t in batch], [t.group_id for t in batch])
    trained = [i for i, t in enumerate(batch) if t.group_id not in filtered]
    assert 0 in filtered and 1 not in filtered
    assert metrics["tokens"] == sum(batch[i].num_generated for i in trained)  # token counts: sampled only
    for i, lp in ref_logprobs.items():
        assert len(lp) == batch[i].num_generated
        torch.testing.assert_close(trainer.last_logprobs[i], lp, **TOL)
    for name, w in gather_stage(trainer.model, trainer.grid).items():
        torch.testing.assert_close(w, ref_weights[name], **TOL)
    plans = plan_step(batch, trained, [0.0] * len(batch), 2, 1, cfg.micro_batch_tokens)
    assert sum(len(p.micro_batches[0]) for p in plans) > 2  # packing split the episodes


def test_an_episode_is_as_stale_as_its_first_sampled_token():
    """Versions 0 then 2 (a weight update mid-episode): with eta 1 at trainer version 2 it is too stale."""
    t = Trajectory(0, [1], [5, 6, 7, 8], [-1.0, -1.0, -1.0], [0, 2, 2], reward=1.0, mask=[1, 0, 1, 1])
    u = Trajectory(0, [1], [5, 6], [-1.0, -1.0], [2, 2], reward=0.0, mask=[1, 1])
    assert t.oldest_version == 0
    gate = StalenessGate(1, eta=1)
    buf = ReplayBuffer(gate, filter_equal_rewards=False)
    assert gate.try_acquire(0)
    buf.expect(0, 2)
    assert buf.add(t) == "pending" and buf.add(u) == "accepted"
    assert buf.drop_stale(2) == [0] and gate.too_stale == 1
