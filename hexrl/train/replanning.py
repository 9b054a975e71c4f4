"""Re-planning a running job: every `replan.every_s` seconds the controller rank asks the planner
what the run's measurements imply, and acts on the answer at a step boundary.

The decision is `python -m hexrl.plan replan` (hexrl/plan/replan.py) on the run's metrics.jsonl and
the running plan, in a process of its own: the planner takes seconds of CPU, and the step loop
only looks at step boundaries whether it has finished. Each decision, switch or not, is one line in
metrics.jsonl (`"event": "replan"`) and one line in the log. A decision to switch becomes a `Stop`
for the hand-off (hexrl/train/handoff.py): every trainer rank leaves the step loop at the same
boundary, the job checkpoints, the new plan is recorded as the run's next round
(RUN_DIR/plans/<round>.json, reason "drift: ...") and every rank exits with elastic.SWITCH_EXIT, so
that torchrun restarts them into it (hexrl/main.py). A launch without a torchrun restart left logs the
decision as not taken.

Time is Unix seconds (`time.time()`): what the run knows of its switches (`Switches`) is kept in the
checkpoint, and a switch's own restart counts against the horizon. The first step after a switch
measures what it cost: from leaving the old plan to the end of that step (checkpoint, restart, reload,
warm-up), less any held-out evaluation in it; later decisions price a switch at that, in place of
replan.switch_s. A decision that finishes while the held-out evaluation runs is read at the next step
boundary, after that evaluation: a switch leaves only between steps.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable

from hexrl.runtime import errors
from hexrl.runtime.context import RankContext
from hexrl.runtime.elastic import read_recorded_plan
from hexrl.schema import Plan

from .handoff import Stop

PATIENCE_S = 1800.0  # a decision still running after max(replan.every_s, this) is stopped and logged
MAX_WHY = 2000  # characters of a decision's reason: the log line and metrics.jsonl carry it


@dataclass
class Switches:
    """What the run knows of its switches of plans (kept in every checkpoint; Unix seconds)."""

    last_switch_s: float | None = None  # when the last decision to switch started: the horizon runs from it
    left_s: float | None = None  # when the ranks left the old plan, until the new plan's first step measures
    switch_s: float | None = None  # what the last switch cost, measured (None: replan.switch_s)

    @classmethod
    def from_state(cls, state: dict | None) -> "Switches":
        """From a checkpoint's `replan` (None: no switch yet)."""
        return cls(**{f.name: (state or {}).get(f.name) for f in fields(cls)})


class Decision:
    """One `python -m hexrl.plan replan` in a process of its own; its stdout and stderr go to files."""

    def __init__(self, cmd: list[str]):
        self.out, self.err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=self.err, stdin=subprocess.DEVNULL)
        try:  # it inherits the rank's cores: the controller thread and the trainer come first (a lower
            # priority still, 19, starves it for minutes where the ranks keep every core busy)
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, 10)
        except OSError:  # already ended
            pass

    def done(self) -> bool:
        return self.proc.poll() is not None

    def result(self) -> dict | str:
        """The decision row, or why the planner gave none (its last line of stderr)."""
        self.out.seek(0)
        self.err.seek(0)
        out, err = self.out.read().decode(errors="replace"), self.err.read().decode(errors="replace")
        self.out.close()
        self.err.close()
        if self.proc.returncode == 0:
            try:
                return json.loads(out)
            except json.JSONDecodeError:
                pass
        lines = err.strip().splitlines()
        return f"the planner failed (exit {self.proc.returncode}): {lines[-1] if lines else 'no message'}"

    def cancel(self) -> None:
        if not self.done():
            self.proc.kill()
            self.proc.wait()


