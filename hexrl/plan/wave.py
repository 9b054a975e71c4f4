"""A wave on one rollout replica: n sequences handed to it at once, on the decode-step clock.

Continuous batching: at most b sequences decode; a sequence of L tokens holds its slot for L
steps, and a queued sequence takes the first slot that frees. Expected counts come from a
fluid renewal on bins of steps: slots freed = starts convolved with the length distribution,
queued sequences take freed slots in order, one pass per generation of slots. The next step's
groups may join at bin `join` (the staleness gate hands them out when a training step ends):
they queue behind the wave's own sequences and take every slot that frees, so the wave's long
tail then decodes in full batches, each step slower than the tail's near-empty ones.
"""

from dataclasses import dataclass, field

import numpy as np

BINS = 1024  # step bins over the horizon: the renewal's resolution
MAX_GENERATIONS = 48  # passes of the renewal (CostModel follows at most 16 batches of a queue in it)


@dataclass
class WaveSteps:
    """The wave bin by bin (bins of `width` decode steps)."""

    width: int
    alive: np.ndarray  # P(some sequence of the wave decodes in the bin): the slowest of `spread` replicas
    batch: np.ndarray  # sequences decoding in the bin (the wave's and the joiners'), given alive
    context: np.ndarray  # context positions they read per step, given alive
    starts: np.ndarray  # sequences prefilled in the bin (the first batch's are in bin 0)


@dataclass(frozen=True)
class Lengths:
    """The output-length distribution on the step clock: pmf[d] = P(L = d), d = 0..max."""

    pmf: np.ndarray
    prompt: int
    _spectra: dict = field(default_factory=dict, compare=False, repr=False)

    def spectra(self, width: int, bins: int) -> dict[str, np.ndarray]:
        """Fourier transforms (length 2 * bins) of, per bin offset k after a start (steps k * width
        to k * width + width - 1): P(L in bin k) "freed", the mean of P(L > d) "occupied", of
        P(L > d) (prompt + d) "context", and log P(L <= the bin's middle) "log_done"; memoised."""
        key = (width, bins)
        if key not in self._spectra:
            size = bins * width
            pmf = np.zeros(size)
            m = min(size, len(self.pmf))
            pmf[:m] = self.pmf[:m]
            pmf[m - 1] += self.pmf[m:].sum()
            done = np.cumsum(pmf)
            occ = 1 - done  # occ[d] = P(L > d)
            shape = (bins, width)
            rows = {"freed": pmf.reshape(shape).sum(1), "occupied": occ.reshape(shape).mean(1),
                    "context": (occ * (self.prompt + np.arange(size))).reshape(shape).mean(1),
                    "log_done": np.log(np.maximum(done.reshape(shape)[:, width // 2], 1e-300))}
            self._spectra[key] = {k: np.fft.rfft(v, 2 * bins) for k, v in rows.items()}
        return self._spectra[key]


def wave_steps(lengths: Lengths, b: int, n: float, spread: float = 1.0,
               join: int | None = None, n_join: float = 0.0, width: int | None = None) -> WaveSteps:
    """Expected course of a wave of n sequences on a replica running at most b at once.

    spread: the wave's sequences over all replicas / n (alive is that of the slowest replica);
    join: the bin (< BINS) where n_join more sequences arrive (None: nothing joins); width: steps
    per bin (default: bin_width)."""
    if width is None:
        width = bin_width(lengths, b, n + n_join)
    K = BINS if join is None else 2 * BINS
    spec = lengths.spectra(width, K)
    first = min(n, b)
    own, joiners = _renewal(spec["freed"], K, b, first, n - first, join, n_join)
    own[0] += first

    def conv(starts: np.ndarray, kernel: str) -> np.ndarray:
        return np.fft.irfft(np.fft.rfft(starts, 2 * K) * spec[kernel], 2 * K)[:K]

    run_own, run_join = conv(own, "occupied"), conv(joiners, "occupied")
    ctx_own, ctx_join = conv(own, "context"), conv(joiners, "context")
    all_started = np.cumsum(own) >= n - 1e-6
    alive = np.where(all_started, 1 - np.exp(np.minimum(0.0, spread * conv(own, "log_done"))), 1.0)
    given = np.maximum(alive, 1e-300)
    mine = run_own / given
    batch = np.minimum(b, mine + run_join)
    extra = np.where(run_join > 1e-12, (batch - np.minimum(mine, batch)) / np.maximum(run_join, 1e-12), 0.0)
    context = ctx_own / given + ctx_join * extra
    return WaveSteps(width, alive, np.maximum(batch, 1.0), context, own + joiners)


def bin_width(lengths: Lengths, b: int, n: float) -> int:
    """Steps per bin so that BINS bins hold the wave: its queue at full rate, then the longest."""
    mean = float((np.arange(len(lengths.pmf)) * lengths.pmf).sum())
    horizon = 1.25 * (len(lengths.pmf) + max(0.0, n - b) / b * mean)
    return max(1, int(np.ceil(horizon / BINS)))


def _renewal(freed_spectrum, K, b, first, queued, join, n_join):
    """Starts per bin of the wave's queued sequences and of the joiners (fluid, by generations)."""
    own, joiners = np.zeros(K), np.zeros(K)
    for _ in range(MAX_GENERATIONS):
        seed = own + joiners
        seed[0] += first
        freed = np.maximum(np.fft.irfft(np.fft.rfft(seed, 2 * K) * freed_spectrum, 2 * K)[:K], 0.0)
        new_own = np.diff(np.minimum(np.cumsum(freed), queued), prepend=0.0)
        new_join = joiners
        if join is not None:
            spare = freed - new_own
            pool = np.zeros(K)
            pool[join:] = spare[join:]
            pool[join] += spare[:join].sum() + (b - first)  # slots idle until the joiners came
            new_join = np.diff(np.minimum(np.cumsum(pool), n_join), prepend=0.0)
        change = np.abs(new_own - own).sum() + np.abs(new_join - joiners).sum()
        own, joiners = new_own, new_join
        if change < 1e-4 * (queued + n_join + 1):
            break
    return own, joiners
