"""Pure-torch references for the Triton kernels (the ground truth in tests, the CPU fallback).

Sampling semantics shared by `sample_torch` and the Triton kernel in `kernels/sampling.py`:

* temperature < GREEDY_EPS -> greedy: argmax of the logits (first index on ties); top-k/top-p are
  ignored; the log-prob is under the full softmax at T=1.
* otherwise the row is filtered on the *raw* logits x (the order of x/T is the order of x):
  top-k keeps {x >= k-th largest x}; top-p (applied after top-k, on the top-k renormalised
  softmax(x/T)) keeps {x >= tau} with tau the largest value whose upper set has probability
  >= top_p. Ties exactly at a threshold are all kept, so a row may keep more than k tokens.
* the token is drawn by Gumbel-max over the kept set: argmax(x/T + g), g = -log(-log(u)), with u
  from a counter-based Philox-4x32-10 keyed by the row's seed; vocabulary element i uses output
  i % 4 of counter (i // 4, offset_lo, stream, offset_hi). Same (seed, offset, stream) -> same
  noise, whatever else is in the batch, on CPU or GPU.
* the log-prob is log softmax(x/T) renormalised over the kept set (the distribution sampled from).
"""

import os

import torch

GREEDY_EPS = 1e-5
_M32 = 0xFFFFFFFF
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85


# ----------------------------------------------------------------------------- arguments


def _row_tensor(value, n: int, dtype: torch.dtype, device, name: str, problems: list[str]):
    """A scalar or a [n] sequence/tensor as a [n] tensor of `dtype` on `device`."""
    t = torch.as_tensor(value, dtype=dtype).to(device) if not torch.is_tensor(value) else value
    if t.dim() == 0:
        return t.to(device=device, dtype=dtype).expand(n).contiguous()
    if t.shape != (n,):
        problems.append(f"{name}: expected a scalar or shape [{n}], got {list(t.shape)}")
        return torch.zeros(n, dtype=dtype, device=device)
    return t.to(device=device, dtype=dtype).contiguous()


def sample_args(logits, temperature, top_k, top_p, seed, offset, check: bool = True):
    """Validate the sampling arguments and return them as [B] tensors on the logits' device.

    Returns (temperature f32, top_k i64, top_p f32, seeds i64, offsets i64, streams i64). An int
    `seed` gives every row that seed with stream = row index; a [B] tensor of seeds gives stream 0,
    so a row's draw then depends only on its own (seed, offset). All problems are raised at once.
    check=False skips the value checks, the only part that waits for the device (hot loops that
    validated their parameters earlier; also keeps CUDA-graph capture possible).
    """
    if not torch.is_tensor(logits) or logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits: expected a [B, V] tensor with V > 0, got {getattr(logits, 'shape', type(logits))}")
    if not logits.is_floating_point():
        raise ValueError(f"logits: expected a floating-point tensor, got {logits.dtype}")
    n, dev, problems = logits.shape[0], logits.device, []
    temp = _row_tensor(temperature, n, torch.float32, dev, "temperature", problems)
    k = _row_tensor(top_k, n, torch.int64, dev, "top_k", problems)
    p = _row_tensor(top_p, n, torch.float32, dev, "top_p", problems)
    per_row_seed = torch.is_tensor(seed) and seed.dim() == 1
    seeds = _row_tensor(seed, n, torch.int64, dev, "seed", problems)
    offsets = _row_tensor(offset, n, torch.int64, dev, "offset", problems)
    streams = torch.zeros(n, dtype=torch.int64, device=dev) if per_row_seed else torch.arange(n, device=dev)
    if check and n and not problems:
        # One host sync for all the value checks.
        bad = torch.stack([
            ~torch.isfinite(temp) | (temp < 0), k < 0, ~(p > 0) | (p > 1), offsets < 0,
        ]).any(dim=1).tolist()
        msgs = ["temperature: must be finite and >= 0", "top_k: must be >= 0 (0 = off)",
                "top_p: must be in (0, 1] (1 = off)", "offset: must be >= 0"]
        problems += [m for m, b in zip(msgs, bad) if b]
    if problems:
        raise ValueError("invalid sampling arguments: " + "; ".join(problems))
    return temp, k, p, seeds, offsets, streams


def use_triton(t: torch.Tensor) -> bool:
    """Triton on CUDA tensors; on CPU only under TRITON_INTERPRET=1 (the interpreter is slow)."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------- noise


def _umul32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * b for uint32 values held in int64. The product is < 2^64,
    so the wrapped int64 result carries its exact bit pattern."""
    prod = b * a
    return (prod >> 32) & _M32, prod & _M32


def philox(seed: torch.Tensor, c0, c1, c2, c3) -> list[torch.Tensor]:
    """Philox-4x32-10 with the same round order as `tl.philox`; uint32 words held in int64."""
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    c0, c1, c2, c3 = torch.broadcast_tensors(c0 & _M32, c1 & _M32, c2 & _M32, c3 & _M32)
    for _ in range(10):
        hi_b, lo_b = _umul32(_PHILOX_ROUND_B, c2)
        hi_a, lo_a = _umul32(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY_A) & _M32, (k1 + _PHILOX_KEY_B) & _M32
    return [c0, c1, c2, c3]


