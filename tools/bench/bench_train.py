"""Trainer model-FLOPs utilisation against the bf16 matmul peak measured in the same run.

    python tools/bench/bench_train.py                      # GPU: Qwen2.5-1.5B shape, one GPU, bf16
    python tools/bench/bench_train.py --seqs 32 --prompt-len 256 --completion-len 768 --micro-batch-tokens 8192
    python tools/bench/bench_train.py --shape tiny         # what the CPU default runs: seconds

Random weights (a temporary HF checkpoint), equal-length synthetic trajectories, naive PPO by
default (`--decoupled` adds the proximal forward pass, and its FLOPs). Model FLOPs per step:
6 x (matmul parameters per token) x tokens for the decoder layers, 6 x V x H per completion
token for the lm_head (logits are only computed where a completion token is predicted), and
causal attention 3 x 2 x n^2 x heads x head_dim per layer for a sequence of n tokens. Prints, per config:
    [plain] MFU  <achieved TFLOP/s> / <peak TFLOP/s> = <ratio>   ...
    [plain] phases forward .. logprob .. backward .. proximal .. optimizer .. host ..
(CUDA events on a GPU, perf_counter on the CPU; "host" is the wall time no phase covers; the
log-prob phase is the lm_head + log-prob forward, its backward is in "backward").
    python tools/bench/bench_train.py --configs plain,decoupled,decoupled+checkpointing   # one process
"""
from __future__ import annotations

import argparse
import random
import resource
import tempfile
import time
from pathlib import Path

import torch

from hexrl.model.config import ModelConfig
from hexrl.model.decoder import Decoder
from hexrl.model.hf_checkpoint import save_state_dict
from hexrl.train import TrainConfig, Trainer
from hexrl.train.phases import PhaseTimer
from hexrl.trajectory import Trajectory

SHAPES = {
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}


def write_random_checkpoint(shape: str, path: Path, device: torch.device) -> ModelConfig:
    """A random-weight HF checkpoint (bf16 on GPU) built on the device: CPU init of 1.5B is slow."""
    cfg = ModelConfig.from_hf({"architectures": ["Qwen2ForCausalLM"], "max_position_embeddings": 32768,
                               "rms_norm_eps": 1e-6, **SHAPES[shape]})
    with torch.device(device):
        model = Decoder(cfg)
    model.init_weights(seed=0) if device.type == "cpu" else _init_on_device(model)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    save_state_dict({k: v.to(dtype) for k, v in model.state_dict().items()}, cfg, path)
    return cfg


def _init_on_device(model: Decoder) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if p.dim() == 1 and "norm" in name else p.normal_(0.0, 0.02) if p.dim() > 1 else p.zero_()


def make_batch(cfg: ModelConfig, seqs: int, prompt_len: int, completion_len: int, group: int = 8) -> list[Trajectory]:
    """`seqs` random trajectories (fixed seed) in groups of `group`, half of them rewarded."""
    rng = random.Random(0)
    return [Trajectory(group_id=i // group, prompt_ids=[rng.randrange(cfg.vocab_size) for _ in range(prompt_len)],
                       completion_ids=[rng.randrange(cfg.vocab_size) for _ in range(completion_len)],
                       logprobs=[-2.0] * completion_len, versions=[0] * completion_len, reward=float(i % 2))
            for i in range(seqs)]


def step_flops(cfg: ModelConfig, trajs: list[Trajectory], decoupled: bool) -> float:
    """Model FLOPs of one training step (backward = 2 x forward), with the proximal forward if decoupled."""
    h, L, d = cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    layer_matmul = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size  # weights used per token
    fwd = 0.0
    for t in trajs:
        n, c = t.num_tokens - 1, len(t.completion_ids)
        fwd += 2 * L * layer_matmul * n + 2 * cfg.vocab_size * h * c  # linears + lm_head rows kept
        fwd += L * 2 * n * n * q  # causal QK^T and AV: 2 matmuls x 2 flops x n^2/2 x q
    return fwd * (4 if decoupled else 3)


