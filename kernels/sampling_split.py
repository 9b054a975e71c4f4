"""Temperature / top-k / top-p sampling with each row's vocabulary split across many programs.

Same semantics and the same Philox draws as `kernels/sampling.py` (one program per row) and the
sort-based `reference.sample_torch`. The work is cut into fixed launches, so the host never waits
and the whole sampler can sit in a CUDA graph:

  stats    grid (row blocks, chunks): per chunk of CHUNK logits, max and sum-exp of x/T, min/max
           order-preserving key, and the chunk's argmax of x/T (+ Gumbel noise on plain rows);
  cands    (filtering calls only) the stats pass also keeps, per chunk, the indices of its logits
           within BAND of the running max of x/T (up to CAND per chunk; the largest value it had
           to drop is recorded). One program per row then gathers them: every logit within BAND
           of the row max is there unless a chunk dropped one, so if the row's top-k count and
           top-p mass are reached inside the band (the usual case: LLM logits are peaked), the
           thresholds, the kept set's mass and the Gumbel-max winner come from these few
           candidates alone (`_cand_kernel`). Other rows fall back to the rounds below;
  rounds   2 x ROUNDS launches, same grid, only when some row filters: the NC-ary threshold search
           of `sampling_common.search_threshold` (top-k, then top-p on the top-k mass), one round per
           launch. Each program first narrows [lo, hi) itself from the previous round's per-chunk
           counts ([chunks, NC] values: every program of a row reduces them redundantly, so no
           separate reduce launch), then counts its own chunk. ROUNDS = 32 / log2(NC) narrowings
           take any 32-bit key range to one element key;
  kept     same grid: the final narrowing, then each chunk's Gumbel-max over {key >= threshold};
  finish   one program per row block: combines the chunks' max, sum-exp and winners into the
           token and its log-prob (under the tempered, filtered, renormalised distribution).
Plain and greedy batches run stats + finish only (two launches). In a filtering call the rounds
and the kept pass skip the rows the candidates served (programs whose rows are all served do no
work), so a peaked batch reads its logits once.
"""

import torch
import triton
import triton.language as tl

from kernels.reference import GREEDY_EPS, sample_args
from kernels.sampling_common import INT_MAX as _INT_MAX
from kernels.sampling_common import INT_MIN as _INT_MIN
from kernels.sampling_common import float_key, gumbel_block, search_threshold

