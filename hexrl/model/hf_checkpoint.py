"""Hugging Face checkpoint I/O: `config.json` + `*.safetensors` (single file or sharded with an index).

Loading reads only the tensors (and, under tensor parallelism, only the slices) that this
rank's stage holds: safetensors memory-maps the files, so a rank never holds the whole model.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hexrl.input_files import open_input, read_json

from .config import ModelConfig, rope_inv_freq
from .decoder import Decoder
from .fused import hf_state_dict
from .parallel import TPGroup, shard_dim_of
from .safetensors_header import weight_file_problems

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message lists every problem found."""


def tensor_files(path: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file holding it."""
    if (path / INDEX).is_file():
        try:
            weight_map = read_json(path / INDEX, "safetensors index")["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path / INDEX}: corrupt index ({e})") from None
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise CheckpointError(f"{path}: shard files named in {INDEX} are missing: {', '.join(missing)}")
        return {name: path / f for name, f in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files (and no {INDEX})")
    names = {}
    for f in files:
        for name in _open(f).keys():
            names[name] = f
    return names


def _open(file: Path):
    try:
        open_input(file, "safetensors file").close()  # a FIFO is refused before the library blocks on it
        return safe_open(str(file), framework="pt")
    except Exception as e:  # safetensors raises several error types for truncated/garbled headers
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None


def _read(handle, name: str, module: torch.nn.Module | None, tp: TPGroup | None) -> torch.Tensor:
    """Read a tensor, or just this TP rank's slice of it along the module's `shard_dim`."""
    dim = shard_dim_of(module, name, tp)
    if dim is None:
        return handle.get_tensor(name)
    sl = handle.get_slice(name)
    n = sl.get_shape()[dim] // tp.size
    idx = [slice(None)] * len(sl.get_shape())
    idx[dim] = slice(tp.rank * n, (tp.rank + 1) * n)
    return sl[tuple(idx)]


def load_pretrained(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    layers: tuple[int, int] | None = None,
    tp: TPGroup | None = None,
    device: str | torch.device = "cpu",
    fused: bool = False,
) -> Decoder:
    """Load an HF Qwen2/Llama checkpoint (or its layers [i, j) / TP shard) into a `Decoder`; `fused=True`
    stacks q/k/v and gate/up (each TP rank its own shards) as the rollout engine runs them."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: checkpoint directory does not exist")
    cfg = ModelConfig.from_dir(path)
    if problems := weight_file_problems(path, cfg):  # the headers, and every shape against config.json, first
        raise CheckpointError(f"{path}: checkpoint is damaged or does not match config.json:\n  "
                              + "\n  ".join(problems))
    with torch.device("meta"):
        model = Decoder(cfg, layers=layers, tp=tp)
    files = tensor_files(path)
    modules = dict(model.named_modules())
    state, problems, handles = {}, [], {}
    for name, param in model.state_dict(keep_vars=True).items():
        source = name
        if name == "lm_head.weight" and cfg.tie_word_embeddings and name not in files:
            source = "model.embed_tokens.weight"
        if source not in files:
            problems.append(f"missing tensor {source}")
            continue
        handle = handles.setdefault(files[source], _open(files[source]))
        t = _read(handle, source, modules.get(name.rsplit(".", 1)[0]), tp)
        if tuple(t.shape) != tuple(param.shape):
            problems.append(f"{source}: shape {tuple(t.shape)} in the checkpoint, config expects {tuple(param.shape)}")
            continue
        state[name] = t.to(dtype=dtype).contiguous()  # a TP shard of columns is a strided view
    if problems:
        raise CheckpointError(f"{path}: checkpoint does not match config.json:\n  " + "\n  ".join(problems))
    model.load_state_dict(state, assign=True)
    if cfg.tie_word_embeddings and model.is_first and model.is_last:
        model.lm_head.weight = model.model.embed_tokens.weight  # assign=True broke the tie
    for mod in model.modules():  # buffers (RoPE frequencies) were created on meta
        if hasattr(mod, "inv_freq"):
            mod.inv_freq = rope_inv_freq(cfg)
    if fused:
        model.fuse()  # on the host, before the move: the device never holds both layouts
    return model.to(device)


def save_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig, path: str | os.PathLike,
                    max_shard_bytes: int = 4 << 30, extra_files: dict[str, str] | None = None) -> None:
    """Write a full (unsharded) state dict as an HF checkpoint directory, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    shards = _shard(state, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(tmp / SINGLE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        total = sum(t.numel() * t.element_size() for t in state.values())
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    hf = cfg.to_hf()
    hf["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(hf, indent=2))
    for fname, text in (extra_files or {}).items():
        (tmp / fname).write_text(text)
    _replace_dir(tmp, path)


def save_pretrained(model: Decoder, path: str | os.PathLike, max_shard_bytes: int = 4 << 30) -> None:
    """Save a whole (single-process) model so `transformers.AutoModelForCausalLM` can load it (HF names:
    a fused model's q/k/v and gate/up are written split)."""
    if not (model.is_first and model.is_last) or (model.tp and model.tp.size > 1):
        raise ValueError("save_pretrained needs the whole model; gather pipeline/TP shards first")
    save_state_dict(hf_state_dict(model), model.cfg, path, max_shard_bytes)


def _shard(state: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards, size = [{}], 0
    for k, v in state.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    return shards


def _replace_dir(tmp: Path, final: Path) -> None:
    """Swap a finished directory into place so readers never see a half-written checkpoint."""
    if final.exists():
        old = final.with_name(f".{final.name}.old")
        if old.exists():
            _rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        _rmtree(old)
    else:
        os.replace(tmp, final)


def _rmtree(p: Path) -> None:
    import shutil

    shutil.rmtree(p, ignore_errors=True)
