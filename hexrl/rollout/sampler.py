"""The one place the engine gets its sampler from (`kernels.sampling.sample`).

On CPU tensors the kernel's own torch reference is called directly: same semantics and same
draws, without the Triton interpreter, which exists to test the kernel and is slow per call.
"""
from __future__ import annotations

import torch

from kernels.reference import sample_torch
from kernels.sampling import sample


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  seeds: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B] int64, behaviour logprobs [B] float32); row r draws with (seeds[r], offsets[r])."""
    fn = sample if logits.is_cuda else sample_torch
    return fn(logits, temperature, top_k, top_p, seeds, offsets)
