"""Checks of a run's input files before any process group exists.

Every rank runs them right after reading the plan (they are deterministic, so every rank
reaches the same verdict and exits 2 together). Each problem names its file and what is wrong
with it: the tokenizer, the dataset (every prompt is tokenized here; prompts the tokenizer or
the model cannot take are skipped and counted, a dataset with none left is refused), the job
environment's stop strings (the tokenizer must be able to write them), the model's safetensors
files (headers and extents against the file sizes) and the checkpoint given to --resume (every
file its layout implies; an incomplete newest step falls back to the previous complete one,
saying so).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hexrl.data.datasets import dataset_problems, load_dataset
from hexrl.data.prompts import Prompts, run_prompts
from hexrl.data.tokenizer import load_tokenizer
from hexrl.envs import environment_class, stop_string_problems
from hexrl.model.safetensors_header import weight_file_problems

if TYPE_CHECKING:
    from hexrl.schema.job import Job


@dataclass
class Inputs:
    """What the checks found: every problem, notes to print (a resume that falls back to an older
    step), and the usable prompts (None without a model path, or when a check failed before
    tokenizing)."""

    problems: list[str] = field(default_factory=list)
    train: Prompts | None = None
    heldout: Prompts | None = None
    notes: list[str] = field(default_factory=list)


def _dataset_problems(job: Job, where: str) -> list[str]:
    """Why the job's dataset gives no training problems (read without a tokenizer)."""
    try:
        train, _ = load_dataset(job.data.synthetic, job.data.path, job.data.kind, job.data.reasoning_gym)
    except (OSError, ValueError, TypeError) as e:
        return [f"{where}: {e}"]
    return [] if train else [f"{where}: holds no training problems"]


def check_inputs(job: Job, resume: str | None = None, layout: dict | None = None) -> Inputs:
    """Every reason the run's inputs cannot be used (the synthetic data spec, the --resume checkpoint
    for the trainer `layout`, the model's weight files, the tokenizer, every prompt), each naming
    its file. The prompts are tokenized once, here, and the trainer takes them from the result."""
    out = Inputs(dataset_problems(job.data.synthetic, job.data.reasoning_gym))
    if out.problems:
        return out
    if resume is not None:
        from hexrl.train.checkpoint import problems as checkpoint_problems  # torch: only the run needs it
        from hexrl.train.checkpoint import resolve_complete

        out.problems += [f"--resume {resume}: {p}" for p in checkpoint_problems(resume, layout, job.model.config)]
        if not out.problems:
            step, passed_over = resolve_complete(resume)
            out.notes += [f"--resume {resume}: {n}; resuming from {step.name} instead" for n in passed_over]
    if job.model.path:
        out.problems += weight_file_problems(job.model.path, job.model.config)
    where = (f"data.path {job.data.path}" if job.data.path else
             "data.reasoning_gym" if job.data.reasoning_gym else "data.synthetic")
    if not job.model.path:  # no tokenizer to encode prompts with: the dataset must still hold some
        out.problems += _dataset_problems(job, where)
        return out
    try:
        tokenizer = load_tokenizer(job.model.path)
    except (OSError, ValueError) as e:
        out.problems.append(f"model.path tokenizer: {e}")
        return out
    if job.env is not None:
        out.problems += [f"env ({job.env.name}): {p}"
                         for p in stop_string_problems(environment_class(job.env.name), tokenizer)]
    try:
        out.train, out.heldout = run_prompts(job, tokenizer)
    except (OSError, ValueError, TypeError) as e:
        out.problems.append(f"{where}: {e}")
        return out
    if not out.train.problems:
        out.problems.append(f"{where}: none of its {len(out.train.skipped)} training prompts can be used: "
                            f"{out.train.summary()}")
    return out


def plan_time_checks(job: Job) -> tuple[list[str], list[str]]:
    """(problems, warnings) of a job at plan time. The planner may run where the dataset is not
    (it is read at run time, on the cluster): a missing data.path is then a loud warning, and the
    model's files are still checked; a dataset that is here is checked in full."""
    # a FIFO is refused, not skipped
    if job.data.synthetic or job.data.reasoning_gym or (job.data.path and Path(job.data.path).exists()):
        return check_inputs(job).problems, []
    warning = (f"WARNING: data.path {job.data.path} does not exist here; the run reads it at start on every "
               "node and refuses to start without it")
    return (weight_file_problems(job.model.path, job.model.config) if job.model.path else []), [warning]
