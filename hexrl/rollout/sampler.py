"""The one place the engine gets its sampler from (`kernels.sampling.sample`), and the per-slot
sampling parameters it feeds it.

On CPU tensors the kernel's own torch reference is called directly: same semantics and same
draws, without the Triton interpreter, which exists to test the kernel and is slow per call.
A step picks the cheapest sampler that serves all its rows: an argmax when every row is greedy
(the sampling kernel never runs), the kernel without its top-k/top-p search launches when no row
filters, else the full kernel.
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.reference import GREEDY_EPS, greedy_torch, sample_torch
from kernels.sampling import sample

from .sequence import PENDING, Request, Sequence

GREEDY, PLAIN, FILTERED = 0, 1, 2  # sampling modes, cheapest first


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  seeds: torch.Tensor, offsets: torch.Tensor, check: bool = False,
                  filtered: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B] int64, behaviour logprobs [B] float32); row r draws with (seeds[r], offsets[r]).
    check=False (the engine's hot path): requests were validated when added, and the value checks
    would wait for the device. filtered=False: no row uses top-k/top-p (skips the kernel's search)."""
    if logits.is_cuda:
        return sample(logits, temperature, top_k, top_p, seeds, offsets, check=check, filtered=filtered)
    return sample_torch(logits, temperature, top_k, top_p, seeds, offsets, check=check)


def greedy_tokens(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An all-greedy step: argmax and its T = 1 log-prob, without the sampling kernel (the same
    tokens and log-probs the kernel gives greedy rows)."""
    return greedy_torch(logits)


def is_greedy(req: Request) -> bool:
    """Whether a request decodes greedily (the sampler's own temperature cut-off)."""
    return req.temperature < GREEDY_EPS


def request_mode(req: Request) -> int:
    """GREEDY, PLAIN (temperature only) or FILTERED (top-k or top-p on)."""
    if is_greedy(req):
        return GREEDY
    return FILTERED if req.top_k > 0 or req.top_p < 1.0 else PLAIN


def sampling_mode(seqs: list[Sequence]) -> int:
    """The cheapest sampling mode that serves every sequence of a step."""
    return max((s.mode for s in seqs), default=GREEDY)


class SlotParams:
    """Each slot's sampling parameters and last token as persistent device tensors, written once on
    admission; `last_token` then follows every sample (a decode step's input never leaves the device).
    One extra slot, `pad_slot` (greedy, never admitted), serves the padding rows of graph batches."""

    def __init__(self, slots: int, device: torch.device):
        self.pad_slot = slots
        n = slots + 1
        self.temperature = torch.zeros(n, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(n, dtype=torch.int64, device=device)
        self.top_p = torch.ones(n, dtype=torch.float32, device=device)
        self.seed = torch.zeros(n, dtype=torch.int64, device=device)
        self.num_prompt = torch.zeros(n, dtype=torch.int64, device=device)
        self.last_token = torch.zeros(n, dtype=torch.int64, device=device)

    def admission(self, seqs: list[Sequence]) -> list[int]:
        """The parameters of newly admitted sequences as one host list for `admit_from`: slots,
        temperatures, top-k, top-p, seeds, prompt lengths, last tokens (floats as float32 bits)."""
        if any(s.tokens[-1] == PENDING for s in seqs):
            raise RuntimeError("admitting a sequence whose last token was not read back yet (a bug)")
        reqs = [s.req for s in seqs]

        def bits(xs: list[float]) -> list[int]:
            return np.array(xs, dtype=np.float32).view(np.int32).tolist()

        return ([s.slot for s in seqs] + bits([r.temperature for r in reqs]) + [r.top_k for r in reqs]
                + bits([r.top_p for r in reqs]) + [s.seed for s in seqs] + [s.num_prompt for s in seqs]
                + [s.tokens[-1] for s in seqs])

    def admit_from(self, values: torch.Tensor) -> None:
        """Scatter `admission()`'s list, uploaded as int64 to the device, into the admitted slots."""
        if not len(values):
            return
        rows, temperature, top_k, top_p, seed, num_prompt, last = values.view(7, -1)
        self.temperature[rows] = temperature.to(torch.int32).view(torch.float32)
        self.top_p[rows] = top_p.to(torch.int32).view(torch.float32)
        for t, v in ((self.top_k, top_k), (self.seed, seed), (self.num_prompt, num_prompt), (self.last_token, last)):
            t[rows] = v

    def admit(self, seqs: list[Sequence]) -> None:
        """Write the parameters of newly admitted sequences into their slots (one copy of their own)."""
        self.admit_from(torch.tensor(self.admission(seqs), dtype=torch.int64).to(self.seed.device))

    def sample(self, logits: torch.Tensor, rows: torch.Tensor, kv_lens: torch.Tensor, mode: int = FILTERED):
        """Sample one token per logits row (row i belongs to slot rows[i] and has kv_lens[i] tokens),
        and make it the slot's last token. Plain tensor ops and Triton kernels only: CUDA-graph safe."""
        if mode == GREEDY:
            tokens, logprobs = greedy_tokens(logits)
        else:
            tokens, logprobs = sample_tokens(logits, self.temperature[rows], self.top_k[rows], self.top_p[rows],
                                             self.seed[rows], kv_lens - self.num_prompt[rows],
                                             filtered=mode == FILTERED)
        self.last_token[rows] = tokens  # the next decode step's input, without a host round trip
        return tokens, logprobs
