"""Triton kernels for hexrl, each with a pure-torch reference in `kernels.reference`.

Dispatch rule (both entry points): Triton on CUDA tensors; on CPU Triton only when
TRITON_INTERPRET=1 is set (tests), otherwise the torch reference.
"""

from kernels.logprob import token_logprobs
from kernels.reference import sample_torch, sampling_probs, token_logprobs_torch
from kernels.sampling import sample

__all__ = ["sample", "sample_torch", "sampling_probs", "token_logprobs", "token_logprobs_torch"]
