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
    tensor's dtype, shape and data extent against the file's size and the other tensors'."""
    return read_header(file)[1]


def read_header(file: Path) -> tuple[dict[str, list[int]], list[str]]:
    """(tensor name -> shape, the problems of header_problems) of one safetensors file."""
    shapes: dict[str, list[int]] = {}
    return shapes, _read_header(file, shapes)


def _read_header(file: Path, shapes: dict) -> list[str]:
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
    tensors = {name: t for name, t in header.items() if name != "__metadata__"}
    out = [p for name, t in tensors.items() for p in _tensor_problems(file, name, t, data)]
    if not out:
        shapes.update({name: t["shape"] for name, t in tensors.items()})
        out = _overlaps(file, tensors)
    return out[:5] + ([f"{file}: and {len(out) - 5} more problems"] if len(out) > 5 else [])


def _overlaps(file: Path, tensors: dict) -> list[str]:
    """Tensors whose data extents share bytes (each must own its own: a header that maps two
    tensors onto one range, or one over another, describes no real checkpoint)."""
    spans = sorted((t["data_offsets"][0], t["data_offsets"][1], name) for name, t in tensors.items()
                   if t["data_offsets"][1] > t["data_offsets"][0])
    return [f"{file}: tensors {a!r} [{b0}, {b1}) and {b!r} [{c0}, {c1}) overlap"
            for (b0, b1, a), (c0, c1, b) in zip(spans, spans[1:]) if c0 < b1]


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


def weight_file_problems(model_dir: str | Path, config=None) -> list[str]:
    """Every problem of the model directory's safetensors files (those its index names, else all);
    with `config` (a ModelConfig), also every tensor whose shape it does not give, a missing one,
    and layers beyond its num_hidden_layers."""
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
    shapes, out = {}, []
    for f in files:
        found, problems = read_header(f)
        shapes.update(found)
        out += problems
    if out or config is None:
        return out
    return config.checkpoint_problems(shapes, str(model_dir))
