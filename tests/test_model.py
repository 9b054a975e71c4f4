"""Our decoder and checkpoint I/O against Hugging Face `transformers` as the reference."""
import json
from pathlib import Path

import pytest
import torch

from hexrl.model.attention import CausalAttention
from hexrl.model.config import ModelConfig
from hexrl.model.decoder import Decoder
from hexrl.model.hf_checkpoint import CheckpointError, load_pretrained, save_pretrained
from hexrl.model.parallel import TPGroup
from hexrl.model.tiny import make_tiny_model, tiny_config

transformers = pytest.importorskip("transformers")

VARIANTS = {
    "qwen2-gqa-tied": dict(arch="qwen2", kv_heads=2, tie=True),
    "qwen2-mha-untied": dict(arch="qwen2", kv_heads=4, tie=False, rope_theta=1e6),
    "llama-gqa-untied": dict(arch="llama", kv_heads=1, tie=False, rope_theta=5e5),
    "llama-tied": dict(arch="llama", kv_heads=2, tie=True),
}


def hf_checkpoint(tmp_path: Path, **kw) -> Path:
    """A random checkpoint created and saved by transformers itself (the independent reference)."""
    cfg = tiny_config(**kw)
    if kw.get("arch") == "llama":
        cfg.update(attention_bias=True)  # exercise q/k/v/o biases on the Llama path too
    hf_cfg = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float()
    with torch.no_grad():  # HF zero-inits biases; make them count
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def hf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model(ids).logits


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(tmp_path, variant):
    path = hf_checkpoint(tmp_path, **VARIANTS[variant])
    ids = torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(1))
    ours = load_pretrained(path)(ids)
    assert ours.shape == (3, 11, 64)
    assert (ours - hf_logits(path, ids)).abs().max().item() < 1e-4


def test_save_then_transformers_load_gives_same_logits(tmp_path):
    make_tiny_model(tmp_path / "ours", arch="qwen2", tie=False)
    ours = load_pretrained(tmp_path / "ours")
    with torch.no_grad():
        for p in ours.parameters():  # a "trained" model: weights differ from the file
            p.add_(0.01 * torch.randn_like(p))
    save_pretrained(ours, tmp_path / "saved", max_shard_bytes=40_000)  # forces an index + shards
    assert (tmp_path / "saved" / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, 64, (2, 7))
    assert (ours(ids) - hf_logits(tmp_path / "saved", ids)).abs().max().item() < 1e-4
    assert (load_pretrained(tmp_path / "saved")(ids) - ours(ids)).abs().max().item() == 0


def test_stage_load_matches_slice_of_full_model(tmp_path):
    path = make_tiny_model(tmp_path / "m", layers=4, tie=True)
    full = load_pretrained(path)
    ids = torch.randint(0, 64, (9,))
    pos, attn = torch.arange(9), CausalAttention([9])
    first, middle, last = (load_pretrained(path, layers=r) for r in [(0, 1), (1, 3), (3, 4)])
    assert list(middle.model.layers) == ["1", "2"] and middle.model.embed_tokens is None
    h = last.stage(middle.stage(first.stage(ids, pos, attn), pos, attn), pos, attn)
    torch.testing.assert_close(last.logits(h), full.logits(full.stage(ids, pos, attn)), rtol=0, atol=1e-6)
    torch.testing.assert_close(last.lm_head.weight, full.model.embed_tokens.weight)  # tied head on a last stage


def test_tensor_parallel_shard_reads_only_its_slice(tmp_path):
    path = make_tiny_model(tmp_path / "m", layers=2, tie=False)
    full = load_pretrained(path)
    shard = load_pretrained(path, tp=TPGroup(group=None, rank=1, size=2))
    a, b = shard.model.layers["0"], full.model.layers["0"]
    torch.testing.assert_close(a.self_attn.q_proj.weight, b.self_attn.q_proj.weight[32:])  # column: rows
    torch.testing.assert_close(a.self_attn.o_proj.weight, b.self_attn.o_proj.weight[:, 32:])  # row: columns
    torch.testing.assert_close(a.mlp.down_proj.weight, b.mlp.down_proj.weight[:, 64:])
    torch.testing.assert_close(shard.model.embed_tokens.weight, full.model.embed_tokens.weight[32:])
    torch.testing.assert_close(shard.lm_head.weight, full.lm_head.weight[32:])


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    cfg = tiny_config(arch="llama", tie=False)
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    hf_cfg = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    transformers.AutoModelForCausalLM.from_config(hf_cfg).save_pretrained(tmp_path / "m")
    ids = torch.randint(0, 64, (1, 40))
    assert (load_pretrained(tmp_path / "m")(ids) - hf_logits(tmp_path / "m", ids)).abs().max().item() < 1e-4


def test_bad_checkpoints_get_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(tmp_path / "empty")

    path = make_tiny_model(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_pretrained(path)

    (path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(CheckpointError, match=r"up_proj.weight has shape \[128, 64\], config.json gives \[96, 64\]"):
        load_pretrained(path)

    (path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 5}))
    with pytest.raises(CheckpointError, match="lacks tensor model.layers.4"):
        load_pretrained(path)

    (path / "config.json").write_text(json.dumps(cfg))
    (path / "model.safetensors").write_bytes(b"\x10\x00garbage")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        load_pretrained(path)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_pretrained(path)


def test_packed_sequences_do_not_attend_across_boundaries():
    model = Decoder(ModelConfig.from_hf(tiny_config()))
    model.init_weights(seed=0)
    a, b = torch.randint(0, 64, (5,)), torch.randint(0, 64, (8,))
    packed = model.logits(model.stage(torch.cat([a, b]), torch.cat([torch.arange(5), torch.arange(8)]),
                                      CausalAttention([5, 8])))
    torch.testing.assert_close(packed[5:], model(b[None])[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(packed[:5], model(a[None])[0], rtol=0, atol=1e-5)
