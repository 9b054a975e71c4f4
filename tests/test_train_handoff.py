"""The trainer hand-off: each DP rank gets, and builds, exactly its part of the all-ranks plan.

The reference is the plan as every rank used to build it, written here with plain lists:
longest-first balancing into mini-batches and DP ranks, first-fit decreasing into micro-batches,
then each micro-batch's tensors from the trajectories' lists.
"""
import random
from types import SimpleNamespace as NS

import msgpack
import numpy as np
import pytest
import torch
from dist_utils import run_world

from hexrl.schema import TrainerLayout
from hexrl.train.grid import build_grid
from hexrl.train.handoff import Stop, decode_share, encode_error, encode_share, share_batch
from hexrl.train.loss import equal_reward_groups, group_advantages
from hexrl.train.packing import RankShare, plan_batch
from hexrl.train.trainer import TrainConfig, Trainer
from hexrl.trajectory import Trajectory

VOCAB = 50


def make_batch(seed: int = 0, groups: int = 6, n: int = 4, arrays: bool = False) -> list[Trajectory]:
    """Random lengths; every third group an episode (mask), some tokens from an older version,
    group 0 all-equal rewards (filtered); `arrays`: fields as numpy arrays instead of lists."""
    rng, out = random.Random(seed), []
    for g in range(groups):
        for _ in range(n):
            p, c = rng.randint(1, 12), rng.randint(1, 20)
            mask = [int(rng.random() < 0.7) for _ in range(c)] if g % 3 == 2 else None
            k = sum(mask) if mask else c
            old = rng.randint(0, k)
            t = Trajectory(g, [rng.randrange(VOCAB) for _ in range(p)], [rng.randrange(VOCAB) for _ in range(c)],
                           [rng.uniform(-5, 0) for _ in range(k)], [3] * old + [4] * (k - old),
                           reward=1.0 if g == 0 else float(rng.random() < 0.5), mask=mask, start_version=3)
            if arrays:
                t.prompt_ids, t.completion_ids = np.asarray(t.prompt_ids), np.asarray(t.completion_ids, np.int32)
                t.logprobs, t.versions = np.asarray(t.logprobs), np.asarray(t.versions)
            out.append(t)
    return out


def reference_plan(trajs, minibatches: int, dp: int, budget: int) -> list[list[list[dict]]]:
    """[mini-batch][dp rank][micro-batch] -> that micro-batch's fields as lists, every rank's."""
    def lpt(sizes, bins):
        out, load = [[] for _ in range(bins)], [0] * bins
        for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
            b = min(range(bins), key=lambda b: (load[b], b))
            out[b].append(i)
            load[b] += sizes[i]
        return out

    def ffd(members):
        bins, load = [], []
        for i in sorted(members, key=lambda i: (-size[i], i)):
            b = next((b for b in range(len(bins)) if load[b] + size[i] <= budget), None)
            if b is None:
                bins.append([])
                load.append(0)
                b = -1
            bins[b].append(i)
            load[b] += size[i]
        return bins

    def build(seqs):
        mb = dict(seqs=seqs, input_ids=[], positions=[], loss_index=[], targets=[], behav=[], adv=[], versions=[])
        for i in seqs:
            t = trajs[i]
            prompt, completion = list(t.prompt_ids), list(t.completion_ids)
            sampled = [j for j in range(len(completion)) if t.mask is None or t.mask[j]]
            start = len(mb["input_ids"]) + len(prompt) - 1
            mb["loss_index"] += [start + j for j in sampled]
            mb["targets"] += [int(completion[j]) for j in sampled]
            seq = (prompt + completion)[:-1]
            mb["input_ids"] += [int(x) for x in seq]
            mb["positions"] += list(range(len(seq)))
            mb["behav"] += torch.tensor(list(t.logprobs), dtype=torch.float32).tolist()
            mb["adv"] += torch.tensor([adv[i]] * len(sampled), dtype=torch.float32).tolist()
            mb["versions"] += [int(v) for v in t.versions]
        return mb

    rewards, gids = [t.reward for t in trajs], [t.group_id for t in trajs]
    adv, dropped = group_advantages(rewards, gids), equal_reward_groups(rewards, gids)
    seqs = [i for i, t in enumerate(trajs) if t.group_id not in dropped]
    size = [len(t.prompt_ids) + len(t.completion_ids) - 1 for t in trajs]
    plans = []
    for part in lpt([size[i] for i in seqs], minibatches):
        mine = [seqs[j] for j in sorted(part)]
        shares = lpt([size[i] for i in mine], dp)
        plans.append([[build(b) for b in ffd([mine[j] for j in sorted(share)])] for share in shares])
    return plans


