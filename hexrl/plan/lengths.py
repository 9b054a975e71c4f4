"""Rollout output-length distributions: the long tail the cost model and the simulator reason about.

The job's `workload.output_len` (checked by hexrl.schema) is one of {samples: [...]},
{histogram: {edges, counts}} or {mean, max}; `output_lengths` turns it into a LengthDist.
`quantile_samples` gives samples for a distribution a run measured by its mean and quantiles.
"""

import math
from dataclasses import dataclass


@dataclass
class LengthDist:
    """A discrete distribution of rollout output lengths (tokens)."""

    lengths: list[float]
    probs: list[float]

    def mean(self) -> float:
        return sum(l * p for l, p in zip(self.lengths, self.probs))

    def max(self) -> float:
        return max(l for l, p in zip(self.lengths, self.probs) if p > 0)

    def second_moment(self) -> float:
        return sum(l * l * p for l, p in zip(self.lengths, self.probs))

    def expected_max(self, n: int) -> float:
        """E[max of n independent draws]."""
        order = sorted(zip(self.lengths, self.probs))
        out, cdf = 0.0, 0.0
        for l, p in order:
            prev, cdf = cdf, min(1.0, cdf + p)
            out += l * (cdf ** n - prev ** n)
        return out

    def sample(self, rng, n: int):
        """n lengths drawn with numpy Generator `rng` (integers >= 1)."""
        import numpy as np
        idx = rng.choice(len(self.lengths), size=n, p=np.asarray(self.probs) / sum(self.probs))
        return np.maximum(1, np.rint(np.asarray(self.lengths)[idx])).astype(int)

    def split(self, alpha: float) -> tuple["LengthDist", "LengthDist"]:
        """(the longest `alpha` of the probability mass, the rest), each normalised: the lengths of
        the long-tail and the regular class where the longest groups are predicted right. A length
        on the boundary gives each side its part of its mass, so alpha * long.mean() +
        (1 - alpha) * rest.mean() is the mean."""
        order = sorted((l, p / sum(self.probs)) for l, p in zip(self.lengths, self.probs))
        long, rest, need = [], [], alpha
        for l, p in reversed(order):
            take = min(p, max(0.0, need))
            need -= take
            if take > 0:
                long.append((l, take / alpha))
            if p - take > 0:
                rest.append((l, (p - take) / (1 - alpha)))
        return (LengthDist([l for l, _ in long[::-1]], [p for _, p in long[::-1]]),
                LengthDist([l for l, _ in rest[::-1]], [p for _, p in rest[::-1]]))


def long_tail(mean: float, maximum: float, buckets: int = 64) -> LengthDist:
    """A truncated-exponential distribution on [1, max] with the given mean (the RL long tail)."""
    edges = [1 + (maximum - 1) * i / buckets for i in range(buckets + 1)]
    mids = [(a + b) / 2 for a, b in zip(edges, edges[1:])]
    span = max(maximum - 1.0, 1.0)

    def dist(lam):
        w = [math.exp(-lam * (m - 1) / span) for m in mids]
        s = sum(w)
        return [x / s for x in w]

    lo, hi = -60.0, 60.0  # rate in units of 1/span; negative rates skew towards max
    for _ in range(100):
        mid = (lo + hi) / 2
        m = sum(a * b for a, b in zip(mids, dist(mid)))
        lo, hi = (mid, hi) if m > mean else (lo, mid)
    return LengthDist(mids, dist((lo + hi) / 2))


def quantile_samples(mean: float, p50: float, p90: float, top: float, n: int = 100) -> list[float]:
    """`n` lengths at evenly spaced probabilities of a measured distribution known by its mean, median,
    90th percentile and longest: the quantile function runs straight from the shortest to the median,
    the 90th percentile and the longest. The shortest (unmeasured, in [1, median]) makes the mean the
    measured one; where none can, the lengths are scaled to it (capped at the longest)."""
    # the mean of that quantile function: 0.25 (lo + p50) + 0.2 (p50 + p90) + 0.05 (p90 + top)
    lo = min(max(1.0, 4 * (mean - 0.2 * (p50 + p90) - 0.05 * (p90 + top)) - p50), p50)
    knots = [(0.0, lo), (0.5, p50), (0.9, p90), (1.0, top)]

    def at(u: float) -> float:
        (u0, x0), (u1, x1) = next((a, b) for a, b in zip(knots, knots[1:]) if u <= b[0])
        return x0 + (x1 - x0) * (u - u0) / (u1 - u0)

    out = [at((i + 0.5) / n) for i in range(n)]  # n a multiple of 10: exact means on each straight piece
    scale = mean / (sum(out) / n)
    return [round(min(top, max(1.0, x * scale)), 2) for x in out]


