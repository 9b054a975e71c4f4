"""A tiny random Qwen2- or Llama-shaped checkpoint in Hugging Face format: the CPU demo's and the tests' model.

`tools/make_tiny_model.py` is its command line.
"""
from __future__ import annotations

from pathlib import Path

import torch

from hexrl.model.checkpoint import save_pretrained
from hexrl.model.config import ModelConfig
from hexrl.model.decoder import Decoder

ARCH = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


def tiny_config(arch: str = "qwen2", vocab: int = 64, hidden: int = 64, layers: int = 4, heads: int = 4,
                kv_heads: int = 2, intermediate: int = 128, tie: bool = True, rope_theta: float = 10000.0) -> dict:
    """An HF config dict for a tiny decoder (GQA when kv_heads < heads)."""
    return {
        "architectures": [ARCH[arch]], "model_type": arch, "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hidden // heads, "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta, "tie_word_embeddings": tie, "max_position_embeddings": 4096,
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
    }


def make_tiny_model(out: str | Path, seed: int = 0, tokenizer: str | None = None, **kw) -> Path:
    """Create the checkpoint directory (and a char tokenizer in it when asked) and return its path."""
    cfg = ModelConfig.from_hf(tiny_config(**kw))
    torch.manual_seed(seed)
    model = Decoder(cfg)
    model.init_weights(seed=seed)
    save_pretrained(model, out)
    if tokenizer == "char":
        from hexrl.data.tokenizer import CharTokenizer

        CharTokenizer().save(out)
    return Path(out)
