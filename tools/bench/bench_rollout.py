"""Rollout decode throughput against the HBM roofline and Hugging Face `generate`, side by side.

    python tools/bench/bench_rollout.py                       # GPU: Qwen2.5-1.5B shape, bf16, batch 1 and 256
    python tools/bench/bench_rollout.py --batch 64 --prompt-len 512 --output-len 256
    python tools/bench/bench_rollout.py --shape tiny          # what the CPU default runs: seconds

Random weights, fixed prompt and output lengths (EOS ignored), greedy. For each batch size it
prints our end-to-end and decode-only tokens/s, the roofline tokens/s (a decode step must read
every weight plus every cached k/v once: bytes / copy bandwidth measured here), and HF
`generate` on the same weights and device (transformers is imported only in this tool).
"""
from __future__ import annotations

import argparse
import gc
import time

import torch

from hexrl.model.config import (
    ModelConfig,
    rope_inv_freq,
)
from hexrl.model.decoder import Decoder
from hexrl.model.fused import hf_state_dict
from hexrl.rollout import Engine, EngineConfig, Request

SHAPES = {
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                         rope_theta=1e6, max_position_embeddings=32768),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def model_config(shape: str) -> ModelConfig:
    return ModelConfig.from_hf({"architectures": ["Qwen2ForCausalLM"], "rms_norm_eps": 1e-6, **SHAPES[shape]})


def random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> Decoder:
    """Random weights made directly on the device (a CPU init of 1.5B parameters takes long)."""
    with torch.device(device):
        model = Decoder(cfg)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.to(dtype)
    for mod in model.modules():  # keep RoPE frequencies in fp32, as checkpoint loading does
        if hasattr(mod, "inv_freq"):
            mod.inv_freq = rope_inv_freq(cfg).to(device)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted), the roofline's denominator."""
    n = (1 << 30) if device.type == "cuda" else (1 << 27)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    reps = 20 if device.type == "cuda" else 5
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * n * reps / (time.perf_counter() - t0)


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


def bench_ours(model: Decoder, batch: int, plen: int, olen: int, args) -> tuple[float, float]:
    """(end-to-end tokens/s, decode-only tokens/s) for one batch of fixed-length requests."""
    cfg = EngineConfig(page_size=args.page_size, max_running=batch, max_batch_tokens=max(8192, batch * plen),
                       gpu_memory_fraction=args.kv_fraction, attention=args.attention,
                       cuda_graphs=not args.no_graphs, max_pages=args.max_pages)
    engine = Engine(model, cfg, eos_ids=[])
    graphs = f"on ({len(engine.graphs.batch_sizes)} sizes)" if engine.graphs is not None else "off"
    print(f"batch {batch}: attention backend {engine.backend.name}, CUDA graphs {graphs}", flush=True)
    ids = prompts(batch, plen, model.cfg.vocab_size)
    warm = [Request(f"w{i}", p, max_new_tokens=4, temperature=0.0) for i, p in enumerate(ids[:batch])]
    engine.generate(warm)  # kernel JIT, allocator warm-up
    for i, p in enumerate(ids):
        engine.add(Request(i, p, max_new_tokens=olen, temperature=0.0, ignore_eos=True))
    sync(model.lm_head.weight.device)
    t0 = time.perf_counter()
    decode_start, decoded_before, done = None, 0, 0
    while done < batch:
        done += len(engine.step())
        if decode_start is None and engine.stats.steps and not engine.scheduler.waiting \
                and all(s.num_uncached == 1 for s in engine.scheduler.running):
            sync(model.lm_head.weight.device)
            decode_start, decoded_before = time.perf_counter(), engine.stats.generated_tokens
    sync(model.lm_head.weight.device)
    end = time.perf_counter()
    decode_start = decode_start or t0
    decode_tokens = engine.stats.generated_tokens - decoded_before
    del engine
    gc.collect()  # free the KV pool and graph memory before HF runs
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return batch * olen / (end - t0), decode_tokens / max(end - decode_start, 1e-9)


