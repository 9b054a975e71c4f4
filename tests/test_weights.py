"""Weight sync: every trainer rank of a stage sends its own TP shard's pieces of its DP replica's
buckets; each rollout rank assembles full tensors and keeps its slice (per part, under a fused
layout: rank r holds [q_r; k_r; v_r]); a delta patches the weights a rank holds, bit for bit."""

import torch
import torch.distributed as dist
from dist_utils import run_world

from hexrl.comm.delta import bits_of
from hexrl.comm.weights import (
    ShardSender,
    SyncLink,
    current_values,
    load_into,
    receive_shards,
    shard_layout,
    source_receivers,
    stage_specs,
)
from hexrl.model.config import ModelConfig
from hexrl.model.decoder import Decoder
from hexrl.model.parallel import TPGroup
from hexrl.model.tiny import tiny_config

CFG = ModelConfig.from_hf(tiny_config(tie=False))
IDS = torch.tensor([5, 9, 2, 33, 7])
STAGES = [((0, 2), 2), ((2, 4), 1)]  # (layers, TP) per pipeline stage
DP = 2


def trained_model() -> Decoder:
    model = Decoder(CFG)
    model.init_weights(seed=3)  # "new" weights: the receivers start from seed 0
    return model


def version(v: int) -> dict[str, torch.Tensor]:
    """The full weights at version v: each version changes a few elements (v 3: most of them) and
    flips one zero's sign, a change of bits but not of value."""
    state = {n: p.detach().clone() for n, p in trained_model().named_parameters()}
    g = torch.Generator().manual_seed(7)
    for k in range(1, v + 1):
        share = 0.6 if k == 3 else 0.05
        for t in state.values():
            hit = torch.rand(t.shape, generator=g) < share
            t[hit] += 1e-2 * torch.randn(t.shape, generator=g)[hit]
        state["model.norm.weight"][0] = -0.0 if k % 2 else 0.0
    return state


def trainer_slots() -> list[tuple[int, int, int]]:
    """(stage, dp, tp) of each trainer rank, in rank order."""
    return [(s, d, t) for s, (_, tp) in enumerate(STAGES) for d in range(DP) for t in range(tp)]


def make_sync_groups(rank: int, replicas: list[list[int]]) -> list[list[SyncLink]]:
    """One group per source (stage, t, d), created by every rank in the same order, as hexrl.main does."""
    slot = {c: r for r, c in enumerate(trainer_slots())}
    out = []
    for s, (_, tp) in enumerate(STAGES):
        out.append([])
        for i, (t, d) in enumerate((t, d) for t in range(tp) for d in range(DP)):
            ranks = sorted([slot[(s, d, t)], *source_receivers(i, replicas)])
            g = dist.new_group(ranks)
            out[-1].append(SyncLink(slot[(s, d, t)], g if rank in ranks else None))
    return out


def sharded_sync_worker(rank, world, replicas, dtype):
    """Versions 1-3 in "auto" delta mode, then version 4 dense; returns each trainer rank's bytes
    sent and each rollout rank's mismatched tensors, per version."""
    import hexrl.comm.weights as w

    w.BUCKET_BYTES = 1 << 13  # many buckets, several rounds
    links = make_sync_groups(rank, replicas)
    replica_groups = [dist.new_group(r) for r in replicas]
    slots = trainer_slots()
    if rank < len(slots):  # a trainer rank: its own shard of the stage, as the trainer holds it
        s, d, t = slots[rank]
        (layers, tp) = STAGES[s]
        lay = shard_layout(CFG, layers, tp, DP, dtype)
        sender, dense, sent = ShardSender(lay, t, d, "auto", auto_max=0.3), ShardSender(lay, t, d), []
        for v in (1, 2, 3, 4):
            model = Decoder(CFG, layers=layers, tp=TPGroup(None, t, tp) if tp > 1 else None)
            load_into(model, version(v))
            local = dict(model.named_parameters())
            sent.append((sender if v < 4 else dense).send(local.__getitem__, links[s][t * DP + d], dtype))
        return sent
    k = next(i for i, r in enumerate(replicas) if rank in r)
    tp = TPGroup(replica_groups[k], replicas[k].index(rank), len(replicas[k])) if len(replicas[k]) > 1 else None
    model = Decoder(CFG, tp=tp).to(dtype)
    model.init_weights(seed=0)
    if rank == replicas[0][1]:  # fused q/k/v and gate/up, as the rollout engine runs; the others keep HF's layout
        model.fuse()
    mismatched = []
    for v in (1, 2, 3, 4):
        for s, (layers, stp) in enumerate(STAGES):
            receive_shards(shard_layout(CFG, layers, stp, DP, dtype), links[s], tp, dtype, torch.device("cpu"),
                           lambda part: load_into(model, part), current_values(model) if v < 4 else None)
        want = Decoder(CFG, tp=tp).to(dtype)  # a full sync of version v into a fresh model
        if rank == replicas[0][1]:
            want.fuse()
        load_into(want, {n: x.to(dtype) for n, x in version(v).items()})
        mismatched.append([n for (n, a), b in zip(model.named_parameters(), want.parameters())
                           if not torch.equal(bits_of(a.detach()), bits_of(b.detach()))])
    return mismatched


