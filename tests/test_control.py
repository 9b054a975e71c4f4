"""hexrl.control: staleness gate, replay buffer, dispatch, dataset cursor, metrics, heartbeats."""
import io
import json
import math
import random
from collections import Counter, deque
from types import SimpleNamespace

import numpy as np
import pytest

from hexrl.control.buffer import ReplayBuffer
from hexrl.control.controller import Controller, ReplicaInfo
from hexrl.control.dataset import DatasetCursor
from hexrl.control.dispatch import Dispatcher
from hexrl.control.gate import StalenessGate
from hexrl.control.heartbeat import Heartbeats
from hexrl.control.metrics import (
    REQUIRED_KEYS,
    MetricsWriter,
    length_stats,
    read_events,
    read_metrics,
    replica_rates,
    staleness_histogram,
)
from hexrl.data.problems import Problem
from hexrl.trajectory import Trajectory


def traj(group_id: int, reward: float, version: int = 0, length: int = 2) -> Trajectory:
    return Trajectory(group_id=group_id, prompt_ids=[1], completion_ids=[2] * length, logprobs=[-1.0] * length,
                      versions=[version] * length, reward=reward, finish_reason="eos")


# ---------------------------------------------------------------- gate


def test_gate_eta0_is_synchronous_exactly_b_groups_per_version():
    gate = StalenessGate(batch_size=4, eta=0)
    for version in range(3):
        handed = 0
        while gate.try_acquire(version):
            handed += 1
        assert handed == 4
        gate.on_accepted(4)
        assert gate.capacity(version) == 0  # accepted groups keep their slot until the next version


def test_gate_eta2_formula():
    gate = StalenessGate(batch_size=3, eta=2)
    assert gate.capacity(0) == 9  # (2 + 0 + 1) * 3
    assert sum(gate.try_acquire(0) for _ in range(12)) == 9
    gate.on_accepted(2)
    gate.on_dropped("equal_rewards")  # a filtered group gives its slot back
    assert (gate.running, gate.accepted) == (6, 2)
    assert gate.capacity(0) == 9 - 8
    assert gate.capacity(4) == (2 + 4 + 1) * 3 - 8
    gate.on_dropped("stale", was_accepted=True)
    assert gate.accepted == 1 and gate.released == {"equal_rewards": 1, "stale": 1}
    with pytest.raises(ValueError, match="running"):
        gate.on_accepted(7)
    assert StalenessGate(4, None).capacity(0) == math.inf


def test_max_concurrent_rollouts_bounds_an_unbounded_gate():
    gate = StalenessGate(batch_size=2, eta=None, max_concurrent_rollouts=3)
    assert [gate.try_acquire(0) for _ in range(4)] == [True, True, True, False]  # 3 generating at once
    gate.on_accepted(2)
    assert gate.capacity(0) == 2  # accepted groups no longer generate; staleness stays unbounded
    bounded = StalenessGate(batch_size=2, eta=1, max_concurrent_rollouts=100)
    assert bounded.capacity(0) == 4  # the formula binds first
    with pytest.raises(ValueError, match="max_concurrent_rollouts"):
        StalenessGate(2, None, max_concurrent_rollouts=0)


def test_gate_staleness_check_counts():
    gate = StalenessGate(batch_size=2, eta=2)
    assert not gate.is_too_stale(oldest_version=3, trainer_version=5)
    assert gate.is_too_stale(oldest_version=2, trainer_version=5)
    assert gate.too_stale == 1
    assert not StalenessGate(2, None).is_too_stale(0, 10**6)
    for bad in (dict(batch_size=0, eta=1), dict(batch_size=2, eta=-1)):
        with pytest.raises(ValueError):
            StalenessGate(**bad)


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_gate_and_buffer_keep_staleness_within_eta(eta):
    """Simulated run: rollouts finish FIFO after `delay` ticks; the trainer steps when a batch is ready.

    Reference: a group handed out at version v is trained at version <= v + eta (AReaL's bound),
    and eta = 0 trains only on fresh data.
    """
    B, n, delay = 3, 2, 5
    gate = StalenessGate(B, eta)
    buf = ReplayBuffer(gate=gate)
    version, next_gid, flying, staleness = 0, 0, deque(), Counter()
    for tick in range(200):
        while gate.try_acquire(version):
            buf.expect(next_gid, n)
            flying.append((tick + delay, next_gid, version))
            next_gid += 1
        while flying and flying[0][0] <= tick:
            _, gid, v = flying.popleft()
            for i in range(n):
                buf.add(traj(gid, reward=float(i), version=v))
        batch = buf.pop_batch(B, trainer_version=version)
        if batch:
            staleness.update(version - g.oldest_version for g in batch)
            version += 1
    assert version > 10 and gate.too_stale == 0
    assert max(staleness) <= eta
    if eta > 0:
        assert max(staleness) > 0  # the overlap really happened
    buf.drain()
    buf.assert_balanced(allow_pending=False)


