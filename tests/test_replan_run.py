"""Re-planning a running job (hexrl/train/replanning.py): every replan.every_s the controller rank asks the
planner what the run measured, and writes each decision as one line of metrics.jsonl; a decision to switch
checkpoints, records the new plan as the run's next round and restarts every rank into it (hexrl/main.py);
the last switch survives the restart."""
import io
import json
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
from dist_utils import free_port
from runtime_utils import ROOT, metrics, torchrun, write_job
from test_elastic import A, B, check_finished, elastic_cmd, plans, start
from test_replan import paper_job, rows_at

from hexrl import main as hexrl_main
from hexrl.control.metrics import MetricsWriter, read_events
from hexrl.plan.__main__ import main as plan_cli
from hexrl.plan.planner import plan_job
from hexrl.plan.replan import split_of
from hexrl.schema import load_job, load_plan
from hexrl.schema.replan_spec import ReplanSpec
from hexrl.train import replanning
from hexrl.train import trainer_rank as worker
from hexrl.trajectory import Trajectory

T0 = 1_000_000.0  # the Unix time the fake clock starts at


class Clock:
    """A clock the test moves: seconds since the run started."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def unix(self) -> float:
        return T0 + self.t


class InProcess:
    """One decision run here, at once: the command line the controller rank starts, given to the planner's
    command in this process."""

    def __init__(self, cmd: list[str]):
        assert cmd[1:4] == ["-m", "hexrl.plan", "replan"], cmd
        self.cmd, out = cmd, io.StringIO()
        with redirect_stdout(out):
            self.rc = plan_cli(cmd[3:])
        self.out = out.getvalue()

    def done(self) -> bool:
        return True

    def result(self) -> dict | str:
        return json.loads(self.out) if self.rc == 0 else f"the planner failed (exit {self.rc})"

    def cancel(self) -> None:
        pass


@pytest.fixture(scope="module")
def short_plan():
    """The paper's 7B job planned for 2,500-token outputs; a decision every 100 s, a long horizon."""
    return plan_job(load_job(paper_job(2500, replan={"every_s": 100, "horizon_s": 36000}), check_paths=False))


