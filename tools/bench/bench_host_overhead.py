"""The rollout engine's host time per decode step, with a model whose forward costs nothing, for
the engine loop without overlap (old: read step n's tokens, then schedule n + 1) and with it (new:
schedule and launch n + 1, then read n), side by side.

    python -m tools.bench.bench_host_overhead                 # batch 256, ~512-token contexts
    python -m tools.bench.bench_host_overhead --batch 64 --context 2048 --repeats 7
    python -m tools.bench.bench_host_overhead --model qwen2.5-1.5b --batch 64   # a real model on the GPU

With --model (CUDA): wall ms per decode step, host ms (wall minus the time blocked waiting for
sampled tokens), GPU ms (CUDA events around each step's launch) and the blocked ms, old and new
side by side. With overlap the wall approaches max(host, GPU) instead of their sum.

What a step costs the host besides the GPU work: scheduling, page-table updates, the step's
input tensors, sampling parameters, reading back tokens and log-probs, stop checks. The model
returns a fixed logits tensor without computing anything, the attention backend is a no-op
(the torch backend's context gather, a stand-in for GPU attention, is excluded), and the
sampler is the engine's own (on CPU the torch reference, over a 32-token vocabulary so its
arithmetic is small) in one run and a stub that does the GPU sampler's host side only (argument
handling, no kernel) in the other: the headline "host ms per decode step" is the latter, since on
a GPU the sampler is one Triton kernel. One thread, as a GPU host loop. Prints the median over
repeats of the mean time per decode step: the CPU time this thread used (the headline: what the
host spends, unaffected by other processes holding the cores) and the wall time.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import hexrl.rollout.sampler as sampler
from hexrl.model.config import ModelConfig
from hexrl.rollout import Engine, EngineConfig, Request
from hexrl.rollout.model_runner import ModelRunner, Pending
from kernels.reference import sample_args

VOCAB = 32
real_sampler = sampler.sample_tokens


class NullModel(nn.Module):
    """Looks like a whole Decoder to the engine; its forward costs (almost) nothing."""

    def __init__(self, batch: int):
        super().__init__()
        self.cfg = ModelConfig.from_hf({
            "architectures": ["Qwen2ForCausalLM"], "vocab_size": VOCAB, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
            "max_position_embeddings": 1 << 20})
        self.tp, self.layer_range, self.is_first, self.is_last = None, (0, 1), True, True
        self.weight = nn.Parameter(torch.zeros(1))
        self._hidden = torch.zeros(1, 1).expand(1 << 20, 1)  # a view: no per-step allocation
        logits = torch.zeros(batch, VOCAB)
        logits[:, 5] = 1.0  # greedy always picks token 5, never an EOS
        self._logits = logits

    def stage(self, ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        return self._hidden[:len(ids)]

    def logits(self, hidden: torch.Tensor, fp32: bool = False) -> torch.Tensor:
        return self._logits[:len(hidden)]


def null_sampler(logits, temperature, top_k, top_p, seeds, offsets, check=False, filtered=None):
    """The GPU sampler's host side (argument checks without a sync), then a kernel that costs nothing."""
    sample_args(logits, temperature, top_k, top_p, seeds, offsets, check)
    return logits.new_full((len(logits),), 5, dtype=torch.int64), logits.new_zeros(len(logits))


class NullAttention:
    """An attention backend that plans nothing (excludes the torch backend's gather)."""

    def begin(self, meta):
        return self