# ---------------------------------------------------------------- buffer


def test_buffer_groups_complete_then_pop_oldest_first():
    gate = StalenessGate(batch_size=2, eta=None)
    buf = ReplayBuffer(gate=gate)
    for gid in range(4):
        assert gate.try_acquire(0)
        buf.expect(gid, n=2)
    assert buf.add(traj(0, 0.0, version=5)) == "pending"
    assert buf.pop_batch(1) is None  # an incomplete group is not ready
    assert buf.add(traj(0, 1.0, version=5)) == "accepted"
    for gid, version in ((1, 3), (2, 5)):
        buf.add(traj(gid, 0.0, version))
        buf.add(traj(gid, 1.0, version))
    assert buf.pop_batch(4) is None  # only 3 ready: nothing popped
    assert [g.group_id for g in buf.pop_batch(2)] == [1, 0]  # version 3 first, then completion order
    assert [g.group_id for g in buf.pop_batch(1)] == [2]
    assert (gate.running, gate.accepted) == (1, 3)
    acc = buf.accounting()
    assert acc["produced"] == 6 and acc["trained"] == 6 and acc["pending"] == 0 and acc["balanced"]


def test_buffer_filters_equal_rewards_when_asked():
    buf = ReplayBuffer()
    buf.expect(0, n=3)
    assert [buf.add(traj(0, 1.0)) for _ in range(3)] == ["pending", "pending", "filtered"]
    assert buf.filtered == {"equal_rewards": 3} and buf.ready == []
    keep = ReplayBuffer(filter_equal_rewards=False)
    keep.expect(0, n=2)
    assert [keep.add(traj(0, 1.0)) for _ in range(2)] == ["pending", "accepted"]


def test_buffer_accounts_for_every_trajectory():
    gate = StalenessGate(batch_size=1, eta=1)
    buf = ReplayBuffer(gate=gate)
    for gid in range(5):
        assert gate.try_acquire(version=3)
        buf.expect(gid, n=2)
    assert buf.add(traj(99, 0.0)) == "dropped"  # never handed out
    buf.add(traj(0, 0.0))
    bad = traj(0, 1.0)
    bad.logprobs = bad.logprobs[:1]
    assert buf.add(bad) == "dropped"  # malformed sample: the whole group goes
    assert buf.add(traj(0, 1.0)) == "dropped"  # late sample of that group, same reason
    buf.add(traj(1, 0.0))
    assert buf.abandon(1, "replica_dead") == 1
    for gid, version in ((2, 0), (3, 3)):
        buf.add(traj(gid, 0.0, version))
        buf.add(traj(gid, 1.0, version))
    buf.add(traj(4, 0.0))
    assert buf.accounting()["balanced"]
    batch = buf.pop_batch(1, trainer_version=3)  # group 2 is 3 versions behind, eta = 1
    assert [g.group_id for g in batch] == [3] and gate.too_stale == 1
    assert buf.drain("shutdown") == 1
    acc = buf.accounting()
    assert acc["dropped"] == {"unknown_group": 1, "malformed": 3, "replica_dead": 1, "stale": 2, "shutdown": 1}
    assert acc["produced"] == 10 and acc["trained"] == 2 and acc["pending"] == 0
    buf.assert_balanced(allow_pending=False)
    assert (gate.running, gate.accepted) == (0, 1)  # only the trained group still holds a slot
    buf.trained += 1  # a bookkeeping bug must not go unnoticed
    with pytest.raises(AssertionError, match="does not add up"):
        buf.assert_balanced()


