"""Temperature / top-k / top-p sampling with each row's vocabulary split across many programs.

Same semantics and the same Philox draws as `kernels/sampling.py` (one program per row) and the
sort-based `reference.sample_torch`. The work is cut into fixed launches, so the host never waits
and the whole sampler can sit in a CUDA graph:

  stats    grid (row blocks, chunks): per chunk of CHUNK logits, max and sum-exp of x/T, min/max
           order-preserving key, and the chunk's argmax of x/T (+ Gumbel noise on plain rows);
  rounds   2 x ROUNDS launches, same grid, only when some row filters: the NC-ary threshold search
           of `sampling.search_threshold` (top-k, then top-p on the top-k mass), one round per
           launch. Each program first narrows [lo, hi) itself from the previous round's per-chunk
           counts ([chunks, NC] values: every program of a row reduces them redundantly, so no
           separate reduce launch), then counts its own chunk. ROUNDS = 32 / log2(NC) narrowings
           take any 32-bit key range to one element key;
  kept     same grid: the final narrowing, then each chunk's Gumbel-max over {key >= threshold};
  finish   one program per row block: combines the chunks' max, sum-exp and winners into the
           token and its log-prob (under the tempered, filtered, renormalised distribution).
Plain and greedy batches run stats + finish only (two launches).
"""

import torch
import triton
import triton.language as tl

from kernels.reference import GREEDY_EPS, sample_args
from kernels.sampling import _INT_MAX, _INT_MIN, float_key, gumbel_block

NC = 16  # candidate thresholds per round: 4 bits of the key per round
ROUNDS = 8  # 32 bits / 4 bits per round: every search has converged after this many narrowings
GPU_CHUNK, GPU_BLOCK, GPU_SEARCH_BLOCK = 2048, 1024, 256  # 75 programs per row at V = 151,936
CPU_CHUNK = 1024  # tests lower it to exercise several chunks per row


@triton.jit
def _row_params(rows, rmask, temp_ptr, topk_ptr, topp_ptr, V, GREEDY: tl.constexpr):
    temp = tl.load(temp_ptr + rows, mask=rmask, other=1.0)
    greedy = temp < GREEDY
    t_eff = tl.where(greedy, 1.0, temp)  # greedy rows report the log-prob at T = 1
    top_k = tl.load(topk_ptr + rows, mask=rmask, other=0)
    top_p = tl.load(topp_ptr + rows, mask=rmask, other=1.0)
    use_k = rmask & (greedy == 0) & (top_k > 0) & (top_k < V)
    use_p = rmask & (greedy == 0) & (top_p < 1.0)
    return t_eff, top_k.to(tl.int32), top_p, use_k, use_p, greedy


@triton.jit
def _row_stats(pm_ptr, pz_ptr, pkmin_ptr, pkmax_ptr, rows, rmask, NB, NBP: tl.constexpr):
    """A row's max and sum-exp of x/T and min/max key, combined from its chunks' partials."""
    c = tl.arange(0, NBP)
    mask = rmask[:, None] & (c < NB)[None, :]
    idx = rows[:, None] * NBP + c[None, :]
    pm = tl.load(pm_ptr + idx, mask=mask, other=-3.0e38)
    m = tl.max(pm, 1)
    z = tl.sum(tl.load(pz_ptr + idx, mask=mask, other=0.0) * tl.exp(pm - m[:, None]), 1)
    kmin = tl.min(tl.load(pkmin_ptr + idx, mask=mask, other=_INT_MAX), 1)
    kmax = tl.max(tl.load(pkmax_ptr + idx, mask=mask, other=_INT_MIN), 1)
    return m, z, kmin, kmax


