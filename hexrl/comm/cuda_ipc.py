"""A CUDA buffer shared between two processes on one GPU (CUDA IPC), its handle sent as msgpack.

torch.multiprocessing's `reduce_tensor` describes a CUDA tensor for another process as a rebuild
function and its arguments, meant for pickle. Unpickling bytes from a peer could run any code, so
only the plain values cross: the allocation's IPC handle, its ref-counter and event handles
(bytes), sizes, strides and offsets (integers) and the dtype (a name from a fixed list), as
msgpack. `import_handle` checks every field's type and calls torch's `rebuild_cuda_tensor`
with the tensor and storage classes fixed here, so nothing received chooses code to run. A
handle maps memory of the sending process's GPU allocation and means nothing on another machine;
the receiver maps it read-write, which is why only the job's own ranks, over a job group, send one.
"""
from __future__ import annotations

import msgpack
import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_INTS = ("offset", "device", "storage_size", "storage_offset", "ref_offset")
_BYTES = ("handle", "ref_handle")
_MAX, _MAX_DIMS = 1 << 62, 64  # no integer near int64's end, no view of more dimensions than torch's
FIELDS = frozenset((*_INTS, *_BYTES, "size", "stride", "dtype", "event_handle", "event_sync"))


def export_handle(t: torch.Tensor) -> bytes:
    """msgpack bytes that let another process on this GPU map `t` (kept alive by the caller)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not t.is_cuda or t.dtype not in DTYPES.values():
        raise ValueError(f"export_handle: a CUDA tensor of {', '.join(DTYPES)} only, got {t.dtype} on {t.device}")
    _, a = reduce_tensor(t)
    if len(a) != 15:  # the layout of torch 2.x's rebuild_cuda_tensor arguments, which import_handle calls
        raise RuntimeError(f"export_handle: torch {torch.__version__}'s reduce_tensor gives {len(a)} fields, not 15")
    name = next(k for k, v in DTYPES.items() if v == t.dtype)
    return encode({"size": list(a[1]), "stride": list(a[2]), "offset": a[3], "dtype": name, "device": a[6],
                   "handle": a[7], "storage_size": a[8], "storage_offset": a[9], "ref_handle": a[11],
                   "ref_offset": a[12], "event_handle": a[13], "event_sync": bool(a[14])})


def encode(fields: dict) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def decode(payload: bytes) -> dict:
    """The handle's fields, every one checked (types first, then that the view fits inside the
    storage it maps, before anything is mapped); ValueError naming what is wrong."""
    try:
        d = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises many types on garbage
        raise ValueError(f"CUDA IPC handle: not msgpack ({type(e).__name__})") from None
    if not isinstance(d, dict) or set(d) != FIELDS:
        got = sorted(d) if isinstance(d, dict) else type(d).__name__
        raise ValueError(f"CUDA IPC handle: fields must be {sorted(FIELDS)}, got {got}")
    bad = [k for k in _INTS if not _is_int(d[k]) or not 0 <= d[k] < _MAX]
    bad += [k for k in _BYTES if not isinstance(d[k], bytes) or not d[k]]
    bad += [k for k in ("size", "stride") if not isinstance(d[k], list) or len(d[k]) > _MAX_DIMS
            or not all(_is_int(v) and 0 <= v < _MAX for v in d[k])]
    if not isinstance(d["dtype"], str) or d["dtype"] not in DTYPES:  # a list or map is not hashable
        bad.append("dtype")
    if d["event_handle"] is not None and not isinstance(d["event_handle"], bytes):
        bad.append("event_handle")
    if not isinstance(d["event_sync"], bool):
        bad.append("event_sync")
    if not bad and len(d["size"]) != len(d["stride"]):
        bad.append("size/stride (lengths differ)")
    if not bad and (end := _end_bytes(d)) > d["storage_size"]:
        bad.append(f"size/stride/offset (the view ends at byte {end}, past storage_size {d['storage_size']})")
    if bad:
        raise ValueError(f"CUDA IPC handle: bad field(s) {', '.join(bad)}")
    return d


def _end_bytes(d: dict) -> int:
    """One past the last byte of the storage the view (size, stride, offset) touches."""
    if 0 in d["size"]:
        return 0
    last = d["offset"] + sum((n - 1) * s for n, s in zip(d["size"], d["stride"]))
    return (last + 1) * DTYPES[d["dtype"]].itemsize


def import_handle(payload: bytes) -> torch.Tensor:
    """The tensor another process on this GPU exported (`export_handle`), mapped into this one."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    d = decode(payload)
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(d["size"]), tuple(d["stride"]), d["offset"],
                               torch.storage.TypedStorage, DTYPES[d["dtype"]], d["device"], d["handle"],
                               d["storage_size"], d["storage_offset"], False, d["ref_handle"], d["ref_offset"],
                               d["event_handle"], d["event_sync"])


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
