"""Weight sync: a trainer stage broadcasts full tensors; a TP=2 rollout replica keeps its slices
(per part, under a fused layout: rank r holds [q_r; k_r; v_r])."""

import torch
import torch.distributed as dist
from dist_utils import run_world

from hexrl.comm.weights import load_into, receive_stage, send_stage, stage_specs
from hexrl.model.config import ModelConfig
from hexrl.model.decoder import Decoder
from hexrl.model.parallel import TPGroup
from hexrl.model.tiny import tiny_config

CFG = ModelConfig.from_hf(tiny_config(tie=False))
IDS = torch.tensor([5, 9, 2, 33, 7])


def trained_model() -> Decoder:
    model = Decoder(CFG)
    model.init_weights(seed=3)  # "new" weights: the receivers start from seed 0
    return model


def sync_worker(rank, world):
    from hexrl.model.attention import CausalAttention

    replica = dist.new_group([1, 2])
    everyone = dist.new_group([0, 1, 2])
    specs = stage_specs(CFG, (0, CFG.num_hidden_layers))
    BUCKET = 1 << 14  # force many buckets
    import hexrl.comm.weights as w

    w.BUCKET_BYTES = BUCKET
    if rank == 0:
        state = dict(trained_model().named_parameters())
        send_stage(state.get, specs, 0, everyone, torch.float32)
        return None
    model = Decoder(CFG, tp=TPGroup(replica, rank - 1, 2))
    model.init_weights(seed=0)
    if rank == 2:  # fused q/k/v and gate/up, as the rollout engine runs; rank 1 keeps HF's split layout
        model.fuse()
    receive_stage(specs, 0, everyone, torch.float32, torch.device("cpu"), lambda part: load_into(model, part))
    with torch.no_grad():
        local = model.logits(model.stage(IDS, torch.arange(5), CausalAttention([5])))
        parts = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(parts, local, group=replica)
    return torch.cat(parts, -1)


def test_tp2_replica_matches_the_broadcast_model():
    out = run_world(sync_worker, 3)
    with torch.no_grad():
        want = trained_model()(IDS[None])[0]
    for got in out[1:]:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_specs_send_a_tied_embedding_once():
    tied = ModelConfig.from_hf(tiny_config(tie=True))
    names = [s.name for s in stage_specs(tied, (0, tied.num_hidden_layers))]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert "lm_head.weight" in [s.name for s in stage_specs(tied, (2, 4))]  # a last-only stage holds its copy
