"""A tensor-parallel replica (2 CPU processes over gloo) generates what a single process does,
through an interrupt with new weights as well, and with an episode extended and released between
turns (the followers apply the leader's extends in the same order), and with a request withdrawn
mid-generation and added back with its prefix (as a moved group's samples are)."""
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from dist_utils import run_world

from hexrl.model.hf_checkpoint import load_pretrained, save_pretrained
from hexrl.model.parallel import TPGroup
from hexrl.model.tiny import make_tiny_model
from hexrl.rollout import Engine, EngineConfig, Request

CONFIG = dict(page_size=4, max_pages=48, max_running=3, max_batch_tokens=24)
SWITCH_AT = 4  # update weights before this step
MOVE_AT = 6  # withdraw request 0 before this step and add it back with its prefix


def checkpoint(path: Path, seed: int) -> Path:
    make_tiny_model(path, seed=seed, vocab=128, tie=False)
    model = load_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # sharp logits: the TP all-reduce order cannot flip a greedy pick
    save_pretrained(model, path)
    return path


def requests() -> list[Request]:
    g = torch.Generator().manual_seed(0)
    reqs = [Request(i, torch.randint(3, 128, (n,), generator=g).tolist(), max_new_tokens=10, temperature=0.0,
                    ignore_eos=True) for i, n in enumerate([4, 9, 2, 13])]
    return reqs + [Request("sampled", [5, 6, 7], max_new_tokens=10, temperature=1.0, top_k=30, seed=3,
                           ignore_eos=True), Request("ep", [9, 8], max_new_tokens=3, temperature=0.0, ignore_eos=True,
                                                     episode=True)]


def run_leader(engine: Engine, new_weights, move: bool = True) -> dict:
    for r in requests():
        engine.add(r)
    outs, k = {}, 0
    while engine.has_work():
        if k == SWITCH_AT:
            engine.update_weights(new_weights, 1)
        if k == MOVE_AT and move:
            prefix = engine.withdraw([0])[0]
            assert 0 < len(prefix.token_ids) < 10 and 0 < prefix.versions.count(0) < len(prefix.versions)
            engine.add(replace(requests()[0], prefix=prefix))
        for f in engine.step():
            key = str(f.id) if f.id != "ep" else f"ep{sum(x.startswith('ep') for x in outs)}"
            outs[key] = (f.token_ids, f.versions)
            if f.id == "ep" and key != "ep3":  # three observations, then the episode ends
                engine.extend("ep", [11, 12, 13][:int(key[2]) + 1], 3)
            elif f.id == "ep":
                engine.release("ep")
        k += 1
    return outs


def worker(rank: int, world_size: int, path_a: str, path_b: str) -> dict | None:
    tp = TPGroup(dist.group.WORLD, rank, world_size)
    engine = Engine(load_pretrained(path_a, tp=tp), EngineConfig(**CONFIG))
    new = load_pretrained(path_b, tp=tp).state_dict()  # this rank's shard of the new weights
    outs = None
    if rank == 0:
        outs = run_leader(engine, new)
        engine.shutdown()
    else:
        engine.follow(on_update=lambda version: new)
    dist.barrier()  # both ranks done with collectives before teardown (gloo can abort otherwise)
    return outs


def test_tp2_equals_tp1_through_an_interrupt(tmp_path):
    a, b = checkpoint(tmp_path / "a", 0), checkpoint(tmp_path / "b", 1)
    single = run_leader(Engine(load_pretrained(a), EngineConfig(**CONFIG)), load_pretrained(b).state_dict())
    unmoved = run_leader(Engine(load_pretrained(a), EngineConfig(**CONFIG)), load_pretrained(b).state_dict(), False)
    sharded, _ = run_world(worker, 2, str(a), str(b))
    assert sharded == single == unmoved
    assert any(0 < versions.count(0) < 10 for _, versions in single.values())  # the switch hit mid-sequence
    assert [k for k in single if k.startswith("ep")] == ["ep0", "ep1", "ep2", "ep3"]