def output_lengths(spec: dict) -> LengthDist:
    """The distribution a validated `workload.output_len` describes."""
    if "samples" in spec:
        counts: dict[float, int] = {}
        for v in spec["samples"]:
            counts[float(v)] = counts.get(float(v), 0) + 1
        n = len(spec["samples"])
        return LengthDist(list(counts), [c / n for c in counts.values()])
    if "histogram" in spec:
        e, c = spec["histogram"]["edges"], spec["histogram"]["counts"]
        total = float(sum(c))
        return LengthDist([max(1.0, (a + b) / 2) for a, b in zip(e, e[1:])], [v / total for v in c])
    return long_tail(float(spec["mean"]), float(spec["max"]))


def draw_latency(spec: dict | None, rng, size: int | None = None):
    """Environment call seconds from a validated workload.env_latency_s (0 without one): one draw,
    or an array of `size` (rng: a numpy Generator)."""
    import numpy as np

    if not spec or spec["mean"] <= 0:
        return 0.0 if size is None else np.zeros(size)
    mean = spec["mean"]
    if spec["dist"] == "exponential":
        out = rng.exponential(mean, size)
    elif spec["dist"] == "lognormal":  # mu such that the mean is `mean`
        sigma = spec.get("sigma", 1.0)
        out = rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma, size)
    else:
        out = mean if size is None else np.full(size, float(mean))
    return float(out) if size is None else out


MC_DRAWS = 1 << 24  # latency draws expected_max_wait makes at most (about 0.5 s; one trial at a time in memory)


def expected_max_wait(spec: dict | None, calls: int, episodes: int, trials: int = 200) -> float:
    """E[the longest of `episodes` episodes' total environment wait], each `calls` draws summed: what
    the last episode of a step adds to its wave (Monte Carlo, fixed seed: the same every call).

    At most MC_DRAWS draws, one trial in memory at a time: past them, fewer trials (the longest of
    many episodes varies little from trial to trial), and where one trial would pass them, each
    episode's total is drawn whole (`episode_waits`) instead of call by call."""
    import numpy as np

    if not spec or spec["mean"] <= 0 or calls <= 0 or episodes <= 0:
        return 0.0
    rng = np.random.default_rng(0)
    fit = min(trials, MC_DRAWS // (episodes * calls))
    if fit >= 1:  # one trial's draws at a time: the same stream as drawing them all at once
        return float(np.mean([draw_latency(spec, rng, episodes * calls).reshape(episodes, calls).sum(-1).max()
                              for _ in range(fit)]))
    fit = max(1, min(trials, MC_DRAWS // episodes))
    return float(np.mean([episode_waits(spec, calls, rng, episodes).max() for _ in range(fit)]))


def episode_waits(spec: dict, calls: int, rng, size: int):
    """`size` episodes' total waits of `calls` calls each, drawn whole: exact for fixed and exponential
    latencies (a gamma), for lognormal ones the lognormal of the same mean and variance (Fenton-Wilkinson;
    closer the more calls an episode makes)."""
    import numpy as np

    mean = spec["mean"]
    if spec["dist"] == "exponential":
        return rng.gamma(calls, mean, size)
    if spec["dist"] == "lognormal":
        sigma2 = math.log1p(math.expm1(spec.get("sigma", 1.0) ** 2) / calls)
        return rng.lognormal(math.log(calls * mean) - sigma2 / 2, math.sqrt(sigma2), size)
    return np.full(size, calls * float(mean))
