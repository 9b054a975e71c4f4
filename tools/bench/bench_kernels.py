"""Measure this GPU type for the planner: each number next to its own roofline, one profile JSON.

    python -m tools.bench.bench_kernels --out profiles/     # CUDA: Qwen2.5-1.5B shape, bf16 (~2-3 min on an H100)
    python -m tools.bench.bench_kernels --quick             # CUDA: a smaller grid (~1 min)
    python -m tools.bench.bench_kernels                     # CPU: tiny shape through the same code, prints only

Measures copy bandwidth and the bf16 matmul peak; the rollout engine's decode step time over a
grid of batch sizes x context lengths; prefill throughput; the trainer's forward+backward time
per token (Decoder.stage + logits + token_logprobs, plain autograd, packed sequences); the
sampling and log-prob kernels. Prints a table (measured, roofline, ratio) and writes
`<out>/<gpu>.json` with the hardware name, software versions, date, every raw measurement, and
the catalogue keys the planner reads (hexrl/gpus.py: measured hbm_TBps, bf16_tflops,
hbm_GB, and hbm_efficiency / decode_mfu / decode_overhead_s / prefill_mfu / train_mfu fitted
through the planner's own cost model by hexrl/plan/profile.py; train_overhead_s and
train_fwd_overhead_s, a training micro-batch's fixed cost: the intercepts of fwd+bwd and forward
time against tokens; optimizer_overhead_s, an optimizer step's, against parameters). On CPU the profile is
written only when --out is given; the CPU "bf16" peak is an fp32 matmul (the CPU path runs fp32).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import gc
import importlib.metadata
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from hexrl.gpus import CATALOGUE, gpu_type_name
from hexrl.model.attention import CausalAttention
from hexrl.model.config import ModelConfig
from hexrl.model.decoder import Decoder
from hexrl.plan.profile import calibrate
from hexrl.rollout import Engine, EngineConfig, Request
from kernels import sample, token_logprobs
from tools.bench.bench_rollout import DTYPES, SHAPES, model_config, random_model

BENCH = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Grid:
    """What to measure. Kept small: the whole device check must fit one 10-minute call."""

    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_warm: int  # decode steps before timing (graph replay, allocator)
    decode_steps: int  # timed decode steps per point (median)
    prefill: tuple[tuple[int, int], ...]  # (batch, prompt_len)
    train: tuple[tuple[int, int], ...]  # (seq_len, sequences packed into one batch)
    sample_batches: tuple[int, ...]
    logprob_tokens: tuple[int, ...]
    copy_bytes: int
    matmul_n: int
    batch_tokens: int = 8192  # engine tokens per forward pass (its default)
    # (seq_len, sequences) at one seq_len, few to many tokens: time = a + b * tokens, the intercept a is a
    # micro-batch's fixed cost (train_overhead_s; forward-only: train_fwd_overhead_s)
    overhead: tuple[tuple[int, int], ...] = ()


GRIDS = {
    # 4 x 3 decode points: 1.8M prompt tokens of prefill in all, ~1 min on an H100
    "cuda": Grid((1, 16, 64, 256), (256, 1024, 4096), 8, 24, ((16, 512), (8, 2048)), ((1024, 8), (4096, 2)),
                 (1, 64, 256), (256, 8192), 1 << 30, 8192, overhead=((256, 1), (256, 4), (256, 16))),
    "cuda-quick": Grid((1, 64), (256, 1024), 4, 12, ((8, 512),), ((1024, 4),), (64,), (1024,), 1 << 28, 4096,
                       overhead=((256, 1), (256, 8))),
    "cpu": Grid((1, 4), (16, 48), 2, 4, ((4, 32),), ((32, 2),), (4,), (64,), 1 << 24, 256, 256,
                overhead=((16, 1), (16, 4), (16, 16))),
    # the learning experiment's operating range (short arithmetic prompts and answers, up to
    # 512 sequences decoding; 128 packed sequences per PPO mini-batch): tools/experiments/learning_run.py --study.
    # Prompts of 4 and 8 are timed at contexts of about 10 and 14, inside one 16-token page as
    # the study's sequences are (prompt ~10 + answer ~5); a longer point crosses into a second
    # page, whose extra gather the linear context term then spreads over every context
    "cpu-rl": Grid((1, 32, 128, 512), (4, 8), 2, 6, ((64, 8), (512, 8)), ((12, 128),), (512,), (4096,),
                   1 << 24, 256, 4096, overhead=((12, 1), (12, 16), (12, 128))),
}


# ----------------------------------------------------------------------------- environment

def versions() -> dict:
    """Software versions the numbers depend on (missing packages are None)."""
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for pkg in ("triton", "flashinfer-python", "transformers"):
        try:
            out[pkg.split("-")[0]] = importlib.metadata.version(pkg)  # no import: transformers takes seconds
        except importlib.metadata.PackageNotFoundError:
            out[pkg.split("-")[0]] = None
    try:
        q = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        out["driver"] = subprocess.run(q, capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["driver"] = None
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Give a dropped engine's KV pool and graphs back before the next one allocates."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def timed(fn: Callable[[], object], device: torch.device, warmup: int = 3, reps: int = 10) -> float:
    """Median seconds of fn() after warm-ups: CUDA events on a GPU, wall clock on CPU."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ----------------------------------------------------------------------------- rooflines

