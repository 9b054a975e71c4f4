"""Per-step metrics: one JSON object per line in run_dir/metrics.jsonl, a console line, and
TensorBoard scalars when `torch.utils.tensorboard` imports.

Each line is flushed and fsynced, so a crash loses at most the step being written (a torn
last line is skipped by `read_metrics`).
"""
from __future__ import annotations

import json
import math
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Iterable, TextIO

import numpy as np

REQUIRED_KEYS = ("step", "version", "reward_mean", "trajectories_accepted", "trajectories_filtered",
                 "trajectories_dropped", "max_staleness", "rollout_tokens_per_s", "train_tokens_per_s",
                 "weight_sync_s")


def staleness_histogram(oldest_versions: Iterable[int], trainer_version: int) -> dict[str, int]:
    """{"age": count} of trainer_version - oldest version, keys as strings for JSON."""
    ages = Counter(trainer_version - v for v in oldest_versions)
    return {str(a): ages[a] for a in sorted(ages)}


def token_staleness_histogram(trajectories: Iterable, trainer_version: int) -> dict[str, int]:
    """{"lag": count} over every completion token: trainer_version - the version that sampled it
    (one trajectory may mix versions when a weight update interrupts it)."""
    lags: Counter[int] = Counter()
    for t in trajectories:  # versions: a list or an array; counted per distinct version, not per token
        versions, counts = np.unique(np.asarray(t.versions, dtype=np.int64), return_counts=True)
        for v, n in zip(versions.tolist(), counts.tolist()):
            lags[trainer_version - v] += n
    return {str(a): lags[a] for a in sorted(lags)}


def equal_reward_share(before: dict, after: dict) -> float | None:
    """Share of the groups completed between two controller `counters()` readings that were filtered
    for equal rewards (in trajectories, so groups of any size weigh by their samples); None if none completed."""
    equal = after["filtered"].get("equal_rewards", 0) - before["filtered"].get("equal_rewards", 0)
    done = (after["accepted"] - before["accepted"]) + sum(after["filtered"].values()) - sum(before["filtered"].values())
    return equal / done if done > 0 else None


def _jsonable(value):
    """numpy/torch scalars -> Python numbers; NaN/inf -> None (strict JSON has neither)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalar, 0-d tensor
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All complete records of a metrics.jsonl (a torn last line from a crash is skipped)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def truncate_after(path: Path, step: int) -> None:
    """Keep only the records of `path` (a JSONL of {"step": ...}) up to `step`: on resume from that
    checkpoint, the steps after it are redone and must not be listed twice."""
    keep = [r for r in read_metrics(path) if r.get("step", -1) <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
    os.replace(tmp, path)


class MetricsWriter:
    """`log(record)` once per training step; `close()` at the end."""

    def __init__(self, run_dir: str | os.PathLike, console: TextIO | None = sys.stdout,
                 tensorboard: bool = True, resume_step: int | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            self._truncate_after(resume_step)
        self.file = open(self.path, "a")
        self.console = console
        self.tb = self._open_tensorboard() if tensorboard else None

    def _truncate_after(self, step: int) -> None:
        """On resume from checkpoint `step`, forget records of steps that will be redone."""
        truncate_after(self.path, step)

    def _open_tensorboard(self):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception:  # tensorboard is optional
            return None
        return SummaryWriter(str(self.run_dir / "tb"))

    def log(self, record: dict) -> None:
        """Validate, append one line (flush + fsync), print a console line, add TB scalars."""
        missing = [k for k in REQUIRED_KEYS if k not in record]
        if missing:
            raise ValueError(f"metrics record lacks required keys: {missing}")
        if not isinstance(record["step"], int) or record["step"] < 0:
            raise ValueError(f"metrics 'step' must be a non-negative int, got {record['step']!r}")
        record = _jsonable(record)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        if self.console is not None:
            print(format_line(record), file=self.console, flush=True)
        if self.tb is not None:
            self._log_tensorboard(record)

    def _log_tensorboard(self, record: dict) -> None:
        for key, value in record.items():
            items = value.items() if isinstance(value, dict) else [("", value)]
            for sub, v in items:
                if isinstance(v, (int, float)) and not isinstance(v, bool) and key != "step":
                    self.tb.add_scalar(f"{key}/{sub}" if sub else key, v, record["step"])

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def format_line(r: dict) -> str:
    """The one-line console summary of a record."""
    return (f"step {r['step']} v{r['version']} | reward {_num(r['reward_mean'], '.3f')}"
            f" | traj acc {r['trajectories_accepted']} filt {r['trajectories_filtered']}"
            f" drop {r['trajectories_dropped']} | stale<= {r['max_staleness']}"
            f" | rollout {_num(r['rollout_tokens_per_s'], '.0f')} tok/s"
            f" train {_num(r['train_tokens_per_s'], '.0f')} tok/s | sync {_num(r['weight_sync_s'], '.2f')} s")
