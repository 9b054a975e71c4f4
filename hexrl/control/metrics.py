"""Per-step metrics: one JSON object per line in run_dir/metrics.jsonl, a console line, and
TensorBoard scalars when `torch.utils.tensorboard` imports; and each trained sample's problem, group
and generated length in run_dir/lengths.jsonl (one line per step, kept out of metrics.jsonl's rows).
An event (a re-planning decision) is a line of its own in metrics.jsonl, told apart from a step row
by its "event" key: `read_metrics` gives the step rows, `read_events` the events.

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

REQUIRED_KEYS = ("step", "version", "reward_mean", "trajectories_accepted", "trajectories_filtered",
                 "trajectories_dropped", "max_staleness", "rollout_tokens_per_s", "train_tokens_per_s",
                 "weight_sync_s")
LENGTHS_FILE = "lengths.jsonl"  # per step: each trained sample's problem id, group id and generated length


def staleness_histogram(oldest_versions: Iterable[int], trainer_version: int) -> dict[str, int]:
    """{"age": count} of trainer_version - oldest version, keys as strings for JSON."""
    ages = Counter(trainer_version - v for v in oldest_versions)
    return {str(a): ages[a] for a in sorted(ages)}


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


def length_stats(lengths: list[int]) -> dict:
    """A step's generated tokens per sample: mean, median, 90th percentile and longest (nearest rank)."""
    s = sorted(lengths)
    if not s:
        return {"output_len_mean": None, "output_len_p50": None, "output_len_p90": None, "output_len_max": None}
    rank = lambda q: s[max(0, math.ceil(q * len(s)) - 1)]  # noqa: E731
    return {"output_len_mean": sum(s) / len(s), "output_len_p50": rank(0.5), "output_len_p90": rank(0.9),
            "output_len_max": s[-1]}


def replica_rates(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """{replica id: tokens generated per second} between two readings of the controller's per-replica
    token counts (`counters()["replica_tokens"]`) `seconds` apart."""
    return {str(r): (n - before.get(r, 0)) / max(seconds, 1e-9) for r, n in sorted(after.items())}


def read_records(path: str | os.PathLike) -> list[dict]:
    """All complete records of a JSONL file: a line that is not a JSON object (a torn last line from a
    crash, an edit, bytes that are not UTF-8, nesting deeper than the parser goes) is skipped."""
    records = []
    for line in Path(path).read_bytes().decode(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The step rows of a metrics.jsonl (or every record of another JSONL file, none of which is an event)."""
    return [r for r in read_records(path) if "event" not in r]


def read_events(path: str | os.PathLike, kind: str) -> list[dict]:
    """The events of one kind in a metrics.jsonl (e.g. "replan": every re-planning decision)."""
    return [r for r in read_records(path) if r.get("event") == kind]


def truncate_after(path: Path, step: int) -> None:
    """Keep only the records of `path` (a JSONL of {"step": ...}) up to `step`: on resume from that
    checkpoint, the steps after it are redone and must not be listed twice."""
    keep = [r for r in read_records(path) if r.get("step", -1) <= step]
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
        self.lengths_path = self.run_dir / LENGTHS_FILE
        if resume_step is not None:
            for path in (self.path, self.lengths_path):
                if path.exists():
                    truncate_after(path, resume_step)
        self.file = open(self.path, "a")
        self.lengths_file = open(self.lengths_path, "a")
        self.console = console
        self.tb = self._open_tensorboard() if tensorboard else None

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
        _append(self.file, record)
        if self.console is not None:
            print(format_line(record), file=self.console, flush=True)
        if self.tb is not None:
            self._log_tensorboard(record)

    def log_event(self, record: dict) -> None:
        """Append one event line (a dict with "event" and "step": the step boundary it was taken at)."""
        if not isinstance(record.get("event"), str) or not isinstance(record.get("step"), int):
            raise ValueError(f"an event record needs an 'event' name and an int 'step', got {sorted(record)}")
        _append(self.file, _jsonable(record))

    def log_lengths(self, step: int, problem_ids: list, group_ids: list[int], lengths: list[int]) -> None:
        """Append one line to lengths.jsonl: the step's trained samples, in batch order (flush + fsync)."""
        if not len(problem_ids) == len(group_ids) == len(lengths):
            raise ValueError(f"lengths row of step {step}: {len(problem_ids)} problem ids, {len(group_ids)} "
                             f"group ids and {len(lengths)} lengths (one each per sample)")
        _append(self.lengths_file, _jsonable({"step": step, "problem_ids": problem_ids, "group_ids": group_ids,
                                              "lengths": lengths}))

    def _log_tensorboard(self, record: dict) -> None:
        for key, value in record.items():
            items = value.items() if isinstance(value, dict) else [("", value)]
            for sub, v in items:
                if isinstance(v, (int, float)) and not isinstance(v, bool) and key != "step":
                    self.tb.add_scalar(f"{key}/{sub}" if sub else key, v, record["step"])

    def close(self) -> None:
        self.file.close()
        self.lengths_file.close()
        if self.tb is not None:
            self.tb.close()


def _append(file: TextIO, record: dict) -> None:
    """One JSON line, flushed and fsynced: a crash tears at most this line."""
    file.write(json.dumps(record) + "\n")
    file.flush()
    os.fsync(file.fileno())


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def format_line(r: dict) -> str:
    """The one-line console summary of a record."""
    return (f"step {r['step']} v{r['version']} | reward {_num(r['reward_mean'], '.3f')}"
            f" | traj acc {r['trajectories_accepted']} filt {r['trajectories_filtered']}"
            f" drop {r['trajectories_dropped']} | stale<= {r['max_staleness']}"
            f" | rollout {_num(r['rollout_tokens_per_s'], '.0f')} tok/s"
            f" train {_num(r['train_tokens_per_s'], '.0f')} tok/s | sync {_num(r['weight_sync_s'], '.2f')} s")
