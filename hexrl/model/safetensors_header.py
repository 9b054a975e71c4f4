"""Safetensors files checked against their own headers before a run plans or starts.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
(`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`), then the
data, which the offsets index. A truncated file, or a header length of 10^15, is caught here,
naming the file and the tensor, instead of in a rank's memory map mid-load. Stdlib only.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from hexrl.input_files import InputFileError, loads_json, open_input, read_json

INDEX = "model.safetensors.index.json"
MAX_HEADER = 100_000_000  # the safetensors library's own limit on the header length
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def header_problems(file: Path) -> list[str]:
    """Why `file` is not a whole safetensors file: its header length, header JSON, and each
    tensor's dtype, shape and data extent against the file's size."""
    try:
        with open_input(file, "safetensors file") as f:  # a FIFO is refused, never waited on
            size = os.fstat(f.fileno()).st_size
            n = int.from_bytes(f.read(8), "little") if size >= 8 else -1
            if not 0 < n <= min(MAX_HEADER, size - 8):
                return [f"{file}: not a safetensors file: header length {n} for a file of {size} bytes"]
            header = loads_json(f.read(n), str(file), "safetensors header")
    except InputFileError as e:
        return [str(e)]
    except OSError as e:
        return [f"{file}: cannot read ({e.strerror or e})"]
    if not isinstance(header, dict):
        return [f"{file}: corrupt safetensors header (a {type(header).__name__}, not an object)"]
    data = size - 8 - n
    out = [p for name, t in header.items() if name != "__metadata__" for p in _tensor_problems(file, name, t, data)]
    return out[:5] + ([f"{file}: and {len(out) - 5} more problems"] if len(out) > 5 else [])


def _tensor_problems(file: Path, name: str, t, data: int) -> list[str]:
    where = f"{file}: tensor {name!r}"
    try:
        width, shape, (begin, end) = DTYPE_BYTES[t["dtype"]], t["shape"], t["data_offsets"]
        if not all(type(d) is int and d >= 0 for d in shape + [begin, end]):
            raise TypeError("negative or non-integer")
    except (KeyError, TypeError, ValueError) as e:
        return [f"{where}: malformed entry {str(t)[:120]} ({type(e).__name__}: {e})"]
    if end - begin != width * math.prod(shape):
        return [f"{where}: offsets [{begin}, {end}) hold {end - begin} bytes, dtype {t['dtype']} "
                f"shape {shape} needs {width * math.prod(shape)}"]
    if end > data:
        return [f"{where}: ends at data byte {end}, the file holds {data} (truncated?)"]
    return []


def weight_file_problems(model_dir: str | Path) -> list[str]:
    """Every problem of the model directory's safetensors files (those its index names, else all)."""
    model_dir = Path(model_dir)
    if (model_dir / INDEX).is_file():
        try:
            names = sorted(set(read_json(model_dir / INDEX, "safetensors index")["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return [f"{model_dir / INDEX}: corrupt index ({type(e).__name__}: {e})"]
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            return [f"{model_dir}: files named in {INDEX} are missing: {', '.join(missing)}"]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            return [f"{model_dir}: no *.safetensors files (and no {INDEX})"]
    return [p for f in files for p in header_problems(f)]
