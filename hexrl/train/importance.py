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


_EDGES: dict[torch.device, torch.Tensor] = {}  # the edges on each device, copied once


def log_w_counts(w: torch.Tensor) -> torch.Tensor:
    """float64 counts of log(w) per bin (length NUM_BINS), on w's device, without a host sync."""
    edges = _EDGES.get(w.device)
    if edges is None:
        edges = _EDGES[w.device] = LOG_W_EDGES.to(w.device)
    index = torch.bucketize(w.detach().double().log(), edges, right=True)
    counts = torch.zeros(NUM_BINS, dtype=torch.float64, device=w.device)
    return counts.index_add_(0, index.reshape(-1), torch.ones(index.numel(), dtype=torch.float64, device=w.device))


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