def test_a_sample_without_tokens_has_the_version_it_started_under():
    """An episode whose environment failed before the model's first turn has no token versions; its
    fresh group (eta 1, trainer at version 4, everything started under 3) is trained, not stale."""
    gate = StalenessGate(batch_size=1, eta=1)
    buf = ReplayBuffer(gate=gate)
    assert gate.try_acquire(version=3)
    buf.expect(0, n=2)
    empty = Trajectory(group_id=0, prompt_ids=[1], completion_ids=[], logprobs=[], versions=[], reward=0.0,
                       finish_reason="env_error", start_version=3)
    assert empty.oldest_version == 3 and traj(0, 1.0, version=3).oldest_version == 3
    buf.add(traj(0, 1.0, version=3))
    assert buf.add(empty) == "accepted"
    assert [g.group_id for g in buf.pop_batch(1, trainer_version=4)] == [0]
    assert gate.too_stale == 0 and buf.dropped == {}


def test_a_trajectory_reads_the_same_from_lists_and_from_typed_arrays():
    """Built by hand (lists) or received (the wire's typed arrays): the same answers, with no per-token
    Python loop over an array; converting refuses a value its dtype cannot hold instead of wrapping it."""
    lists = Trajectory(0, [1], [5, 6, 7, 8], [-1.0, -2.0, -0.5], [2, 3, 3], mask=[1, 0, 1, 1], start_version=2)
    arrays = lists.as_arrays()
    assert [arrays.completion_ids.dtype, arrays.logprobs.dtype, arrays.versions.dtype, arrays.mask.dtype] == [
        np.int32, np.float32, np.int32, np.uint8]
    assert arrays == lists and arrays.as_arrays().completion_ids is arrays.completion_ids  # kept, not copied
    for t in (lists, arrays):
        assert (t.num_generated, t.oldest_version, t.generated_positions().tolist(), t.shape_problems()) == (
            3, 2, [0, 2, 3], [])
    arrays.mask = np.array([1, 0, 2, 1], np.uint8)
    assert "mask: values must be 0 (environment) or 1 (model)" in arrays.shape_problems() and arrays != lists
    for field, value in [("completion_ids", [5, 6, 7, 1 << 31]), ("completion_ids", [5, 6, 7, 8.5]),
                         ("versions", [True, False, True]), ("mask", [1, 0, -1, 1]), ("logprobs", ["a", "b", "c"])]:
        with pytest.raises(ValueError, match=field):
            Trajectory(**{**vars(lists), field: value}).as_arrays()


def test_buffer_rejects_double_hand_out():
    buf = ReplayBuffer()
    buf.expect(1, n=2)
    with pytest.raises(ValueError, match="already"):
        buf.expect(1, n=2)
    with pytest.raises(ValueError, match="n must"):
        buf.expect(2, n=0)


# ---------------------------------------------------------------- dispatch


def test_dispatch_follows_planned_shares():
    d = Dispatcher({0: 1.0, 1: 3.0, 2: 2.0})
    assert d.pick() == 0  # all idle: ties go to the smallest id
    picks = Counter(d.assign(gid) for gid in range(12))
    assert picks == {0: 2, 1: 6, 2: 4}  # proportional to the shares
    assert d.done(5) is not None and d.done(5) is None


def test_dispatch_fills_the_least_loaded_and_skips_the_dead():
    d = Dispatcher({0: 1.0, 1: 1.0})
    assert [d.assign(g) for g in range(4)] == [0, 1, 0, 1]
    d.done(0)
    assert d.pick() == 0
    assert d.mark_dead(0) == [2]
    assert [d.assign(g) for g in (10, 11)] == [1, 1]
    assert d.in_flight[1] == {1, 3, 10, 11}
    d.mark_dead(1)
    assert d.assign(12) is None
    with pytest.raises(ValueError, match="positive"):
        Dispatcher({0: 1.0, 1: 0.0})


def scan_pick(d: Dispatcher) -> int | None:
    """The dispatch rule read straight: the live replica with the smallest (in flight / share, id)."""
    alive = [r for r in d.shares if r not in d.dead]
    return min(alive, key=lambda r: (len(d.in_flight[r]) / d.shares[r], r)) if alive else None


def test_dispatch_picks_what_a_scan_of_every_replica_picks():
    rng = random.Random(0)
    for _ in range(200):
        ids = rng.sample(range(100), rng.randint(1, 12))  # not in order: ties must go to the smallest id
        shares = {r: rng.choice([0.5, 1.0, 1.0, 2.0, 3.0, 1 / 3]) for r in ids}  # equal loads are common
        d, gid = Dispatcher(shares), 0
        for _ in range(rng.choice([20, 1000])):  # 1000: outdated heap entries pile up and are cleared
            op = rng.random()
            if op < 0.55:
                expected = scan_pick(d)
                assert d.assign(gid) == expected
                gid += 1
            elif op < 0.98 and d.owner:
                d.done(rng.choice(list(d.owner)))
            elif op >= 0.98:
                d.mark_dead(rng.choice(ids))
            assert d.pick() == scan_pick(d)


