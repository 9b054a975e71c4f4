"""Write a small random Qwen2- or Llama-shaped checkpoint in Hugging Face format.

    python tools/make_tiny_model.py OUT_DIR [--arch qwen2|llama] [--vocab 64] [--tokenizer char]
"""
from __future__ import annotations

import argparse

from hexrl.model.tiny import ARCH, make_tiny_model


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
