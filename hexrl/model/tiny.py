"""A tiny random Qwen2- or Llama-shaped checkpoint in Hugging Face format: the CPU demo's and the tests' model.

`tools/make_tiny_model.py` is its command line.
"""
from __future__ import annotations

from pathlib import Path

import torch

from hexrl.model.config import ARCH, ModelConfig, tiny_config
from hexrl.model.decoder import Decoder
from hexrl.model.hf_checkpoint import save_pretrained

__all__ = ["ARCH", "make_tiny_model", "tiny_config"]  # ARCH and tiny_config live in the torch-free config.py


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
