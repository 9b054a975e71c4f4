"""Sample from a model with the rollout engine.

    python -m hexrl.generate MODEL --prompt "37+45=" [--prompt ...] --max-new-tokens 32 \\
        [--temperature 0] [--top-p 1] [--top-k 0] [--seed 0] [--json]

MODEL is a Hugging Face model directory (config.json, *.safetensors, tokenizer), a run directory
(its final/ model, else its latest checkpoint), or a checkpoint directory (RUN_DIR/checkpoints).

With --json, prints one JSON object per prompt (in prompt order, one per line) with the prompt,
the generated `token_ids` and `text`, per-token `logprobs`, and `finish_reason`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from hexrl.model.config import MAX_POSITIONS, ModelConfig
from hexrl.ranges import MAX_SEED, number_problem

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hexrl.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a model directory (config.json, *.safetensors, tokenizer), a run directory "
                   "(its final/, else its latest checkpoint) or a checkpoint directory")
    p.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for several")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=0, help="prompt i samples with seed + i")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-pages", type=int, default=None, help="KV pages (default: from free memory)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    return p.parse_args(argv)


def device_problem(name: str) -> str | None:
    """Why `--device NAME` cannot run here (not a device name, a GPU this host lacks), or None."""
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError) as e:
        return f"--device {name!r}: not a device name (cpu, cuda, cuda:N) ({str(e)[:100]})"
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        return f"--device {name!r}: only cpu and cuda devices run the engine"
    if not torch.cuda.is_available():
        return f"--device {name!r}: this host has no CUDA GPU (use --device cpu)"
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        return f"--device {name!r}: this host has {torch.cuda.device_count()} CUDA GPU(s)"
    return None


def memory_bytes(device: torch.device) -> int:
    """Free memory on `device` (a GPU's free memory, else the host's available memory)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62


def arg_problems(args: argparse.Namespace) -> list[str]:
    """Every bad argument, each named, before any model is read (hexrl.ranges bounds the numbers)."""
    out = [] if (why := device_problem(args.device)) is None else [why]
    for flag, value, lo, hi, integer in (("--max-new-tokens", args.max_new_tokens, 1, MAX_POSITIONS, True),
                                         ("--temperature", args.temperature, 0, 1e3, False),
                                         ("--top-p", args.top_p, 0, 1, False),
                                         ("--top-k", args.top_k, 0, 1 << 22, True),
                                         ("--seed", args.seed, 0, MAX_SEED - len(args.prompt), True),
                                         ("--page-size", args.page_size, 1, 1 << 16, True),
                                         ("--max-pages", args.max_pages, 1, 1 << 40, True)):
        if value is not None and (why := number_problem(value, lo, hi, integer=integer)):
            out.append(f"{flag}: {why}")
    if args.top_p == 0:
        out.append("--top-p: must be > 0, got 0")
    return out


def kv_problem(args: argparse.Namespace, cfg, dtype: torch.dtype) -> str | None:
    """Why --max-pages x --page-size tokens of KV cache cannot fit in the device's free memory."""
    if args.max_pages is None:
        return None
    need = args.max_pages * args.page_size * cfg.kv_bytes_per_token(torch.finfo(dtype).bits // 8)
    have = memory_bytes(torch.device(args.device))
    if need > have:
        return (f"--max-pages {args.max_pages}: {need / 2**30:,.1f} GiB of KV cache at --page-size {args.page_size}, "
                f"{have / 2**30:,.1f} GiB free on {args.device}")
    return None


def model_dir(path: str, scratch: Path) -> Path:
    """The HF model directory to load for `path`: itself, a run's final/, or a training checkpoint
    (a run's latest, a checkpoint root's latest, or one step) exported into `scratch`."""
    p = Path(path)
    if (p / "config.json").is_file() and not (p / "latest").is_file():  # a checkpoint root holds one too
        return p
    if (p / "final" / "config.json").is_file():
        return p / "final"
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    if not ((root / "latest").is_file() or (root / "meta.json").is_file()):
        what = "does not exist" if not p.exists() else "holds no model (config.json), final/ or checkpoint"
        raise FileNotFoundError(f"{p} {what}")
    from hexrl.train.checkpoint import resolve
    from hexrl.train.export import export_checkpoint

    print(f"[generate] no final model: using the checkpoint {resolve(root)}", file=sys.stderr)
    return export_checkpoint(root, scratch / "model")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from hexrl.data.tokenizer import load_tokenizer
    from hexrl.model.hf_checkpoint import load_pretrained
    from hexrl.rollout import Engine, EngineConfig, Request

    if problems := arg_problems(args):
        print("error: " + "\n       ".join(problems), file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    try:
        with tempfile.TemporaryDirectory(prefix="hexrl-generate-") as scratch:
            path = model_dir(args.model, Path(scratch))
            tokenizer = load_tokenizer(path)
            if why := kv_problem(args, ModelConfig.from_dir(path), dtype):  # before the model or the cache
                raise ValueError(why)
            model = load_pretrained(path, dtype=dtype, device=args.device, fused=True)  # the engine's layout
        engine = Engine(model, EngineConfig(page_size=args.page_size, max_pages=args.max_pages), tokenizer=tokenizer)
        requests = [Request(i, tokenizer.encode(text), max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed + i)
                    for i, text in enumerate(args.prompt)]
        outputs = engine.generate(requests)
    except (OSError, ValueError) as e:  # bad paths, checkpoints, prompts or settings: say so, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompt, outputs):
        text = tokenizer.decode(out.token_ids)
        if args.json:
            print(json.dumps({"prompt": prompt, "text": text, "token_ids": out.token_ids,
                              "logprobs": out.logprobs, "finish_reason": out.finish_reason}))
        else:
            print(f"--- prompt: {prompt!r}  ({len(out.token_ids)} tokens, {out.finish_reason})\n{prompt}{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