def write_rows(run: Path, rows: list[dict]) -> None:
    with open(run / "metrics.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def run(short_plan, tmp_path) -> Path:
    """A run whose outputs grew to 5,000 tokens: five step rows as the run writes them. The trained
    tokens say 2,500 (the job's prompt and output): the rows' measured output_len_mean is what counts."""
    rows = rows_at(short_plan, 2500)
    write_rows(tmp_path, [{**r, "rollout_tokens_per_s": x["rollout_tokens_per_s"], "output_len_mean": 5000.0,
                           "replica_tokens_per_s": {"0": 1.0}} for r, x in zip(rows, rows_at(short_plan, 5000))])
    return tmp_path


def replanner(plan, run: Path, clock: Clock, restarts_left: int, **kw) -> replanning.Replanner:
    return replanning.Replanner(plan, run, MetricsWriter(run, console=None, tensorboard=False), restarts_left,
                                clock=clock, now=clock.unix, start=InProcess, **kw)


def test_a_decision_every_every_s_is_one_metrics_line_with_what_was_measured(short_plan, run):
    clock = Clock()
    r = replanner(short_plan, run, clock, restarts_left=0, since_step=0)
    stops = []
    for step, t in enumerate([0, 50, 100, 150, 200, 250, 299], start=1):
        clock.t = t
        stops.append(r.at_boundary(step))
    events = read_events(run / "metrics.jsonl", "replan")
    # started at 100 s and 200 s (every_s), each written at the boundary after it finished
    assert [(e["step"], e["time_s"]) for e in events] == [(4, T0 + 100), (6, T0 + 200)]
    e = events[0]
    assert e["measured"]["output_len_mean"] == 5000 and e["measured"]["rows"] == 5
    assert e["new_split"] != e["running_split"] and e["amortised_gain"] > 0.1
    # a switch is worth it, but this launch has no torchrun restart to make it
    assert not e["taken"] and e["why"].startswith("not taken: the launch cannot restart")
    assert "is above replan.min_gain 10%" in e["why"]
    assert stops == [None] * 7 and r.switches == replanning.Switches()  # no switch, none measured


def test_a_planner_that_fails_is_a_decision_not_taken(short_plan, run):
    clock = Clock()
    r = replanner(short_plan, run, clock, restarts_left=1, since_step=0)
    r.start = lambda cmd: NS(done=lambda: True, result=lambda: "the planner failed (exit 2): infeasible job")
    clock.t = 100
    r.at_boundary(1)
    assert r.at_boundary(2) is None
    (e,) = read_events(run / "metrics.jsonl", "replan")
    assert (e["step"], e["taken"], e["why"]) == (2, False, "the planner failed (exit 2): infeasible job")


def test_a_switch_is_the_runs_next_round_and_its_time_survives_the_restart(short_plan, run, monkeypatch):
    clock = Clock()
    r = replanner(short_plan, run, clock, restarts_left=1, since_step=0)
    clock.t = 100
    assert r.at_boundary(3) is None  # started
    stop = r.at_boundary(4)
    assert stop.reason.startswith("drift: at step 4, amortised gain") and "mean output 5000 tokens" in stop.reason
    # every trainer rank checkpoints at this boundary; the controller rank records the plan and tells every rank
    saved = []
    path = worker.switch_plans(NS(run_dir=run), NS(save=lambda root, extra: saved.append(extra)), None, r, 4, stop)
    assert saved == [{"step": 4, "controller": None,
                      "replan": {"last_switch_s": T0 + 100, "left_s": T0 + 100, "switch_s": None}}]
    assert path == run / "plans" / "0.json"
    recorded = json.loads(path.read_text())
    assert recorded["predicted"]["elastic"] == {"round": 0, "nodes": [n.name for n in short_plan.job.cluster.nodes],
                                                "reason": stop.reason, "switched_at_s": T0 + 100}

    # torchrun restarts every rank: a first attempt runs the plan given, a restarted one the recorded plan
    short_plan.save(run / "given.json")
    args = NS(run_dir=str(run), plan=str(run / "given.json"))
    monkeypatch.setenv(hexrl_main.RESTART_ENV, "0")
    assert hexrl_main.recorded_plan(args, rank=1) is None
    monkeypatch.setenv(hexrl_main.RESTART_ENV, "1")
    assert hexrl_main.recorded_plan(args, rank=1) == recorded
    new_plan = load_plan(recorded, check_paths=False)
    assert new_plan.world_size == short_plan.world_size

    # the restarted controller rank resumes at step 4 and measures only the steps after it: outputs down to
    # 1,000 tokens would switch back...
    resumed = MetricsWriter(run, console=None, tensorboard=False, resume_step=4)  # step 5's row is redone
    write_rows(run, [{**x, "step": x["step"] + 4} for x in rows_at(new_plan, 1000)])
    ctx = NS(plan=new_plan, run_dir=run, restarts_left=1)
    fresh = replanning.start_replanning(ctx, resumed, 4, None, clock=clock, now=clock.unix, start=InProcess)
    clock.t = 600
    fresh.at_boundary(5)
    assert fresh.at_boundary(6).reason.startswith("drift: at step 6")
    # ...but not within the horizon of the switch the checkpoint it resumed from remembers
    after = replanning.start_replanning(ctx, resumed, 4, saved[0], clock=clock, now=clock.unix, start=InProcess)
    clock.t = 700
    after.at_boundary(5)
    assert after.at_boundary(6) is None
    last = read_events(run / "metrics.jsonl", "replan")[-1]
    assert not last["taken"] and last["why"] == "switched 600 s ago, within replan.horizon_s 36000 s"
    assert last["measured"]["rows"] == 5  # the steps after 4 only
    # the first step in the new plan ended 600 s after the ranks left the old one: what the switch cost,
    # which the decision prices in place of replan.switch_s (300 s), and later checkpoints keep
    assert last["switch_s"] == 600.0 and fresh.switches.switch_s is None
    assert after.state() == {"last_switch_s": T0 + 100, "left_s": None, "switch_s": 600.0}


def test_replan_off_starts_no_decision_and_writes_no_row(tmp_path):
    ctx = NS(plan=NS(job=NS(replan=ReplanSpec(every_s=0))), run_dir=tmp_path, restarts_left=3)
    assert replanning.start_replanning(ctx, None, 0, None) is None
    assert list(tmp_path.iterdir()) == []


class Counters:
    """The controller's counters at the start of the step, then at its end."""

    def __init__(self, *readings):
        self.readings = list(readings)

    def __call__(self):
        return self.readings.pop(0)


def counters(tokens: dict) -> dict:
    return {"accepted": 0, "filtered": {}, "dropped": {}, "trained": 0, "produced": 0, "pending": 0, "too_stale": 0,
            "rewards_clipped": 0, "env_timeouts": 0, "equal_groups_in_a_row": 0, "groups_moved": 0,
            "rejected_messages": 0, "rejected_reasons": {}, "completion_tokens": sum(tokens.values()),
            "replica_tokens": tokens}


STEP_OUT = ("loss", "clip_frac", "capped_frac", "mean_w", "w_std", "w_p05", "w_p50", "w_p95", "tokens",
            "logprob_mismatch_mean", "logprob_mismatch_p99", "logprob_mismatch_tokens", "grad_norm", "kl", "entropy")


def step_parts(tmp_path: Path, batch: list, counters_fn) -> tuple:
    """(ctx, trainer, controller) for `run_step` without a model: the trainer's step only counts versions
    (`trainer.trained`: the versions it made), the controller hands out `batch` and reads `counters_fn`."""
    controller = NS(counters=counters_fn, next_batch=lambda: [NS(group_id=0, trajectories=batch)],
                    choose_eta=lambda *a: 1, publish_version=lambda v: None, wait_delivered=lambda v: None)
    trainer = NS(version=0, grid=NS(trainer_group=None), trained=[])
    out = {**{k: 0.0 for k in STEP_OUT}, "token_staleness_hist": {}}

    def step(share):
        trainer.version += 1
        trainer.trained.append(trainer.version)
        return out

    trainer.step = step
    ctx = NS(plan=NS(job=NS(rl=NS(steps=10, checkpoint_every=0))), run_dir=tmp_path, device="cpu")
    return ctx, trainer, controller


def test_a_step_row_holds_each_replicas_rate_and_the_output_lengths(monkeypatch, tmp_path):
    monkeypatch.setattr(worker, "share_batch", lambda batch, *a: batch)
    monkeypatch.setattr(worker, "sync_weights", lambda *a: 0.0)
    batch = [Trajectory(0, [1], [2] * n, [-1.0] * n, [0] * n, reward=1.0) for n in (2, 4, 6, 20)]
    ctx, trainer, controller = step_parts(tmp_path, batch, Counters(counters({0: 5, 1: 0}),
                                                                     counters({0: 25, 1: 12})))
    rows = []
    metrics_writer = NS(log=rows.append, log_lengths=lambda *a: None)
    evaluator = NS(seconds=0.0, wall=lambda: 0.0, maybe=lambda t, step: None)
    assert worker.run_step(ctx, trainer, controller, metrics_writer, evaluator, 0, torch.float32) is None
    (row,) = rows
    rates = row["replica_tokens_per_s"]
    assert set(rates) == {"0", "1"} and rates["0"] / rates["1"] == pytest.approx(20 / 12)
    assert sum(rates.values()) == pytest.approx(row["rollout_tokens_per_s"])
    assert (row["output_len_mean"], row["output_len_p50"], row["output_len_p90"], row["output_len_max"]) == (
        8.0, 4, 20, 20)


def test_a_decision_that_ends_during_an_evaluation_switches_at_the_boundary_after_it(
        short_plan, run, monkeypatch):
    """A decision to switch whose process ends while the held-out evaluation of step 4 runs: step 4 is
    trained, evaluated and written once, and the switch comes at the boundary after it, before step 5
    trains. The first step in the new plan, which evaluates for 30 s, leaves those 30 s out of what the
    switch cost."""
    monkeypatch.setattr(worker, "share_batch", lambda batch, *a: batch)  # a Stop too: every rank gets it
    monkeypatch.setattr(worker, "sync_weights", lambda *a: 0.0)
    batch = [Trajectory(0, [1], [2] * 8, [-1.0] * 8, [0] * 8, reward=1.0)]
    ctx, trainer, controller = step_parts(run, batch, lambda: counters({0: 8}))
    decisions = []

    def start(cmd):  # the decision's process ends when the evaluation says
        d = NS(ended=False, cancel=lambda: None, result=lambda: InProcess(cmd).result())
        d.done = lambda: d.ended
        decisions.append(d)
        return d

    evaluated = []

    def evaluate(trainer, step):
        evaluated.append(step)
        for d in decisions:
            d.ended = True
        evaluator.seconds += 30.0
        return 0.5

    evaluator = NS(seconds=0.0, wall=lambda: 0.0, maybe=evaluate)
    rows = []
    metrics_writer = NS(log=rows.append, log_lengths=lambda *a: None)
    clock = Clock()
    r = replanning.Replanner(short_plan, run, MetricsWriter(run, console=None, tensorboard=False), 1, since_step=3,
                             clock=clock, now=clock.unix, start=start)
    clock.t = 100
    args = (ctx, trainer, controller, metrics_writer, evaluator)
    assert worker.run_step(*args, 3, torch.float32, None, r) is None  # the decision starts, step 4 trains
    assert len(decisions) == 1 and decisions[0].ended  # it ended during step 4's evaluation
    assert read_events(run / "metrics.jsonl", "replan") == []  # and waits for the boundary
    stop = worker.run_step(*args, 4, torch.float32, None, r)
    assert stop is not None and stop.reason.startswith("drift: at step 4")
    (e,) = read_events(run / "metrics.jsonl", "replan")
    assert (e["step"], e["taken"]) == (4, True)
    assert trainer.trained == [1] and evaluated == [4] and [row["step"] for row in rows] == [4]  # each once
    # the restarted attempt's first step ends 100 s after the ranks left the old plan, 30 s of it evaluating
    clock.t = 200
    restarted = replanning.Replanner(short_plan, run, MetricsWriter(run, console=None, tensorboard=False), 1,
                                     since_step=4, switches=r.switches, clock=clock, now=clock.unix, start=start)
    restarted.at_boundary(5, untimed_s=30.0)
    assert restarted.switches.switch_s == 70.0


# ------------------------------------------------------------------ a CPU job that switches plans


STEPS = 80  # room for the first decision on a loaded machine (it has come at steps 18 to 53 of 60)


def drifting_job(tmp_path: Path, steps: int, nodes: list[dict] | None = None) -> Path:
    """A 3-rank CPU job planned for rewards of 50 ms a sample (so 1 trainer, 2 rollout ranks), whose
    rewards take no time: its training is the bottleneck, and the first decision moves a rank to it.
    `nodes`: its cluster (default one node of 3)."""
    plan = write_job(tmp_path, steps=steps, nodes=nodes)
    job = json.loads((tmp_path / "job.json").read_text())
    del job["layout"]  # the planner chooses the split
    job["workload"] = {"prompt_len": 256, "output_len": {"mean": 2, "max": 3}, "reward_s_per_sample": 0.05}
    job["replan"] = {"every_s": 2, "min_gain": 0.0, "horizon_s": 36000, "switch_s": 1}
    (tmp_path / "job.json").write_text(json.dumps(job))
    subprocess.run([sys.executable, "-m", "hexrl.plan", str(tmp_path / "job.json"), "-o", str(plan)], check=True,
                   capture_output=True, cwd=ROOT)
    return plan


@pytest.mark.slow
@pytest.mark.parametrize("restarts", [1, 0])
def test_a_cpu_job_switches_plans_through_a_torchrun_restart(tmp_path, restarts):
    plan = drifting_job(tmp_path, steps=STEPS)
    assert replanning_split(load_plan(plan)) == (1, 2)
    run = tmp_path / "run"
    proc = torchrun(plan, run, restarts=restarts)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-5000:]
    check_finished(run, STEPS)  # every step trained once, balanced, the staleness bound held across the switch
    decisions = read_events(run / "metrics.jsonl", "replan")
    assert decisions, out[-3000:]
    first = decisions[0]
    assert first["new_split"] == {"train": {"cpu": 2}, "rollout": {"cpu": 1}}
    if restarts == 0:  # the launch cannot restart: the decision is logged, the job goes on in its plan
        assert not first["taken"] and first["why"].startswith("not taken: the launch cannot restart")
        assert not (run / "plans").exists() and "switching plans" not in out
        return
    assert first["taken"]
    (switched,) = plans(run)
    assert switched["predicted"]["elastic"]["reason"].startswith(f"drift: at step {first['step']}")
    assert replanning_split(load_plan(switched)) == (2, 1)
    assert f"resuming from {run / 'checkpoints'}" in out and "the run's newest recorded plan" in out
    assert all(not d["taken"] for d in decisions[1:])  # the new plan is the running one, or within the horizon
    assert len(metrics(run)) == STEPS


