"""The one numeric-range rule: every number hexrl reads from a file is finite and inside a sane,
declared range, checked before anything is allocated or enumerated from it.

Job and plan fields (hexrl.schema.fields.Reader.num), a model's config.json fields
(hexrl.model.config) and every hand-read list of numbers (prices, bandwidths, histogram edges)
go through `number_problem`. A field that declares no upper bound gets DEFAULT_MAX: a
million is beyond every count, size, time and price a job has, and a field that needs more
(a seed, a token count) says so. Stdlib only.
"""
from __future__ import annotations

import math

DEFAULT_MAX = 1_000_000
MAX_SEED = 2**63 - 1
MAX_RANKS = 1 << 16  # GPUs (ranks) of one job


def is_number(v, integer: bool = False) -> bool:
    """An int (or, unless `integer`, a float); never a bool."""
    if isinstance(v, bool):
        return False
    return isinstance(v, int) or (not integer and isinstance(v, float))


def number_problem(v, lo=None, hi=DEFAULT_MAX, *, integer: bool = False, lo_open: bool = False) -> str | None:
    """Why `v` is not a finite number (an integer if `integer`) in [lo, hi] ((lo, hi] with
    `lo_open`); None when it is. A float holding an integer counts as one."""
    if integer and isinstance(v, float) and math.isfinite(v) and v.is_integer():
        v = int(v)
    if not is_number(v, integer):
        return f"must be {'an integer' if integer else 'a number'}, got {v!r}"[:200]
    if isinstance(v, float) and not math.isfinite(v):
        return f"must be a finite number, got {v!r}"
    if lo is not None and (v <= lo if lo_open else v < lo):
        return f"must be {'>' if lo_open else '>='} {lo}, got {v}"
    if hi is not None and v > hi:
        return f"must be <= {hi:,}, got {v:,}" if isinstance(v, int) else f"must be <= {hi}, got {v}"
    return None


def numbers_problem(values, lo=None, hi=DEFAULT_MAX, *, integer: bool = False, lo_open: bool = False,
                    max_len: int = DEFAULT_MAX) -> str | None:
    """Why `values` is not a non-empty list of at most `max_len` numbers each in range (the first
    bad one named by index); None when it is."""
    if not isinstance(values, list) or not values:
        return f"must be a non-empty list of numbers, got {type(values).__name__}"
    if len(values) > max_len:
        return f"must hold at most {max_len:,} numbers, got {len(values):,}"
    for i, v in enumerate(values):
        if why := number_problem(v, lo, hi, integer=integer, lo_open=lo_open):
            return f"[{i}] {why}"
    return None