def test_dispatch_looks_at_a_few_replicas_per_group_not_all():
    class Counting(Dispatcher):
        looked = 0

        def load(self, replica):
            self.looked += 1
            return super().load(replica)

    d = Counting({r: 1.0 + r % 3 for r in range(4096)})
    d.looked = 0
    for gid in range(2000):
        d.assign(gid)
        if gid >= 500:
            d.done(gid - 500)  # groups come back: loads go down as well as up
    assert d.looked < 10 * 2000  # a scan would look at all 4,096 replicas for each group


class ConnectedRouter:
    """A RouterChannel stand-in on which the named replicas have connected: it records what is sent
    and counts how often the controller reads its peer table."""

    def __init__(self, names: list[str]):
        self.routes, self.rejected, self.sent, self.peer_reads = dict.fromkeys(names, b""), Counter(), [], 0

    @property
    def peers(self):
        self.peer_reads += 1
        return self.routes.keys()

    def send(self, msg: dict, to: str, timeout_s: float = 5.0) -> bool:
        self.sent.append((msg["type"], to))
        return to in self.routes

    def broadcast(self, msg: dict, to: list[str], timeout_s: float = 5.0) -> list[str]:
        return [name for name in to if not self.send(msg, name)]


def test_a_version_reaches_every_live_replica_once_and_idle_passes_look_at_none():
    rl = SimpleNamespace(batch_size=1, group_size=2, eta=0, max_concurrent_rollouts=None, filter_equal_groups=False,
                         temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4, seed=0, reward_bound=1e6)
    replicas = [ReplicaInfo(i, 1.0) for i in range(64)]
    router = ConnectedRouter([r.name for r in replicas if r.id != 5])  # replica 5 has not connected yet
    problems = [Problem(f"{i}+{i}=", str(2 * i), id=i, kind="synthetic") for i in range(4)]
    ctl = Controller(rl, DatasetCursor(problems, seed=0), lambda text: [3, 4], replicas, router, vocab_size=16)
    for _ in range(10):
        ctl._flush_outbox()  # every loop pass: nothing to send, so no replica is looked at
    assert router.peer_reads == 0 and router.sent == []
    ctl.publish_version(1)
    ctl._flush_outbox()
    assert router.sent == [] and ctl.delivered == 0  # every replica must hear it: wait for replica 5
    router.routes["replica-5"] = b""
    ctl.dispatcher.mark_dead(7)  # ... but not for a dead one
    ctl._flush_outbox()
    assert router.sent == [("weights", r.name) for r in replicas if r.id != 7] and ctl.delivered == 1
    ctl._flush_outbox()
    assert len(router.sent) == 63 and router.peer_reads == 2  # one look at the peer table per pass that sends


class RecordingRouter(ConnectedRouter):
    """A ConnectedRouter that keeps every message sent."""

    def send(self, msg: dict, to: str, timeout_s: float = 5.0) -> bool:
        self.messages = getattr(self, "messages", []) + [msg]
        return super().send(msg, to, timeout_s)


def test_a_synthetic_tasks_budget_sets_each_groups_token_limit_by_its_version():
    rl = SimpleNamespace(batch_size=1, group_size=2, eta=0, max_concurrent_rollouts=None, filter_equal_groups=False,
                         temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=64, seed=0, reward_bound=1e6)
    router = RecordingRouter(["replica-0"])
    problems = [Problem(f"{i}+{i}=", str(2 * i), id=i, kind="synthetic") for i in range(4)]
    ctl = Controller(rl, DatasetCursor(problems, seed=0), lambda text: [3, 4], [ReplicaInfo(0, 1.0)], router,
                     vocab_size=16, budget={"start": 8, "end": 32, "steps": 4})
    ctl._dispatch()
    ctl.gate.on_accepted()
    ctl.version = ctl.delivered = 2  # two steps on: half-way from 8 to 32
    ctl._dispatch()
    assert [(m["version"], m["sampling"]["max_new_tokens"]) for m in router.messages] == [(0, 8), (2, 20), (2, 20)]


