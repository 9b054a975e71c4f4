"""Checkpoints survive crashes mid-write and resume bit-identically; HF export; bf16 master weights."""
import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from hexrl.model.hf_checkpoint import load_pretrained
from hexrl.model.tiny import make_tiny_model
from hexrl.schema import TrainerLayout
from hexrl.train import Grid, TrainConfig, Trainer
from hexrl.train import checkpoint as ckpt
from hexrl.train.optim import AdamW

ROOT = Path(__file__).resolve().parents[1]
from test_train_parallel import make_batch  # noqa: E402

SINGLE = {"dp": 1, "stages": [{"tp": 1, "layers": [0, 2]}]}
CFG = dict(lr=1e-3, micro_batch_tokens=32, ppo_minibatches=2)


@pytest.fixture
def model_path(tmp_path):
    return make_tiny_model(tmp_path / "m", layers=2, tie=False)


def weights(trainer):
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def test_resume_is_bit_identical(tmp_path, model_path):
    a = Trainer(model_path, SINGLE, TrainConfig(**CFG))
    a.step(make_batch(0))
    a.save(tmp_path / "ck", extra={"epoch": 3, "cursor": [1, 2]})  # stored as JSON
    after_save = a.step(make_batch(1))
    b = Trainer(model_path, SINGLE, TrainConfig(**CFG))
    assert b.load(tmp_path / "ck") == {"epoch": 3, "cursor": [1, 2]} and b.version == 1
    assert b.step(make_batch(1)) == after_save  # every metric, exactly
    for k, v in weights(a).items():
        assert torch.equal(v, weights(b)[k]), k
    two_stages = TrainerLayout.from_dict({"dp": 1, "stages": [{"tp": 1, "layers": [0, 1]},
                                                              {"tp": 1, "layers": [1, 2]}]})
    with pytest.raises(ValueError, match="resharding needs the trainer's model"):
        ckpt.load(tmp_path / "ck", Grid(two_stages, rank=0, stage=0, dp_rank=0, tp_rank=0))


def test_rng_state_round_trips_through_a_weights_only_load(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3), np.random.standard_normal()  # numpy caches a gauss
    torch.save(ckpt.rng_state(), tmp_path / "rng.pt")
    first = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    ckpt.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == first


def test_exception_between_files_keeps_previous_checkpoint(tmp_path, model_path, monkeypatch):
    t = Trainer(model_path, SINGLE, TrainConfig(**CFG))
    t.step(make_batch(0))
    t.save(tmp_path / "ck")
    saved = weights(t)
    t.step(make_batch(1))
    real, calls = ckpt._write, []

    def failing(obj, path):
        calls.append(path.name)
        if len(calls) == 2:
            raise OSError("disk full")
        real(obj, path)

    monkeypatch.setattr(ckpt, "_write", failing)
    with pytest.raises(RuntimeError, match="not written"):
        t.save(tmp_path / "ck")
    assert calls == ["model-s0-tp0.pt", "rng-s0-dp0-tp0.pt"]
    assert (tmp_path / "ck" / "latest").read_text() == "step00000001"
    assert not (tmp_path / "ck" / "step00000002").exists()
    fresh = Trainer(model_path, SINGLE, TrainConfig(**CFG))
    fresh.load(tmp_path / "ck")
    assert fresh.version == 1 and all(torch.equal(v, weights(fresh)[k]) for k, v in saved.items())
    monkeypatch.setattr(ckpt, "_write", real)
    t.save(tmp_path / "ck")  # a later save succeeds
    assert (tmp_path / "ck" / "latest").read_text() == "step00000002"


KILLED_SAVE = """
import os, signal
import torch
torch.set_num_threads(1)
from hexrl.schema import TrainerLayout
from hexrl.train import Grid, TrainConfig, Trainer
from hexrl.train import checkpoint as ckpt
from test_train_parallel import make_batch
t = Trainer({model!r}, {layout!r}, TrainConfig(**{cfg!r}))
t.step(make_batch(0))
t.save({root!r})
t.step(make_batch(1))
real = ckpt._write
def die_mid_write(obj, path):
    with open(path, "wb") as f:
        f.write(b"partial")
    os.kill(os.getpid(), signal.SIGKILL)
ckpt._write = die_mid_write
t.save({root!r})
"""


def test_process_killed_mid_write_keeps_previous_checkpoint(tmp_path, model_path):
    root = tmp_path / "ck"
    script = KILLED_SAVE.format(model=str(model_path), layout=SINGLE, cfg=CFG, root=str(root))
    # `python -c` imports from its working directory: test_train_parallel's make_batch
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT / "tests", capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert (root / ".tmp-step00000002" / "model-s0-tp0.pt").read_bytes() == b"partial"  # the torn write
    assert ckpt.resolve(root).name == "step00000001"
    t = Trainer(model_path, SINGLE, TrainConfig(**CFG))
    t.load(root)
    assert t.version == 1
    twin = Trainer(model_path, SINGLE, TrainConfig(**CFG))  # the same history in this process
    twin.step(make_batch(0))
    assert t.step(make_batch(1)) == twin.step(make_batch(1))
    t.save(root)
    assert not (root / ".tmp-step00000002").exists() and ckpt.resolve(root).name == "step00000002"


