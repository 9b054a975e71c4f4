"""Job and plan schema: loading, defaults, and validation that reports every problem at once."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hexrl.model.config import ModelConfig
from hexrl.plan.lengths import output_lengths
from hexrl.plan.planner import plan_job
from hexrl.schema import PRESETS, ConfigError, load_job, load_plan, validate_plan_against_world

CONFIGS = Path(__file__).resolve().parent.parent / "tools" / "configs"


def small_job(**over) -> dict:
    job = {
        "model": {"preset": "tiny"},
        "data": {"synthetic": {"task": "arithmetic", "n": 64}},
        "rl": {"batch_size": 4, "group_size": 2, "max_new_tokens": 32},
        "cluster": {"nodes": [{"name": "a", "gpu_type": "cpu", "gpus": 2},
                              {"name": "b", "gpu_type": "cpu", "gpus": 2}]},
    }
    job.update(over)
    return job


def demo_job() -> dict:
    """tools/configs/cpu_demo.json with the tiny preset in place of the demo's warm-started checkpoint."""
    job = json.loads((CONFIGS / "cpu_demo.json").read_text())
    return {**job, "model": {"preset": "tiny"}}


def test_cpu_demo_reads_its_checkpoint_relative_to_the_job_file(tmp_path):
    (tmp_path / "tools" / "configs").mkdir(parents=True)
    (tmp_path / "runs" / "demo" / "model").mkdir(parents=True)
    (tmp_path / "runs" / "demo" / "model" / "config.json").write_text(json.dumps(PRESETS["tiny"]))
    path = tmp_path / "tools" / "configs" / "cpu_demo.json"
    path.write_text((CONFIGS / "cpu_demo.json").read_text())
    job = load_job(path)
    assert job.model.path == str(tmp_path / "runs" / "demo" / "model")
    assert job.model.config.num_hidden_layers == PRESETS["tiny"]["num_hidden_layers"]


def test_cpu_demo_loads_with_defaults():
    job = load_job(demo_job())
    assert job.model.preset == "tiny" and job.model.config.num_hidden_layers == 4
    assert job.cluster.world_size == 3 and job.cluster.gpus_per_node == 3
    assert job.reward.name == "exact"  # given; synthetic data would default to it as well
    assert job.rl.clip_low == 0.2 and job.rl.behav_cap == 5.0 and job.rl.kl_coef == 0.0
    assert job.rl.filter_equal_groups is True
    assert job.prices == {"cpu": 0.0}
    assert job.layout == {"train_gpus": 2, "tp": 1, "pp": 1, "rollout_tp": 1}


def test_paper_configs_load():
    for name in ["1.5b", "7b", "14b"]:
        for kind, types in [("h800", {"H800"}), ("h20", {"H20"}), ("hetero", {"H800", "H20"})]:
            job = load_job(CONFIGS / f"paper_{name}_{kind}.json", check_paths=False)
            assert set(job.cluster.types()) == types
            assert job.cluster.inter_node_GBps == 5.0 and job.cluster.cross_GBps("H800", "H20") == 1.5


