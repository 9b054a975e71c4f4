"""Sequence packing and the trainer grid's rank/peer arithmetic (no processes needed)."""
import random

import pytest
import torch

from hexrl.schema import TrainerLayout
from hexrl.train.packing import build_micro_batch, check_trajectories, input_length, plan_step
from hexrl.trajectory import Trajectory


def batch(n=20, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, c = rng.randint(1, 30), rng.randint(1, 40)
        out.append(Trajectory(i // 4, [rng.randrange(100) for _ in range(p)], [rng.randrange(100) for _ in range(c)],
                              [-float(j) for j in range(c)], [0] * c, reward=float(i % 2)))
    return out


def test_micro_batch_layout():
    a = Trajectory(0, [5, 6, 7], [8, 9], [-0.1, -0.2], [0, 0])
    b = Trajectory(0, [1], [2, 3, 4], [-1.0, -2.0, -3.0], [0, 0, 0])
    mb = build_micro_batch([a, b], [0, 1], adv=[0.5, -0.5])
    assert mb.input_ids.tolist() == [5, 6, 7, 8, 1, 2, 3]  # each sequence minus its last token
    assert mb.positions.tolist() == [0, 1, 2, 3, 0, 1, 2]  # restart per sequence
    assert mb.seq_lens == [4, 3] and mb.completion_lens == [2, 3]
    assert mb.loss_index.tolist() == [2, 3, 4, 5, 6]  # the rows whose logits predict 8, 9, 2, 3, 4
    assert mb.targets.tolist() == [8, 9, 2, 3, 4]
    assert mb.adv.tolist() == [0.5, 0.5, -0.5, -0.5, -0.5]
    assert mb.behav.tolist() == pytest.approx([-0.1, -0.2, -1.0, -2.0, -3.0])


def test_plan_covers_every_sequence_once_within_budget_and_balanced():
    trajs = batch(40)
    seqs = list(range(0, 40, 1))
    adv = [float(i) for i in range(40)]
    plans = plan_step(trajs, seqs, adv, minibatches=2, dp=3, micro_batch_tokens=64)
    seen = [i for p in plans for rank in p.micro_batches for mb in rank for i in mb.seqs]
    assert sorted(seen) == seqs
    for p in plans:
        members = [i for rank in p.micro_batches for mb in rank for i in mb.seqs]
        assert p.num_loss_tokens == sum(len(trajs[i].completion_ids) for i in members)
        loads = [sum(mb.num_tokens for mb in rank) for rank in p.micro_batches]
        assert max(loads) - min(loads) <= max(input_length(trajs[i]) for i in members)  # greedy LPT bound
        for rank in p.micro_batches:
            for mb in rank:
                assert mb.num_tokens <= 64 or len(mb.seqs) == 1  # only a lone oversize sequence exceeds
                for k, i in enumerate(mb.seqs):  # targets and advantages line up with their sequence
                    start = sum(mb.completion_lens[:k])
                    assert mb.targets[start:start + mb.completion_lens[k]].tolist() == trajs[i].completion_ids
                    assert (mb.adv[start:start + mb.completion_lens[k]] == adv[i]).all()
    again = plan_step(trajs, seqs, adv, minibatches=2, dp=3, micro_batch_tokens=64)  # every rank agrees
    assert [[[mb.seqs for mb in r] for r in p.micro_batches] for p in again] == \
        [[[mb.seqs for mb in r] for r in p.micro_batches] for p in plans]


def test_bad_trajectories_reported_together():
    bad = [Trajectory(0, [], [1], [-1.0], [0]), Trajectory(0, [1], [2, 3], [-1.0], [0, 0], reward=float("nan")),
           Trajectory(0, [1], [200], [-1.0], [0])]
    with pytest.raises(ValueError) as e:
        check_trajectories(bad, vocab_size=100)
    msg = str(e.value)
    assert "4 problem(s)" in msg and "trajectories[0].prompt_ids" in msg and "trajectories[1].logprobs" in msg
    assert "trajectories[1].reward" in msg and "trajectories[2]: token ids outside [0, 100): [200]" in msg


def test_layout_ranks_and_mixed_tp_peers():
    layout = TrainerLayout.from_dict({"dp": 2, "stages": [{"tp": 2, "layers": [0, 3]}, {"tp": 1, "layers": [3, 4]},
                                                   {"tp": 4, "layers": [4, 6]}]}, num_layers=6)
    assert layout.world_size == 2 * (2 + 1 + 4)
    assert [layout.rank(0, 1, t) for t in range(2)] == [2, 3]
    assert layout.rank(1, 1, 0) == 5 and layout.rank(2, 0, 3) == 9
    assert all(layout.coord(layout.rank(*c)) == c for c in layout.slots())
    # stage 0 (tp 2) -> stage 1 (tp 1): only tp rank 0 sends; the one receiver gets gradients back to both
    assert layout.act_targets(0, 1, 0) == [5] and layout.act_targets(0, 1, 1) == []
    assert layout.act_source(1, 1, 0) == 2 and layout.grad_targets(1, 1, 0) == [2, 3]
    assert layout.grad_source(0, 1, 1) == 5
    # stage 1 (tp 1) -> stage 2 (tp 4): one sender feeds all four
    assert layout.act_targets(1, 0, 0) == [6, 7, 8, 9] and layout.act_source(2, 0, 3) == 4
    assert layout.grad_source(1, 0, 0) == 6
    assert layout.grad_targets(2, 0, 0) == [4] and layout.grad_targets(2, 0, 1) == []
    # every send has exactly one matching receive
    for s, d, t in layout.slots():
        for r in layout.act_targets(s, d, t):
            assert layout.act_source(*layout.coord(r)) == layout.rank(s, d, t)
        for r in layout.grad_targets(s, d, t):
            assert layout.grad_source(*layout.coord(r)) == layout.rank(s, d, t)
    explicit = TrainerLayout.from_dict({"dp": 1, "stages": [{"tp": 2, "layers": [0, 2]}], "ranks": [7, 3]})
    assert explicit.rank(0, 0, 1) == 3 and explicit.coord(7) == (0, 0, 0) and explicit.coord(0) is None


def test_layout_problems_listed_at_once():
    with pytest.raises(ValueError) as e:
        TrainerLayout.from_dict({"dp": 0, "stages": [{"tp": 0, "layers": [0, 2]}, {"tp": 1, "layers": "x"}]})
    msg = str(e.value)
    assert "layout.dp" in msg and "layout.stages[0].tp" in msg and "layout.stages[1].layers" in msg
    with pytest.raises(ValueError, match=r"stages\[1\].layers: \[3, 4\) must start at 2(.|\n)*model has 5 layers"):
        TrainerLayout.from_dict({"dp": 1, "stages": [{"tp": 1, "layers": [0, 2]}, {"tp": 1, "layers": [3, 4]}]},
                                num_layers=5)
    with pytest.raises(ValueError, match="2 ranks given, the grid has 3 slots"):
        TrainerLayout.from_dict({"dp": 1, "stages": [{"tp": 3, "layers": [0, 1]}], "ranks": [0, 1]})


def test_packing_tensors_are_int64_and_float32():
    mb = build_micro_batch(batch(4), [0, 1], adv=[1.0] * 4)
    assert mb.input_ids.dtype == mb.loss_index.dtype == mb.targets.dtype == torch.int64
    assert mb.behav.dtype == mb.adv.dtype == torch.float32