# ---------------------------------------------------------------- dataset cursor


def test_cursor_epochs_are_seeded_permutations():
    problems = [f"p{i}" for i in range(10)]
    c = DatasetCursor(problems, seed=3)
    e0, e1 = [c.next() for _ in range(10)], [c.next() for _ in range(10)]
    assert sorted(e0) == sorted(e1) == sorted(problems) and e0 != e1
    again = DatasetCursor(problems, seed=3)
    assert [again.next() for _ in range(20)] == e0 + e1
    other = DatasetCursor(problems, seed=4)
    assert [other.next() for _ in range(10)] != e0
    assert [DatasetCursor(problems, shuffle=False).next() for _ in range(1)] == ["p0"]
    idx, p = DatasetCursor(problems, seed=3).next_indexed()
    assert problems[idx] == p == e0[0]


@pytest.mark.parametrize("k", [0, 3, 7, 8, 9, 20])
def test_cursor_resume_neither_repeats_nor_skips(k):
    problems = list(range(7))
    straight = DatasetCursor(problems, seed=11)
    expected = [straight.next() for _ in range(k + 15)]
    first = DatasetCursor(problems, seed=11)
    head = [first.next() for _ in range(k)]
    state = json.loads(json.dumps(first.state()))  # as it would go through a checkpoint
    resumed = DatasetCursor(problems, seed=11)
    resumed.load_state(state)
    assert resumed.consumed == k
    assert head + [resumed.next() for _ in range(15)] == expected


def test_cursor_refuses_mismatched_state_and_stops_after_max_epochs():
    c = DatasetCursor(list(range(5)), seed=1)
    with pytest.raises(ValueError) as e:
        c.load_state({"epoch": 0, "index": 9, "seed": 2, "shuffle": True, "size": 6})
    for word in ("seed", "size", "index"):
        assert word in str(e.value)
    c = DatasetCursor(list(range(3)), seed=0, max_epochs=2)
    assert sorted(c) == [0, 0, 1, 1, 2, 2]
    with pytest.raises(StopIteration):
        c.next()
    with pytest.raises(ValueError, match="empty"):
        DatasetCursor([], seed=0)


# ---------------------------------------------------------------- metrics


def record(step: int, **extra) -> dict:
    base = {k: 0 for k in REQUIRED_KEYS}
    base.update(step=step, version=step, reward_mean=0.25, rollout_tokens_per_s=1234.5)
    return {**base, **extra}


def test_metrics_writes_one_json_line_per_step(tmp_path):
    out = io.StringIO()
    w = MetricsWriter(tmp_path / "run", console=out, tensorboard=False)
    w.log(record(0, staleness_hist=staleness_histogram([3, 3, 2], trainer_version=4)))
    w.log(record(1, reward_mean=np.float32(0.5), train_tokens_per_s=float("nan")))
    with pytest.raises(ValueError) as e:
        w.log({"step": 2, "version": 2})
    assert "reward_mean" in str(e.value) and "weight_sync_s" in str(e.value)
    w.close()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["staleness_hist"] == {"1": 2, "2": 1}
    assert rows[1]["reward_mean"] == 0.5 and rows[1]["train_tokens_per_s"] is None
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("step 0 v0") and "1234 tok/s" in lines[0]


def test_metrics_resume_truncates_redone_steps_and_skips_torn_line(tmp_path):
    w = MetricsWriter(tmp_path, console=None, tensorboard=False)
    for s in range(4):
        w.log(record(s))
    w.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "vers')  # crash mid-write
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
    w = MetricsWriter(tmp_path, console=None, tensorboard=False, resume_step=1)
    w.log(record(2, reward_mean=0.75))
    w.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[2]["reward_mean"] == 0.75


def test_lengths_rows_are_truncated_on_resume_like_metrics(tmp_path):
    w = MetricsWriter(tmp_path, console=None, tensorboard=False)
    for s in range(1, 4):
        w.log_lengths(s, [f"p{s}", f"p{s}"], [s, s], [3 * s, 5])
    w.close()
    w = MetricsWriter(tmp_path, console=None, tensorboard=False, resume_step=1)  # steps 2 and 3 are redone
    w.log_lengths(2, ["q", "q"], [7, 7], [4, 6])
    w.close()
    rows = read_metrics(tmp_path / "lengths.jsonl")
    assert rows == [{"step": 1, "problem_ids": ["p1", "p1"], "group_ids": [1, 1], "lengths": [3, 5]},
                    {"step": 2, "problem_ids": ["q", "q"], "group_ids": [7, 7], "lengths": [4, 6]}]
    with pytest.raises(ValueError, match="step 4: 2 problem ids, 2 group ids and 1 lengths"):
        MetricsWriter(tmp_path, console=None, tensorboard=False).log_lengths(4, ["a", "a"], [1, 1], [2])