def matmul_peak(device: torch.device) -> float:
    """Best measured dense bf16 (fp32 on CPU) matmul FLOP/s over a few square sizes."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    best = 0.0
    for n in ((4096, 8192, 16384) if device.type == "cuda" else (512, 1024)):
        a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
        iters = max(3, int(2e12 / (2 * n**3))) if device.type == "cuda" else 3
        a @ b
        sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            a @ b
        sync(device)
        best = max(best, 2 * n**3 * iters / (time.perf_counter() - t0))
    return best


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (timings on a GPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CONFIGS = {"plain": {}, "decoupled": {"decoupled": True}, "checkpointing": {"checkpointing": True},
           "decoupled+checkpointing": {"decoupled": True, "checkpointing": True}}


def run_config(a: argparse.Namespace, name: str, model_dir: Path, cfg: ModelConfig, device: torch.device,
               peak: float) -> None:
    """Time `a.steps` steps of one config (after a warm-up step) and print MFU, memory and the phases."""
    opts = {"decoupled": a.decoupled, "checkpointing": a.checkpointing} | CONFIGS[name]
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    trainer = Trainer(model_dir, {"dp": 1, "stages": [{"tp": 1, "layers": [0, cfg.num_hidden_layers]}]},
                      TrainConfig(lr=1e-6, micro_batch_tokens=a.micro_batch_tokens, decoupled=opts["decoupled"],
                                  activation_checkpointing=opts["checkpointing"], filter_equal_groups=False,
                                  logprob_chunk_rows=a.chunk_rows), device=device)
    batch = make_batch(cfg, a.seqs, a.prompt_len, a.completion_len)
    trainer.step(batch)  # warm-up: kernels compiled, allocator filled
    trainer.phases = PhaseTimer(device)
    for _ in range(a.steps):
        with trainer.phases.step():
            trainer.step(batch)
    phases = {k: v / a.steps for k, v in trainer.phases.read().items()}
    seconds = sum(phases.values())  # the steps' wall time: the phases plus the uncovered "host" share
    flops = step_flops(cfg, batch, opts["decoupled"])
    tokens = sum(t.num_tokens - 1 for t in batch)
    cuda = device.type == "cuda"
    if cuda:
        mem = f"  peak mem {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB"
    else:  # the process's peak resident memory (Linux: KiB): every config so far, not this one alone
        mem = f"  peak mem {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.3f} GiB (process RSS)"
    print(f"[{name}] {a.shape} on {torch.cuda.get_device_name(device) if cuda else 'cpu'}: {tokens} tokens/step, "
          f"{seconds * 1e3:.0f} ms/step, {tokens / seconds:,.0f} tokens/s, {cfg.num_params / 1e6:,.1f}M params{mem}")
    print(f"[{name}] MFU  {flops / seconds / 1e12:.4g} TFLOP/s / {peak / 1e12:.4g} TFLOP/s measured matmul peak = "
          f"{flops / seconds / peak:.1%}")
    print(f"[{name}] phases " + "  ".join(f"{k} {v * 1e3:.1f} ms ({v / seconds:.0%})" for k, v in phases.items()))
    del trainer


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b" if cuda else "tiny")
    p.add_argument("--seqs", type=int, default=32 if cuda else 8)
    p.add_argument("--prompt-len", type=int, default=256 if cuda else 16)
    p.add_argument("--completion-len", type=int, default=768 if cuda else 48)
    p.add_argument("--micro-batch-tokens", type=int, default=8192 if cuda else 256)
    p.add_argument("--chunk-rows", type=int, default=1024, help="lm_head + log-prob rows at a time")
    p.add_argument("--steps", type=int, default=3 if cuda else 2)
    p.add_argument("--decoupled", action="store_true", help="decoupled PPO: adds the proximal forward pass")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--configs", default="plain",
                   help=f"comma-separated, run one after another in this process: {', '.join(CONFIGS)}")
    a = p.parse_args()
    names = a.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {', '.join(unknown)} (known: {', '.join(CONFIGS)})")
    device = torch.device("cuda" if cuda else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = write_random_checkpoint(a.shape, Path(tmp) / "model", device)
        peak = matmul_peak(device)
        for name in names:
            run_config(a, name, Path(tmp) / "model", cfg, device, peak)


if __name__ == "__main__":
    main()
