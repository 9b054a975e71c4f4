"""Triton helpers both sampling kernels use (`kernels/sampling.py`, one program per row, and
`kernels/sampling_split.py`, a row split across programs): the order-preserving float key, the
Philox Gumbel noise and the NC-ary threshold search. Semantics: `kernels/reference.py`."""

import triton
import triton.language as tl

INT_MAX = tl.constexpr(2147483647)  # jit code may only read constexpr globals
INT_MIN = tl.constexpr(-2147483648)


@triton.jit
def float_key(x):
    """Order-preserving int32 key of float32 x; +0.0 and -0.0 share a key (they compare equal)."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(x == 0.0, 0, key)


@triton.jit
def gumbel_block(seed, off, stream, start, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """[ROWS, BLOCK] Gumbel noise for vocab columns start..start+BLOCK (start % 4 == 0)."""
    zero = tl.zeros([ROWS, BLOCK // 4], dtype=tl.uint32)
    col = (start // 4 + tl.arange(0, BLOCK // 4)).to(tl.uint32)
    c0 = zero + col[None, :]
    c1 = zero + (off & 0xFFFFFFFF).to(tl.uint32)[:, None]
    c2 = zero + (stream & 0xFFFFFFFF).to(tl.uint32)[:, None]
    c3 = zero + ((off >> 32) & 0xFFFFFFFF).to(tl.uint32)[:, None]
    r0, r1, r2, r3 = tl.philox(seed[:, None], c0, c1, c2, c3)
    # column 4n + q takes output q of counter n
    r = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [ROWS, BLOCK])
    u = ((r >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # in (0, 1), never 0 or 1
    return -tl.log(-tl.log(u))


@triton.jit
def search_threshold(row_ptr, rmask, V, t_eff, m, lo, hi, mbh, mass_lo, need_cnt, need_mass, active,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr, NC: tl.constexpr):
    """Per row, the largest element key t with count(key >= t) >= need_cnt and
    mass(key >= t) >= need_mass (mass = sum exp(x/T - m)); returns (t, mass(key >= t)).

    Invariants: lo is an element key satisfying the predicate, hi > lo fails it, mbh is the
    largest element key below hi; the row is done when mbh == lo.
    """
    j = tl.arange(0, NC)
    done = (active == 0) | (mbh == lo)
    it = 0
    while (tl.sum(tl.where(done, 0, 1), 0) > 0) & (it < 40):
        width = hi.to(tl.int64) - lo.to(tl.int64)  # may exceed int32
        cand = (lo.to(tl.int64)[:, None] + (width[:, None] * j[None, :]) // NC).to(tl.int32)
        cnt = tl.zeros([ROWS, NC], dtype=tl.int32)
        mass = tl.zeros([ROWS, NC], dtype=tl.float32)
        minge = tl.full([ROWS, NC], INT_MAX, dtype=tl.int32)
        maxlt = tl.full([ROWS, NC], INT_MIN, dtype=tl.int32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = rmask[:, None] & (cols < V)[None, :]
            x = tl.load(row_ptr + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32)
            e = tl.exp(x / t_eff[:, None] - m[:, None])
            key = tl.where(mask, float_key(x), INT_MIN)  # padding is below every candidate
            key3 = key[:, :, None]
            ge = key3 >= cand[:, None, :]
            cnt += tl.sum(ge.to(tl.int32), 1)
            mass += tl.sum(tl.where(ge, e[:, :, None], 0.0), 1)
            minge = tl.minimum(minge, tl.min(tl.where(ge, key3, INT_MAX), 1))
            maxlt = tl.maximum(maxlt, tl.max(tl.where(ge, INT_MIN, key3), 1))
        ok = (cnt >= need_cnt[:, None]) & (mass >= need_mass[:, None])
        ok = ok | (cand == lo[:, None])  # lo satisfies the predicate by construction
        jstar = tl.sum(ok.to(tl.int32), 1) - 1
        sel = j[None, :] == jstar[:, None]
        nxt = j[None, :] == jstar[:, None] + 1
        upd = done == 0
        narrow = upd & (jstar < NC - 1)
        lo = tl.where(upd, tl.sum(tl.where(sel, minge, 0), 1), lo)
        mass_lo = tl.where(upd, tl.sum(tl.where(sel, mass, 0.0), 1), mass_lo)
        hi = tl.where(narrow, tl.sum(tl.where(nxt, cand, 0), 1), hi)
        mbh = tl.where(narrow, tl.sum(tl.where(nxt, maxlt, 0), 1), mbh)
        done = done | (mbh == lo)
        it += 1
    return lo, mass_lo