def bench_hf(model: Decoder, batch: int, plen: int, olen: int) -> float:
    """HF generate tokens/s on the same weights (greedy, fixed length)."""
    import transformers

    cfg = model.cfg
    hf_cfg = transformers.AutoConfig.for_model("qwen2", **{k: v for k, v in cfg.to_hf().items() if k != "model_type"})
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    missing = hf.load_state_dict(hf_state_dict(model), strict=False).missing_keys  # HF names, split
    assert not [k for k in missing if "rotary" not in k], f"HF model lacks {missing}"
    hf.eval()
    ids = torch.tensor(prompts(batch, plen, cfg.vocab_size), device=device)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        warm = ids[:, :8]
        hf.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, min_new_tokens=4, **kw)
        sync(device)
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=olen, min_new_tokens=olen, **kw)
        sync(device)
    assert out.shape[1] == plen + olen
    del hf
    return batch * olen / (time.perf_counter() - t0)


def roofline(cfg: ModelConfig, dtype: torch.dtype, batch: int, plen: int, olen: int, bandwidth: float) -> float:
    """Decode tokens/s if each step only had to read the weights and the cached k/v once."""
    elem = torch.empty((), dtype=dtype).element_size()
    kv_per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * elem
    step_bytes = cfg.num_params * elem + batch * (plen + olen / 2) * kv_per_token  # mean context
    return batch / (step_bytes / bandwidth)


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b" if cuda else "tiny")
    p.add_argument("--batch", type=int, action="append", help="repeat for several (default 1 and 256; CPU 1 and 8)")
    p.add_argument("--prompt-len", type=int, default=128 if cuda else 16)
    p.add_argument("--output-len", type=int, default=256 if cuda else 32)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16" if cuda else "float32")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-pages", type=int, default=None)
    p.add_argument("--kv-fraction", type=float, default=0.5, help="of free GPU memory (HF needs the rest)")
    p.add_argument("--attention", choices=["auto", "torch", "flashinfer"], default="auto")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--hf-runs", default=None, help="BxL,...: run HF generate only at these batch x output "
                   "lengths (ours too, side by side), e.g. 1x128,64x256; the --batch rows then skip HF "
                   "(HF is ~10x slower: its 1,024-token runs took 186 s of gpu_check on an H100)")
    args = p.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    batches = args.batch or ([1, 256] if cuda else [1, 8])
    cfg, dtype = model_config(args.shape), DTYPES[args.dtype]
    model = random_model(cfg, dtype, device)
    bw = copy_bandwidth(device)
    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, shape {args.shape} "
          f"({cfg.num_params / 1e6:.1f}M params, {args.dtype}), copy bandwidth {bw / 1e9:.0f} GB/s")
    head = f"{'batch':>6} {'prompt':>6} {'output':>6} {'tok/s':>10} {'decode tok/s':>13} {'roofline':>10} " \
           f"{'of roof':>8} {'HF tok/s':>10} {'x HF':>6}"
    print(head)
    hf_runs = parse_runs(p, args.hf_runs) if args.hf_runs else []
    rows = [(b, args.output_len, not (args.no_hf or hf_runs)) for b in batches] + [(b, n, True) for b, n in hf_runs]
    for b, olen, with_hf in rows:
        ours, decode = bench_ours(model, b, args.prompt_len, olen, args)
        roof = roofline(cfg, dtype, b, args.prompt_len, olen, bw)
        hf = bench_hf(model, b, args.prompt_len, olen) if with_hf else float("nan")
        print(f"{b:>6} {args.prompt_len:>6} {olen:>6} {ours:>10.1f} {decode:>13.1f} {roof:>10.1f} "
              f"{decode / roof:>8.1%} {hf:>10.1f} {ours / hf:>6.2f}", flush=True)


def parse_runs(p: argparse.ArgumentParser, text: str) -> list[tuple[int, int]]:
    """"1x128,64x256" -> [(1, 128), (64, 256)]; a parser error names the bad item."""
    runs = []
    for item in text.split(","):
        b, _, n = item.partition("x")
        if not (b.isdigit() and n.isdigit() and int(b) > 0 and int(n) > 0):
            p.error(f"--hf-runs: {item!r} is not BATCHxLENGTH (positive integers)")
        runs.append((int(b), int(n)))
    return runs


if __name__ == "__main__":
    main()
