"""Checkpoints that do not match their config or the run, and hexrl.generate's
arguments: refused before launch and at load, each naming what differs."""
import json
import shutil
import struct

import pytest
import torch
from runtime_utils import write_job
from test_bad_inputs import layout_checkpoint

from hexrl.generate import main as generate
from hexrl.main import load_checked_plan
from hexrl.model.hf_checkpoint import CheckpointError, load_pretrained
from hexrl.model.safetensors_header import header_problems, weight_file_problems
from hexrl.model.tiny import make_tiny_model
from hexrl.preflight import plan_time_checks
from hexrl.schema import load_job
from hexrl.train import checkpoint as ckpt

OTHER_MODELS = [({"hidden": 32, "heads": 2}, "hidden_size 32"), ({"vocab": 80}, "vocab_size 80"),
                ({"tie": False}, "tie_word_embeddings False")]


@pytest.mark.parametrize("shape,field", OTHER_MODELS)
def test_resume_with_another_models_checkpoints_is_refused_before_launch(tmp_path, capsys, shape, field):
    plan = write_job(tmp_path, steps=1)  # the tiny model: hidden 64, vocab 64, tied
    trainer = json.loads(plan.read_text())["trainer"]
    root = tmp_path / "ck"
    layout_checkpoint(root, 1, trainer, model=tmp_path / "model")
    other = make_tiny_model(tmp_path / "other", **shape)
    shutil.copy(other / "config.json", root / "config.json")  # what the run that saved them wrote
    found = ckpt.problems(root, trainer, load_job(tmp_path / "job.json").model.config)
    assert len(found) == 1 and "checkpoints of another model" in found[0] and field in found[0], found
    with pytest.raises(SystemExit) as e:
        load_checked_plan(str(plan), 0, 3, 3, None, resume=str(root))
    err = capsys.readouterr().err
    assert e.value.code == 2 and field in err, err
    shutil.copy(tmp_path / "model" / "config.json", root / "config.json")
    assert ckpt.problems(root, trainer, load_job(tmp_path / "job.json").model.config) == []


@pytest.mark.parametrize("shape,tensor", [
    ({"hidden": 32, "heads": 2}, "embed_tokens.weight: shape [64, 32], the model has [64, 64]"),
    ({"vocab": 80}, "embed_tokens.weight: shape [80, 64], the model has [64, 64]")])
def test_another_models_weights_are_refused_before_launch_without_a_config_beside_them(tmp_path, capsys, shape,
                                                                                      tensor):
    """Trainer.save writes no config.json (the run writes it beside): the shards' own shapes are compared,
    read without their data, and the refusal is one line naming the file and the tensor."""
    plan = write_job(tmp_path, steps=1)
    trainer = json.loads(plan.read_text())["trainer"]
    root = tmp_path / "ck"
    layout_checkpoint(root, 1, trainer, model=make_tiny_model(tmp_path / "other", **shape))
    found = ckpt.problems(root, trainer, load_job(tmp_path / "job.json").model.config)
    assert len(found) == 1 and f"{root / 'step00000001' / 'model-s0-tp0.pt'}: does not match" in found[0], found
    assert tensor in found[0]
    with pytest.raises(SystemExit) as e:
        load_checked_plan(str(plan), 0, 3, 3, None, resume=str(root))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[0] == "hexrl.main (rank 0): invalid plan: 1 problem(s)", err
    assert len(err) == 2 and "model-s0-tp0.pt: does not match" in err[1] and tensor in err[1], err


def test_a_shard_of_another_shape_is_named_at_load():
    want = {"a.weight": torch.zeros(4, 8), "b.weight": torch.zeros(8)}
    with pytest.raises(CheckpointError, match=r"ck: does not match .*a.weight: shape \[4, 4\], the model has \[4, 8\]; "
                                              r"b.weight: missing"):
        ckpt.check_shapes({"a.weight": torch.zeros(4, 4)}, want, "ck")
    ckpt.check_shapes({k: v.clone() for k, v in want.items()}, want, "ck")


def edit_config(model, **fields):
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, **fields}))


@pytest.mark.parametrize("fields,why", [
    ({"num_hidden_layers": 2}, "holds layers [2, 3] but config.json says num_hidden_layers 2"),
    ({"intermediate_size": 96}, "mlp.gate_proj.weight has shape [128, 64], config.json gives [96, 64]"),
    ({"tie_word_embeddings": False}, "lacks tensor lm_head.weight"),
    ({"num_key_value_heads": 4}, "k_proj.weight has shape [32, 64], config.json gives [64, 64]"),
])
def test_a_config_that_does_not_describe_its_checkpoint_is_refused(tmp_path, capsys, fields, why):
    model = make_tiny_model(tmp_path / "m", tokenizer="char")  # 4 layers, hidden 64, tied
    edit_config(model, **fields)
    with pytest.raises(CheckpointError, match=why.replace("[", r"\[").replace("]", r"\]")):
        load_pretrained(model)
    assert generate([str(model), "--prompt", "1+1=", "--max-new-tokens", "2"]) == 2  # before: garbage, exit 0
    assert why in capsys.readouterr().err
    job = load_job({"model": {"path": str(model)}, "data": {"synthetic": {"task": "arithmetic", "n": 64}},
                    "rl": {"batch_size": 2, "group_size": 2, "max_new_tokens": 8},
                    "cluster": {"nodes": [{"name": "a", "gpu_type": "cpu", "gpus": 2}]}})
    problems, _ = plan_time_checks(job)
    assert any(why in p for p in problems), problems


def safetensors(path, tensors: dict) -> None:
    header = json.dumps({name: {"dtype": "F32", "shape": [n], "data_offsets": [a, a + 4 * n]}
                         for name, (a, n) in tensors.items()}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))


@pytest.mark.parametrize("tensors", [{"a": (0, 4), "b": (0, 4)}, {"a": (0, 4), "b": (8, 4)},
                                     {"a": (0, 8), "b": (4, 2)}])
def test_a_safetensors_header_with_overlapping_tensors_is_refused(tmp_path, tensors):
    safetensors(tmp_path / "w.safetensors", tensors)
    found = header_problems(tmp_path / "w.safetensors")
    assert len(found) == 1 and "tensors 'a'" in found[0] and "'b'" in found[0] and "overlap" in found[0], found
    assert weight_file_problems(tmp_path) == found
    safetensors(tmp_path / "w.safetensors", {"a": (0, 4), "b": (16, 4)})
    assert header_problems(tmp_path / "w.safetensors") == []


@pytest.mark.parametrize("args,why", [
    (["--max-pages", str(10 ** 12)], "--max-pages 1000000000000: "), (["--max-pages", str(10 ** 13)], "--max-pages: "),
    (["--device", "cuda:7"], "--device 'cuda:7': this host has"),
    (["--device", "gpu0"], "--device 'gpu0': not a device"),
    (["--device", "meta"], "--device 'meta': only cpu and cuda"), (["--temperature", "nan"], "--temperature: "),
    (["--top-p", "0"], "--top-p: "), (["--max-new-tokens", "0"], "--max-new-tokens: "),
    (["--page-size", "0"], "--page-size: "), (["--seed", "-1"], "--seed: "),
])
def test_generate_refuses_bad_arguments_naming_them(tmp_path, capsys, args, why):
    if torch.cuda.device_count() > 7 and "cuda:7" in args:
        pytest.skip("this host has a cuda:7")
    model = make_tiny_model(tmp_path / "m", tokenizer="char")
    assert generate([str(model), "--prompt", "1+1=", "--max-new-tokens", "2", *args]) == 2
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err, err