NC = 16  # candidate thresholds per round: 4 bits of the key per round
ROUNDS = 8  # 32 bits / 4 bits per round: every search has converged after this many narrowings
GPU_CHUNK, GPU_BLOCK, GPU_SEARCH_BLOCK = 2048, 1024, 256  # 75 programs per row at V = 151,936
CPU_CHUNK = 1024  # tests lower it to exercise several chunks per row
BAND = 12.0  # candidates: logits within this many units of x/T below the max (e^-12 ~ 6e-6 of its weight)
GPU_CAND, CPU_CAND = 128, 64  # candidates kept per chunk (tests lower CPU_CAND to force the fallback)
GPU_CAND_BLOCK = 512  # candidates per tile in the candidate program (8 warps, as the row kernel)


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
def _gumbel_at(seed, off, stream, idx):
    """[ROWS, N] Gumbel noise at vocabulary indices idx (the values `gumbel_block` gives those columns)."""
    zero = tl.zeros_like(idx).to(tl.uint32)
    c0 = zero + (idx // 4).to(tl.uint32)
    c1 = zero + (off & 0xFFFFFFFF).to(tl.uint32)[:, None]
    c2 = zero + (stream & 0xFFFFFFFF).to(tl.uint32)[:, None]
    c3 = zero + ((off >> 32) & 0xFFFFFFFF).to(tl.uint32)[:, None]
    r0, r1, r2, r3 = tl.philox(seed[:, None], c0, c1, c2, c3)
    q = idx % 4  # column 4n + q takes output q of counter n
    r = tl.where(q == 0, r0, tl.where(q == 1, r1, tl.where(q == 2, r2, r3)))
    u = ((r >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return -tl.log(-tl.log(u))


@triton.jit
def _candidates(lo, hi, NC: tl.constexpr):
    j = tl.arange(0, NC)
    width = hi.to(tl.int64) - lo.to(tl.int64)  # may exceed int32
    return (lo.to(tl.int64)[:, None] + (width[:, None] * j[None, :]) // NC).to(tl.int32)


@triton.jit
def _narrow(st_ptr, part_ptr, buf, B, rows, rmask, need_cnt, need_mass, active, NB,
            NBP: tl.constexpr, NC: tl.constexpr):
    """One narrowing of the search state in buffer `buf` by that round's per-chunk counts
    (as `sampling_common.search_threshold`'s loop body). Returns (lo, hi, mbh, mass_lo, zk)."""
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


# The batch size B and the search round `it` are not specialised: Triton would compile a variant per value
# class (1, multiple of 16, other) of each, 33 compiles per engine start instead of 10 (tools/device/compile_sm90.py)
@triton.jit(do_not_specialize=["B"])
def _stats_kernel(x_ptr, stride, temp_ptr, topk_ptr, topp_ptr, seed_ptr, off_ptr, stream_ptr,
                  pm_ptr, pz_ptr, pkmin_ptr, pkmax_ptr, pbest_ptr, ptok_ptr, cidx_ptr, cn_ptr, cdrop_ptr, B, V,
                  GREEDY: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                  NBP: tl.constexpr, CAND: tl.constexpr, BAND: tl.constexpr):
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
    count = tl.zeros([ROWS], dtype=tl.int32)  # candidates seen (CAND > 0)
    drop = tl.full([ROWS], -float("inf"), dtype=tl.float32)  # the largest x/T of those not kept
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = rmask[:, None] & (cols < V)[None, :]
        x = tl.load(row_ptr + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32)
        s = x / t_eff[:, None]
        m_new = tl.maximum(m, tl.max(s, 1))
        z = z * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        m = m_new
        if CAND > 0:  # in-order compaction of the logits within BAND of the running max
            band = mask & (s >= m_new[:, None] - BAND)
            pos = count[:, None] + tl.cumsum(band.to(tl.int32), 1) - 1
            keep = band & (pos < CAND)
            tl.store(cidx_ptr + (rows[:, None] * NBP + chunk) * CAND + pos, cols[None, :] + tl.zeros_like(pos),
                     mask=keep)
            drop = tl.maximum(drop, tl.max(tl.where(band & (pos >= CAND), s, -float("inf")), 1))
            count += tl.sum(band.to(tl.int32), 1)
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
    if CAND > 0:
        tl.store(cn_ptr + out, tl.minimum(count, CAND), mask=rmask)
        tl.store(cdrop_ptr + out, drop, mask=rmask)


@triton.jit(do_not_specialize=["B"])
def _cand_kernel(x_ptr, stride, temp_ptr, topk_ptr, topp_ptr, seed_ptr, off_ptr, stream_ptr,
                 pm_ptr, pz_ptr, pkmin_ptr, pkmax_ptr, cidx_ptr, cn_ptr, cdrop_ptr, cbeg_ptr, dense_ptr, didx_ptr,
                 fast_ptr, ftok_ptr, fz_ptr, B, V, NB,
                 GREEDY: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, NBP: tl.constexpr,
                 CAND: tl.constexpr, BAND: tl.constexpr, NC: tl.constexpr):
    """Top-k / top-p of the rows whose kept set lies within the candidates (fast[row] = 1: token
    ftok, kept mass fz), the others left to the rounds (fast[row] = 0). The candidates are first
    packed into a dense row (vocabulary order kept), so the searches cost O(candidates), not O(slots)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < B
    t_eff, top_k, top_p, use_k, use_p, _ = _row_params(rows, rmask, temp_ptr, topk_ptr, topp_ptr, V, GREEDY)
    filt = use_k | use_p
    m, z, kmin, kmax = _row_stats(pm_ptr, pz_ptr, pkmin_ptr, pkmax_ptr, rows, rmask, NB, NBP)
    c = tl.arange(0, NBP)
    cmask = rmask[:, None] & (c < NB)[None, :]
    per = rows[:, None] * NBP + c[None, :]
    drop = tl.max(tl.load(cdrop_ptr + per, mask=cmask, other=-float("inf")), 1)
    n_c = tl.where(filt[:, None], tl.load(cn_ptr + per, mask=cmask, other=0), 0)
    tl.store(cbeg_ptr + per, tl.cumsum(n_c, 1) - n_c, mask=cmask)  # where each chunk's candidates go
    total = tl.sum(n_c, 1)
    span = tl.max(total, 0)
    SLOTS = NB * CAND  # chunk-major: slot c * CAND + i is chunk c's i-th candidate
    dense = dense_ptr + rows.to(tl.int64)[:, None] * SLOTS
    didx = didx_ptr + rows.to(tl.int64)[:, None] * SLOTS
    tl.debug_barrier()  # the offsets stored above are read by other threads below
    # pack the candidates (x, or -inf outside BAND of the row max); count, mass and min key of the band
    n_band = tl.zeros([ROWS], dtype=tl.int32)
    mass = tl.zeros([ROWS], dtype=tl.float32)
    lo = tl.full([ROWS], _INT_MAX, dtype=tl.int32)
    for start in range(0, SLOTS, BLOCK):
        j = start + tl.arange(0, BLOCK)
        chunk = rows[:, None] * NBP + j[None, :] // CAND
        inside = rmask[:, None] & (j < SLOTS)[None, :]
        valid = inside & (j[None, :] % CAND < tl.load(cn_ptr + chunk, mask=inside, other=0)) & filt[:, None]
        pos = tl.load(cbeg_ptr + chunk, mask=valid, other=0) + j[None, :] % CAND
        idx = tl.load(cidx_ptr + rows[:, None] * (NBP * CAND) + j[None, :], mask=valid, other=0)
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride + idx, mask=valid, other=-float("inf")).to(tl.float32)
        band = valid & (x / t_eff[:, None] >= m[:, None] - BAND)
        x = tl.where(band, x, -float("inf"))
        tl.store(dense + pos, x, mask=valid)
        tl.store(didx + pos, idx, mask=valid)
        n_band += tl.sum(band.to(tl.int32), 1)
        mass += tl.sum(tl.where(band, tl.exp(x / t_eff[:, None] - m[:, None]), 0.0), 1)
        lo = tl.minimum(lo, tl.min(tl.where(band, float_key(x), _INT_MAX), 1))
    for start in range(0, span, BLOCK):  # rows with fewer candidates than the longest: -inf padding
        o = start + tl.arange(0, BLOCK)
        tl.store(dense + o[None, :], tl.full([ROWS, BLOCK], -float("inf"), dtype=tl.float32),
                 mask=rmask[:, None] & (o[None, :] >= total[:, None]) & (o < span)[None, :])
    tl.debug_barrier()
    complete = drop < m - BAND  # every logit within BAND of the max is a candidate
    ok_k = (use_k == 0) | (n_band >= top_k)
    zero_f = tl.zeros([ROWS], dtype=tl.float32)
    fast = filt & complete & ok_k & (n_band > 0)
    tau, zk = search_threshold(dense, rmask, span, t_eff, m, lo, kmax + 1, kmax, mass, top_k, zero_f,
                               use_k & fast, ROWS, BLOCK, NC)
    zk = tl.where(use_k, zk, z)  # top-p's total: the top-k mass, or the whole row's
    tau = tl.where(use_k, tau, lo)
    mass_p = tl.where(use_k, zk, mass)  # the band's mass (inside top-k when on)
    fast = fast & ((use_p == 0) | (mass_p >= top_p * zk))
    tau, zp = search_threshold(dense, rmask, span, t_eff, m, tau, kmax + 1, kmax, mass_p,
                               tl.full([ROWS], 1, dtype=tl.int32), top_p * zk, use_p & fast, ROWS, BLOCK, NC)
    zp = tl.where(use_p, zp, zk)
    # Gumbel-max over the kept candidates {key >= tau}, in vocabulary order (ties: lowest index)
    seed = tl.load(seed_ptr + rows, mask=rmask, other=0)
    off = tl.load(off_ptr + rows, mask=rmask, other=0)
    stream = tl.load(stream_ptr + rows, mask=rmask, other=0)
    best = tl.full([ROWS], -float("inf"), dtype=tl.float32)
    tok = tl.zeros([ROWS], dtype=tl.int32)
    for start in range(0, span, BLOCK):
        o = start + tl.arange(0, BLOCK)
        live = rmask[:, None] & (o[None, :] < total[:, None])
        x = tl.load(dense + o[None, :], mask=live, other=-float("inf"))
        kept = live & fast[:, None] & (x > -float("inf")) & (float_key(x) >= tau[:, None])
        idx = tl.load(didx + o[None, :], mask=kept, other=0)
        score = tl.where(kept, x / t_eff[:, None] + _gumbel_at(seed, off, stream, idx), -float("inf"))
        bs, bi = tl.max(score, 1, return_indices=True, return_indices_tie_break_left=True)
        win = bs > best
        best = tl.where(win, bs, best)
        tok = tl.where(win, tl.sum(tl.where(tl.arange(0, BLOCK)[None, :] == bi[:, None], idx, 0), 1), tok)
    tl.store(fast_ptr + rows, fast.to(tl.int32), mask=rmask)
    tl.store(ftok_ptr + rows, tok, mask=rmask)
    tl.store(fz_ptr + rows, zp, mask=rmask)


@triton.jit(do_not_specialize=["B", "it"])
def _round_kernel(x_ptr, stride, temp_ptr, topk_ptr, topp_ptr, pm_ptr, pz_ptr, pkmin_ptr, pkmax_ptr,
                  st_ptr, part_ptr, fast_ptr, B, V, NB, it,
                  PHASE: tl.constexpr, FIRST: tl.constexpr, GREEDY: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK: tl.constexpr, CHUNK: tl.constexpr, NBP: tl.constexpr, NC: tl.constexpr):
    """Search round `it`: narrow by round it - 1 (or start a phase), then count this chunk."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < B
    chunk = tl.program_id(1)
    t_eff, top_k, top_p, use_k, use_p, _ = _row_params(rows, rmask, temp_ptr, topk_ptr, topp_ptr, V, GREEDY)
    slow = tl.load(fast_ptr + rows, mask=rmask, other=1) == 0  # rows the candidates did not serve
    use_k = use_k & slow
    use_p = use_p & slow
    if tl.sum((use_k | use_p).to(tl.int32), 0) > 0:  # else every row here is served or not filtering
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


@triton.jit(do_not_specialize=["B", "it"])
def _kept_kernel(x_ptr, stride, temp_ptr, topk_ptr, topp_ptr, seed_ptr, off_ptr, stream_ptr,
                 st_ptr, part_ptr, fast_ptr, kbest_ptr, ktok_ptr, B, V, NB, it,
                 GREEDY: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                 NBP: tl.constexpr, NC: tl.constexpr):
    """The last narrowing (state saved for `finish`), then this chunk's Gumbel-max over the kept set."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < B
    chunk = tl.program_id(1)
    t_eff, _, top_p, use_k, use_p, _ = _row_params(rows, rmask, temp_ptr, topk_ptr, topp_ptr, V, GREEDY)
    slow = tl.load(fast_ptr + rows, mask=rmask, other=1) == 0
    use_k = use_k & slow
    use_p = use_p & slow
    filt = use_k | use_p
    if tl.sum(filt.to(tl.int32), 0) > 0:  # else every row here is served or not filtering
        prev_zk = tl.load(st_ptr + ((it + 1) % 2) * 5 * B + 4 * B + rows, mask=rmask, other=0)
        tau, hi, mbh, mass_lo, zk = _narrow(st_ptr, part_ptr, (it + 1) % 2, B, rows, rmask,
                                            tl.full([ROWS], 1, dtype=tl.int32),
                                            top_p * prev_zk.to(tl.float32, bitcast=True), use_p, NB, NBP, NC)
        if chunk == 0:
            _store_state(st_ptr, it % 2, B, rows, rmask, tau, hi, mbh, mass_lo, zk)
        best = tl.full([ROWS], -float("inf"), dtype=tl.float32)
        tok = tl.zeros([ROWS], dtype=tl.int32)
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


@triton.jit(do_not_specialize=["B", "it"])
def _finish_kernel(x_ptr, stride, temp_ptr, topk_ptr, topp_ptr, pm_ptr, pz_ptr, pkmin_ptr, pkmax_ptr,
                   pbest_ptr, ptok_ptr, st_ptr, kbest_ptr, ktok_ptr, fast_ptr, ftok_ptr, fz_ptr, tok_ptr, lp_ptr,
                   B, V, NB, it,
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
        fast = filt & (tl.load(fast_ptr + rows, mask=rmask, other=0) != 0)
        tok = tl.where(fast, tl.load(ftok_ptr + rows, mask=rmask, other=0), tok)
        z = tl.where(fast, tl.load(fz_ptr + rows, mask=rmask, other=1.0), z)
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
    return sample_split_rows(logits, temperature, top_k, top_p, seed, offset, check, filtered)[:2]


def sample_split_rows(logits, temperature, top_k=0, top_p=1.0, seed=0, offset=0, check: bool = True,
                      filtered: bool | None = None):
    """`sample_split`, plus [B] int32: 1 where the candidates alone served a filtering row (tests)."""
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
        return tokens, logprobs, torch.zeros(0, dtype=torch.int32, device=dev)
    rows, chunk, block, sblock = _launch_shape(n, vocab, logits.is_cuda)
    cand = (GPU_CAND if logits.is_cuda else CPU_CAND) if filtered else 0
    nb = triton.cdiv(vocab, chunk)
    nbp = triton.next_power_of_2(nb)
    grid = (triton.cdiv(n, rows), nb)
    # scratch: entries of rows a launch skips stay unwritten and are never used; the interpreter gets
    # zeros so that numpy never reduces garbage (NaN) floats
    alloc = torch.empty if logits.is_cuda else torch.zeros
    pm, pz, pbest, kbest, cdrop = alloc(5, n, nbp, dtype=torch.float32, device=dev)
    pkmin, pkmax, ptok, ktok, cn = alloc(5, n, nbp, dtype=torch.int32, device=dev)
    cidx = alloc(n, nbp, max(cand, 1), dtype=torch.int32, device=dev)
    warps = 4 if logits.is_cuda else 1
    common = dict(GREEDY=GREEDY_EPS, ROWS=rows, NBP=nbp)
    _stats_kernel[grid](logits, logits.stride(0), temp, k, p, seeds, offsets, streams, pm, pz, pkmin, pkmax,
                        pbest, ptok, cidx, cn, cdrop, n, vocab, BLOCK=block, CHUNK=chunk, CAND=cand, BAND=BAND,
                        num_warps=warps, **common)
    last = 2 * ROUNDS
    state = fast = pm  # placeholders (unused) when nothing filters
    if filtered:
        fast = alloc(n, dtype=torch.int32, device=dev)
        ftok = alloc(n, dtype=torch.int32, device=dev)
        fz = alloc(n, dtype=torch.float32, device=dev)
        dense = alloc(n, nb * cand, dtype=torch.float32, device=dev)  # packed candidates: x and index
        didx = alloc(n, nb * cand, dtype=torch.int32, device=dev)
        cbeg = alloc(n, nbp, dtype=torch.int32, device=dev)
        cap = GPU_CAND_BLOCK if logits.is_cuda else max(16, (1 << 18) // (rows * NC))  # interpreter: bounded tiles
        cblock = min(cap, triton.next_power_of_2(nb * cand))
        _cand_kernel[(grid[0],)](logits, logits.stride(0), temp, k, p, seeds, offsets, streams, pm, pz, pkmin,
                                 pkmax, cidx, cn, cdrop, cbeg, dense, didx, fast, ftok, fz, n, vocab, nb, BLOCK=cblock,
                                 CAND=cand, BAND=BAND, NC=NC, num_warps=8 if logits.is_cuda else 1, **common)
        state = alloc(2, 5, n, dtype=torch.int32, device=dev)  # lo, hi, mbh, mass_lo, zk; double-buffered
        part = alloc(2, 4, n, nbp, NC, dtype=torch.int32, device=dev)  # cnt, mass, minge, maxlt per chunk
        for it in range(last):
            _round_kernel[grid](logits, logits.stride(0), temp, k, p, pm, pz, pkmin, pkmax, state, part, fast, n,
                                vocab, nb, it, PHASE=it // ROUNDS, FIRST=it % ROUNDS == 0, BLOCK=sblock,
                                CHUNK=chunk, NC=NC, num_warps=warps, **common)
        _kept_kernel[grid](logits, logits.stride(0), temp, k, p, seeds, offsets, streams, state, part, fast, kbest,
                           ktok, n, vocab, nb, last, BLOCK=block, CHUNK=chunk, NC=NC, num_warps=warps, **common)
    else:
        ftok = fz = pm
    _finish_kernel[(grid[0],)](logits, logits.stride(0), temp, k, p, pm, pz, pkmin, pkmax, pbest, ptok,
                               state, kbest, ktok, fast, ftok, fz, tokens, logprobs, n, vocab, nb, last,
                               FILTERED=bool(filtered), num_warps=warps, **common)
    return tokens, logprobs, fast if filtered else torch.zeros(n, dtype=torch.int32, device=dev)