def make_engine(batch: int, context: int, steps: int, page_size: int, overlap: bool, model=None) -> Engine:
    """A prefilled engine: `batch` sampled (T = 1) sequences, all decoding. model=None: the NullModel
    and a no-op attention backend on CPU; else that model (CUDA: FlashInfer and graphs of size batch)."""
    # early sequences decode while later ones prefill (up to batch*context/max_batch_tokens steps):
    # leave them room so that all `batch` are still running through the timed steps
    margin = steps + 16 + 2 * (-(-batch * context // max(8192, batch)))
    pages = batch * (-(-(context + margin) // page_size) + 1)
    cfg = EngineConfig(page_size=page_size, max_pages=pages, max_running=batch, max_batch_tokens=max(8192, batch),
                       overlap=overlap, graph_batch_sizes=(batch,))
    engine = Engine(model or NullModel(batch), cfg, eos_ids=[])
    if model is None:
        engine.runner.backend = NullAttention()
    vocab = engine.model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        prompt = torch.randint(6, vocab, (context,), generator=g).tolist()
        engine.add(Request(i, prompt, max_new_tokens=margin, temperature=1.0, seed=i, ignore_eos=True))
    while engine.scheduler.waiting or engine._pending or \
            any(s.num_uncached > 1 for s in engine.scheduler.running):  # prefill (not timed)
        engine.step()
    return engine


def time_steps(engine: Engine, steps: int) -> tuple[float, float, float, float]:
    """Per decode step: (CPU seconds, wall seconds, seconds blocked waiting for sampled tokens, GPU
    seconds from CUDA events around each launch, nan on CPU)."""
    blocked, read, launch = [0.0], Pending.read, ModelRunner.launch
    cuda = engine.device.type == "cuda"
    events = []

    def timed_read(self):
        t = time.perf_counter()
        out = read(self)
        blocked[0] += time.perf_counter() - t
        return out

    def timed_launch(self, step):  # GPU time of a step: its first to its last enqueued work
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = launch(self, step)
        end.record()
        events.append((start, end))
        return out

    for _ in range(5):  # warm-up
        engine.step()
    Pending.read = timed_read
    if cuda:
        ModelRunner.launch = timed_launch
    try:
        c0, t0 = time.thread_time(), time.perf_counter()
        for _ in range(steps):
            engine.step()
        cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
    finally:
        Pending.read, ModelRunner.launch = read, launch
    if cuda:
        torch.cuda.synchronize()
    gpu = sum(a.elapsed_time(b) for a, b in events) / 1e3 if cuda else float("nan")
    assert engine.stats.generated_tokens >= len(engine.scheduler.running) * steps
    return cpu / steps, wall / steps, blocked[0] / steps, gpu / steps


def time_decode(batch: int, context: int, steps: int, page_size: int, torch_sampler: bool,
                overlap: bool = True, model=None) -> tuple[float, float, float, float]:
    """time_steps over a prefilled batch (CPU: with the torch sampler or the GPU sampler's host side)."""
    sampler.sample_tokens = real_sampler if torch_sampler or model is not None else null_sampler
    try:
        engine = make_engine(batch, context, steps, page_size, overlap, model)
        assert len(engine.scheduler.running) == batch
        return time_steps(engine, steps)
    finally:
        sampler.sample_tokens = real_sampler


def show(times: list[tuple], i: int) -> str:
    ms = [t[i] * 1e3 for t in times]
    return f"{statistics.median(ms):.3f} ({min(ms):.3f}-{max(ms):.3f})"


def main_model(args) -> None:
    """Old (no overlap) and new (overlap) engine loops over a real model (on the GPU), side by side."""
    from hexrl.model.hf_checkpoint import load_pretrained
    from tools.bench.bench_rollout import SHAPES, model_config, random_model

    cuda = torch.cuda.is_available()  # CPU: a smoke run of the same code (fp32, torch attention)
    dev, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    torch.set_num_threads(1)  # one host thread, as the engine loop (CPU smoke runs: no oversubscription)
    if args.model in SHAPES:  # random weights of a named shape (bench_rollout's)
        model = random_model(model_config(args.model), dtype, dev)
    else:
        model = load_pretrained(args.model, dtype=dtype, device=dev)
    runs = {False: [], True: []}
    for _ in range(args.repeats):
        for overlap in runs:
            runs[overlap].append(time_decode(args.batch, args.context, args.steps, args.page_size, True, overlap,
                                             model))
    device = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"{device}, {args.model}, batch {args.batch}, contexts ~{args.context} tokens, "
          f"{args.steps} steps x {args.repeats} repeats, T = 1; medians (min-max), ms per decode step")
    for overlap, name in ((False, "old loop (no overlap)"), (True, "new loop (overlap)")):
        t = runs[overlap]
        host = [(w - b,) for _, w, b, _ in t]
        print(f"  {name:<22} wall {show(t, 1)}  host {show(host, 0)}  GPU {show(t, 3)}  blocked {show(t, 2)}")
    print("  host = wall - blocked (host work per step); GPU = CUDA events around each step's launch (its "
          "enqueued work, idle gaps inside included); overlap takes the wall from host + GPU towards max(host, GPU)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed per repeat")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", help="a checkpoint directory or a bench_rollout shape (qwen2.5-1.5b): time that "
                                    "model on the GPU instead")
    args = p.parse_args(argv)
    if args.model:
        return main_model(args)
    torch.set_num_threads(1)
    variants = {"torch": (True, True), "old": (False, False), "new": (False, True)}  # (torch sampler, overlap)
    runs = {k: [] for k in variants}
    for _ in range(args.repeats):  # interleaved, so load changes hit all alike
        for name, (torch_sampler, overlap) in variants.items():
            runs[name].append(time_decode(args.batch, args.context, args.steps, args.page_size, torch_sampler,
                                          overlap))
    print(f"batch {args.batch}, contexts {args.context}-{args.context + args.steps + 5} tokens, page size "
          f"{args.page_size}, {args.steps} steps x {args.repeats} repeats, T = 1; medians (min-max); CPU time of "
          f"this thread, and wall time (which also counts waiting for a core on a loaded machine)")
    print(f"  with the CPU torch sampler's arithmetic (B x {VOCAB} logits): CPU {show(runs['torch'], 0)} ms, "
          f"wall {show(runs['torch'], 1)} ms")
    print(f"  old loop (no overlap): CPU {show(runs['old'], 0)} ms, wall {show(runs['old'], 1)} ms")
    print(f"  new loop (overlap):    CPU {show(runs['new'], 0)} ms, wall {show(runs['new'], 1)} ms "
          "(on CPU nothing runs in parallel: overlap shows on a GPU, --model)")
    print(f"  wall ms per decode step: {show(runs['new'], 1)}")
    print(f"host ms per decode step: {show(runs['new'], 0)}")


if __name__ == "__main__":
    main()