@pytest.mark.parametrize("name", ["r1-distill-qwen-7b", "qwen2.5-1.5b", "r1-distill-qwen-14b"])
def test_param_count_matches_transformers(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    skip = {"architectures", "model_type", "torch_dtype"}
    cfg = transformers.Qwen2Config(**{k: v for k, v in PRESETS[name].items() if k not in skip})
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(cfg)
    assert ModelConfig.from_hf(PRESETS[name]).num_params == sum(p.numel() for p in model.parameters())


def test_param_count_by_hand():
    tiny = ModelConfig.from_hf(PRESETS["tiny"])  # h 64, 4 layers, 4 heads / 2 KV heads of 16, MLP 128, vocab 64, tied
    layer = 64 * 64 * 2 + 64 * 32 * 2 + (64 + 32 + 32) + 3 * 64 * 128 + 2 * 64
    assert tiny.num_params == 4 * layer + 64 * 64 + 64
    llama = ModelConfig.from_hf({**PRESETS["tiny"], "architectures": ["LlamaForCausalLM"], "attention_bias": True})
    assert llama.layer_params() == layer + 64  # q/k/v and o biases


def test_defaults_and_eta_null_means_unbounded():
    job = load_job(small_job())
    assert job.rl.eta == 4 and job.rl.decoupled and job.rl.top_k == 0
    assert output_lengths(job.workload.output_len).mean() == pytest.approx(16, rel=0.01)  # default mean: max_new/2
    d = small_job()
    d["rl"] = {**d["rl"], "eta": None, "top_k": -1}
    job = load_job(d)
    assert job.rl.eta is None and job.rl.top_k == 0


def test_max_concurrent_rollouts_and_the_old_name_refused():
    d = small_job()
    assert load_job(d).rl.max_concurrent_rollouts == (4 + 1) * 4  # (eta + 1) * batch_size: never binds
    d["rl"] = {**d["rl"], "max_concurrent_rollouts": 3}
    assert load_job(d).rl.max_concurrent_rollouts == 3
    d["rl"] = {**small_job()["rl"], "max_running": 3}  # a job file from before the rename
    with pytest.raises(ConfigError) as e:
        load_job(d)
    assert e.value.problems == ["rl.max_running: renamed to rl.max_concurrent_rollouts; rename it in the job file"]


def test_every_problem_reported_at_once():
    bad = small_job()
    bad["cluster"] = {"nodes": [{"name": "a", "gpu_type": "H900", "gpus": 8},
                                {"name": "b", "gpu_type": "H20", "gpus": 4},
                                {"name": "c", "gpus": 8}],
                      "inter_node_GBps": -5, "cross_type_GBps": {"H20/XYZ": 1.0}}
    bad["rl"] = {"batch_size": 0, "lr": "fast", "clip_hi": 0.3}
    bad["prices"] = {"H20": -1}
    del bad["data"]
    with pytest.raises(ConfigError) as e:
        load_job(bad)
    msg = str(e.value)
    expected = [
        "cluster.nodes[0].gpu_type: unknown GPU type 'H900' (known: H100",
        "cluster.nodes[2].gpu_type: missing",
        "cluster.nodes: all nodes must have the same number of GPUs",
        "cluster.inter_node_GBps: must be > 0",
        "cluster.cross_type_GBps['H20/XYZ']",
        "rl.batch_size: must be >= 1",
        "rl.lr: must be a number",
        "rl.clip_hi: unknown field",
        "prices.H20: must be a number >= 0",
        "data: missing",
    ]
    for part in expected:
        assert part in msg, part
    assert len(e.value.problems) == len(expected)


def test_an_unknown_field_suggests_the_known_one_it_resembles():
    bad = small_job()
    bad["rl"] = {"learning_rate": 1e-4, "etta": 2, "zzz": 1}
    bad["data"] = {"synthetic": {"task": "arithmetic", "n": 10, "n_held_out": 5}}
    with pytest.raises(ConfigError) as e:
        load_job(bad)
    msg = str(e.value)
    assert "rl.etta: unknown field (did you mean 'eta'? known: " in msg
    assert "data.synthetic.n_held_out: unknown field (did you mean 'n_heldout'? known: " in msg
    assert "rl.zzz: unknown field (known: " in msg  # nothing close: the list alone


def test_a_synthetic_tasks_token_budget_is_read_and_each_bad_field_named():
    job = load_job(small_job(data={"synthetic": {"task": "arithmetic", "n": 64,
                                                 "budget": {"start": 8, "end": 32, "steps": 50}}}))
    assert job.data.synthetic["budget"] == {"start": 8, "end": 32, "steps": 50}
    bad = small_job(data={"synthetic": {"task": "arithmetic", "n": 64,
                                        "budget": {"start": 0, "end": 64, "steps": 2.5, "grow": 2}}})
    with pytest.raises(ConfigError) as e:
        load_job(bad)
    msg = str(e.value)
    assert "data.synthetic.budget.start: must be >= 1, got 0" in msg
    assert "data.synthetic.budget.end: 64 tokens > rl.max_new_tokens 32" in msg
    assert "data.synthetic.budget.steps: must be an integer" in msg
    assert "data.synthetic.budget.grow: unknown field" in msg
    with pytest.raises(ConfigError, match="data.synthetic.budget.steps: missing"):
        load_job(small_job(data={"synthetic": {"task": "arithmetic", "budget": {"start": 8, "end": 16}}}))


def test_model_path_reads_config_json(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(PRESETS["tiny"]))
    (tmp_path / "job.json").write_text(json.dumps(small_job(model={"path": "ckpt"})))
    job = load_job(tmp_path / "job.json")  # relative to the job file
    assert job.model.path == str(tmp_path / "ckpt") and job.model.config.hidden_size == 64
    with pytest.raises(ConfigError, match=r"model.path: no config.json"):
        load_job(small_job(model={"path": str(tmp_path)}))
    with pytest.raises(ConfigError, match=r"model.config.num_hidden_layers: missing"):
        load_job(small_job(model={"config": {"hidden_size": 8, "intermediate_size": 8,
                                             "num_attention_heads": 2, "vocab_size": 10}}))


def test_data_path_checked_unless_planning(tmp_path):
    job = small_job(data={"path": str(tmp_path / "nope.jsonl"), "kind": "math"})
    with pytest.raises(ConfigError, match="data.path: file not found"):
        load_job(job)
    assert load_job(job, check_paths=False).data.kind == "math"


def test_output_length_forms():
    rl = {"batch_size": 4, "group_size": 2, "max_new_tokens": 100}
    hist = load_job(small_job(rl=rl, workload={"output_len": {"histogram": {"edges": [0, 10, 100],
                                                                        "counts": [3, 1]}}}))
    assert output_lengths(hist.workload.output_len).mean() == pytest.approx(0.75 * 5 + 0.25 * 55)
    samples = load_job(small_job(rl=rl, workload={"samples": [10, 20, 20, 50]}))  # flat form also accepted
    assert output_lengths(samples.workload.output_len).mean() == pytest.approx(25)
    assert output_lengths(samples.workload.output_len).max() == 50
    with pytest.raises(ConfigError, match=r"longest output 120 > rl.max_new_tokens 100"):
        load_job(small_job(rl=rl, workload={"output_len": {"samples": [120]}}))
    with pytest.raises(ConfigError, match=r"len\(edges\) == len\(counts\) \+ 1"):
        load_job(small_job(rl=rl, workload={"output_len": {"histogram": {"edges": [0, 1], "counts": [1, 2]}}}))


def test_an_output_length_that_is_a_bare_number_is_named():
    """`"output_len": 3` (a number, not a distribution) is one problem naming the field, with the others."""
    with pytest.raises(ConfigError) as e:
        load_job(small_job(rl={"batch_size": 4, "group_size": 2, "max_new_tokens": 32, "eta": -1},
                           workload={"output_len": 3}))
    assert "workload.output_len: must be {samples: [...]}" in str(e.value) and "rl.eta" in str(e.value)


def test_equal_reward_fraction():
    """The share of groups filtered for equal rewards: generation does 1 / (1 - f) of a step."""
    from hexrl.plan.cost_inputs import workload_of
    rl = {"batch_size": 4, "group_size": 2, "max_new_tokens": 100}
    job = load_job(small_job(rl=rl, workload={"equal_reward_fraction": 0.75}))
    assert job.workload.to_dict()["equal_reward_fraction"] == 0.75
    assert workload_of(job).gen_samples == pytest.approx(4 * 2 * 4)
    with pytest.raises(ConfigError, match=r"workload.equal_reward_fraction: must be <= 0.99, got 1"):
        load_job(small_job(rl=rl, workload={"equal_reward_fraction": 1}))
    with pytest.raises(ConfigError, match=r"workload.equal_reward_fraction: rl.filter_equal_groups is false"):
        load_job(small_job(rl={**rl, "filter_equal_groups": False}, workload={"equal_reward_fraction": 0.5}))


def test_plan_round_trip_and_world_checks(tmp_path):
    job = load_job(demo_job())
    plan = plan_job(job)
    plan.save(tmp_path / "plan.json")
    again = load_plan(tmp_path / "plan.json")
    assert [r.to_dict() for r in again.ranks] == [r.to_dict() for r in plan.ranks]
    assert again.trainer.to_dict() == plan.trainer.to_dict()
    validate_plan_against_world(again, 3, 3)
    with pytest.raises(ConfigError) as e:
        validate_plan_against_world(again, 4, 2)
    assert "WORLD_SIZE=4 but the plan has 3 ranks (1 node x 3)" in str(e.value)  # not "1 nodes"
    assert "LOCAL_WORLD_SIZE=2" in str(e.value)


def test_broken_plans_name_every_problem():
    plan = plan_job(load_job(demo_job())).to_dict()
    bad = copy.deepcopy(plan)
    bad["ranks"][2]["role"] = "critic"
    with pytest.raises(ConfigError) as e:
        load_plan(bad)
    msg = str(e.value)
    assert "ranks[2].role: unknown role 'critic'" in msg
    bad = copy.deepcopy(plan)
    bad["ranks"][1]["rank"] = 0  # rank 0 twice, rank 1 missing
    bad["rollout"]["replicas"][0]["ranks"] = [0]  # a trainer rank inside a replica
    with pytest.raises(ConfigError) as e:
        load_plan(bad)
    msg = str(e.value)
    assert "rank 0 listed twice" in msg and "missing global ranks 1" in msg
    assert "rank 0 must be role 'rollout'" in msg
    assert "rollout ranks 2 belong to no replica" in msg


def test_schema_and_planner_load_without_torch():
    """The schema depends on nothing above it: planning never imports torch."""
    code = "import sys, hexrl.schema, hexrl.plan.planner, hexrl.plan.simulate; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_unsupported_architecture_is_refused_at_plan_time():
    gemma = {**PRESETS["tiny"], "architectures": ["GemmaForCausalLM"], "model_type": "gemma"}
    with pytest.raises(ConfigError, match=r"model.config.architectures: unsupported architecture 'GemmaForCausalLM'"):
        load_job(small_job(model={"config": gemma}))


def test_lr_decay_fields_default_off_and_are_validated():
    rl = load_job(small_job()).rl
    assert (rl.lr_decay_steps, rl.lr_final_frac) == (0, 0.0)
    d = small_job()
    d["rl"] = {**d["rl"], "lr_decay_steps": 1200, "lr_final_frac": 0.25}
    rl = load_job(d).rl
    assert (rl.lr_decay_steps, rl.lr_final_frac) == (1200, 0.25)
    d["rl"] = {**d["rl"], "lr_decay_steps": -1, "lr_final_frac": 1.5}
    with pytest.raises(ConfigError) as e:
        load_job(d)
    assert [p.split(":")[0] for p in e.value.problems] == ["rl.lr_decay_steps", "rl.lr_final_frac"], e.value.problems


def test_lr_lag_scale_defaults_off_and_is_validated():
    assert load_job(small_job()).rl.lr_lag_scale == 0.0
    d = small_job()
    d["rl"] = {**d["rl"], "lr_lag_scale": 0.25}
    assert load_job(d).rl.lr_lag_scale == 0.25
    d["rl"] = {**d["rl"], "lr_lag_scale": -1}
    with pytest.raises(ConfigError) as e:
        load_job(d)
    assert [p.split(":")[0] for p in e.value.problems] == ["rl.lr_lag_scale"], e.value.problems


def test_reward_bound_defaults_to_a_million_and_is_validated():
    assert load_job(small_job()).rl.reward_bound == 1e6
    d = small_job()
    d["rl"] = {**d["rl"], "reward_bound": 10}
    assert load_job(d).rl.reward_bound == 10.0
    for bad in (0, -1, 1e7, float("nan"), "big", True):
        d["rl"] = {**d["rl"], "reward_bound": bad}
        with pytest.raises(ConfigError) as e:
            load_job(d)
        assert [p.split(":")[0] for p in e.value.problems] == ["rl.reward_bound"], (bad, e.value.problems)


def test_sync_delta_defaults_off_is_validated_and_rides_in_the_plan():
    assert (load_job(small_job()).sync.delta, load_job(small_job()).sync.changed_fraction) == (False, 0.034)
    job = load_job(small_job(sync={"delta": "auto", "changed_fraction": 0.1}))
    assert (job.sync.delta, job.sync.changed_fraction) == ("auto", 0.1)
    assert load_job(job.to_dict()).sync == job.sync  # a plan file carries it to the run
    with pytest.raises(ConfigError) as e:
        load_job(small_job(sync={"delta": 1, "changed_fraction": 2, "bitmap": True}))
    assert sorted(p.split(":")[0] for p in e.value.problems) == [
        "sync.bitmap", "sync.changed_fraction", "sync.delta"], e.value.problems


def test_long_tail_defaults_off_is_validated_and_rides_in_the_plan():
    job = load_job(small_job())
    assert (job.long_tail.alpha, job.long_tail.on, "long_tail" in job.to_dict()) == (0.0, False, False)
    job = load_job(small_job(long_tail={"alpha": 0.2, "caps": [32, 8]}))
    assert (job.long_tail.alpha, job.long_tail.caps) == (0.2, (8, 32))
    assert load_job(job.to_dict()).long_tail == job.long_tail  # a plan file carries it to the run
    for bad, field in (({"alpha": 1}, "long_tail.alpha"), ({"alpha": -0.1}, "long_tail.alpha"),
                       ({"alpha": "most"}, "long_tail.alpha"), ({"caps": []}, "long_tail.caps"),
                       ({"caps": [0]}, "long_tail.caps"), ({"caps": [10**6]}, "long_tail.caps"),
                       ({"caps": [8, 8]}, "long_tail.caps"), ({"caps": [8.5]}, "long_tail.caps"),
                       ({"caps": list(range(1, 4097))}, "long_tail.caps"),  # one MILP a cap: planned for minutes
                       ({"cap": 8}, "long_tail.cap")):
        with pytest.raises(ConfigError) as e:
            load_job(small_job(long_tail=bad))
        assert [p.split(":")[0] for p in e.value.problems] == [field], (bad, e.value.problems)


def test_a_replica_marked_long_tail_reads_back_and_a_plain_one_writes_no_mark():
    plan = plan_job(load_job(small_job()))
    d = plan.to_dict()
    assert all("long_tail" not in x for x in d["rollout"]["replicas"])  # a job without the section: as before
    d["rollout"]["replicas"][0]["long_tail"] = True
    assert load_plan(d).replicas[0].long_tail is True
    d["rollout"]["replicas"][0]["long_tail"] = "yes"
    with pytest.raises(ConfigError) as e:
        load_plan(d)
    assert "rollout.replicas[0].long_tail" in str(e.value.problems)
