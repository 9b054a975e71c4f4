"""The rollout engine's host time per decode step, with a model whose forward costs nothing.

    python tools/bench/bench_host_overhead.py                 # batch 256, ~512-token contexts
    python tools/bench/bench_host_overhead.py --batch 64 --context 2048 --repeats 7

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
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import hexrl.rollout.sampler as sampler  # noqa: E402
from hexrl.model.config import ModelConfig  # noqa: E402
from hexrl.rollout import Engine, EngineConfig, Request  # noqa: E402
from kernels.reference import sample_args  # noqa: E402

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


def null_sampler(logits, temperature, top_k, top_p, seeds, offsets, check=False):
    """The GPU sampler's host side (argument checks without a sync), then a kernel that costs nothing."""
    sample_args(logits, temperature, top_k, top_p, seeds, offsets, check)
    return logits.new_full((len(logits),), 5, dtype=torch.int64), logits.new_zeros(len(logits))


class NullAttention:
    """An attention backend that plans nothing (excludes the torch backend's gather)."""

    def begin(self, meta):
        return self


def make_engine(batch: int, context: int, steps: int, page_size: int) -> Engine:
    # early sequences decode while later ones prefill (up to batch*context/max_batch_tokens steps):
    # leave them room so that all `batch` are still running through the timed steps
    margin = steps + 16 + 2 * (-(-batch * context // max(8192, batch)))
    pages = batch * (-(-(context + margin) // page_size) + 1)
    cfg = EngineConfig(page_size=page_size, max_pages=pages, max_running=batch, max_batch_tokens=max(8192, batch))
    engine = Engine(NullModel(batch), cfg, eos_ids=[])
    engine.backend = NullAttention()
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        prompt = torch.randint(6, VOCAB, (context,), generator=g).tolist()
        engine.add(Request(i, prompt, max_new_tokens=margin, temperature=0.0, ignore_eos=True))
    while engine.scheduler.waiting or engine._pending or \
            any(s.num_uncached > 1 for s in engine.scheduler.running):  # prefill (not timed)
        engine.step()
    return engine


def time_decode(batch: int, context: int, steps: int, page_size: int, torch_sampler: bool) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per decode step, means over `steps` steps of a prefilled batch."""
    sampler.sample_tokens = real_sampler if torch_sampler else null_sampler
    engine = make_engine(batch, context, steps, page_size)
    assert len(engine.scheduler.running) == batch
    for _ in range(5):  # warm-up
        engine.step()
    c0, t0 = time.thread_time(), time.perf_counter()
    for _ in range(steps):
        engine.step()
    cpu, wall = (time.thread_time() - c0) / steps, (time.perf_counter() - t0) / steps
    assert len(engine.scheduler.running) == batch and engine.stats.generated_tokens >= batch * steps
    return cpu, wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed per repeat")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    runs = {False: [], True: []}
    for _ in range(args.repeats):  # interleaved, so load changes hit both alike
        for torch_sampler in runs:
            runs[torch_sampler].append(time_decode(args.batch, args.context, args.steps, args.page_size, torch_sampler))

    def show(times: list[tuple[float, float]], i: int) -> str:
        ms = [t[i] * 1e3 for t in times]
        return f"{statistics.median(ms):.3f} ({min(ms):.3f}-{max(ms):.3f})"

    print(f"batch {args.batch}, contexts {args.context}-{args.context + args.steps + 5} tokens, page size "
          f"{args.page_size}, {args.steps} steps x {args.repeats} repeats; medians (min-max); CPU time of this "
          f"thread, and wall time (which also counts waiting for a core on a loaded machine)")
    print(f"  with the CPU torch sampler's arithmetic (B x {VOCAB} logits): CPU {show(runs[True], 0)} ms, "
          f"wall {show(runs[True], 1)} ms")
    print(f"  wall ms per decode step: {show(runs[False], 1)}")
    print(f"host ms per decode step: {show(runs[False], 0)}")

if __name__ == "__main__":
    main()