class Replanner:
    """The controller rank's clock for re-planning decisions (see the module doc).

    `restarts_left`: the torchrun restarts the launch still allows (a switch needs one);
    `since_step`: the step this attempt started from (the running plan measured only the steps after);
    `clock` (seconds, monotonic) schedules the decisions, `now` (Unix seconds) stamps them;
    `start` starts one decision from its command line.
    """

    def __init__(self, plan: Plan, run_dir: Path, metrics, restarts_left: int, since_step: int,
                 switches: Switches | None = None, clock: Callable[[], float] = time.monotonic,
                 now: Callable[[], float] = time.time, start: Callable[[list[str]], Decision] = Decision):
        self.spec, self.job, self.run_dir, self.metrics = plan.job.replan, plan.job, Path(run_dir), metrics
        self.restarts_left, self.since_step, self.switches = restarts_left, since_step, switches or Switches()
        self.clock, self.now, self.start = clock, now, start
        self.dir = self.run_dir / "replan"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.running, self.new_plan = self.dir / "running.json", self.dir / "next.json"
        plan.save(self.running)  # what the planner prices (the plan this attempt runs, however it got it)
        self.world = plan.world_size
        self.due = clock() + self.spec.every_s
        self.pending: Decision | None = None
        self.asked_at, self.started = 0.0, 0.0  # Unix time the decision was asked at; clock() then
        self.switch_to: dict | None = None  # the plan a Stop restarts into (plan.json as a dict)

    def state(self) -> dict:
        """What a checkpoint keeps: the run's switches (hysteresis and the measured cost across restarts)."""
        return asdict(self.switches)

    def command(self, now: float) -> list[str]:
        sw = self.switches
        cmd = [sys.executable, "-m", "hexrl.plan", "replan", str(self.run_dir), "--plan", str(self.running),
               "--now-s", repr(now), "--since-step", str(self.since_step), "--new-plan", str(self.new_plan),
               "--json"]
        return (cmd + (["--last-switch-s", repr(sw.last_switch_s)] if sw.last_switch_s is not None else [])
                + (["--switch-s", repr(sw.switch_s)] if sw.switch_s is not None else []))

    def at_boundary(self, step: int, untimed_s: float = 0.0) -> Stop | None:
        """At the step boundary after `step` trained steps: write the decision that finished since the last
        boundary, if any; start the next one when it is due. A Stop when the job is to switch now.
        `untimed_s`: the seconds this attempt has spent on untimed work, the held-out evaluation and the
        policy probe (HeldoutEval.seconds), which a switch's measured cost leaves out."""
        sw, stop = self.switches, None
        if sw.left_s is not None and step > self.since_step:  # the new plan's first step: the switch is over
            sw.switch_s, sw.left_s = round(max(0.0, self.now() - sw.left_s - untimed_s), 3), None
        if self.pending is not None and self.pending.done():
            stop = self._finish(self.pending.result(), step)
            self.pending = None
        elif self.pending is not None and self.clock() - self.started > self.patience_s:
            self.close()  # a planner that hangs would hold every later decision back, silently
            self._finish(f"the planner gave no answer in {self.patience_s:g} s (stopped)", step)
        if self.pending is None and stop is None and self.clock() >= self.due:
            self.new_plan.unlink(missing_ok=True)
            self.asked_at, self.started = self.now(), self.clock()
            self.pending = self.start(self.command(self.asked_at))
            self.due = self.clock() + self.spec.every_s
        return stop

    @property
    def patience_s(self) -> float:
        """How long a decision may run before it is stopped: the planner takes seconds to minutes."""
        return max(self.spec.every_s, PATIENCE_S)

    def _finish(self, result: dict | str, step: int) -> Stop | None:
        """Log one decision (a row, or why there is none); a Stop if it is to switch and can."""
        why = result if isinstance(result, str) else not_a_decision(result)
        if why is None:
            row = {**result, "event": "replan", "step": step}
        else:
            why = why if isinstance(result, str) else f"the planner's answer is not a decision: {why}"
            row = {"event": "replan", "time_s": round(self.asked_at, 3), "taken": False, "why": why, "step": step}
        plan = self._switchable(row)
        self.metrics.log_event(row)
        errors.say(log_line(row))
        if plan is None:
            return None
        self.switch_to = plan
        self.switches.last_switch_s, self.switches.left_s = row["time_s"], self.now()
        return Stop(drift_reason(row))

    def _switchable(self, row: dict) -> dict | None:
        """The plan a decision to switch restarts into; None, and the row marked not taken with why, when
        the decision is not to switch or the launch cannot act on it."""
        if not row["taken"]:
            return None
        try:  # the planner wrote it for this job: a torn or edited file, or another job's, is refused
            plan, why = read_recorded_plan(self.new_plan, self.job), None
        except (ValueError, OSError) as e:
            plan, why = None, str(e)
        if why is None and self.restarts_left < 1:
            why = "the launch cannot restart (no torchrun restart left; launch with torchrun --max-restarts K)"
        elif why is None and len(plan["ranks"]) != self.world:  # torchrun restarts the same number of ranks
            why = f"the new plan has {len(plan['ranks'])} ranks, the launch {self.world}"
        if why is None:
            return plan
        row.update(taken=False, why=f"not taken: {why}: {row['why']}")
        return None

    def close(self) -> None:
        """End a decision still running (the job is done, or is switching)."""
        if self.pending is not None:
            self.pending.cancel()
            self.pending = None