def matmul_params(cfg: ModelConfig) -> int:
    """Weights a token multiplies through: the layers and the output head (not the lookup table)."""
    return cfg.num_params - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)


def attn_flops(cfg: ModelConfig) -> int:
    """Attention FLOPs per token per context position (QK^T and PV, all layers)."""
    return 4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers


def kv_bytes(cfg: ModelConfig, elem: int) -> int:
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem


def decode_roofline_s(cfg: ModelConfig, elem: int, batch: int, context: float, bw: float, peak: float) -> float:
    """A decode step reads every weight and every cached k/v once, or is bound by its FLOPs."""
    nbytes = matmul_params(cfg) * elem + batch * context * kv_bytes(cfg, elem)
    flops = batch * (2 * matmul_params(cfg) + attn_flops(cfg) * context)
    return max(nbytes / bw, flops / peak)


def forward_flops_per_token(cfg: ModelConfig, seq_len: float) -> float:
    """Forward FLOPs of one token of a causal sequence of seq_len tokens (mean context seq_len/2)."""
    return 2 * matmul_params(cfg) + attn_flops(cfg) * seq_len / 2


# ----------------------------------------------------------------------------- engine points

def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


def make_engine(model: Decoder, batch: int, seq_tokens: int, grid: Grid, attention: str) -> Engine:
    """An engine whose CUDA graph covers exactly this batch size (one capture, not ~35). On a GPU
    the KV pool takes 85% of free memory; on CPU just enough pages for batch x seq_tokens."""
    pages = None if next(model.parameters()).is_cuda else batch * (seq_tokens // 16 + 2) + 4
    cfg = EngineConfig(page_size=16, max_running=batch, max_batch_tokens=max(grid.batch_tokens, batch),
                       gpu_memory_fraction=0.85, graph_batch_sizes=(batch,), max_pages=pages, attention=attention)
    engine = Engine(model, cfg, eos_ids=[])
    engine.generate([Request("warm", [5] * 16, max_new_tokens=3, ignore_eos=True, seed=0)])  # JIT, planning
    return engine


def all_decoding(engine: Engine, batch: int) -> bool:
    running = engine.scheduler.running
    return not engine.scheduler.waiting and len(running) == batch and all(s.num_uncached == 1 for s in running)


def decode_point(model: Decoder, batch: int, context: int, grid: Grid, attention: str = "auto") -> dict:
    """Median seconds of one decode step with `batch` sequences of about `context` tokens each.

    Each engine step waits for the previous step's sampled tokens (overlap: one step in flight), so in the
    steady state the wall clock per step() is the step time.
    """
    # early admissions decode while later ones prefill (the step's token budget is shared)
    prefill_steps = math.ceil(batch * context / max(1, grid.batch_tokens - batch))
    budget = prefill_steps + grid.decode_warm + grid.decode_steps + 16
    engine = make_engine(model, batch, context + budget, grid, attention)
    try:
        for i, ids in enumerate(random_prompts(batch, context, model.cfg.vocab_size, seed=context)):
            engine.add(Request(i, ids, max_new_tokens=budget, temperature=1.0, ignore_eos=True, seed=i))
        for _ in range(budget):
            if all_decoding(engine, batch):
                break
            engine.step()
        else:
            raise RuntimeError(f"decode point batch {batch} context {context}: the batch never reached pure decode")
        for _ in range(grid.decode_warm):
            engine.step()
        times, ctxs = [], []
        for _ in range(grid.decode_steps):
            ctxs.append(statistics.fmean(len(s.tokens) for s in engine.scheduler.running))
            t0 = time.perf_counter()
            done = engine.step()
            times.append(time.perf_counter() - t0)
            if done:
                raise RuntimeError("a sequence finished while timing (token budget too small)")
        return {"batch": batch, "prompt_len": context, "context": round(statistics.fmean(ctxs), 1),
                "step_s": statistics.median(times), "graph_steps": engine.stats.graph_steps,
                "attention": engine.backend.name}
    finally:
        del engine
        free_memory(next(model.parameters()).device)


def prefill_point(model: Decoder, batch: int, prompt_len: int, grid: Grid, attention: str = "auto",
                  reps: int = 3) -> dict:
    """Median seconds to prefill `batch` prompts of `prompt_len` tokens (and sample one token each)."""
    engine = make_engine(model, batch, prompt_len + 1, grid, attention)
    try:
        prompts = random_prompts(batch, prompt_len, model.cfg.vocab_size, seed=prompt_len + 1)
        times = []
        for rep in range(reps):  # the engine caches no prefixes: every rep prefills in full
            reqs = [Request((rep, i), p, max_new_tokens=1, ignore_eos=True, seed=i) for i, p in enumerate(prompts)]
            t0 = time.perf_counter()
            engine.generate(reqs)  # ends with the sampled tokens on the host: synchronous
            times.append(time.perf_counter() - t0)
        seconds = statistics.median(times)
        return {"batch": batch, "prompt_len": prompt_len, "seconds": seconds,
                "tokens_per_s": batch * prompt_len / seconds}
    finally:
        del engine
        free_memory(next(model.parameters()).device)


# ----------------------------------------------------------------------------- trainer, kernels

def train_point(model: Decoder, seq_len: int, n_seqs: int, backward: bool = True) -> dict:
    """Forward+backward seconds per token of a packed batch: stage -> logits -> token_logprobs -> backward
    (backward=False: the forward alone, under no_grad, as the trainer's proximal log-probs run)."""
    device = next(model.parameters()).device
    n = seq_len * n_seqs
    g = torch.Generator().manual_seed(seq_len)
    ids = torch.randint(3, model.cfg.vocab_size, (n,), generator=g).to(device)
    targets = torch.roll(ids, -1)
    positions = torch.arange(seq_len).repeat(n_seqs).to(device)
    attn = CausalAttention([seq_len] * n_seqs)

    def step():
        model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(backward):
            logp = token_logprobs(model.logits(model.stage(ids, positions, attn)), targets, check=False)
        if backward:
            (-logp.mean()).backward()

    seconds = timed(step, device, warmup=2, reps=5)
    model.zero_grad(set_to_none=True)
    free_memory(device)
    return {"seq_len": seq_len, "tokens": n, "seconds": seconds, "s_per_token": seconds / n}


def line_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(a, b) of the least-squares line y = a + b x (two or more distinct xs)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def overhead_points(model: Decoder, points: tuple[tuple[int, int], ...]) -> dict:
    """A training micro-batch's fixed seconds: fwd+bwd and forward-only time at a few token counts
    (one seq_len), each fitted to a + b * tokens; the intercepts, clamped at 0 (timing noise can push
    a tiny one below), are train_overhead_s and train_fwd_overhead_s."""
    rows = [train_point(model, s, n) | {"forward_s": train_point(model, s, n, backward=False)["seconds"]}
            for s, n in points]
    tokens = [float(r["tokens"]) for r in rows]
    a, b = line_fit(tokens, [r["seconds"] for r in rows])
    af, bf = line_fit(tokens, [r["forward_s"] for r in rows])
    return {"points": rows, "fit": {"a": a, "b": b, "forward_a": af, "forward_b": bf},
            "train_overhead_s": max(0.0, a), "train_fwd_overhead_s": max(0.0, af)}


class _Chars:
    """A stand-in tokenizer for host_point: ids to characters (the rollout leader decodes completions)."""

    @staticmethod
    def decode(ids: list[int]) -> str:
        return "".join(chr(48 + i % 10) for i in ids)


def finished(gid: int, prompt_msg: dict, out_len: int):
    """A prompt group whose n samples all finished (out_len tokens each), as the rollout leader holds it."""
    from hexrl.rollout.rollout_rank import PendingGroup
    from hexrl.rollout.sequence import Finished

    return PendingGroup(prompt_msg, {i: Finished(f"{gid}:{i}", list(prompt_msg["prompt_ids"]), [4 + i % 5] * out_len,
                                                 [-0.5] * out_len, [0] * out_len, "length")
                                     for i in range(prompt_msg["n"])})


def host_point(groups: int = 64, group: int = 8, prompt_len: int = 12, out_len: int = 5) -> dict:
    """Seconds per finished sample of the rollout leader's host work between decode steps, through
    its own functions: completions to the reward workers ("exact") and back, then each trajectory
    encoded, sealed and sent over ZeroMQ to a local controller socket (drained after the clock stops)."""
    from hexrl.comm.channel import DealerChannel, RouterChannel, new_secret
    from hexrl.plan.cost_sync import REWARD_WORKERS
    from hexrl.rewards import RewardPool
    from hexrl.rollout.rollout_rank import PendingGroup, reward_inputs, trajectory_messages

    secret = new_secret()
    router, dealer = RouterChannel(secret), DealerChannel("replica-0", secret)
    dealer.connect(router.bind("127.0.0.1"))
    pool = RewardPool("exact", workers=REWARD_WORKERS, timeout_s=30)

    def finished_group(gid: int) -> PendingGroup:
        return finished(gid, {"group_id": gid, "problem_id": gid, "prompt_ids": list(range(3, 3 + prompt_len)),
                              "n": group, "answer": "12345"}, out_len)

    def run(first: int) -> float:
        t0, scoring = time.perf_counter(), {}
        for gid in range(first, first + groups):
            g = finished_group(gid)
            scoring[pool.submit(reward_inputs(g, "exact", _Chars))] = g
        while scoring:
            for ticket, rewards in pool.finished(0.001).items():
                for m in trajectory_messages(scoring.pop(ticket), rewards, rank=1):
                    dealer.send(m, timeout_s=60)
        seconds = time.perf_counter() - t0
        while router.recv(timeout_s=0.2) is not None:
            pass
        return seconds

    try:
        run(0)  # warm-up: worker start, connection
        seconds = statistics.median(run(groups * (i + 1)) for i in range(3))
    finally:
        pool.close()
        dealer.close()
        router.close()
    return {"samples": groups * group, "seconds": seconds, "s_per_sample": seconds / (groups * group)}


def optimizer_point(model: Decoder) -> list[dict]:
    """Seconds of one trainer optimizer step (hexrl.train.optim.AdamW: fused AdamW on float32
    masters from float32 main_grad, then the copy back into the compute-dtype weights): over the
    whole model, then over its first layer alone (the two fit the step's fixed part, optimizer_fit)."""
    first = next(iter(model.model.layers.values()))
    return [_optimizer_seconds(list(model.parameters())), _optimizer_seconds(list(first.parameters()))]


def optimizer_fit(rows: list[dict]) -> float:
    """An optimizer step's fixed seconds: the intercept of time = a + b * params through the rows
    (clamped at 0, timing noise can push a tiny one below); 0 with fewer than two sizes."""
    if len({r["params"] for r in rows}) < 2:
        return 0.0
    return max(0.0, line_fit([float(r["params"]) for r in rows], [r["seconds"] for r in rows])[0])


def _optimizer_seconds(params: list[torch.Tensor]) -> dict:
    """{"params", "seconds"} of one AdamW step over `params` (zero float32 main_grads)."""
    from hexrl.train.optim import AdamW

    device = params[0].device
    for p in params:
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
    try:
        opt = AdamW(params, lr=1e-6)
        seconds = timed(opt.step, device, warmup=2, reps=5)
        n = sum(p.numel() for p in opt.params)
    finally:
        for p in params:
            del p.main_grad
        opt = None
        free_memory(device)
    return {"params": n, "seconds": seconds}


def sampling_points(batches, vocab: int, dtype: torch.dtype, device: torch.device) -> list[dict]:
    """The fused sampling kernel at T=1 (plain) and T=0.7, top-k 50, top-p 0.9 (filtered)."""
    rows = []
    for b in batches:
        logits = torch.randn(b, vocab, device=device, dtype=dtype) * 3
        seeds = torch.arange(b, device=device)
        for case, args in (("plain", (1.0, 0, 1.0)), ("topk-topp", (0.7, 50, 0.9))):
            s = timed(partial(sample, logits, *args, seeds, 0, check=False), device)
            rows.append({"batch": b, "vocab": vocab, "case": case, "seconds": s})
    return rows


def logprob_points(tokens, vocab: int, dtype: torch.dtype, device: torch.device) -> list[dict]:
    """The one-pass log-prob kernel (forward) over [N, V] logits."""
    rows = []
    for n in tokens:
        logits = torch.randn(n, vocab, device=device, dtype=dtype)
        targets = torch.randint(0, vocab, (n,), device=device)
        s = timed(partial(token_logprobs, logits, targets, check=False), device)
        rows.append({"tokens": n, "vocab": vocab, "seconds": s})
        del logits
    return rows


def copy_bandwidth(nbytes: int, device: torch.device) -> float:
    """Bytes/s of a device-to-device copy, read + write counted."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    s = timed(lambda: dst.copy_(src), device, warmup=3, reps=20)
    return 2 * nbytes / s


def matmul_peak(n: int, dtype: torch.dtype, device: torch.device) -> float:
    """FLOP/s of an n x n x n matmul on random data."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    s = timed(lambda: a @ b, device, warmup=3, reps=10)
    return 2 * n ** 3 / s


# ----------------------------------------------------------------------------- run

def optional(name: str, fn: Callable[[], list], errors: list[str], log) -> list:
    """fn() or [] if it raises: a broken kernel costs its own rows, not the whole profile."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - recorded in the profile and printed
        errors.append(f"{name}: {type(e).__name__}: {e}")
        log(f"{name} FAILED: {type(e).__name__}: {e}")
        return []


def measure(model: Decoder, grid: Grid, device: torch.device, dtype: torch.dtype, attention: str = "auto",
            log=print) -> dict:
    """Every measurement of the profile (raw; no planner keys yet). The decode grid and training
    are required (the calibration needs them); prefill, sampling and log-prob failures are recorded."""
    cfg, errors = model.cfg, []
    bw = copy_bandwidth(grid.copy_bytes, device)
    peak = matmul_peak(grid.matmul_n, dtype if device.type == "cuda" else torch.float32, device)
    log(f"copy {bw / 1e9:.0f} GB/s, matmul {peak / 1e12:.2f} TFLOP/s")
    rollout = copy.deepcopy(model).fuse()  # the engine's layout (fused qkv, gate_up); training keeps HF's
    decode = []
    for b in grid.decode_batches:
        for c in grid.decode_contexts:
            decode.append(decode_point(rollout, b, c, grid, attention))
            log(f"decode batch {b} context {c}: {decode[-1]['step_s'] * 1e3:.2f} ms/step "
                f"({decode[-1]['attention']}, {decode[-1]['graph_steps']} graph steps)")
    train = [train_point(model, s, n) for s, n in grid.train]
    log("train: " + ", ".join(f"seq {r['seq_len']} {r['s_per_token'] * 1e6:.3f} us/token" for r in train))
    overhead = optional("overhead", lambda: [overhead_points(model, grid.overhead)] if grid.overhead else [],
                        errors, log)
    if overhead:
        log(f"training micro-batch fixed cost: fwd+bwd {overhead[0]['train_overhead_s'] * 1e3:.3f} ms, "
            f"forward {overhead[0]['train_fwd_overhead_s'] * 1e3:.3f} ms (intercepts over "
            f"{[r['tokens'] for r in overhead[0]['points']]} tokens)")
    optimizer = optional("optimizer", lambda: optimizer_point(model), errors, log)
    host = optional("host", host_point, errors, log)
    if host:
        log(f"host work per finished sample (reward round trip, trajectory send): {host['s_per_sample'] * 1e6:.0f} us")
    prefill = optional("prefill", lambda: [prefill_point(rollout, b, p, grid, attention) for b, p in grid.prefill],
                       errors, log)
    sampling = optional("sampling", lambda: sampling_points(grid.sample_batches, cfg.vocab_size, dtype, device),
                        errors, log)
    logprob = optional("logprob", lambda: logprob_points(grid.logprob_tokens, cfg.vocab_size, dtype, device),
                       errors, log)
    return {"copy_Bps": bw, "matmul_flops": peak, "decode": decode, "prefill": prefill, "train": train,
            "overhead": overhead[0] if overhead else None, "optimizer": optimizer, "host": host,
            "sampling": sampling, "logprob": logprob,
            "errors": errors}


def table(m: dict, cfg: ModelConfig, elem: int, datasheet) -> list[tuple[str, str, str, str, float]]:
    """(what, point, measured, roofline, roofline/measured time or measured/peak rate) rows."""
    bw, peak = m["copy_Bps"], m["matmul_flops"]
    sheet_bw = datasheet.hbm_TBps * 1e12 if datasheet else math.nan  # a type the catalogue lacks: no datasheet
    sheet_peak = datasheet.bf16_tflops * 1e12 if datasheet else math.nan
    rows = [("copy bandwidth", "", f"{bw / 1e9:.0f} GB/s", f"{sheet_bw / 1e9:.0f} GB/s datasheet", bw / sheet_bw),
            ("matmul peak", "", f"{peak / 1e12:.1f} TFLOP/s", f"{sheet_peak / 1e12:.0f} TFLOP/s datasheet",
             peak / sheet_peak)]
    for r in m["decode"]:
        roof = decode_roofline_s(cfg, elem, r["batch"], r["context"], bw, peak)
        rows.append(("decode step", f"b={r['batch']} ctx={r['context']:.0f}", f"{r['step_s'] * 1e3:.3f} ms",
                     f"{roof * 1e3:.3f} ms", roof / r["step_s"]))
    for r in m["prefill"]:
        roof = r["batch"] * r["prompt_len"] * forward_flops_per_token(cfg, r["prompt_len"]) / peak
        rows.append(("prefill", f"b={r['batch']} len={r['prompt_len']}", f"{r['tokens_per_s']:.0f} tok/s",
                     f"{r['batch'] * r['prompt_len'] / roof:.0f} tok/s", roof / r["seconds"]))
    for r in m["train"]:
        roof = 3 * forward_flops_per_token(cfg, r["seq_len"]) / peak
        rows.append(("train fwd+bwd", f"seq={r['seq_len']} tok={r['tokens']}", f"{r['s_per_token'] * 1e6:.3f} us/tok",
                     f"{roof * 1e6:.3f} us/tok", roof / r["s_per_token"]))
    for r in m["optimizer"]:
        roof = r["params"] * 32 / bw  # read + write fp32 master, grad, Adam m and v
        rows.append(("optimizer step", f"{r['params']:.3g} params", f"{r['seconds'] * 1e3:.2f} ms",
                     f"{roof * 1e3:.2f} ms", roof / r["seconds"]))
    for r in m["sampling"]:
        roof = r["batch"] * r["vocab"] * elem / bw
        rows.append((f"sample {r['case']}", f"B={r['batch']} V={r['vocab']}", f"{r['seconds'] * 1e6:.1f} us",
                     f"{roof * 1e6:.1f} us", roof / r["seconds"]))
    for r in m["logprob"]:
        roof = r["tokens"] * r["vocab"] * elem / bw
        rows.append(("token_logprobs", f"N={r['tokens']} V={r['vocab']}", f"{r['seconds'] * 1e6:.1f} us",
                     f"{roof * 1e6:.1f} us", roof / r["seconds"]))
    return rows


def build_profile(m: dict, gpu: str, device_name: str, shape: str, cfg: ModelConfig, dtype_name: str,
                  grid_name: str, total_GB: float | None) -> dict:
    """The profile: identity, versions, measured peaks (planner keys), raw tables."""
    profile = {
        "gpu": gpu, "device_name": device_name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"), "versions": versions(), "model": shape, "model_config": cfg.to_hf(),
        "dtype": dtype_name, "grid": grid_name,
        # planner keys (hexrl/plan/catalogue.py GPU fields): measured peaks ...
        "hbm_TBps": m["copy_Bps"] / 1e12, "bf16_tflops": m["matmul_flops"] / 1e12,
        "decode": m["decode"], "prefill": m["prefill"], "train": m["train"], "optimizer": m["optimizer"],
        "host": m["host"],
        "train_s_per_token": statistics.median(r["s_per_token"] for r in m["train"]),
        "prefill_tokens_per_s": statistics.median(r["tokens_per_s"] for r in m["prefill"]) if m["prefill"] else None,
        "sampling": m["sampling"], "logprob": m["logprob"], "errors": m["errors"],
    }
    if m.get("overhead"):
        profile["train_overhead"] = m["overhead"]  # raw points and fit
        profile["train_overhead_s"] = m["overhead"]["train_overhead_s"]
        profile["train_fwd_overhead_s"] = m["overhead"]["train_fwd_overhead_s"]
    if m["optimizer"]:
        profile["optimizer_overhead_s"] = optimizer_fit(m["optimizer"])
    if m["host"]:
        profile["host_s_per_sample"] = m["host"]["s_per_sample"]
    if total_GB:
        profile["hbm_GB"] = total_GB
    profile.update(calibrate(profile))  # ... and efficiencies fitted through the planner's cost model
    return profile


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="directory for <gpu>.json (default on CUDA: profiles/; on CPU: none, print only)")
    p.add_argument("--quick", action="store_true", help="a smaller grid (on CPU the grid is always tiny)")
    p.add_argument("--model", choices=sorted(SHAPES), default=None,
                   help="model shape (default qwen2.5-1.5b on CUDA, tiny on CPU)")
    p.add_argument("--attention", choices=["auto", "torch", "flashinfer"], default="auto",
                   help="engine attention backend (auto: FlashInfer when usable)")
    p.add_argument("--config", type=Path, help="a checkpoint directory (or its config.json): measure its shape")
    p.add_argument("--grid", choices=sorted(GRIDS), help="what to measure (default: by device and --quick)")
    p.add_argument("--cpu-core", type=int, help="pin to this core with one torch thread (a CPU 'device')")
    args = p.parse_args(argv)
    if args.cpu_core is not None:  # the same pinning a rank applies from the plan's cpu_affinity
        from hexrl.runtime.cpu_pinning import core_problems, pin
        from hexrl.schema.affinity import CpuAffinity
        spec = CpuAffinity([[args.cpu_core]])
        if bad := core_problems(spec):
            p.error("--cpu-core: " + "; ".join(bad))
        print(f"bench_kernels: pinned to cores {pin(spec, 0).actual}, {torch.get_num_threads()} torch thread")
    device = torch.device("cuda" if cuda else "cpu")
    shape = args.model or ("qwen2.5-1.5b" if cuda else "tiny")
    grid_name = args.grid or (("cuda-quick" if args.quick else "cuda") if cuda else "cpu")
    grid = GRIDS[grid_name]
    dtype_name = "bfloat16" if cuda else "float32"
    dtype = DTYPES[dtype_name]
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    gpu = gpu_type_name(device_name)
    cfg = model_config(shape)
    if args.config:
        path = args.config / "config.json" if args.config.is_dir() else args.config
        cfg, shape = ModelConfig.from_hf(json.loads(path.read_text())), str(path)
    print(f"bench_kernels: {device_name} (type {gpu}), shape {shape} ({cfg.num_params / 1e6:.1f}M params, "
          f"{dtype_name}), grid {grid_name}", flush=True)
    model = random_model(cfg, dtype, device)
    m = measure(model, grid, device, dtype, args.attention, log=lambda s: print("  " + s, flush=True))
    del model
    free_memory(device)
    total = torch.cuda.get_device_properties(device).total_memory / 1e9 if cuda else None
    profile = build_profile(m, gpu, device_name, shape, cfg, dtype_name, grid_name, total)
    datasheet = CATALOGUE.get(gpu)
    print(f"\n{'what':<18}{'point':<22}{'measured':>18}{'roofline':>26}{'of roof':>9}")
    for what, point, meas, roof, ratio in table(m, cfg, dtype.itemsize, datasheet):
        print(f"{what:<18}{point:<22}{meas:>18}{roof:>26}{ratio:>9.1%}")
    keys = {k: profile[k] for k in ("hbm_GB", "hbm_TBps", "bf16_tflops", "hbm_efficiency", "decode_mfu",
                                    "decode_overhead_s", "prefill_mfu", "train_mfu", "train_overhead_s",
                                    "train_fwd_overhead_s", "optimizer_overhead_s", "host_s_per_sample")
            if k in profile}
    print("planner keys: " + ", ".join(f"{k}={v:.4g}" for k, v in keys.items()))
    out = args.out or ("profiles" if cuda else None)
    if out:
        path = Path(out) / f"{gpu}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(profile, indent=1) + "\n")
        tmp.replace(path)  # a reader never sees half a profile
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