def as_lists(mbs) -> list[dict]:
    return [dict(seqs=mb.seqs, **{k: getattr(mb, k).tolist() for k in (
        "input_ids", "positions", "loss_index", "targets", "behav", "adv", "versions")}) for mb in mbs]


@pytest.mark.parametrize("dp", [1, 2, 3])
@pytest.mark.parametrize("arrays", [False, True])
def test_each_dp_rank_builds_exactly_its_part_of_the_all_ranks_plan(dp, arrays):
    trajs = make_batch(arrays=arrays)
    want = reference_plan(trajs, minibatches=2, dp=dp, budget=40)
    plan = plan_batch(trajs, minibatches=2, dp=dp, micro_batch_tokens=40)
    assert plan.summary.groups_filtered == 1 and plan.summary.sequences == 20
    for d in range(dp):
        share = plan.share(trajs, d)
        assert len(share.packed.index) == sum(len(mb["seqs"]) for mbs in want for mb in mbs[d])  # only its own
        got = [as_lists(mbs) for mbs in share.micro_batches()]
        assert got == [mbs[d] for mbs in want]
        wire = decode_share(encode_share(share), vocab_size=VOCAB)  # what another rank receives
        assert [as_lists(mbs) for mbs in wire.micro_batches()] == got
        assert wire.num_loss_tokens == share.num_loss_tokens and wire.summary == share.summary


def test_summary_counts_the_whole_batch():
    trajs = make_batch()
    s = plan_batch(trajs, minibatches=2, dp=3, micro_batch_tokens=40).summary
    trained = [t for t in trajs if t.group_id != 0]
    assert s.groups == 6 and s.oldest_version == 3
    assert s.token_staleness(5) == {"1": sum(v == 4 for t in trained for v in t.versions),
                                    "2": sum(v == 3 for t in trained for v in t.versions)}


def tamper(raw: bytes, **changes) -> bytes:
    msg = msgpack.unpackb(raw)
    msg.update(changes)
    return msgpack.packb(msg)