@triton.jit
def _row_winner(pbest_ptr, ptok_ptr, rows, rmask, NB, NBP: tl.constexpr):
    """The row's winning token from its chunks' (score, token) partials; ties go to the first chunk."""
    c = tl.arange(0, NBP)
    mask = rmask[:, None] & (c < NB)[None, :]
    idx = rows[:, None] * NBP + c[None, :]
    best = tl.load(pbest_ptr + idx, mask=mask, other=-float("inf"))
    _, bi = tl.max(best, 1, return_indices=True, return_indices_tie_break_left=True)
    return tl.load(ptok_ptr + rows * NBP + bi, mask=rmask, other=0)


@triton.jit
def _candidates(lo, hi, NC: tl.constexpr):
    j = tl.arange(0, NC)
    width = hi.to(tl.int64) - lo.to(tl.int64)  # may exceed int32
    return (lo.to(tl.int64)[:, None] + (width[:, None] * j[None, :]) // NC).to(tl.int32)


@triton.jit
def _narrow(st_ptr, part_ptr, buf, B, rows, rmask, need_cnt, need_mass, active, NB,
            NBP: tl.constexpr, NC: tl.constexpr):
    """One narrowing of the search state in buffer `buf` by that round's per-chunk counts
    (as `sampling.search_threshold`'s loop body). Returns (lo, hi, mbh, mass_lo, zk)."""
    s = st_ptr + buf * 5 * B + rows
    lo = tl.load(s, mask=rmask, other=0)
    hi = tl.load(s + B, mask=rmask, other=1)
    mbh = tl.load(s + 2 * B, mask=rmask, other=0)
    mass_lo = tl.load(s + 3 * B, mask=rmask, other=0).to(tl.float32, bitcast=True)
    zk = tl.load(s + 4 * B, mask=rmask, other=0).to(tl.float32, bitcast=True)
    c = tl.arange(0, NBP)
    j = tl.arange(0, NC)
    idx = (rows[:, None, None] * NBP + c[None, :, None]) * NC + j[None, None, :]
    mask = rmask[:, None, None] & (c < NB)[None, :, None]
    p = part_ptr + buf * 4 * B * NBP * NC + idx
    n = B * NBP * NC
    cnt = tl.sum(tl.load(p, mask=mask, other=0), 1)
    mass = tl.sum(tl.load(p + n, mask=mask, other=0).to(tl.float32, bitcast=True), 1)
    minge = tl.min(tl.load(p + 2 * n, mask=mask, other=_INT_MAX), 1)
    maxlt = tl.max(tl.load(p + 3 * n, mask=mask, other=_INT_MIN), 1)
    cand = _candidates(lo, hi, NC)
    ok = (cnt >= need_cnt[:, None]) & (mass >= need_mass[:, None])
    ok = ok | (cand == lo[:, None])  # lo satisfies the predicate by construction
    jstar = tl.sum(ok.to(tl.int32), 1) - 1
    sel = j[None, :] == jstar[:, None]
    nxt = j[None, :] == jstar[:, None] + 1
    upd = (active != 0) & (mbh != lo)
    narrow = upd & (jstar < NC - 1)
    new_lo = tl.where(upd, tl.sum(tl.where(sel, minge, 0), 1), lo)
    mass_lo = tl.where(upd, tl.sum(tl.where(sel, mass, 0.0), 1), mass_lo)
    hi = tl.where(narrow, tl.sum(tl.where(nxt, cand, 0), 1), hi)
    mbh = tl.where(narrow, tl.sum(tl.where(nxt, maxlt, 0), 1), mbh)
    return new_lo, hi, mbh, mass_lo, zk


@triton.jit
def _store_state(st_ptr, buf, B, rows, rmask, lo, hi, mbh, mass_lo, zk):
    s = st_ptr + buf * 5 * B + rows
    tl.store(s, lo, mask=rmask)
    tl.store(s + B, hi, mask=rmask)
    tl.store(s + 2 * B, mbh, mask=rmask)
    tl.store(s + 3 * B, mass_lo.to(tl.int32, bitcast=True), mask=rmask)
    tl.store(s + 4 * B, zk.to(tl.int32, bitcast=True), mask=rmask)


@triton.jit
def _stats_kernel(x_ptr, stride, temp_ptr, topk_ptr, topp_ptr, seed_ptr, off_ptr, stream_ptr,
                  pm_ptr, pz_ptr, pkmin_ptr, pkmax_ptr, pbest_ptr, ptok_ptr, B, V,
                  GREEDY: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                  NBP: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < B
    chunk = tl.program_id(1)
    t_eff, _, _, use_k, use_p, greedy = _row_params(rows, rmask, temp_ptr, topk_ptr, topp_ptr, V, GREEDY)
    noisy = rmask & (greedy == 0) & ((use_k | use_p) == 0)
    seed = tl.load(seed_ptr + rows, mask=rmask, other=0)
    off = tl.load(off_ptr + rows, mask=rmask, other=0)
    stream = tl.load(stream_ptr + rows, mask=rmask, other=0)
    row_ptr = x_ptr + rows.to(tl.int64)[:, None] * stride
    m = tl.full([ROWS], -3.0e38, dtype=tl.float32)  # finite so all -inf blocks give 0, not nan
    z = tl.zeros([ROWS], dtype=tl.float32)
    kmin = tl.full([ROWS], _INT_MAX, dtype=tl.int32)
    kmax = tl.full([ROWS], _INT_MIN, dtype=tl.int32)
    best = tl.full([ROWS], -float("inf"), dtype=tl.float32)
    tok = tl.zeros([ROWS], dtype=tl.int32)
    any_noise = tl.sum(noisy.to(tl.int32), 0) > 0
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = rmask[:, None] & (cols < V)[None, :]
        x = tl.load(row_ptr + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32)
        s = x / t_eff[:, None]
        m_new = tl.maximum(m, tl.max(s, 1))
        z = z * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        m = m_new
        key = float_key(x)
        kmin = tl.minimum(kmin, tl.min(tl.where(mask, key, _INT_MAX), 1))
        kmax = tl.maximum(kmax, tl.max(tl.where(mask, key, _INT_MIN), 1))
        score = s
        if any_noise:
            score = s + tl.where(noisy[:, None], gumbel_block(seed, off, stream, start, ROWS, BLOCK), 0.0)
        bs, bi = tl.max(tl.where(mask, score, -float("inf")), 1, return_indices=True,
                        return_indices_tie_break_left=True)
        win = bs > best  # strict: the first block wins ties, like argmax
        best = tl.where(win, bs, best)
        tok = tl.where(win, start + bi, tok)
    out = rows * NBP + chunk
    tl.store(pm_ptr + out, m, mask=rmask)
    tl.store(pz_ptr + out, z, mask=rmask)
    tl.store(pkmin_ptr + out, kmin, mask=rmask)
    tl.store(pkmax_ptr + out, kmax, mask=rmask)
    tl.store(pbest_ptr + out, best, mask=rmask)
    tl.store(ptok_ptr + out, tok, mask=rmask)


@triton.jit
def _round_kernel(x_ptr, stride, temp_ptr, topk_ptr, topp_ptr, pm_ptr, pz_ptr, pkmin_ptr, pkmax_ptr,
                  st_ptr, part_ptr, B, V, NB, it,
                  PHASE: tl.constexpr, FIRST: tl.constexpr, GREEDY: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK: tl.constexpr, CHUNK: tl.constexpr, NBP: tl.constexpr, NC: tl.constexpr):
    """Search round `it`: narrow by round it - 1 (or start a phase), then count this chunk."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < B
    chunk = tl.program_id(1)
    t_eff, top_k, top_p, use_k, use_p, _ = _row_params(rows, rmask, temp_ptr, topk_ptr, topp_ptr, V, GREEDY)
    m, z, kmin, kmax = _row_stats(pm_ptr, pz_ptr, pkmin_ptr, pkmax_ptr, rows, rmask, NB, NBP)
    zero_f = tl.zeros([ROWS], dtype=tl.float32)
    if FIRST and PHASE == 0:  # top-k starts from the whole key range
        lo, hi, mbh, mass_lo, zk = kmin, kmax + 1, kmax, z, z
    elif FIRST:  # top-p starts from the top-k threshold and mass (or the whole row)
        lo, hi, mbh, mass_lo, zk = _narrow(st_ptr, part_ptr, (it + 1) % 2, B, rows, rmask, top_k, zero_f,
                                           use_k, NB, NBP, NC)
        lo = tl.where(use_k, lo, kmin)
        zk = tl.where(use_k, mass_lo, z)
        hi, mbh, mass_lo = kmax + 1, kmax, zk
    elif PHASE == 0:
        lo, hi, mbh, mass_lo, zk = _narrow(st_ptr, part_ptr, (it + 1) % 2, B, rows, rmask, top_k, zero_f,
                                           use_k, NB, NBP, NC)
    else:
        prev_zk = tl.load(st_ptr + ((it + 1) % 2) * 5 * B + 4 * B + rows, mask=rmask, other=0)
        need_mass = top_p * prev_zk.to(tl.float32, bitcast=True)
        lo, hi, mbh, mass_lo, zk = _narrow(st_ptr, part_ptr, (it + 1) % 2, B, rows, rmask,
                                           tl.full([ROWS], 1, dtype=tl.int32), need_mass, use_p, NB, NBP, NC)
    buf = it % 2
    if chunk == 0:
        _store_state(st_ptr, buf, B, rows, rmask, lo, hi, mbh, mass_lo, zk)
    if PHASE == 0:
        live = use_k & (mbh != lo)
    else:
        live = use_p & (mbh != lo)
    if tl.sum(live.to(tl.int32), 0) > 0:
        j = tl.arange(0, NC)
        cand = _candidates(lo, hi, NC)
        cnt = tl.zeros([ROWS, NC], dtype=tl.int32)
        mass = tl.zeros([ROWS, NC], dtype=tl.float32)
        minge = tl.full([ROWS, NC], _INT_MAX, dtype=tl.int32)
        maxlt = tl.full([ROWS, NC], _INT_MIN, dtype=tl.int32)
        row_ptr = x_ptr + rows.to(tl.int64)[:, None] * stride
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = rmask[:, None] & (cols < V)[None, :]
            x = tl.load(row_ptr + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32)
            e = tl.exp(x / t_eff[:, None] - m[:, None])
            key3 = tl.where(mask, float_key(x), _INT_MIN)[:, :, None]  # padding is below every candidate
            ge = key3 >= cand[:, None, :]
            cnt += tl.sum(ge.to(tl.int32), 1)
            mass += tl.sum(tl.where(ge, e[:, :, None], 0.0), 1)
            minge = tl.minimum(minge, tl.min(tl.where(ge, key3, _INT_MAX), 1))
            maxlt = tl.maximum(maxlt, tl.max(tl.where(ge, _INT_MIN, key3), 1))
        n = B * NBP * NC
        p = part_ptr + buf * 4 * n + (rows[:, None] * NBP + chunk) * NC + j[None, :]
        pmask = rmask[:, None]
        tl.store(p, cnt, mask=pmask)
        tl.store(p + n, mass.to(tl.int32, bitcast=True), mask=pmask)
        tl.store(p + 2 * n, minge, mask=pmask)
        tl.store(p + 3 * n, maxlt, mask=pmask)


@triton.jit
def _kept_kernel(x_ptr, stride, temp_ptr, topk_ptr, topp_ptr, seed_ptr, off_ptr, stream_ptr,
                 st_ptr, part_ptr, kbest_ptr, ktok_ptr, B, V, NB, it,
                 GREEDY: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                 NBP: tl.constexpr, NC: tl.constexpr):
    """The last narrowing (state saved for `finish`), then this chunk's Gumbel-max over the kept set."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < B
    chunk = tl.program_id(1)
    t_eff, _, top_p, use_k, use_p, _ = _row_params(rows, rmask, temp_ptr, topk_ptr, topp_ptr, V, GREEDY)
    filt = use_k | use_p
    prev_zk = tl.load(st_ptr + ((it + 1) % 2) * 5 * B + 4 * B + rows, mask=rmask, other=0)
    tau, hi, mbh, mass_lo, zk = _narrow(st_ptr, part_ptr, (it + 1) % 2, B, rows, rmask,
                                        tl.full([ROWS], 1, dtype=tl.int32),
                                        top_p * prev_zk.to(tl.float32, bitcast=True), use_p, NB, NBP, NC)
    if chunk == 0:
        _store_state(st_ptr, it % 2, B, rows, rmask, tau, hi, mbh, mass_lo, zk)
    best = tl.full([ROWS], -float("inf"), dtype=tl.float32)
    tok = tl.zeros([ROWS], dtype=tl.int32)
    if tl.sum(filt.to(tl.int32), 0) > 0:
        seed = tl.load(seed_ptr + rows, mask=rmask, other=0)
        off = tl.load(off_ptr + rows, mask=rmask, other=0)
        stream = tl.load(stream_ptr + rows, mask=rmask, other=0)
        row_ptr = x_ptr + rows.to(tl.int64)[:, None] * stride
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = rmask[:, None] & (cols < V)[None, :]
            x = tl.load(row_ptr + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32)
            kept = mask & filt[:, None] & (float_key(x) >= tau[:, None])
            noise = gumbel_block(seed, off, stream, start, ROWS, BLOCK)
            score = tl.where(kept, x / t_eff[:, None] + noise, -float("inf"))
            bs, bi = tl.max(score, 1, return_indices=True, return_indices_tie_break_left=True)
            win = bs > best
            best = tl.where(win, bs, best)
            tok = tl.where(win, start + bi, tok)
    tl.store(kbest_ptr + rows * NBP + chunk, best, mask=rmask)
    tl.store(ktok_ptr + rows * NBP + chunk, tok, mask=rmask)


@triton.jit
def _finish_kernel(x_ptr, stride, temp_ptr, topk_ptr, topp_ptr, pm_ptr, pz_ptr, pkmin_ptr, pkmax_ptr,
                   pbest_ptr, ptok_ptr, st_ptr, kbest_ptr, ktok_ptr, tok_ptr, lp_ptr, B, V, NB, it,
                   FILTERED: tl.constexpr, GREEDY: tl.constexpr, ROWS: tl.constexpr, NBP: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < B
    t_eff, _, _, use_k, use_p, _ = _row_params(rows, rmask, temp_ptr, topk_ptr, topp_ptr, V, GREEDY)
    m, z, _, _ = _row_stats(pm_ptr, pz_ptr, pkmin_ptr, pkmax_ptr, rows, rmask, NB, NBP)
    tok = _row_winner(pbest_ptr, ptok_ptr, rows, rmask, NB, NBP)
    if FILTERED:
        filt = use_k | use_p
        kept_z = tl.load(st_ptr + (it % 2) * 5 * B + 3 * B + rows, mask=rmask, other=0).to(tl.float32, bitcast=True)
        tok = tl.where(filt, _row_winner(kbest_ptr, ktok_ptr, rows, rmask, NB, NBP), tok)
        z = tl.where(filt, kept_z, z)
    x_tok = tl.load(x_ptr + rows.to(tl.int64) * stride + tok, mask=rmask, other=0.0).to(tl.float32)
    tl.store(tok_ptr + rows, tok.to(tl.int64), mask=rmask)
    z = tl.where(rmask, z, 1.0)  # padding rows: avoid log(0)
    tl.store(lp_ptr + rows, x_tok / t_eff - m - tl.log(z), mask=rmask)


def _launch_shape(batch: int, vocab: int, on_gpu: bool) -> tuple[int, int, int, int]:
    """(ROWS, CHUNK, BLOCK, SEARCH_BLOCK). GPU: one row per program, CHUNK logits per program.
    Interpreter: many rows per program (its cost is per operation, not per element)."""
    if on_gpu:
        chunk = min(GPU_CHUNK, max(16, triton.next_power_of_2(vocab)))
        return 1, chunk, min(GPU_BLOCK, chunk), min(GPU_SEARCH_BLOCK, chunk)
    chunk = min(CPU_CHUNK, max(16, triton.next_power_of_2(vocab)))
    rows = max(1, min(triton.next_power_of_2(batch), (1 << 18) // (chunk * NC)))
    return rows, chunk, chunk, chunk


def needs_filter(top_k, top_p, vocab: int) -> bool:
    """Whether the search launches are needed: False only when top_k and top_p are plain numbers
    that turn filtering off (tensors are not read: that would wait for the device)."""
    if torch.is_tensor(top_k) or torch.is_tensor(top_p):
        return True
    return 0 < top_k < vocab or top_p < 1.0


def sample_split(logits, temperature, top_k=0, top_p=1.0, seed=0, offset=0, check: bool = True,
                 filtered: bool | None = None):
    """Split-vocabulary Triton sampler: (tokens [B] int64, logprobs [B] float32), the semantics and
    draws of `reference.sample_torch`. filtered=False promises no row uses top-k/top-p (the caller
    knows; the search launches are skipped); None decides from the arguments."""
    if filtered is None:
        filtered = needs_filter(top_k, top_p, logits.shape[-1] if torch.is_tensor(logits) else 0)
    temp, k, p, seeds, offsets, streams = sample_args(logits, temperature, top_k, top_p, seed, offset, check)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n, vocab = logits.shape
    dev = logits.device
    tokens = torch.empty(n, dtype=torch.int64, device=dev)
    logprobs = torch.empty(n, dtype=torch.float32, device=dev)
    if n == 0:
        return tokens, logprobs
    rows, chunk, block, sblock = _launch_shape(n, vocab, logits.is_cuda)
    nb = triton.cdiv(vocab, chunk)
    nbp = triton.next_power_of_2(nb)
    grid = (triton.cdiv(n, rows), nb)
    pm, pz, pbest, kbest = torch.empty(4, n, nbp, dtype=torch.float32, device=dev)
    pkmin, pkmax, ptok, ktok = torch.empty(4, n, nbp, dtype=torch.int32, device=dev)
    warps = 4 if logits.is_cuda else 1
    common = dict(GREEDY=GREEDY_EPS, ROWS=rows, NBP=nbp)
    _stats_kernel[grid](logits, logits.stride(0), temp, k, p, seeds, offsets, streams, pm, pz, pkmin, pkmax,
                        pbest, ptok, n, vocab, BLOCK=block, CHUNK=chunk, num_warps=warps, **common)
    last = 2 * ROUNDS
    state = part = None
    if filtered:
        state = torch.empty(2, 5, n, dtype=torch.int32, device=dev)  # lo, hi, mbh, mass_lo, zk; double-buffered
        part = torch.empty(2, 4, n, nbp, NC, dtype=torch.int32, device=dev)  # cnt, mass, minge, maxlt per chunk
        for it in range(last):
            _round_kernel[grid](logits, logits.stride(0), temp, k, p, pm, pz, pkmin, pkmax, state, part, n, vocab,
                                nb, it, PHASE=it // ROUNDS, FIRST=it % ROUNDS == 0, BLOCK=sblock, CHUNK=chunk,
                                NC=NC, num_warps=warps, **common)
        _kept_kernel[grid](logits, logits.stride(0), temp, k, p, seeds, offsets, streams, state, part, kbest, ktok,
                           n, vocab, nb, last, BLOCK=block, CHUNK=chunk, NC=NC, num_warps=warps, **common)
    _finish_kernel[(grid[0],)](logits, logits.stride(0), temp, k, p, pm, pz, pkmin, pkmax, pbest, ptok,
                               state if filtered else pm, kbest, ktok, tokens, logprobs, n, vocab, nb, last,
                               FILTERED=bool(filtered), num_warps=warps, **common)
    return tokens, logprobs
