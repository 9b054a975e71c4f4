"""Fused q/k/v and gate/up weights (the rollout's layout) against the trainer's split layout and HF."""
import json

import pytest
import torch
from safetensors import safe_open

from hexrl.comm.weights import load_into, load_state
from hexrl.model.fused import hf_state_dict, hf_tensors
from hexrl.model.hf_checkpoint import load_pretrained, save_pretrained
from hexrl.model.parallel import TPGroup
from hexrl.model.tiny import make_tiny_model

IDS = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Untied tiny Qwen2 with GQA and q/k/v biases (Qwen2 has them; the fused bias must follow)."""
    path = tmp_path_factory.mktemp("fused") / "m"
    make_tiny_model(path, arch="qwen2", tie=False, kv_heads=2)
    cfg = json.loads((path / "config.json").read_text())
    model = load_pretrained(path)
    assert model.cfg.qkv_bias
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
    save_pretrained(model, path)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_fused_layout_replaces_the_split_projections(ckpt):
    model = load_pretrained(ckpt, fused=True)
    names = [n for n, _ in model.named_parameters()]
    split = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    assert not [n for n in names if n.split(".")[-2] in split]
    attn, mlp = model.model.layers["0"].self_attn, model.model.layers["0"].mlp
    cfg = model.cfg
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    assert attn.qkv_proj.weight.shape == (q + 2 * kv, cfg.hidden_size) and attn.qkv_proj.bias.shape == (q + 2 * kv,)
    assert mlp.gate_up_proj.weight.shape == (2 * cfg.intermediate_size, cfg.hidden_size)
    assert sorted(hf_tensors(model)) == sorted(n for n, _ in load_pretrained(ckpt).named_parameters())


def test_fused_logits_equal_split_and_transformers(ckpt):
    split, fused = load_pretrained(ckpt), load_pretrained(ckpt, fused=True)
    with torch.no_grad():
        want, got = split(IDS), fused(IDS)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(got, hf(IDS).logits, rtol=0, atol=1e-4)


def test_checkpoint_round_trips_both_ways(ckpt, tmp_path):
    split = load_pretrained(ckpt)
    fused = load_pretrained(ckpt, fused=True)
    with torch.no_grad():  # a "trained" fused model: its save must differ from the file it came from
        for p in fused.parameters():
            p.add_(0.01)
    save_pretrained(fused, tmp_path / "from_fused")
    with safe_open(str(tmp_path / "from_fused" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert keys == set(split.state_dict()), "a fused model saves HF names, split"
    back = load_pretrained(tmp_path / "from_fused")  # fused -> file -> split
    for name, t in hf_state_dict(fused).items():
        assert torch.equal(back.state_dict()[name], t), name
    again = load_pretrained(tmp_path / "from_fused", fused=True)  # -> fused again: the same tensors
    for (n, a), (m, b) in zip(fused.state_dict().items(), again.state_dict().items()):
        assert n == m and torch.equal(a, b), n


def test_tp_fused_shard_stacks_each_parts_slice(ckpt):
    """Rank r holds [q_r; k_r; v_r] (each part sliced by rank, then stacked), not a slice of the stacked
    full matrix; weight sync (load_into from full HF tensors) lands the same rows."""
    full = load_pretrained(ckpt).state_dict()
    pre = "model.layers.1."
    for rank in (0, 1):
        tp = TPGroup(None, rank, 2)
        model = load_pretrained(ckpt, tp=tp, fused=True)

        def rows(name, rank=rank):
            t = full[pre + name]
            n = t.shape[0] // 2
            return t[rank * n:(rank + 1) * n]

        qkv = model.model.layers["1"].self_attn.qkv_proj
        want = torch.cat([rows(f"self_attn.{p}_proj.weight") for p in "qkv"])
        assert torch.equal(qkv.weight, want)
        assert torch.equal(qkv.bias, torch.cat([rows(f"self_attn.{p}_proj.bias") for p in "qkv"]))
        gate_up = model.model.layers["1"].mlp.gate_up_proj.weight
        assert torch.equal(gate_up, torch.cat([rows("mlp.gate_proj.weight"), rows("mlp.up_proj.weight")]))
        synced = load_pretrained(ckpt, tp=tp, fused=True)
        with torch.no_grad():
            for p in synced.parameters():
                p.zero_()
        load_into(synced, full)  # the trainer's full split tensors, as the broadcast delivers them
        for (n, a), (_, b) in zip(model.state_dict().items(), synced.state_dict().items()):
            assert torch.equal(a, b), n


def test_update_weights_state_takes_hf_or_fused_names_and_reports_problems(ckpt, tmp_path):
    make_tiny_model(tmp_path / "b", arch="qwen2", tie=False, kv_heads=2, seed=5)
    new_split = load_pretrained(tmp_path / "b")
    with torch.no_grad():
        want = new_split(IDS)
    for state in (new_split.state_dict(), load_pretrained(tmp_path / "b", fused=True).state_dict()):
        model = load_pretrained(ckpt, fused=True)
        load_state(model, state)
        with torch.no_grad():
            torch.testing.assert_close(model(IDS), want, rtol=0, atol=1e-5)
    bad = dict(new_split.state_dict(), foo=torch.zeros(1))
    del bad["model.layers.0.self_attn.k_proj.bias"]
    bad["model.layers.2.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError) as e:
        load_state(load_pretrained(ckpt, fused=True), bad)
    msg = str(e.value)
    assert "unexpected foo" in msg and "missing model.layers.0.self_attn.k_proj.bias" in msg
    assert "model.layers.2.mlp.up_proj.weight: shape (3, 3)" in msg
