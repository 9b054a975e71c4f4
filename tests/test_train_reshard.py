"""A checkpoint loads into any layout of the same model: TP, PP and DP may change on resume.

Weights, AdamW moments, step counts and master weights are cut from the saved (stage, TP) files
on load; the next step matches a run that never moved.
"""
import json
from pathlib import Path

import pytest
import torch
from dist_utils import run_world
from test_train_parallel import CONFIG, TOL, make_batch

from hexrl.model.config import ModelConfig
from hexrl.model.hf_checkpoint import CheckpointError
from hexrl.model.tiny import make_tiny_model
from hexrl.schema import TrainerLayout
from hexrl.train import Grid, TrainConfig, Trainer
from hexrl.train import checkpoint as ckpt
from hexrl.train.export import checkpoint_weights, write_model_files
from hexrl.train.grid import build_grid
from hexrl.train.optim import split_by_param

SINGLE = {"dp": 1, "stages": [{"tp": 1, "layers": [0, 4]}]}
TP2_PP2 = {"dp": 1, "stages": [{"tp": 2, "layers": [0, 2]}, {"tp": 2, "layers": [2, 4]}]}
TP1_DP2 = {"dp": 2, "stages": [{"tp": 1, "layers": [0, 4]}]}


@pytest.fixture
def model_path(tmp_path):
    return make_tiny_model(tmp_path / "m", layers=4, tie=True, kv_heads=4)


def write_checkpoint(step: Path, layout: dict, shards: dict, meta: dict) -> None:
    """A checkpoint directory of `layout` from {(stage, tp): shard} (what save() would write)."""
    step.mkdir(parents=True)
    for (s, t), shard in shards.items():
        torch.save(shard, step / f"model-s{s}-tp{t}.pt")
    for name in ckpt.expected_files(layout):
        if name.startswith("rng-"):
            torch.save(ckpt.rng_state(), step / name)
    (step / "meta.json").write_text(json.dumps(dict(meta, layout=layout)))
    (step / "extra.json").write_text("{}")


def reshard_into(step: Path, layout: dict, out: Path, cfg: ModelConfig) -> None:
    """Load every slot of `layout` from the checkpoint `step` (each on a model built on the meta
    device) and write them as a checkpoint of `layout` at `out`."""
    lay = TrainerLayout.from_dict(layout, cfg.num_hidden_layers)
    shards = {}
    for s, st in enumerate(lay.stages):
        for t in range(st.tp):
            grid = Grid(lay, lay.rank(s, 0, t), s, 0, t)
            shards[s, t], _, meta, _ = ckpt.load(step, grid, ckpt.meta_stage(cfg, st.layers, st.tp))
    write_checkpoint(out, layout, shards, meta)


def by_name(shard: dict, cfg: ModelConfig) -> dict:
    """A whole-model shard's weights and optimizer state, per parameter name."""
    params = list(ckpt.meta_stage(cfg, (0, cfg.num_hidden_layers), 1).named_parameters())
    optim = split_by_param(shard["optim"], [p.dim() for _, p in params])
    return {"model": shard["model"], **{name: state for (name, _), state in zip(params, optim)},
            "steps": shard["optim"]["steps"]}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_round_trip_through_other_layouts_is_exact(tmp_path, model_path, dtype):
    """TP 1 -> TP 4 and 2 over uneven stages -> TP 2, 1 and 4 over three other stages -> TP 1: the
    weights, AdamW moments, step counts and (in bfloat16) float32 masters come back bit for bit."""
    t = Trainer(model_path, SINGLE, TrainConfig(**dict(CONFIG, dtype=dtype)))
    t.step(make_batch(0))
    t.save(tmp_path / "ck")
    cfg, step = t.model_cfg, ckpt.resolve(tmp_path / "ck")
    uneven = {"dp": 1, "stages": [{"tp": 4, "layers": [0, 3]}, {"tp": 2, "layers": [3, 4]}]}
    three = {"dp": 2, "stages": [{"tp": 2, "layers": [0, 1]}, {"tp": 1, "layers": [1, 2]},
                                 {"tp": 4, "layers": [2, 4]}]}
    reshard_into(step, uneven, tmp_path / "a", cfg)
    reshard_into(tmp_path / "a", three, tmp_path / "b", cfg)
    reshard_into(tmp_path / "b", SINGLE, tmp_path / "c", cfg)
    before = by_name(torch.load(step / "model-s0-tp0.pt", weights_only=True), cfg)
    after = by_name(torch.load(tmp_path / "c" / "model-s0-tp0.pt", weights_only=True), cfg)
    assert before["steps"] == CONFIG["ppo_minibatches"]
    assert set(before["model.layers.3.mlp.down_proj.weight"]) == (
        {"exp_avg", "exp_avg_sq", "step"} | ({"master"} if dtype == "bfloat16" else set()))
    assert_identical(after, before)
    write_model_files(tmp_path, model_path)  # the HF export joins the resharded files into the same weights
    assert_identical(checkpoint_weights(tmp_path / "a")[1], before["model"])


