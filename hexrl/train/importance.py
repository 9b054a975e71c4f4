"""The spread of the behaviour importance weights w = exp(p − b) over a step's tokens.

Each rank counts its tokens' log w into fixed bins 0.01 wide, centred on -3.00, -2.99, ..., 3.00
(plus one open bin below and one above), so the counts add up over trainer ranks with the step's
other sums and the quantiles of the whole step come out of the one all-reduce the step already
does. A quantile is its bin's centre: within 0.5% of w inside [e^-3, e^3]; in an open bin,
the bound e^±3.005 (+inf above).
"""
from __future__ import annotations

import math

import torch

BIN = 0.01
LOG_W_EDGES = (torch.arange(-300, 302, dtype=torch.float64) - 0.5) * BIN  # -3.005 ... 3.005
NUM_BINS = len(LOG_W_EDGES) + 1  # (-inf, e0), [e0, e1), ..., [e_last, inf)


# |behaviour - proximal| log-prob of lag-0 tokens (the rollout-trainer numerical mismatch): bins a twentieth
# of a decade wide from 1e-6 to 10, plus one open bin below and one above
MISMATCH_EDGES = torch.logspace(-6, 1, 141, dtype=torch.float64)
NUM_MISMATCH_BINS = len(MISMATCH_EDGES) + 1

_EDGES: dict[tuple[int, torch.device], torch.Tensor] = {}  # each edge table on each device, copied once


def bin_counts(x: torch.Tensor, edges: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """float64 counts (or sums of `weights`) of x per bin of `edges` (len(edges) + 1 bins, the outer two
    open), on x's device, without a host sync."""
    key = (id(edges), x.device)
    if key not in _EDGES:
        _EDGES[key] = edges.to(x.device)
    index = torch.bucketize(x.detach().double(), _EDGES[key], right=True).reshape(-1)
    w = torch.ones(index.numel(), dtype=torch.float64, device=x.device) if weights is None else weights.double()
    return torch.zeros(len(edges) + 1, dtype=torch.float64, device=x.device).index_add_(0, index, w.reshape(-1))


def log_w_counts(w: torch.Tensor) -> torch.Tensor:
    """float64 counts of log(w) per bin (length NUM_BINS), on w's device, without a host sync."""
    return bin_counts(w.detach().double().log(), LOG_W_EDGES)


def mismatch_quantile(counts: torch.Tensor | list[float], q: float) -> float | None:
    """The q-quantile of |behaviour - proximal| from `bin_counts(..., MISMATCH_EDGES)`: its bin's upper
    edge, an upper bound within 12% (the lowest bin: 1e-6; above 10: +inf); None without tokens."""
    c = torch.as_tensor(counts, dtype=torch.float64)
    total = float(c.sum())
    if total <= 0:
        return None
    k = int(torch.searchsorted(c.cumsum(0), torch.tensor([q * total], dtype=torch.float64))[0])
    return math.inf if k >= len(MISMATCH_EDGES) else float(MISMATCH_EDGES[k])


def w_quantile(counts: torch.Tensor | list[float], q: float) -> float | None:
    """The q-quantile of w from the counts: its bin's centre (the open bins: e^-3.005, +inf);
    None without tokens."""
    c = torch.as_tensor(counts, dtype=torch.float64)
    total = float(c.sum())
    if total <= 0:
        return None
    k = int(torch.searchsorted(c.cumsum(0), torch.tensor([q * total], dtype=torch.float64))[0])
    if k == 0:
        return math.exp(float(LOG_W_EDGES[0]))
    if k >= len(LOG_W_EDGES):
        return math.inf
    return math.exp(float(LOG_W_EDGES[k - 1] + LOG_W_EDGES[k]) / 2)


def w_std(n: float, w_sum: float, w2_sum: float) -> float:
    """Standard deviation of w from its count, sum and sum of squares (0 without tokens)."""
    if n <= 0:
        return 0.0
    mean = w_sum / n
    return math.sqrt(max(w2_sum / n - mean * mean, 0.0))
