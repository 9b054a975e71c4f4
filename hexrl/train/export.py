"""A training checkpoint as a Hugging Face model directory: TP shards joined, pipeline stages stacked.

    python -m hexrl.train.export RUN_DIR/checkpoints OUT_DIR   # the latest checkpoint (or name one step)

A checkpoint holds each (stage, TP rank)'s weights next to its optimizer state
(hexrl.train.checkpoint). The trainer also writes the model's config.json and tokenizer files into
the checkpoint root (`write_model_files`), so a checkpoint alone is enough to sample from:
`python -m hexrl.generate RUN_DIR` uses it when the run has no final/ yet.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from hexrl.data.tokenizer import tokenizer_files
from hexrl.model.checkpoint import CheckpointError, save_state_dict
from hexrl.model.config import ModelConfig
from hexrl.schema.layout import TrainerLayout

from .checkpoint import _read_json_file, resolve, shard_dims, stage_model


def write_model_files(root: str | os.PathLike, model_dir: str | os.PathLike) -> None:
    """Copy the model's config.json and tokenizer files into the checkpoint root `root`."""
    root, model_dir = Path(root), Path(model_dir)
    root.mkdir(parents=True, exist_ok=True)
    files = {"config.json": (model_dir / "config.json").read_text(encoding="utf-8"), **tokenizer_files(model_dir)}
    for name, text in files.items():
        tmp = root / f".{name}.tmp"  # readers never see half a file
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(root / name)


def stage_shard_dims(cfg: ModelConfig, layers: tuple[int, int], tp: int) -> dict[str, int | None]:
    """The dimension each parameter of a stage is TP-sharded along (None: replicated), read from the
    stage's own modules built on the meta device."""
    return shard_dims(stage_model(cfg, layers, tp))


def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    try:  # mmap: the optimizer state beside the weights is never read
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)["model"]
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (the checkpoint is incomplete)") from None
    except Exception as e:  # a torn file: RuntimeError, UnpicklingError, KeyError, ...
        raise CheckpointError(f"{path}: corrupt or truncated ({type(e).__name__}: {str(e)[:200]})") from None


def checkpoint_weights(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(model config, full state dict with HF names) of the training checkpoint at `path`: a
    checkpoint root (its `latest`) or one step directory."""
    step = resolve(path)
    if not (step.parent / "config.json").is_file():
        raise FileNotFoundError(f"{step.parent}: no config.json beside the checkpoints; put the model's config.json "
                                "and tokenizer files there (hexrl.main writes them into every run's checkpoints/)")
    cfg = ModelConfig.from_dir(step.parent)
    layout = TrainerLayout.from_dict(_read_json_file(step / "meta.json").get("layout"), cfg.num_hidden_layers)
    state = {}
    for s, stage in enumerate(layout.stages):
        dims = stage_shard_dims(cfg, stage.layers, stage.tp)
        shards = [_load_weights(step / f"model-s{s}-tp{t}.pt") for t in range(stage.tp)]
        for name, first in shards[0].items():
            dim = dims.get(name)
            state[name] = torch.cat([shard[name] for shard in shards], dim) if dim is not None else first
    return cfg, state


def export_checkpoint(path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the checkpoint at `path` as a complete HF model directory `out` (weights, config,
    tokenizer); returns `out`."""
    cfg, state = checkpoint_weights(path)
    save_state_dict(state, cfg, out, extra_files=tokenizer_files(resolve(path).parent))
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hexrl.train.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint root (RUN_DIR/checkpoints: its latest) or one step directory")
    p.add_argument("out", help="the HF model directory to write")
    args = p.parse_args(argv)
    try:
        print(f"wrote {export_checkpoint(args.checkpoint, args.out)} from {resolve(args.checkpoint)}")
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