def test_decision_events_are_lines_of_their_own_that_step_readers_skip(tmp_path):
    """A re-planning decision is one line in metrics.jsonl among the step rows: readers of steps never
    see it, `read_events` gives it, and a resume keeps it when it was taken at or before the resumed step."""
    w = MetricsWriter(tmp_path, console=None, tensorboard=False)
    w.log(record(1))
    w.log_event({"event": "replan", "step": 1, "taken": False, "why": "no step measured yet"})
    w.log(record(2))
    w.log_event({"event": "replan", "step": 2, "taken": True})
    with pytest.raises(ValueError, match="an 'event' name and an int 'step'"):
        w.log_event({"taken": True})
    w.close()
    path = tmp_path / "metrics.jsonl"
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    assert [(e["step"], e["taken"]) for e in read_events(path, "replan")] == [(1, False), (2, True)]
    MetricsWriter(tmp_path, console=None, tensorboard=False, resume_step=1).close()  # step 2 is redone
    assert [e["step"] for e in read_events(path, "replan")] == [1] and len(read_metrics(path)) == 1


def test_a_steps_output_lengths_and_each_replicas_rate():
    assert length_stats([5, 1, 3, 100, 2, 4, 6, 7, 8, 9]) == {
        "output_len_mean": 14.5, "output_len_p50": 5, "output_len_p90": 9, "output_len_max": 100}
    assert length_stats([])["output_len_mean"] is None
    # tokens per replica at the step's start and end, 2 s apart; replica ids become JSON keys
    assert replica_rates({0: 10, 1: 0}, {0: 30, 1: 8}, 2.0) == {"0": 10.0, "1": 4.0}


# ---------------------------------------------------------------- heartbeats


def test_heartbeats_deadlines():
    hb = Heartbeats(timeout_s=10)
    hb.beat(0, now=0.0)
    hb.beat(1, now=0.0)
    hb.expect(2, now=0.0)
    assert hb.dead(now=5.0) == []
    hb.beat(1, now=8.0)
    hb.beat(2, now=9.0)
    assert hb.dead(now=12.0) == [0]
    assert hb.dead(now=30.0) == [0, 1, 2]
    hb.forget(0)
    hb.beat(2, now=30.0)
    assert hb.dead(now=30.0) == [1]
    with pytest.raises(ValueError):
        Heartbeats(timeout_s=0)


def test_heartbeats_look_at_every_rank_only_when_one_may_be_overdue():
    class Looked(dict):  # counts the reads of every rank's time
        scans = 0

        def items(self):
            self.scans += 1
            return super().items()

        def values(self):
            self.scans += 1
            return super().values()

    hb = Heartbeats(timeout_s=10)
    for rank in range(1024):
        hb.expect(rank, now=0.0)
    hb.last = Looked(hb.last)
    for t in range(1, 11):  # a controller loop pass after each beat: no rank can be overdue yet
        hb.beat(t, now=float(t))
        assert hb.dead(now=float(t)) == []
    assert hb.last.scans == 0
    assert hb.dead(now=10.5) == [0, *range(11, 1024)]  # ranks 1-10 beat within the last 10 s
    hb.forget(0)
    assert hb.dead(now=10.5) == list(range(11, 1024))


def test_metrics_tensorboard_gets_numeric_scalars(tmp_path):
    class FakeTB:  # stands in for SummaryWriter (tensorboard is optional and not installed here)
        def __init__(self):
            self.scalars = {}

        def add_scalar(self, tag, value, step):
            self.scalars[(tag, step)] = value

        def close(self):
            pass

    w = MetricsWriter(tmp_path, console=None, tensorboard=False)
    w.tb = FakeTB()
    w.log(record(3, staleness_hist={"0": 5, "1": 2}, note="text"))
    scalars = w.tb.scalars
    w.close()
    assert scalars[("reward_mean", 3)] == 0.25 and scalars[("staleness_hist/1", 3)] == 2
    assert ("step", 3) not in scalars and ("note", 3) not in scalars
