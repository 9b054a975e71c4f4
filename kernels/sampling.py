"""Fused temperature / top-k / top-p sampling in Triton, without sorting the vocabulary, one
program per row (`sample_triton`; kept for comparison: `sample` runs the split-vocabulary
kernel of `kernels/sampling_split.py`; both use the jit helpers of `kernels/sampling_common.py`).

Per row (semantics in `kernels/reference.py`, which is the sort-based ground truth):
  pass 1   online max and sum-exp of x/T, min/max of the row, and the Gumbel-max winner for rows
           that need no filtering (greedy and plain rows are finished after this one pass);
  search   for top-k, then top-p: an NC-ary search over order-preserving int32 keys of the
           logits; each round is one pass over V that counts elements and sums their probability
           mass above NC candidate thresholds, then narrows [lo, hi) to one gap. lo always
           snaps to an actual element, so the threshold found is an exact logit value (at most
           ceil(32 / log2 NC) rounds, usually fewer);
  final    Gumbel-max and sum-exp over the kept set {x >= threshold}.
The noise is Philox keyed by the row's seed with counters (vocab index // 4, offset, stream), so a
draw depends only on (seed, offset, stream) and matches `reference.sample_torch` bit for bit
(up to last-ulp differences of exp/log between backends, which flip a token only at near-ties).
Tie behaviour: every token equal to the threshold logit is kept, as in the reference. The top-p
boundary can differ from the reference only where the cumulative probability is within float32
rounding of top_p. NaN logits are not supported.
"""

import torch
import triton
import triton.language as tl

from kernels.reference import GREEDY_EPS, sample_args, sample_torch, use_triton
from kernels.sampling_common import INT_MAX, INT_MIN, float_key, gumbel_block, search_threshold
from kernels.sampling_split import sample_split

GPU_MAX_BLOCK = 512  # with 8 warps: ~106 registers on sm_90, no spills (ptxas -v)
CPU_MAX_BLOCK = 1024  # tests lower it to exercise several blocks per row
_NC = 16  # candidate thresholds per search round: 4 bits of the key per pass over the row