def assert_identical(got, want, where: str = "") -> None:
    if isinstance(want, dict):
        assert set(got) == set(want), where
        for k in want:
            assert_identical(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), where
    else:
        assert got == want, where


def test_a_slot_reads_only_the_files_that_hold_its_slice(tmp_path):
    cfg = ModelConfig.from_dir(make_tiny_model(tmp_path / "m", layers=4, tie=False, kv_heads=4))
    saved = TrainerLayout.from_dict({"dp": 2, "stages": [{"tp": 4, "layers": [0, 1]}, {"tp": 2, "layers": [1, 3]},
                                                         {"tp": 1, "layers": [3, 4]}]})

    def reads(layers, tp, t):
        return ckpt.saved_files(saved, ckpt.meta_stage(cfg, layers, tp), t, tp)

    assert reads((0, 2), 2, 1) == ["model-s0-tp2.pt", "model-s0-tp3.pt", "model-s1-tp1.pt"]
    assert reads((2, 4), 4, 3) == ["model-s1-tp1.pt", "model-s2-tp0.pt"]  # slices of the files, by mmap
    assert reads((3, 4), 1, 0) == ["model-s2-tp0.pt"]
    assert len(reads((0, 4), 1, 0)) == 7  # one rank for the whole model reads every file


def test_a_slot_loads_from_only_the_files_it_reads(tmp_path, model_path):
    t = Trainer(model_path, SINGLE, TrainConfig(**CONFIG))
    t.step(make_batch(0))
    t.save(tmp_path / "ck")
    saved = {"dp": 1, "stages": [{"tp": 4, "layers": [0, 3]}, {"tp": 2, "layers": [3, 4]}]}
    reshard_into(ckpt.resolve(tmp_path / "ck"), saved, tmp_path / "a", t.model_cfg)
    lay = TrainerLayout.from_dict({"dp": 1, "stages": [{"tp": 2, "layers": [0, 2]}, {"tp": 4, "layers": [2, 4]}]})
    grid, stage = Grid(lay, lay.rank(1, 0, 3), 1, 0, 3), ckpt.meta_stage(t.model_cfg, (2, 4), 4)
    reads = ckpt.saved_files(TrainerLayout.from_dict(saved), stage, 3, 4)
    assert reads == ["model-s0-tp3.pt", "model-s1-tp1.pt"]  # of the six
    (tmp_path / "b").mkdir()
    for f in reads + [f.name for f in (tmp_path / "a").glob("*.json")] + ["rng-s0-dp0-tp0.pt"]:
        (tmp_path / "b" / f).write_bytes((tmp_path / "a" / f).read_bytes())
    assert_identical(ckpt.load(tmp_path / "b", grid, stage)[0], ckpt.load(tmp_path / "a", grid, stage)[0])


def test_a_new_slot_takes_the_saved_leaders_rng(tmp_path, model_path):
    t = Trainer(model_path, SINGLE, TrainConfig(**CONFIG))
    t.save(tmp_path / "ck")
    lay = TrainerLayout.from_dict(TP1_DP2, 4)
    _, rng, _, _ = ckpt.load(tmp_path / "ck", Grid(lay, 1, 0, 1, 0))  # replica 1 was not saved
    saved = torch.load(ckpt.resolve(tmp_path / "ck") / "rng-s0-dp0-tp0.pt", weights_only=True)
    assert rng is not None and torch.equal(rng["torch"], saved["torch"])


