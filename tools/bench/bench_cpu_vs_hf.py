"""The rollout engine against Hugging Face `generate` on CPU: same weights, fp32, greedy, same tokens.

    python tools/bench/bench_cpu_vs_hf.py                          # ~25M-param Qwen2, batch 1 and 32
    python tools/bench/bench_cpu_vs_hf.py --batch 8 --repeats 7 --prompt-len 128 --output-len 128
    python tools/bench/bench_cpu_vs_hf.py --hf-onednn                # HF gets the engine's oneDNN CPU linears too

A random ~25M-parameter Qwen2 checkpoint (lm_head sharpened so greedy picks have no near-ties)
is written to a temporary directory and loaded by both sides. Per batch size, the two sides run
alternately (A, B, A, B, ...) so that load from other processes hits both alike; each run is a
whole generation (prefill + decode) of fixed-length outputs, timed end to end (our engine is
built once per batch size, untimed, as a rollout server keeps one; its KV pool is sized to the run). The outputs must
be identical token for token. Prints tokens/s of each side (medians) and the ratio of the medians,
by wall clock and by the CPU time of the (single) compute thread, which a loaded machine disturbs
less, with the machine's load average. One intra-op thread on both sides unless --threads says more.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hexrl.model.hf_checkpoint import load_pretrained, save_pretrained
from hexrl.model.tiny import make_tiny_model
from hexrl.rollout import Engine, EngineConfig, Request
from hexrl.rollout.cpu_linear import pack_linears

SHAPE = dict(vocab=16384, hidden=384, layers=8, heads=6, kv_heads=2, intermediate=1024, tie=False)


def make_checkpoint(path: Path) -> Path:
    make_tiny_model(path, seed=0, **SHAPE)
    model = load_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # well-separated greedy picks: both sides must agree exactly
    save_pretrained(model, path)
    return path


def prompts(batch: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, SHAPE["vocab"], (batch, length), generator=g).tolist()


def make_engine(model, batch: int, plen: int, olen: int) -> Engine:
    """A long-lived engine, as a rollout server keeps one (its KV pool is allocated once, untimed)."""
    cfg = EngineConfig(max_running=batch, max_batch_tokens=max(2048, batch * plen), attention="torch",
                       max_pages=batch * (-(-(plen + olen) // 16) + 1))
    return Engine(model, cfg, eos_ids=[])


def run_ours(engine: Engine, ids: list[list[int]], olen: int) -> tuple[float, list[list[int]]]:
    reqs = [Request(i, p, max_new_tokens=olen, temperature=0.0, ignore_eos=True) for i, p in enumerate(ids)]
    c0, t0 = time.thread_time(), time.perf_counter()
    outs = engine.generate(reqs)
    return (time.perf_counter() - t0, time.thread_time() - c0), [o.token_ids for o in outs]


def run_hf(hf, ids: list[list[int]], olen: int) -> tuple[float, list[list[int]]]:
    x = torch.tensor(ids)
    c0, t0 = time.thread_time(), time.perf_counter()
    with torch.no_grad():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=olen, min_new_tokens=olen,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
    return (time.perf_counter() - t0, time.thread_time() - c0), out[:, x.shape[1]:].tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, action="append", help="repeat for several (default 1 and 32)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--hf-onednn", action="store_true",
                   help="give HF the engine's CPU linears too (oneDNN, prepacked): compares the rest alone")
    args = p.parse_args()
    import transformers

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp) / "qwen2-25m")
        ours_model = load_pretrained(path)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if args.hf_onednn and not pack_linears(hf):
        raise SystemExit("--hf-onednn: this torch build has no oneDNN linear")
    n_params = sum(t.numel() for t in ours_model.parameters())
    hf_linears = "oneDNN" if args.hf_onednn else "F.linear"
    print(f"Qwen2 {n_params / 1e6:.1f}M params, fp32, greedy, HF linears {hf_linears}, prompt {args.prompt_len}, "
          f"output {args.output_len}, "
          f"{args.threads} thread(s), {args.repeats} interleaved repeats; load average before: "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'batch':>5} {'clock':>5} {'ours tok/s':>11} {'HF tok/s':>10} {'ours / HF':>10}  identical  "
          "(ratio min-max over pairs)")
    for b in args.batch or [1, 32]:
        ids = prompts(b, args.prompt_len)
        engine = make_engine(ours_model, b, args.prompt_len, args.output_len)
        run_ours(engine, ids[:1], 4)  # warm-up of both code paths
        run_hf(hf, ids[:1], 4)
        ours, theirs, same = [], [], True
        for _ in range(args.repeats):
            t_ours, out_ours = run_ours(engine, ids, args.output_len)
            t_hf, out_hf = run_hf(hf, ids, args.output_len)
            ours.append(t_ours)
            theirs.append(t_hf)
            same &= out_ours == out_hf
        tokens = b * args.output_len
        for i, clock in enumerate(("wall", "CPU")):
            o, h = [t[i] for t in ours], [t[i] for t in theirs]
            pairs = [y / x for x, y in zip(o, h)]
            print(f"{b:>5} {clock:>5} {tokens / statistics.median(o):>11.1f} {tokens / statistics.median(h):>10.1f} "
                  f"{statistics.median(h) / statistics.median(o):>10.2f}  {'yes' if same else 'NO':>9}  "
                  f"({min(pairs):.2f}-{max(pairs):.2f})")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