def test_bad_hand_off_payloads_are_refused_by_field():
    trajs = make_batch()
    raw = encode_share(plan_batch(trajs, 1, 2, 40).share(trajs, 1))
    msg = msgpack.unpackb(raw)
    cases = {
        "hand-off.tokens: 1": tamper(raw, tokens=msg["tokens"][:-8]),  # one id short
        "hand-off.logprobs: 3 bytes is not a whole number of float32": tamper(raw, logprobs=b"abc"),
        "hand-off.adv: ": tamper(raw, adv=msg["adv"][:4]),
        "hand-off.counts: ": tamper(raw, counts=[[1, 1]]),
        "hand-off.mask: values must be 0": tamper(raw, mask=b"\x02" * len(msg["mask"])),
        "hand-off.tokens: ids outside [0, 50)": tamper(raw, tokens=np.full(len(msg["tokens"]) // 8, 99).tobytes()),
        "hand-off.num_loss_tokens": tamper(raw, num_loss_tokens=[-1]),
        "hand-off.summary": tamper(raw, summary={"sequences": "all"}),
        "not a msgpack payload": raw[:len(raw) // 2],
    }
    for reason, bad in cases.items():
        with pytest.raises(ValueError) as e:
            decode_share(bad, vocab_size=VOCAB)
        assert reason in str(e.value), (reason, str(e.value))
    with pytest.raises(ValueError, match=r"2 problem\(s\)(.|\n)*hand-off.summary(.|\n)*hand-off.logprobs"):
        decode_share(tamper(raw, summary=None, logprobs=b"abc"), vocab_size=VOCAB)  # every problem at once
    with pytest.raises(ValueError, match="1 problem.s. in the training batch"):  # the sender's error, as sent
        decode_share(encode_error("1 problem(s) in the training batch: ..."))


LAYOUTS = [{"dp": 2, "stages": [{"tp": 1, "layers": [0, 1]}, {"tp": 1, "layers": [1, 2]}]},  # replica = pipeline
           {"dp": 2, "stages": [{"tp": 2, "layers": [0, 2]}]}]  # replica = TP group


def _hand_off_worker(rank, world):
    out = []
    for spec in LAYOUTS:
        layout = TrainerLayout.from_dict(spec, num_layers=2)
        grid = build_grid(layout)
        trainer = NS(grid=grid, device=torch.device("cpu"), model_cfg=NS(vocab_size=VOCAB),
                     config=TrainConfig(ppo_minibatches=2, micro_batch_tokens=40))
        trainer.plan = lambda batch, trainer=trainer: Trainer.plan(trainer, batch)
        share = share_batch(make_batch() if rank == 0 else None, trainer)
        assert isinstance(share, RankShare)
        bad = make_batch()
        bad[5].completion_ids[0] = VOCAB  # every rank raises the controller rank's error
        try:
            share_batch(bad if rank == 0 else None, trainer)
            error = None
        except ValueError as e:
            error = str(e)
        stop = share_batch(Stop("drift: at step 40") if rank == 0 else None, trainer)  # no batch: every rank leaves
        out.append((grid.dp_rank, [as_lists(mbs) for mbs in share.micro_batches()], error, stop))
    return out


def test_hand_off_sends_each_replica_its_share():
    results = run_world(_hand_off_worker, 4, timeout=120)
    want = reference_plan(make_batch(), minibatches=2, dp=2, budget=40)
    for per_layout in zip(*results):
        for dp_rank, got, error, stop in per_layout:
            assert got == [mbs[dp_rank] for mbs in want]
            assert "trajectories[5]: token ids outside [0, 50): [50]" in error
            assert stop == Stop("drift: at step 40")


def test_the_bench_prints_every_piece_per_token(capsys):
    from tools.bench import bench_trainer_handoff
    assert bench_trainer_handoff.main(["--groups", "3", "--samples", "2", "--mean", "30", "--dp", "2",
                                       "--repeats", "1", "--micro-batch-tokens", "64"]) == 0
    out = capsys.readouterr().out
    assert "DP 2" in out and "other rank total" in out and "new (arrays)" in out
    assert "micro-batches identical in every column: yes" in out  # lists and arrays build the same


def test_the_bench_writes_the_hand_off_into_the_host_profile(tmp_path, monkeypatch, capsys):
    from hexrl.gpus import host_costs
    from tools.bench import bench_trainer_handoff
    monkeypatch.setenv("HEXRL_PROFILES", str(tmp_path))
    assert bench_trainer_handoff.main(["--groups", "3", "--samples", "2", "--mean", "30", "--dp", "2",
                                       "--repeats", "1", "--micro-batch-tokens", "64", "--write"]) == 0
    assert f"wrote {tmp_path / 'host.json'}" in capsys.readouterr().out
    h = host_costs()  # the planner's host costs now carry this machine's hand-off
    assert h.handoff_ns_per_token_rank0 > 0 and h.handoff_ns_per_token_other > 0
    assert h.controller_us_per_traj == 30.0  # the defaults where nothing was measured