def test_sharded_delta_sync_equals_a_full_sync_bit_for_bit():
    """Six trainer ranks (stage 0: TP 2 x DP 2, stage 1: TP 1 x DP 2) each send their own part to a
    TP 2 replica (one rank fused) and a TP 1 replica. In "auto" delta mode the first version goes
    dense, the second as a delta, the third (most elements changed) dense again; the fourth in
    dense mode. After each, every rollout rank's weights equal a full sync's, bit for bit."""
    out = run_world(sharded_sync_worker, 9, [[6, 7], [8]], torch.bfloat16)
    for rank in (6, 7, 8):
        assert out[rank] == [[], [], [], []], f"rank {rank}: {out[rank]}"
    for sent in out[:6]:  # every trainer rank sent its share
        assert sent[0] > 0 and sent[1] < sent[0] / 4  # 5% changed: a delta
        assert sent[2] == sent[0] > sent[3]  # dense; in delta mode each bucket also carries its count
        assert (sent[0] - sent[3]) % 8 == 0


def replica_logits_worker(rank, world):
    import hexrl.comm.weights as w
    from hexrl.model.attention import CausalAttention

    w.BUCKET_BYTES = 1 << 14
    replica = dist.new_group([1, 2])
    # one trainer rank (TP 1, DP 1): a single source, taken by the replica's rank 0 and shared
    source = dist.new_group([0, *source_receivers(0, [[1, 2]])])
    links = [SyncLink(0, source if rank in (0, 1) else None)]
    lay = shard_layout(CFG, (0, CFG.num_hidden_layers), 1, 1, torch.float32)
    if rank == 0:
        state = dict(trained_model().named_parameters())
        ShardSender(lay, 0, 0).send(state.__getitem__, links[0], torch.float32)
        return None
    model = Decoder(CFG, tp=TPGroup(replica, rank - 1, 2))
    model.init_weights(seed=0)
    if rank == 2:
        model.fuse()
    receive_shards(lay, links, TPGroup(replica, rank - 1, 2), torch.float32, torch.device("cpu"),
                   lambda part: load_into(model, part))
    with torch.no_grad():
        local = model.logits(model.stage(IDS, torch.arange(5), CausalAttention([5])))
        parts = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(parts, local, group=replica)
    return torch.cat(parts, -1)


def test_tp2_replica_matches_the_sent_model():
    out = run_world(replica_logits_worker, 3)
    with torch.no_grad():
        want = trained_model()(IDS[None])[0]
    for got in out[1:]:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_specs_send_a_tied_embedding_once():
    tied = ModelConfig.from_hf(tiny_config(tie=True))
    names = [s.name for s in stage_specs(tied, (0, tied.num_hidden_layers))]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert "lm_head.weight" in [s.name for s in stage_specs(tied, (2, 4))]  # a last-only stage holds its copy


def test_a_replica_splits_the_sources_between_its_ranks():
    assert source_receivers(0, [[4, 5], [6]]) == [4, 6]
    assert source_receivers(1, [[4, 5], [6]]) == [5, 6]
    assert source_receivers(2, [[4, 5, 7]]) == [7]