def not_a_decision(row) -> str | None:
    """What in the planner's answer is not a decision row of `python -m hexrl.plan replan --json` (the
    fields the log line, the switch and the next decision read); None when it is one."""
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an object"
    bad = [k for k, ok in (("taken", isinstance(row.get("taken"), bool)),
                           ("why", isinstance(row.get("why"), str) and len(row["why"]) <= MAX_WHY),
                           ("time_s", _finite(row.get("time_s")))) if not ok]
    gains = ("predicted_gain", "amortised_gain")
    if row.get("taken") is True or any(k in row for k in gains):
        bad += [k for k in gains if not _finite(row.get(k))]
    if row.get("taken") is True:
        bad += [k for k in ("running_split", "new_split") if not _split(row.get(k))]
        if not _finite((row.get("measured") if isinstance(row.get("measured"), dict) else {}).get("output_len_mean")):
            bad.append("measured.output_len_mean")
    return f"{', '.join(bad)} missing or malformed" if bad else None


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _split(s) -> bool:
    """{"train": {gpu type: count}, "rollout": {...}}, as replan.split_of writes it."""
    return isinstance(s, dict) and all(isinstance(s.get(role), dict) and all(
        isinstance(t, str) and isinstance(n, int) and not isinstance(n, bool) for t, n in s[role].items())
        for role in ("train", "rollout"))


def log_line(row: dict) -> str:
    """A decision as one line of the log."""
    gain = (f"; predicted {row['predicted_gain']:+.1%}, {row['amortised_gain']:+.1%} after the switch"
            if "predicted_gain" in row else "")
    return f"[hexrl] replan at step {row['step']}: {'switch' if row['taken'] else 'no switch'} ({row['why']}){gain}"


def drift_reason(row: dict) -> str:
    """Why the job switches plans, as its recorded plan says (RUN_DIR/plans/<round>.json)."""
    gpus = lambda split, role: sum(split[role].values())  # noqa: E731
    old, new = row["running_split"], row["new_split"]
    return (f"drift: at step {row['step']}, {row['why']} (mean output {row['measured']['output_len_mean']:.0f} "
            f"tokens; train {gpus(old, 'train')} -> {gpus(new, 'train')} GPUs, rollout {gpus(old, 'rollout')} -> "
            f"{gpus(new, 'rollout')})")


def start_replanning(ctx: RankContext, metrics, start_step: int, resumed: dict | None, **clocks) -> Replanner | None:
    """The controller rank's re-planning for this attempt, from step `start_step` (`resumed`: the extra
    of the checkpoint it resumed from, which keeps the run's switches; `clocks`: Replanner's clock, now
    and start); None when replan.every_s is 0: then no decision is ever started and no row written."""
    if not ctx.plan.job.replan.on:
        return None
    switches = Switches.from_state((resumed or {}).get("replan"))
    return Replanner(ctx.plan, ctx.run_dir, metrics, ctx.restarts_left, start_step, switches, **clocks)
