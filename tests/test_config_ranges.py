"""Configs that lie: one typed reader of config.json for the planner,
hexrl.main and hexrl.generate, and one numeric-range rule (hexrl.ranges) for every number read."""
import dataclasses
import json
import math
import re
import subprocess
import sys

import pytest
from runtime_utils import ROOT

from hexrl.model.config import ModelConfig, tiny_config
from hexrl.model.tiny import make_tiny_model
from hexrl.schema import PRESETS, ConfigError, load_job, load_plan

TINY = PRESETS["tiny"]
BAD_FIELDS = [  # (field, value): each a raw traceback or silently accepted before
    ("architectures", 3), ("architectures", {"Qwen2ForCausalLM": 1}), ("rope_theta", "abc"),
    ("max_position_embeddings", "4096"), ("max_position_embeddings", None), ("rope_parameters", [1, 2]),
    ("rms_norm_eps", "x"), ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}), ("tie_word_embeddings", "false"),
    ("rope_theta", math.nan), ("rope_theta", math.inf), ("rms_norm_eps", 0), ("hidden_size", 10 ** 9),
    ("max_position_embeddings", 10 ** 12), ("rope_scaling", {"type": "linear"}), ("attention_bias", "yes"),
    ("rope_scaling", [1]), ("eos_token_id", 64), ("model_type", 5), ("num_key_value_heads", 1.5),
]


def job(**over) -> dict:
    j = {"model": {"preset": "tiny"}, "data": {"synthetic": {"task": "arithmetic", "n": 64}},
         "rl": {"batch_size": 4, "group_size": 2, "max_new_tokens": 32},
         "cluster": {"nodes": [{"name": "a", "gpu_type": "cpu", "gpus": 2}]}}
    return {**j, **over}


@pytest.mark.parametrize("field,value", BAD_FIELDS)
def test_a_config_field_of_the_wrong_type_or_range_is_named(tmp_path, field, value):
    with pytest.raises(ConfigError, match=rf"model.config.{field}: "):
        load_job(job(model={"config": {**TINY, field: value}}))
    # hexrl.generate (and hexrl.main, through the plan) read a checkpoint's config.json the same way
    model = make_tiny_model(tmp_path / "m", tokenizer="char")
    (model / "config.json").write_text(json.dumps({**json.loads((model / "config.json").read_text()), field: value}))
    with pytest.raises(ValueError, match=rf"config.json: (invalid model config: .*{field}: |(NaN|Infinity) is not a)"):
        ModelConfig.from_dir(model)
    from hexrl.generate import main
    assert main([str(model), "--prompt", "1+1=", "--max-new-tokens", "2", "--device", "cpu"]) == 2