@triton.jit
def stats_pass(row_ptr, rmask, V, t_eff, noisy, seed, off, stream,
               ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 1: max and sum-exp of x/T, min/max key, and the argmax of x/T (+ Gumbel where noisy)."""
    m = tl.full([ROWS], -3.0e38, dtype=tl.float32)  # finite so all -inf blocks give 0, not nan
    z = tl.zeros([ROWS], dtype=tl.float32)
    kmin = tl.full([ROWS], INT_MAX, dtype=tl.int32)
    kmax = tl.full([ROWS], INT_MIN, dtype=tl.int32)
    best = tl.full([ROWS], -float("inf"), dtype=tl.float32)
    tok = tl.zeros([ROWS], dtype=tl.int32)
    any_noise = tl.sum(noisy.to(tl.int32), 0) > 0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = rmask[:, None] & (cols < V)[None, :]
        x = tl.load(row_ptr + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32)
        s = x / t_eff[:, None]
        m_new = tl.maximum(m, tl.max(s, 1))
        z = z * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        m = m_new
        key = float_key(x)
        kmin = tl.minimum(kmin, tl.min(tl.where(mask, key, INT_MAX), 1))
        kmax = tl.maximum(kmax, tl.max(tl.where(mask, key, INT_MIN), 1))
        score = s
        if any_noise:
            score = s + tl.where(noisy[:, None], gumbel_block(seed, off, stream, start, ROWS, BLOCK), 0.0)
        bs, bi = tl.max(tl.where(mask, score, -float("inf")), 1, return_indices=True,
                        return_indices_tie_break_left=True)
        win = bs > best  # strict: the first block wins ties, like argmax
        best = tl.where(win, bs, best)
        tok = tl.where(win, start + bi, tok)
    return m, z, kmin, kmax, tok


@triton.jit
def kept_pass(row_ptr, rmask, V, t_eff, m, tau, filt, seed, off, stream,
              ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Final pass of filtered rows: Gumbel-max winner and sum-exp over the kept set {key >= tau}."""
    z = tl.zeros([ROWS], dtype=tl.float32)
    best = tl.full([ROWS], -float("inf"), dtype=tl.float32)
    tok = tl.zeros([ROWS], dtype=tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = rmask[:, None] & (cols < V)[None, :]
        x = tl.load(row_ptr + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32)
        s = x / t_eff[:, None]
        kept = mask & filt[:, None] & (float_key(x) >= tau[:, None])
        z += tl.sum(tl.where(kept, tl.exp(s - m[:, None]), 0.0), 1)
        score = tl.where(kept, s + gumbel_block(seed, off, stream, start, ROWS, BLOCK), -float("inf"))
        bs, bi = tl.max(score, 1, return_indices=True, return_indices_tie_break_left=True)
        win = bs > best
        best = tl.where(win, bs, best)
        tok = tl.where(win, start + bi, tok)
    return tok, z


@triton.jit
def _sample_kernel(x_ptr, stride, temp_ptr, topk_ptr, topp_ptr, seed_ptr, off_ptr, stream_ptr,
                   tok_ptr, lp_ptr, B, V,
                   GREEDY: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, NC: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < B
    temp = tl.load(temp_ptr + rows, mask=rmask, other=1.0)
    greedy = temp < GREEDY
    t_eff = tl.where(greedy, 1.0, temp)  # greedy rows report the log-prob at T = 1
    top_k = tl.load(topk_ptr + rows, mask=rmask, other=0)
    top_p = tl.load(topp_ptr + rows, mask=rmask, other=1.0)
    use_k = rmask & (greedy == 0) & (top_k > 0) & (top_k < V)
    use_p = rmask & (greedy == 0) & (top_p < 1.0)
    filt = use_k | use_p
    noisy = rmask & (greedy == 0) & (filt == 0)
    seed = tl.load(seed_ptr + rows, mask=rmask, other=0)
    off = tl.load(off_ptr + rows, mask=rmask, other=0)
    stream = tl.load(stream_ptr + rows, mask=rmask, other=0)
    row_ptr = x_ptr + rows.to(tl.int64)[:, None] * stride

    m, z, kmin, kmax, tok = stats_pass(row_ptr, rmask, V, t_eff, noisy, seed, off, stream, ROWS, BLOCK)
    if tl.sum(filt.to(tl.int32), 0) > 0:
        # top-k threshold, then top-p on the top-k renormalised mass
        tau, zk = search_threshold(row_ptr, rmask, V, t_eff, m, kmin, kmax + 1, kmax, z, top_k.to(tl.int32),
                                   tl.zeros([ROWS], dtype=tl.float32), use_k, ROWS, BLOCK, NC)
        tau = tl.where(use_k, tau, kmin)
        zk = tl.where(use_k, zk, z)
        tau, zk = search_threshold(row_ptr, rmask, V, t_eff, m, tau, kmax + 1, kmax, zk,
                                   tl.full([ROWS], 1, dtype=tl.int32), top_p * zk, use_p, ROWS, BLOCK, NC)
        ftok, fz = kept_pass(row_ptr, rmask, V, t_eff, m, tau, filt, seed, off, stream, ROWS, BLOCK)
        tok = tl.where(filt, ftok, tok)
        z = tl.where(filt, fz, z)

    x_tok = tl.load(x_ptr + rows.to(tl.int64) * stride + tok, mask=rmask, other=0.0).to(tl.float32)
    tl.store(tok_ptr + rows, tok.to(tl.int64), mask=rmask)
    z = tl.where(rmask, z, 1.0)  # padding rows: avoid log(0)
    tl.store(lp_ptr + rows, x_tok / t_eff - m - tl.log(z), mask=rmask)


def _launch_shape(batch: int, vocab: int, on_gpu: bool) -> tuple[int, int]:
    """(ROWS, BLOCK): one row per program on GPU; many rows per program in the interpreter,
    whose cost is per operation, not per element."""
    block = max(4, min(triton.next_power_of_2(vocab), GPU_MAX_BLOCK if on_gpu else CPU_MAX_BLOCK))
    if on_gpu:
        return 1, block
    rows = max(1, min(triton.next_power_of_2(batch), (1 << 18) // (block * _NC)))
    return rows, block


def sample_triton(logits, temperature, top_k=0, top_p=1.0, seed=0, offset=0, check: bool = True):
    """Triton sampler: (tokens [B] int64, logprobs [B] float32); same semantics as `sample_torch`."""
    temp, k, p, seeds, offsets, streams = sample_args(logits, temperature, top_k, top_p, seed, offset, check)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n, vocab = logits.shape
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n == 0:
        return tokens, logprobs
    rows, block = _launch_shape(n, vocab, logits.is_cuda)
    _sample_kernel[(triton.cdiv(n, rows),)](
        logits, logits.stride(0), temp, k, p, seeds, offsets, streams, tokens, logprobs, n, vocab,
        GREEDY=GREEDY_EPS, ROWS=rows, BLOCK=block, NC=_NC, num_warps=8 if logits.is_cuda else 1)
    return tokens, logprobs


def sample(logits, temperature, top_k=0, top_p=1.0, seed=0, offset=0, check: bool = True,
           filtered: bool | None = None):
    """Sample one token per row of `logits` [B, V].

    temperature, top_k (0 = off), top_p (1.0 = off), offset: scalars or [B] tensors; seed: an int
    (row r uses stream r) or a [B] int tensor of per-row seeds (a row's draw is then independent
    of the batch it is in). Returns (tokens [B] int64, logprobs [B] float32): the log-prob under
    the distribution sampled from (tempered, filtered, renormalised); greedy rows (T < 1e-5)
    return the argmax and its log-prob under softmax(logits) at T = 1.
    Runs the split-vocabulary Triton kernel (`kernels.sampling_split`) on CUDA tensors, and on CPU
    when TRITON_INTERPRET=1; otherwise the torch reference, which draws the same tokens for the
    same seeds. check=False skips the value checks (one device sync) for callers that validated
    their sampling parameters already; filtered=False promises no row uses top-k/top-p.
    """
    if use_triton(logits):

        return sample_split(logits, temperature, top_k, top_p, seed, offset, check, filtered)
    return sample_torch(logits, temperature, top_k, top_p, seed, offset, check)
