"""Exact weight deltas: which elements of a flat tensor changed since the last version, and their
new values, as one uint8 buffer.

    payload = bitmap (ceil(n / 64) * 8 bytes, bit i set: element i changed) + the changed values' raw bytes

(the bitmap is padded to 8 bytes so that the values behind it can be viewed in any dtype in place).

Elements are compared by their bits, not their values, so the receiver's copy equals the sender's bit
for bit (-0.0 against 0.0, or a NaN payload, counts as a change). For bf16 the bitmap is 1/16 of the
dense bytes, so a delta is smaller than the dense tensor while fewer than 15/16 of the elements changed;
the encode and decode time decide where it stops paying (tools/bench/bench_weight_sync.py).
"""
from __future__ import annotations

import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> integer view
_SHIFTS = torch.arange(8, dtype=torch.uint8)


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as an integer tensor of the same element size (compared exactly)."""
    return t.view(_BITS[t.element_size()])


def changed(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Bool mask of the elements whose bits differ between two flat tensors of one dtype."""
    return bits_of(new) != bits_of(old)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A flat bool mask as a bitmap, element i in bit i % 8 of byte i // 8."""
    n = mask.numel()
    padded = torch.zeros(_head(n) * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask
    return (padded.view(-1, 8) << _SHIFTS.to(mask.device)).sum(1, dtype=torch.uint8)


def unpack_bits(bitmap: torch.Tensor, n: int) -> torch.Tensor:
    """The bool mask of `n` elements that `pack_bits` packed."""
    return ((bitmap[:, None] >> _SHIFTS.to(bitmap.device)) & 1).view(-1)[:n].bool()


def _head(n: int) -> int:
    return (n + 63) // 64 * 8  # bitmap bytes, padded to 8


def delta_bytes(n: int, count: int, elem: int) -> int:
    """Size of a delta of `count` changed elements out of `n`, each `elem` bytes."""
    return _head(n) + count * elem


def encode(new: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The delta taking flat `old` to flat `new` (same dtype and length) and how many elements changed."""
    mask = changed(new, old)
    values = new[mask]
    return torch.cat([pack_bits(mask), values.view(torch.uint8)]), values.numel()


def apply(payload: torch.Tensor, out: torch.Tensor) -> None:
    """Write a delta's changed values into flat `out` (which holds the old version) in place."""
    n = out.numel()
    head = _head(n)
    mask = unpack_bits(payload[:head], n)
    out[mask] = payload[head:].view(out.dtype)
