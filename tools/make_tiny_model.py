"""Write a small random Qwen2- or Llama-shaped checkpoint in Hugging Face format.

    python tools/make_tiny_model.py OUT_DIR [--arch qwen2|llama] [--vocab 64] [--tokenizer char]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hexrl.model import Decoder, ModelConfig, save_pretrained  # noqa: E402

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
        from hexrl.tokenizer import CharTokenizer

        CharTokenizer().save(out)
    return Path(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--arch", choices=sorted(ARCH), default="qwen2")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=128)
    p.add_argument("--untied", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", choices=["char", "none"], default="char")
    a = p.parse_args()
    path = make_tiny_model(a.out, seed=a.seed, tokenizer=None if a.tokenizer == "none" else a.tokenizer,
                           arch=a.arch, vocab=a.vocab, hidden=a.hidden, layers=a.layers, heads=a.heads,
                           kv_heads=a.kv_heads, intermediate=a.intermediate, tie=not a.untied)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
