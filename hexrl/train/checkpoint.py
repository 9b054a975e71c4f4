"""Training checkpoints (every rank its shard, committed atomically) and Hugging Face export.

Layout on disk (a shared filesystem for multi-node runs):
    ROOT/step00000012/meta.json              version, layout, config (JSON, for people)
    ROOT/step00000012/extra.json             the caller's extra dict (JSON: data position, controller)
    ROOT/step00000012/model-s{S}-tp{T}.pt     weights + optimizer of (stage S, TP rank T), DP replica 0
    ROOT/step00000012/rng-s{S}-dp{D}-tp{T}.pt RNG states of every rank
    ROOT/latest                               name of the newest complete checkpoint, written last
Ranks write into ROOT/.tmp-step00000012; when every rank reports success the leader renames
it into place and only then rewrites `latest`. Every file and the directories holding them are
fsynced before the step that depends on them, and a directory name is never reused (re-saving
a version that is on disk commits `step00000012.1`, and only then deletes the older twin), so
a kill -9 at any point leaves `latest` naming a complete checkpoint; stale temp directories are
removed next time.
Every .pt file holds only tensors and plain containers, so loading uses `weights_only=True`.
A trainer of another layout of the same model (TP degrees, stages and their layers, DP) loads it
too: each rank cuts its slice from the files that hold it (`resharded`).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from hexrl import ranges
from hexrl.comm.weights import stage_specs
from hexrl.input_files import InputFileError, read_json
from hexrl.model.config import ModelConfig
from hexrl.model.decoder import Decoder
from hexrl.model.hf_checkpoint import CheckpointError
from hexrl.model.parallel import ColumnParallelLinear, RowParallelLinear, TPGroup, VocabParallelEmbedding
from hexrl.schema.layout import TrainerLayout

from .grid import Grid
from .optim import join_by_param, split_by_param

LATEST = "latest"


def shard_dims(model: torch.nn.Module) -> dict[str, int | None]:
    """For each parameter name: the dimension it is TP-sharded along, or None if replicated."""
    out = {}
    for mod_name, mod in model.named_modules():
        for p_name, _ in mod.named_parameters(recurse=False):
            dim = getattr(mod, "shard_dim", None)
            if isinstance(mod, RowParallelLinear) and p_name == "bias":
                dim = None  # the bias is added after the all-reduce: replicated
            if not isinstance(mod, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
                dim = None
            out[f"{mod_name}.{p_name}" if mod_name else p_name] = dim
    return out


def rng_state() -> dict:
    """Every generator's state as tensors and plain values (loadable with weights_only=True)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, mt, gauss_next = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)},
             "python": {"version": version, "mt": torch.tensor(mt, dtype=torch.int64), "gauss_next": gauss_next}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n, py = state["numpy"], state["python"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    random.setstate((py["version"], tuple(py["mt"].tolist()), py["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _write(obj, path: Path) -> None:
    """One file, flushed to disk (tests replace this to simulate a crash between files)."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _agree(ok: bool, grid: Grid, device) -> bool:
    """True on every rank iff `ok` on every trainer rank."""
    if grid.trainer_group is None:
        return ok
    t = torch.tensor([0 if ok else 1], device=device)
    dist.all_reduce(t, group=grid.trainer_group)
    return t.item() == 0


def save(root: str | os.PathLike, version: int, grid: Grid, shard: dict | None, meta: dict,
         extra: dict | None = None, device="cpu", keep: int = 2) -> Path:
    """Write this rank's `shard` (DP replica 0 only; None elsewhere) and RNG state, plus `meta`
    and `extra` (both JSON) from the leader; returns the committed directory (on the leader;
    a re-save commits under a new name, see the module doc). Collective over the
    trainer ranks. Keeps the newest `keep` checkpoints."""
    root = Path(root)
    name = f"step{version:08d}"
    tmp, final = root / f".tmp-{name}", root / name  # final: renamed if a re-save
    is_leader = grid.rank == grid.leader
    s, d, t = grid.coord

    def prepare():
        for old in root.glob(".tmp-step*"):  # left by a crashed save
            shutil.rmtree(old, ignore_errors=True)
        tmp.mkdir(parents=True)

    def write_shards():
        if shard is not None:
            _write(shard, tmp / f"model-s{s}-tp{t}.pt")
        _write(rng_state(), tmp / f"rng-s{s}-dp{d}-tp{t}.pt")

    def commit():
        nonlocal final
        _write_json(tmp / "extra.json", extra or {})
        _at_point("extra_written")
        _write_json(tmp / "meta.json", {"version": version, "layout": grid.layout.to_dict(), **meta}, indent=1)
        _fsync_dir(tmp)  # the other ranks fsynced their files; this makes the names durable
        _at_point("files_written")
        final = _free_name(root, name)  # never replace a directory `latest` may name
        os.replace(tmp, final)
        _fsync_dir(root)
        _at_point("renamed")
        _write_text_atomic(root / LATEST, final.name)
        _at_point("latest_written")
        _prune(root, final, keep)

    # Each phase: run it where it belongs, then agree, so a failure raises everywhere instead of hanging.
    for phase, mine in ((prepare, is_leader), (write_shards, True), (commit, is_leader)):
        error = None
        try:
            if mine:
                phase()
        except Exception as e:
            error = e
        if not _agree(error is None, grid, device):
            if is_leader and phase is not commit:
                shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"checkpoint {final} not written: {phase.__name__} failed on a rank") from error
    return final


def _at_point(name: str) -> None:
    """A named point of the commit; tests replace this to kill the writer there."""


def _fsync_dir(path: Path) -> None:
    """Make the entries of directory `path` (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj, indent: int | None = None) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(obj, indent=indent))
        f.flush()
        os.fsync(f.fileno())


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _version_key(p: Path) -> tuple[int, int]:
    """step00000012 -> (12, 0); step00000012.3 (a re-save) -> (12, 3); anything else sorts first."""
    base, _, rev = p.name.removeprefix("step").partition(".")
    return (int(base), int(rev or 0)) if base.isdigit() and (rev.isdigit() or not rev) else (-1, 0)


def _free_name(root: Path, name: str) -> Path:
    """ROOT/name, or ROOT/name.1, name.2, ... when a checkpoint of that version is already there."""
    final, rev = root / name, 0
    while final.exists():
        rev += 1
        final = root / f"{name}.{rev}"
    return final


def _prune(root: Path, final: Path, keep: int) -> None:
    """After `latest` names `final`: delete its older twins of the same version, and all but the
    newest `keep` checkpoints."""
    ckpts = sorted((p for p in root.glob("step*") if _version_key(p)[0] >= 0), key=_version_key)
    twins = [p for p in ckpts if p != final and _version_key(p)[0] == _version_key(final)[0]]
    rest = [p for p in ckpts if p not in twins]
    for old in twins + (rest[:-keep] if keep else []):
        if old != final:
            shutil.rmtree(old, ignore_errors=True)


def latest(root: Path) -> Path:
    """The step directory `root/latest` names (it may be gone); CheckpointError naming the file when
    it does not hold a step's name (not UTF-8, empty, a path)."""
    f = root / LATEST
    try:
        name = f.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{f}: not UTF-8; it holds the newest checkpoint's directory name, like step00000012"
                              ) from None
    if "/" in name or _version_key(Path(name))[0] < 0:
        raise CheckpointError(f"{f}: holds {name[:80]!r}, not a checkpoint's directory name like step00000012")
    return root / name


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint root (follows `latest`) or one checkpoint directory -> that directory."""
    path = Path(path)
    if (path / LATEST).is_file():
        named = latest(path)
        if not (named / "meta.json").is_file():
            raise FileNotFoundError(f"{path / LATEST}: names {named.name}, which is "
                                    + ("not a complete checkpoint (no meta.json)" if named.is_dir() else "missing")
                                    + ", and no other step here is complete")
        return named
    if not (path / "meta.json").is_file():
        raise FileNotFoundError(f"{path}: no complete checkpoint here (no meta.json, no '{LATEST}' pointer)")
    return path


def _read_json_file(path: Path) -> dict:
    """A JSON object from a checkpoint file; CheckpointError naming the file otherwise."""
    try:
        data = read_json(path, "checkpoint file")
    except InputFileError as e:  # unreadable, bad JSON (an empty file too), not UTF-8, too deep, NaN
        raise CheckpointError(f"{path}: corrupt, not a JSON object ({str(e).removeprefix(str(path) + ': ')[:100]})"
                              ) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: corrupt, holds a {type(data).__name__} instead of a JSON object")
    return data


def _torch_load(path: Path, **kw):
    try:
        return torch.load(path, weights_only=True, **kw)
    except Exception as e:  # torch raises RuntimeError, OSError, UnpicklingError, ... on a torn file
        raise CheckpointError(f"{path}: corrupt or truncated ({type(e).__name__}: {str(e)[:200]})") from None


MAX_RANKS = ranges.MAX_RANKS  # a saved layout with more trainer ranks is damaged (and would list billions of files)


def expected_files(layout) -> list[str]:
    """The shard and RNG files of a checkpoint saved with `layout` (its meta.json's "layout");
    ValueError when that is malformed."""
    try:
        dp, stages = int(layout["dp"]), [int(st["tp"]) for st in layout["stages"]]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"layout {str(layout)[:200]} is malformed ({type(e).__name__}: {e})") from None
    if dp < 1 or min(stages, default=1) < 1 or dp * sum(stages) > MAX_RANKS:  # a damaged file, not a job
        raise ValueError(f"layout dp={dp}, stage tp={stages[:8]} is malformed (1 to {MAX_RANKS} ranks expected)")
    return [f for s, tp in enumerate(stages) for t in range(tp)
            for f in [f"model-s{s}-tp{t}.pt"] + [f"rng-s{s}-dp{d}-tp{t}.pt" for d in range(dp)]]


def incomplete(path: Path) -> list[str]:
    """Why the checkpoint directory `path` is not whole: its JSON files, then every shard and RNG
    file its saved layout implies, each present and with a readable zip directory (a torn file
    loses it). Cheap: reads no tensor."""
    try:
        meta, _ = _read_json_file(path / "meta.json"), _read_json_file(path / "extra.json")
    except CheckpointError as e:
        return [str(e)]
    out = [f"{path / 'meta.json'}: corrupt, lacks {k!r}" for k in ("version", "layout") if k not in meta]
    try:
        names = expected_files(meta.get("layout")) if not out else []
    except ValueError as e:
        return out + [f"{path / 'meta.json'}: {e}"]
    missing = [n for n in names if not (path / n).is_file()]
    if missing:
        out.append(f"{path}: incomplete, lacks {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    for f in sorted({path / n for n in names if n not in missing} | set(path.glob("*.pt"))):
        try:
            with zipfile.ZipFile(f) as z:  # torch.save writes a zip; a torn file loses its directory
                z.infolist()
        except (OSError, zipfile.BadZipFile) as e:
            out.append(f"{f}: corrupt or truncated ({e})")
    return out


def resolve_complete(path: str | os.PathLike) -> tuple[Path, list[str]]:
    """(the checkpoint directory to resume from, notes). A root's `latest` names it, unless that
    step is incomplete: then the newest complete step in the root, with a note saying which was
    passed over and why. A step directory named directly is used as it is; so is `latest`'s when
    no step is complete (its problems are then the ones reported)."""
    path = Path(path)
    if not (path / LATEST).is_file():
        return resolve(path), []
    named = latest(path)
    steps = sorted((p for p in path.glob("step*") if p.is_dir() and _version_key(p)[0] >= 0),
                   key=_version_key, reverse=True)
    notes = []
    for step in [named] + [p for p in steps if p != named]:
        why = incomplete(step) if step.is_dir() else [f"{step}: missing"]
        if not why:
            return step, notes
        notes.append(f"{step.name} is incomplete ({'; '.join(why)[:300]})")
    return resolve(path), []


def problems(path: str | os.PathLike, layout: dict | None = None, config: ModelConfig | None = None) -> list[str]:
    """Why the checkpoint at `path` (a root or one checkpoint) cannot be resumed from, by a trainer
    with `layout` (a TrainerLayout.to_dict(), any layout of the saved model; None: any) of the model
    `config` (None: any; compared with the config.json the run wrote beside its checkpoints). Cheap
    (reads the JSON files and each .pt file's zip directory, not the tensors), so it runs before
    launch on every rank."""
    try:
        path, _ = resolve_complete(path)
    except (FileNotFoundError, CheckpointError) as e:
        return [str(e)]
    out = incomplete(path) or (_model_problems(path.parent, config) if config is not None else [])
    if not out and layout is not None:
        out += _layout_problems(path, layout, config)
    if not out and config is not None:
        out += shard_problems(path, _read_json_file(path / "meta.json")["layout"], config)
    return out


def _layout_problems(path: Path, layout: dict, config: ModelConfig | None) -> list[str]:
    """Why a trainer with `layout` cannot load the checkpoint `path`: its saved stages do not tile the
    layers of this job's model (another model). Any other layout is resharded on load."""
    have = _read_json_file(path / "meta.json")["layout"]
    layers = config.num_hidden_layers if config is not None else layout["stages"][-1]["layers"][1]
    try:
        TrainerLayout.from_dict(have, layers)
    except ValueError as e:
        why = str(e).splitlines()[-1].strip()
        return [f"{path}: saved with stages {have.get('stages')}, which do not fit this job's model of {layers} "
                f"layers ({why}); a checkpoint of another model (TP, PP and DP may differ, the model may not)"]
    return []


def shard_problems(step: Path, layout: dict, config: ModelConfig) -> list[str]:
    """Why the weights in checkpoint `step` (saved with `layout`) are not the model `config`: each stage's
    first shard against the shapes that stage of this model has, read through mmap (no tensor data),
    so another model's checkpoint is named before launch even where no config.json sits beside it."""
    try:
        stages = TrainerLayout.from_dict(layout, config.num_hidden_layers).stages
    except ValueError as e:
        return [f"{step / 'meta.json'}: its layout does not fit this job's model ({str(e)[:200]})"]
    for s, stage in enumerate(stages):
        f = step / f"model-s{s}-tp0.pt"
        try:
            shard = _torch_load(f, map_location="cpu", mmap=True)
            model = shard.get("model") if isinstance(shard, dict) else None
            if not isinstance(model, dict):
                raise CheckpointError(f"{f}: holds no model weights")
            check_shapes(model, meta_stage(config, stage.layers, stage.tp).state_dict(), str(f))
        except CheckpointError as e:
            return [str(e)]
    return []


SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias")


def _model_problems(root: Path, config: ModelConfig) -> list[str]:
    """Why the checkpoints under `root` hold another model than `config`: every shape field of
    the config.json the run wrote there that differs."""
    if not (root / "config.json").exists():
        return []  # written by every run since checkpoints had one; the load checks the shapes anyway
    try:
        saved = ModelConfig.from_dir(root)
    except ValueError as e:
        return [str(e)]
    diff = [f"{k} {getattr(saved, k)} (this job: {getattr(config, k)})" for k in SHAPE_FIELDS
            if getattr(saved, k) != getattr(config, k)]
    return [f"{root}: checkpoints of another model: " + ", ".join(diff)] if diff else []


def check_shapes(state: dict, want: dict, where: str) -> None:
    """CheckpointError naming every tensor of a loaded shard `state` that is missing or whose shape
    is not the one this trainer's model has (`want`: its state_dict)."""
    bad = [f"{k}: shape {list(state[k].shape)}, the model has {list(v.shape)}" if k in state else f"{k}: missing"
           for k, v in want.items() if k not in state or tuple(state[k].shape) != tuple(v.shape)]
    if bad:
        raise CheckpointError(f"{where}: does not match this job's model ({len(bad)} tensors): " + "; ".join(bad[:5]))


def load(path: str | os.PathLike, grid: Grid, model: torch.nn.Module | None = None
         ) -> tuple[dict, dict | None, dict, dict]:
    """(shard of this (stage, tp) slot on the CPU, this rank's RNG state or None, meta, extra) of the
    checkpoint at `path` (a root: its newest complete step, see resolve_complete). Saved with the same
    stages (any DP degree), the shard is the slot's own file; saved with other stages or TP degrees,
    it is resharded from the saved files (see `resharded`), which needs this rank's `model`."""
    path, _ = resolve_complete(path)
    meta = _read_json_file(path / "meta.json")
    have, (s, _, t) = meta.get("layout"), grid.coord
    if isinstance(have, dict) and _cuts(have) == _cuts(grid.layout.to_dict()):
        # to host memory, then the caller copies into its tensors: loading onto the GPU would need room
        # for a second copy of weights and optimizer state
        shard = _torch_load(path / f"model-s{s}-tp{t}.pt", map_location="cpu")
    elif isinstance(have, dict) and model is not None:
        try:
            shard = resharded(path, TrainerLayout.from_dict(have, model.cfg.num_hidden_layers), grid, model)
        except CheckpointError:
            raise
        except (ValueError, KeyError, IndexError, RuntimeError) as e:  # a layout or file of another model
            raise CheckpointError(f"{path}: cannot be resharded into this trainer's model "
                                  f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None
    else:
        raise ValueError(f"{path}: saved with stages {have and have.get('stages')}, this trainer has "
                         f"{grid.layout.to_dict()['stages']}; resharding needs the trainer's model")
    return shard, _rng_for(path, grid), meta, _read_json_file(path / "extra.json")


def _cuts(layout: dict) -> list:
    """How a layout (its to_dict()) cuts the model into (stage, TP) shards: each stage's TP degree and
    layers (its GPU type and the DP degree do not change a shard)."""
    return [(st.get("tp"), st.get("layers")) for st in layout.get("stages") or [] if isinstance(st, dict)]


def _rng_for(path: Path, grid: Grid) -> dict | None:
    """This rank's RNG state: the file of its own (stage, dp, tp) slot when the saved layout had one,
    else the saved leader's (so a rank new to the layout starts from a saved state, not its own)."""
    s, d, t = grid.coord
    for f in (path / f"rng-s{s}-dp{d}-tp{t}.pt", path / "rng-s0-dp0-tp0.pt"):
        if f.is_file():
            return _torch_load(f)
    return None


# ------------------------------------------------------------------ loading into another layout


def meta_stage(cfg: ModelConfig, layers: tuple[int, int], tp: int) -> Decoder:
    """A stage of `cfg` (layers [start, end), TP degree `tp`) on the meta device: its parameter names,
    order and shard dims without any memory."""
    with torch.device("meta"):
        return Decoder(cfg, layers=layers, tp=TPGroup(None, 0, tp) if tp > 1 else None)


def _tp_sources(t: int, n: int, m: int) -> range:
    """The TP ranks of a TP-`m` stage whose slices overlap TP rank `t` of `n`'s slice (the first one
    also holds what is replicated)."""
    return range(t * m // n, ((t + 1) * m - 1) // n + 1)


def _stage_of(name: str, saved: TrainerLayout) -> int:
    """The saved stage holding parameter `name`: a layer's by its index, the embedding the first,
    the final norm and lm_head the last."""
    if name.startswith("model.layers."):
        i = int(name.split(".")[2])
        return next(s for s, st in enumerate(saved.stages) if st.layers[0] <= i < st.layers[1])
    return 0 if name.startswith("model.embed_tokens.") else saved.pp - 1


def saved_files(saved: TrainerLayout, model: torch.nn.Module, tp_rank: int, tp: int) -> list[str]:
    """The model files of a checkpoint saved with layout `saved` that TP rank `tp_rank` (of `tp`) of
    the stage `model` reads to reshard: the saved stages holding its parameters, and of each only the
    TP ranks whose slices overlap its own."""
    stages = sorted({_stage_of(name, saved) for name in model.state_dict()})
    return [f"model-s{s}-tp{r}.pt" for s in stages for r in _tp_sources(tp_rank, tp, saved.stages[s].tp)]


@dataclass
class _SavedStage:
    """One stage of a checkpoint's saved layout; each TP shard file is read (memory-mapped, so only
    the pages of the slices taken) when first needed."""

    path: Path
    index: int
    tp: int
    params: list[tuple[str, int]]  # (name, dimensions) of each parameter in the saved optimizer's order
    dims: dict[str, int | None]  # the saved shard dims (all None at TP 1)
    files: dict = field(default_factory=dict)

    @classmethod
    def of(cls, path: Path, saved: TrainerLayout, index: int, cfg: ModelConfig) -> "_SavedStage":
        st = saved.stages[index]
        stage = meta_stage(cfg, st.layers, st.tp)
        return cls(path, index, st.tp, [(n, p.dim()) for n, p in stage.named_parameters()], shard_dims(stage))

    def file(self, r: int) -> dict:
        """TP rank r's file, its optimizer state split by parameter name under "params"."""
        if r not in self.files:
            raw = _torch_load(self.path / f"model-s{self.index}-tp{r}.pt", map_location="cpu", mmap=True)
            names, ndims = zip(*self.params)
            raw["params"] = dict(zip(names, split_by_param(raw["optim"], list(ndims))))
            self.files[r] = raw
        return self.files[r]

    def tensor(self, r: int, kind: str, name: str) -> torch.Tensor:
        """Kind "model" (the weight), or an optimizer kind (exp_avg, exp_avg_sq, step, master), of
        parameter `name` in TP rank r's file."""
        raw = self.file(r)
        if name not in raw["params"]:  # a tied lm_head where the saved stage also held the embedding
            name = "model.embed_tokens.weight"
        return raw["model"][name] if kind == "model" else raw["params"][name][kind]


def _reslice(saved: _SavedStage, kind: str, name: str, t: int, n: int, dim: int | None) -> torch.Tensor:
    """TP rank t of n's slice of `name` (sharded along `dim` in this layout, None: replicated), joined
    from the overlapping slices of the saved stage's TP ranks."""
    ranks = _tp_sources(t, n, saved.tp)
    first = saved.tensor(ranks[0], kind, name)
    dim = saved.dims.get(name, dim) if saved.tp > 1 else dim
    if dim is None or first.dim() == 0:  # replicated, or the step count
        return first.clone()
    width = first.shape[dim]  # of a saved slice
    size = width * saved.tp // n  # of this rank's, which starts at t * size in the whole tensor
    parts = []
    for r in ranks:  # the overlap of each saved slice, so only those bytes are read from the mapped file
        lo, hi = max(t * size, r * width), min((t + 1) * size, (r + 1) * width)
        parts.append(saved.tensor(r, kind, name).narrow(dim, lo - r * width, hi - lo))
    return torch.cat(parts, dim)  # a copy: nothing aliases the mapped file


def resharded(path: Path, saved: TrainerLayout, grid: Grid, model: torch.nn.Module) -> dict:
    """This rank's shard, as save() writes it ({"model", "optim"}), of the checkpoint `path` saved with
    layout `saved`: every weight, AdamW moment, step count and master weight of its parameters is cut
    from the saved (stage, TP) files that hold it (`saved_files`): joined along its shard dim when
    the saved TP degree is higher, sliced when lower; layers found by their index. Any saved DP
    degree: replica 0's files."""
    t, n = grid.tp_rank, grid.tp_size
    stages = {s: _SavedStage.of(path, saved, s, model.cfg) for s in range(saved.pp)}
    dims = shard_dims(model)

    def get(kind, name):
        return _reslice(stages[_stage_of(name, saved)], kind, name, t, n, dims.get(name))

    weights = {name: get("model", name) for name in model.state_dict()}
    check_shapes(weights, model.state_dict(), str(path))
    params = [(name, p.dim()) for name, p in model.named_parameters()]
    source = stages[_stage_of(params[0][0], saved)]
    raw = source.file(_tp_sources(t, n, source.tp)[0])
    kinds = list(raw["params"][params[0][0]])  # the optimizer kinds saved (none before the first step)
    per_param = [{k: get(k, name) for k in kinds} for name, _ in params]
    optim = join_by_param(per_param, [d for _, d in params], raw["optim"]["opt"]["param_groups"],
                          raw["optim"]["steps"])
    return {"model": weights, "optim": optim}


def gather_stage(model: torch.nn.Module, grid: Grid, dtype: torch.dtype | None = None) -> dict | None:
    """Full (TP-gathered) weights of this stage on its (dp 0, tp 0) rank; None elsewhere.
    Collective over the TP group of DP replica 0; other replicas return at once."""
    if grid.dp_rank != 0:
        return None
    dims, out = shard_dims(model), {}
    for name, p in model.state_dict().items():
        p = full_param(p, dims.get(name), grid, dtype)
        if grid.tp_rank == 0:
            out[name] = p.to("cpu", copy=True)  # a snapshot, never an alias of live weights
    return out if grid.tp_rank == 0 else None


def full_param(p: torch.Tensor, dim: int | None, grid: Grid, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The full tensor of this rank's shard `p` (sharded along `dim`, or None) on p's device, in
    `dtype`. Collective over the TP group when sharded; every TP rank gets it."""
    p = p.detach() if dtype is None else p.detach().to(dtype)
    if grid.tp is not None and dim is not None:
        parts = [torch.empty_like(p) for _ in range(grid.tp.size)]
        dist.all_gather(parts, p.contiguous(), group=grid.tp.group)
        p = torch.cat(parts, dim=dim)
    return p


def gather_model(model: torch.nn.Module, grid: Grid, dtype: torch.dtype | None = None) -> dict | None:
    """The whole model's state dict (on the CPU) on the leader rank; None elsewhere. Collective over
    DP replica 0. Later stages stream one tensor at a time, device to device, over the trainer
    group, in the order `stage_specs` gives both sides (raw tensors, no pickled objects)."""
    if grid.dp_rank != 0:
        return None
    if grid.stage != 0:
        params, dims = dict(model.named_parameters()), shard_dims(model)
        for spec in stage_specs(model.cfg, grid.layers):
            t = full_param(params[spec.name], dims[spec.name], grid, dtype)
            if grid.tp_rank == 0:
                dist.send(t.contiguous(), dst=grid.leader, group=grid.trainer_group)
        return None
    full = gather_stage(model, grid, dtype)
    if full is None:
        return None
    like = next(model.parameters())
    for s in range(1, grid.layout.pp):
        for spec in stage_specs(model.cfg, grid.layout.stages[s].layers):
            buf = torch.empty(spec.shape, dtype=dtype or like.dtype, device=like.device)
            dist.recv(buf, src=grid.layout.rank(s, 0, 0), group=grid.trainer_group)
            full[spec.name] = buf.cpu()
    return full