@pytest.mark.slow
def test_an_elastic_job_switches_plans_and_its_next_round_keeps_the_switched_plan(tmp_path):
    """Node A of a two-node elastic job runs alone: round 0 plans A (1 + 2), a decision switches it to
    2 + 1 (recorded as round 1), and the round of the restart, on the same node, keeps that plan."""
    nodes = [{"name": name, "gpu_type": "cpu", "gpus": 3, "address": address} for name, address in (("A", A), ("B", B))]
    plan, run = drifting_job(tmp_path, steps=STEPS, nodes=nodes), tmp_path / "run"
    launcher = start(elastic_cmd(plan, run, A, f"{A}:{free_port()}", "A", restarts=1, nproc=3))
    out, _ = launcher.communicate(timeout=900)
    assert launcher.returncode == 0, out[-5000:]
    check_finished(run, STEPS)
    first, switched, kept = plans(run)
    assert replanning_split(load_plan(first)) == (1, 2)
    assert switched["predicted"]["elastic"]["reason"].startswith("drift: at step ")
    assert replanning_split(load_plan(switched)) == (2, 1)
    assert kept["predicted"]["elastic"]["reason"].endswith("no node left or joined; the plan of round 1 kept")
    assert kept["ranks"] == switched["ranks"]


def replanning_split(plan) -> tuple[int, int]:
    return len(plan.train_ranks()), len(plan.rollout_ranks())