def gumbel_noise(seeds: torch.Tensor, offsets: torch.Tensor, streams: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32 Gumbel noise, bit-compatible with the Triton sampling kernel."""
    n4 = (vocab + 3) // 4
    col = torch.arange(n4, device=seeds.device)[None, :]
    words = philox(seeds[:, None], col, offsets[:, None], streams[:, None], offsets[:, None] >> 32)
    r = torch.stack(words, dim=-1).reshape(len(seeds), 4 * n4)[:, :vocab]
    # 23 random bits + 0.5 ulp: u in (0, 1) exactly representable, never 0 or 1.
    u = ((r >> 9).float() + 0.5) * (1.0 / (1 << 23))
    return -torch.log(-torch.log(u))


# ----------------------------------------------------------------------------- sampling


def kept_mask(x: torch.Tensor, s: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[B, V] bool: the tokens that survive top-k then top-p, by a full sort (ties kept)."""
    n, vocab = x.shape
    keep = torch.ones_like(x, dtype=torch.bool)
    use_k, use_p = (top_k > 0) & (top_k < vocab), top_p < 1.0
    if not bool((use_k | use_p).any()):
        return keep
    xs, order = torch.sort(x, dim=-1, descending=True, stable=True)
    rows = torch.arange(n, device=x.device)
    kth = xs[rows, (top_k.clamp(1, vocab) - 1)]
    keep_k = torch.where(use_k[:, None], x >= kth[:, None], keep)
    ss = torch.where(keep_k, s.double(), -torch.inf).gather(1, order)
    cum = torch.softmax(ss, dim=-1).cumsum(dim=-1)
    last = (cum < top_p.double()[:, None]).sum(dim=-1).clamp(max=vocab - 1)
    tau_p = xs[rows, last]
    return keep_k & torch.where(use_p[:, None], x >= tau_p[:, None], keep)


def greedy_torch(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy rows: (argmax [B] int64, its log-prob under softmax(logits) at T = 1 [B] float32).
    Plain torch ops, so it can be captured in a CUDA graph."""
    x = logits.float()
    tokens = x.argmax(dim=-1)
    return tokens, x.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(x, dim=-1)


def sample_torch(logits, temperature, top_k=0, top_p=1.0, seed=0, offset=0, check: bool = True):
    """Sort-based reference sampler: (tokens [B] int64, logprobs [B] float32). See module doc."""
    temp, k, p, seeds, offsets, streams = sample_args(logits, temperature, top_k, top_p, seed, offset, check)
    x = logits.float()
    greedy = temp < GREEDY_EPS
    if bool(greedy.all()):  # argmax and the full softmax at T=1: no filtering, no noise
        return greedy_torch(x)
    s = x / torch.where(greedy, 1.0, temp)[:, None]
    keep = kept_mask(x, s, torch.where(greedy, 0, k), torch.where(greedy, 1.0, p))
    noise = gumbel_noise(seeds, offsets, streams, x.shape[1])
    score = s + torch.where(greedy[:, None], 0.0, noise)
    tokens = torch.where(keep, score, -torch.inf).argmax(dim=-1)
    kept = torch.where(keep, s, -torch.inf)  # log-prob of the drawn token only: no [B, V] float64 copy
    return tokens, kept.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(kept, dim=-1)


def sampling_probs(logits, temperature, top_k=0, top_p=1.0) -> torch.Tensor:
    """[B, V] float64: the distribution `sample_torch` draws from (for tests and analysis)."""
    temp, k, p, *_ = sample_args(logits, temperature, top_k, top_p, 0, 0)
    x = logits.float()
    greedy = temp < GREEDY_EPS
    s = x / torch.where(greedy, 1.0, temp)[:, None]
    keep = kept_mask(x, s, torch.where(greedy, 0, k), torch.where(greedy, 1.0, p))
    probs = torch.softmax(torch.where(keep, s.double(), -torch.inf), dim=-1)
    onehot = torch.nn.functional.one_hot(x.argmax(dim=-1), x.shape[1]).double()
    return torch.where(greedy[:, None], onehot, probs)


# ----------------------------------------------------------------------------- log-probs


def token_logprobs_torch(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T)[targets] over the last dim; float64 in -> float64 out, else float32."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    lp = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)
    return lp.gather(-1, targets[..., None].long())[..., 0]


def token_logprobs_grad_torch(logits, targets, lse, grad, temperature: float = 1.0) -> torch.Tensor:
    """d/dlogits of sum(grad * logprob): grad * (onehot(target) - softmax(logits/T)) / T."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    probs = torch.exp(logits.to(dtype) / temperature - lse[..., None].to(dtype))
    onehot = torch.nn.functional.one_hot(targets.long(), logits.shape[-1]).to(dtype)
    return (grad[..., None].to(dtype) * (onehot - probs) / temperature).to(logits.dtype)