def test_a_checkpoint_of_another_model_is_not_resharded(tmp_path, model_path):
    t = Trainer(model_path, SINGLE, TrainConfig(**CONFIG))
    t.save(tmp_path / "ck")
    other = ModelConfig.from_dir(make_tiny_model(tmp_path / "o", layers=4, tie=True, kv_heads=4, hidden=32))
    lay = TrainerLayout.from_dict(TP2_PP2, 4)
    with pytest.raises(CheckpointError, match="does not match this job's model"):
        ckpt.load(tmp_path / "ck", Grid(lay, 0, 0, 0, 0), ckpt.meta_stage(other, (0, 2), 2))
    shallow = ModelConfig.from_dir(make_tiny_model(tmp_path / "s", layers=2, tie=True, kv_heads=4))
    lay = TrainerLayout.from_dict({"dp": 1, "stages": [{"tp": 1, "layers": [0, 1]}, {"tp": 1, "layers": [1, 2]}]})
    with pytest.raises(CheckpointError, match="cannot be resharded.*model has 2 layers"):
        ckpt.load(tmp_path / "ck", Grid(lay, 0, 0, 0, 0), ckpt.meta_stage(shallow, (0, 1), 1))


def step_weights(trainer: Trainer, seed: int) -> dict:
    """The next step's metrics and the whole model's weights after it (on stage leaders)."""
    metrics = trainer.step(make_batch(seed))
    return {"metrics": metrics, "weights": ckpt.gather_stage(trainer.model, trainer.grid),
            "optimizer_steps": trainer.optimizer.steps}


def resume_step(path, layout: dict, ck: Path, out: Path) -> dict | None:
    """Resume from `ck` into `layout`, take the next step, save to `out` (None on ranks outside it)."""
    grid = build_grid(TrainerLayout.from_dict(layout, 4), tied_embeddings=True)  # every rank makes the groups
    if grid is None:
        return None
    t = Trainer(path, layout, TrainConfig(**CONFIG), grid=grid)
    t.load(ck)
    loaded = ckpt.gather_stage(t.model, t.grid)
    after = step_weights(t, t.version)
    t.save(out)
    return {"loaded": loaded, t.version - 1: after}


def move_there_and_back(rank, world, path, root):
    """On 4 ranks: the never-moved TP2 x PP2 run (a checkpoint after step 0, then steps 1 and 2);
    resumed as TP1 x PP1 x DP2 on ranks 0-1 for step 1; that resumed as TP2 x PP2 for step 2."""
    t = Trainer(path, TP2_PP2, TrainConfig(**CONFIG))
    t.step(make_batch(0))
    t.save(root / "ck")
    base = {"saved": ckpt.gather_stage(t.model, t.grid), 1: step_weights(t, 1), 2: step_weights(t, 2)}
    there = resume_step(path, TP1_DP2, root / "ck", root / "dp2")
    back = resume_step(path, TP2_PP2, root / "dp2", root / "back")
    return base, there, back


def merged(results: list[dict], key) -> dict:
    out = {}
    for r in results:
        out.update(r[key] or {})
    return out


def assert_same_step(got: list[dict], want: list[dict], step: int) -> None:
    """Every rank's metrics of `step` as the never-moved run's (to float tolerance), and the weights after it."""
    w = want[0][step]["metrics"]
    for r in got:
        m = r[step]["metrics"]
        assert m["loss"] == pytest.approx(w["loss"], abs=2e-5) and m["grad_norm"] == pytest.approx(w["grad_norm"],
                                                                                                   rel=1e-4)
        assert (m["tokens"], m["version"], m["sequences"]) == (w["tokens"], w["version"], w["sequences"])
        assert r[step]["optimizer_steps"] == want[0][step]["optimizer_steps"]
    theirs = merged([r[step] for r in want], "weights")
    ours = merged([r[step] for r in got], "weights")
    assert set(ours) == set(theirs)
    for name, v in theirs.items():
        torch.testing.assert_close(ours[name], v, **TOL, msg=lambda m, name=name: f"{name}: {m}")


def test_tp2_pp2_to_tp1_dp2_and_back_takes_the_never_moved_step(tmp_path, model_path):
    """The run saved by TP2 x PP2 resumes as TP1 x PP1 x DP2 (each rank reads all four files), takes
    a step and saves; that resumes as TP2 x PP2 again (each rank its slice of the one file): both
    steps are the never-moved run's, to float tolerance."""
    base, there, back = zip(*run_world(move_there_and_back, 4, str(model_path), tmp_path))
    there = [r for r in there if r is not None]
    assert len(there) == 2
    saved = merged(base, "saved")
    for name, v in merged(there, "loaded").items():
        assert torch.equal(v, saved[name]), name  # joined exactly
    assert_same_step(there, base, 1)
    assert_same_step(back, base, 2)