def test_the_planner_names_every_bad_config_field_at_once(tmp_path):
    model = make_tiny_model(tmp_path / "m", tokenizer="char")
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "rope_theta": "abc", "tie_word_embeddings": "false",
                                                   "architectures": 3, "max_position_embeddings": None}))
    (tmp_path / "job.json").write_text(json.dumps(job(model={"path": str(model)})))
    res = subprocess.run([sys.executable, "-m", "hexrl.plan", str(tmp_path / "job.json"), "-o",
                          str(tmp_path / "plan.json")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    for field in ("rope_theta", "tie_word_embeddings", "architectures", "max_position_embeddings"):
        assert f"config.json).{field}: " in res.stderr, (field, res.stderr)


def test_valid_configs_still_read_the_same():
    cfg = ModelConfig.from_hf({**TINY, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 8192},
                               "max_position_embeddings": 4096.0, "eos_token_id": [2, 3]})
    assert cfg.max_position_embeddings == 4096 and type(cfg.max_position_embeddings) is int
    assert cfg.rope_scaling["factor"] == 8.0 and cfg.tie_word_embeddings is True and cfg.eos_token_id == [2, 3]
    assert ModelConfig.from_hf({**TINY, "rope_scaling": {"rope_type": "default"}}).rope_scaling is None
    nested = {k: v for k, v in TINY.items() if k != "rope_theta"} | {"rope_parameters": {"rope_theta": 5e5}}
    assert ModelConfig.from_hf(nested).rope_theta == 5e5


BAD_NUMBERS = [  # (job overrides, the field named): NaN, infinite or absurd numbers
    ({"prices": {"cpu": math.nan}}, "prices.cpu"), ({"prices": {"cpu": math.inf}}, "prices.cpu"),
    ({"prices": {"cpu": 1e300}}, "prices.cpu"),
    ({"cluster": {"nodes": [{"name": "a", "gpu_type": "cpu", "gpus": 2}], "cross_type_GBps": math.nan}},
     "cluster.cross_type_GBps"),
    ({"cluster": {"nodes": [{"name": "a", "gpu_type": "cpu", "gpus": 2}], "cross_type_GBps": {"H100/H20": math.inf}}},
     "cluster.cross_type_GBps"),
    ({"cluster": {"nodes": [{"name": "a", "gpu_type": "cpu", "gpus": 2}], "inter_node_GBps": math.inf}},
     "cluster.inter_node_GBps"),
    ({"cluster": {"nodes": [{"name": "a", "gpu_type": "cpu", "gpus": 10_000_000}]}}, "cluster.nodes[0].gpus"),
    ({"cluster": {"nodes": [{"name": f"n{i}", "gpu_type": "cpu", "gpus": 1000} for i in range(100)]}}, "cluster.nodes"),
    ({"workload": {"output_len": {"histogram": {"edges": [0, math.nan, 32], "counts": [1, 1]}}}},
     "workload.output_len.histogram.edges"),
    ({"workload": {"output_len": {"histogram": {"edges": [0, 16, math.inf], "counts": [1, 1]}}}},
     "workload.output_len.histogram.edges"),
    ({"workload": {"output_len": {"histogram": {"edges": [0, 16, 32], "counts": [1, math.inf]}}}},
     "workload.output_len.histogram.counts"),
    ({"workload": {"output_len": {"samples": [1, math.nan]}}}, "workload.output_len.samples"),
    ({"rl": {"batch_size": 10 ** 9, "group_size": 2, "max_new_tokens": 32}}, "rl.batch_size"),
    ({"rl": {"batch_size": 4, "group_size": 10 ** 9, "max_new_tokens": 32}}, "rl.group_size"),
    ({"rl": {"batch_size": 4096, "group_size": 4096, "max_new_tokens": 32}}, "rl.group_size"),
    ({"rl": {"batch_size": 4, "group_size": 2, "max_new_tokens": 10 ** 9}}, "rl.max_new_tokens"),
    ({"rl": {"batch_size": 4, "group_size": 2, "max_new_tokens": 32, "lr": math.nan}}, "rl.lr"),
    ({"rl": {"batch_size": 4, "group_size": 2, "max_new_tokens": 32, "steps": 10 ** 12}}, "rl.steps"),
    ({"budget": math.inf}, "job.budget"),
]


@pytest.mark.parametrize("over,field", BAD_NUMBERS, ids=[f for _, f in BAD_NUMBERS])
def test_every_number_has_a_finite_sane_range(over, field):
    with pytest.raises(ConfigError, match=rf"{re.escape(field)}(\[[^\]]*\])?: "):
        load_job(job(**over))


def plan_dict(tmp_path) -> dict:
    from hexrl.plan.planner import plan_job
    return plan_job(load_job(job(cluster={"nodes": [{"name": "a", "gpu_type": "cpu", "gpus": 3}]}))).to_dict()


@pytest.mark.parametrize("edit,field", [
    (lambda p: p["trainer"].update(dp=10 ** 8), "trainer.dp"),
    (lambda p: p["trainer"]["stages"][0].update(tp=10 ** 8), r"trainer.stages\[0\].tp"),
    (lambda p: p["trainer"].update(dp=60_000), "trainer"),  # each under the cap, the grid over it
    (lambda p: p["ranks"][0].update(rank=math.inf), r"ranks\[0\].rank"),
])
def test_a_hand_edited_plan_with_absurd_degrees_is_refused_before_enumerating(tmp_path, edit, field):
    d = plan_dict(tmp_path)
    edit(d)
    if field == "trainer":
        d["trainer"]["stages"][0]["tp"] = 2
    with pytest.raises(ConfigError, match=rf"{field}: "):
        load_plan(d, check_paths=False)


def test_every_schema_number_goes_through_the_one_rule():
    """No hand-written number checks left in the schema: each goes through hexrl.ranges."""
    src = "".join(p.read_text() for p in (ROOT / "hexrl" / "schema").glob("*.py"))
    assert not re.search(r"isinstance\([^)]*\(int, float\)", src)
    assert "math.isfinite" not in src


def test_the_tiny_preset_is_the_model_make_tiny_model_writes(tmp_path):
    """The tiny shape is defined once (tiny_config): the job preset and the CPU demo's checkpoint share it."""
    assert PRESETS["tiny"] == tiny_config()
    written = ModelConfig.from_dir(make_tiny_model(tmp_path / "m"))
    assert dataclasses.replace(written, hf={}) == dataclasses.replace(load_job(job()).model.config, hf={})
