"""A run that makes no progress says so (hexrl/control/progress_watch.py): groups filtered for equal rewards
and environment timeouts are counted and, past a threshold, named in a warning at most once a minute."""
from types import SimpleNamespace

from hexrl.comm.wire import trajectory_to_msg
from hexrl.control.controller import Controller, ReplicaInfo
from hexrl.control.dataset import DatasetCursor
from hexrl.control.progress_watch import WARN_EVERY_S, ProgressWatch
from hexrl.data.problems import Problem
from hexrl.schema import load_job
from hexrl.schema.job import EnvSpec
from hexrl.trajectory import Trajectory


class Clock:
    """A clock the test moves by hand (no sleeping)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_steps_worth_of_equal_groups_in_a_row_is_named_once_a_minute():
    clock = Clock()
    watch = ProgressWatch(batch_size=4, group_size=8, clock=clock)
    for _ in range(3):
        watch.on_group(equal=True)
    assert watch.warnings() == []  # 3 in a row: less than a step's worth
    watch.on_group(equal=False)
    for _ in range(4):
        watch.on_group(equal=True)
    [line] = watch.warnings()
    assert "the last 4 prompt groups in a row had equal rewards" in line and "a step needs 4" in line
    assert "7 filtered and 1 kept since the start" in line and "reward.name" in line
    for _ in range(1000):
        watch.on_group(equal=True)
    clock.now += WARN_EVERY_S - 1
    assert watch.warnings() == []  # once a minute at most
    clock.now += 1
    [line] = watch.warnings()
    assert "the last 1,004 prompt groups in a row" in line and "1,007 filtered and 1 kept" in line
    watch.on_group(equal=False)
    clock.now += WARN_EVERY_S
    assert watch.warnings() == [] and watch.equal_in_a_row == 0  # a kept group: progress again


def test_an_environment_that_keeps_timing_out_is_named_with_its_limits():
    clock = Clock()
    watch = ProgressWatch(batch_size=2, group_size=4, env=EnvSpec("calculator", timeout_s=1, workers=2), clock=clock)
    for _ in range(3):
        watch.on_trajectory("env_timeout")
    assert watch.warnings() == []  # fewer episodes than one group: too few to read a rate
    watch.on_trajectory("answer")
    [line] = watch.warnings()
    assert "timed out on 3 of the last 4 episodes (3 since the start; env.timeout_s = 1 s, env.workers = 2)" in line
    for reason in ["answer"] * 6 + ["env_timeout"]:  # the window is a step's worth: 8 episodes
        watch.on_trajectory(reason)
    clock.now += WARN_EVERY_S
    assert watch.warnings() == [] and watch.recent_timeouts == 1  # 1 of the last 8: healthy
    for _ in range(3):
        watch.on_trajectory("env_timeout")
    [line] = watch.warnings()
    assert "timed out on 4 of the last 8 episodes (7 since the start" in line


def test_the_controller_counts_and_warns_while_it_regenerates(capsys):
    """A model that never scores: every group is filtered and its slot handed out again. The controller
    says so once (not once per group), and its counters (the metrics) carry the numbers."""
    job = {"model": {"preset": "tiny"}, "data": {"synthetic": {}}, "rl": {"batch_size": 2, "group_size": 2, "eta": 0},
           "cluster": {"nodes": [{"gpu_type": "cpu", "gpus": 2}]}}
    rl, clock, sent = load_job(job, check_paths=False).rl, Clock(), []
    router = SimpleNamespace(rejected={}, peers={"replica-0"}, send=lambda msg, to, timeout_s: sent.append(msg) or True)
    problems = [Problem(f"{i}+{i}=", str(2 * i), id=i, kind="synthetic") for i in range(50)]
    ctl = Controller(rl, DatasetCursor(problems, seed=0), lambda text: [3, 4], [ReplicaInfo(0, 1.0)], router,
                     vocab_size=16, env=EnvSpec("calculator", timeout_s=1, workers=2))
    ctl.progress.clock = clock
    for _ in range(5):
        ctl._dispatch()  # eta 0: a step's worth of groups, then one more for each filtered
        prompts, sent[:] = list(sent), []
        for p in prompts:
            for _ in range(2):
                ctl._admit(0, trajectory_to_msg(Trajectory(p["group_id"], [3, 4], [5], [-1.0], [0], reward=0.0,
                                                           finish_reason="env_timeout", problem_id=p["problem_id"])))
    c = ctl.counters()
    assert c["filtered"] == {"equal_rewards": 20} and c["equal_groups_in_a_row"] == 10 and c["env_timeouts"] == 20
    assert ctl.state()["counters"]["env_timeouts"] == 20
    timeouts, equal = capsys.readouterr().err.splitlines()  # once each, not once per group
    assert "timed out on 2 of the last 2 episodes (2 since the start; env.timeout_s = 1 s" in timeouts
    assert "the last 2 prompt groups in a row had equal rewards" in equal