def answer_to_switch(plan) -> dict:
    """A decision row to switch, as `python -m hexrl.plan replan --json` prints it."""
    split = split_of(plan)
    return {"event": "replan", "time_s": T0 + 100, "taken": True, "why": "amortised gain 40.0% is above ...",
            "running_split": split, "new_split": split, "measured": {"output_len_mean": 5000.0},
            "predicted_gain": 0.5, "amortised_gain": 0.4}


@pytest.mark.parametrize("answer, next_plan, why", [
    ([1, 2], None, "the planner's answer is not a decision: a JSON list, not an object"),
    ("switch", None, None),  # the row below, with time_s a string
    ("row", "torn", "next.json: not a valid plan, refusing to run it"),
    ("row", "another job", "next.json: the plan of another job (name differ"),
])
def test_a_planner_answer_that_is_no_decision_or_no_plan_of_this_job_switches_nothing(short_plan, run, answer,
                                                                                      next_plan, why):
    clock = Clock()
    r = replanner(short_plan, run, clock, restarts_left=1, since_step=0)
    row = answer_to_switch(short_plan)
    answer = {**row, "time_s": "soon"} if answer == "switch" else row if answer == "row" else answer
    why = why or "the planner's answer is not a decision: time_s missing or malformed"
    text = {"torn": json.dumps(short_plan.to_dict())[:500],
            "another job": json.dumps({**short_plan.to_dict(), "name": "other"})}.get(next_plan)

    def start(cmd):
        if text is not None:
            r.new_plan.write_text(text)
        return NS(done=lambda: True, result=lambda: answer)

    r.start = start
    clock.t = 100
    r.at_boundary(1)
    assert r.at_boundary(2) is None and r.switch_to is None
    (e,) = read_events(run / "metrics.jsonl", "replan")
    assert not e["taken"] and why in e["why"], e["why"]


def test_a_planner_that_hangs_is_stopped_and_the_next_decision_starts(short_plan, run):
    clock = Clock()
    r = replanner(short_plan, run, clock, restarts_left=1, since_step=0)
    started, cancelled = [], []
    r.start = lambda cmd: started.append(cmd) or NS(done=lambda: False, cancel=lambda: cancelled.append(1))
    clock.t = 100
    r.at_boundary(1)
    clock.t = 100 + replanning.PATIENCE_S + 1
    assert r.at_boundary(2) is None
    (e,) = read_events(run / "metrics.jsonl", "replan")
    assert (e["taken"], e["why"]) == (False, f"the planner gave no answer in {replanning.PATIENCE_S:g} s (stopped)")
    assert cancelled == [1] and len(started) == 2  # the next decision was due long ago: it starts at once