KILLED_AT_POINT = """
import os, signal
import torch
torch.set_num_threads(1)
from hexrl.train import TrainConfig, Trainer
from hexrl.train import checkpoint as ckpt
from test_train_parallel import make_batch
root = {root!r}
t = Trainer({model!r}, {layout!r}, TrainConfig(**{cfg!r}))
for i in range(2):
    t.step(make_batch(i))
    t.save(root)  # step00000001, step00000002; latest names the second
if {resave!r}:
    t.load(os.path.join(root, "step00000001"))  # back to version 1: the next save re-saves version 2
t.step(make_batch(2))
ckpt._at_point = lambda name: os.kill(os.getpid(), signal.SIGKILL) if name == {point!r} else None
t.save(root)
"""


@pytest.mark.parametrize("resave", [False, True], ids=["new-version", "re-save"])
@pytest.mark.parametrize("point", ["extra_written", "files_written", "renamed", "latest_written"])
def test_kill_9_at_any_point_of_a_save_leaves_a_loadable_latest(tmp_path, model_path, point, resave):
    root = tmp_path / "ck"
    script = KILLED_AT_POINT.format(model=str(model_path), layout=SINGLE, cfg=CFG,
                                    root=str(root), resave=resave, point=point)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT / "tests", capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr  # killed at `point`, not finished
    t = Trainer(model_path, SINGLE, TrainConfig(**CFG))
    t.load(root)  # follows `latest`: it must name a complete checkpoint
    committed = point == "latest_written"
    assert t.version == (2 if resave else 3 if committed else 2)
    assert ckpt.resolve(root).name == ("step00000002.1" if resave and committed else
                                       "step00000003" if committed else "step00000002")
    t.step(make_batch(3))
    t.save(root)  # and saving goes on: stale temp directories go, superseded twins go after commit
    assert not list(root.glob(".tmp-*"))
    assert len({ckpt._version_key(p)[0] for p in root.glob("step*")}) == len(list(root.glob("step*")))


def test_export_hf_round_trips(tmp_path, model_path):
    t = Trainer(model_path, SINGLE, TrainConfig(**CFG))
    t.step(make_batch(0))
    t.export_hf(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_hidden_layers"] == 2
    reloaded = load_pretrained(tmp_path / "hf")
    for k, v in t.model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[k], v), k


def test_bf16_params_with_fp32_master_weights():
    torch.manual_seed(0)
    full = [torch.randn(4, 3), torch.randn(3)]
    params = [torch.nn.Parameter(p.bfloat16()) for p in full]
    opt = AdamW(params, lr=0.1, weight_decay=0.5, masters=[p.clone() for p in full])
    ref = [torch.nn.Parameter(p.clone()) for p in full]
    ref_opt = torch.optim.AdamW([{"params": ref[:1], "weight_decay": 0.5}, {"params": ref[1:], "weight_decay": 0.0}],
                                lr=0.1)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in full]
        for p, g in zip(params, grads):
            p.main_grad = g.clone()
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        opt.step()
        ref_opt.step()
    for p, m, r in zip(params, opt.master, ref):
        assert p.dtype == torch.bfloat16 and m.dtype == torch.float32
        torch.testing.assert_close(m, r.detach(), rtol=0, atol=1e-6)  # decay on the matrix only
        assert torch.equal(p.detach(), m.bfloat16())


def resume_dp2_worker(rank, world, model_path, ck):
    t = Trainer(model_path, {"dp": 2, "stages": [{"tp": 1, "layers": [0, 2]}]}, TrainConfig(**CFG))
    t.load(ck)  # saved by a DP=1 trainer: both replicas load replica 0's shard
    loaded = weights(t)
    t.step(make_batch(1))
    return loaded, weights(t), t.optimizer.steps


def test_resume_with_a_different_dp_degree(tmp_path, model_path):
    from dist_utils import run_world

    a = Trainer(model_path, SINGLE, TrainConfig(**CFG))
    a.step(make_batch(0))
    a.save(tmp_path / "ck")
    saved = weights(a)
    a.step(make_batch(1))
    for loaded, after, steps in run_world(resume_dp2_worker, 2, model_path, tmp_path / "ck"):
        assert all(torch.equal(loaded[k], v) for k, v in saved.items())
        assert steps == 2 * CFG["ppo_minibatches"]  # the optimizer state came back too
        for k, v in weights(a).items():  # DP=2 continues as DP=1 would (up to summation order)
            torch.testing.assert_close(after[k], v, rtol=1e-5, atol=1e-6)
