"""Dispatch by length class: with the job's long_tail.alpha above 0 and replicas marked long_tail in
the plan, the controller predicts each group's length (hint, else what the run has recorded) and
sends the groups predicted among the longest alpha of the last batch's worth to the long-tail
replicas, by their shares among themselves; the rest go to the regular replicas by share. With
alpha 0, or no replica marked, dispatch is exactly the length-blind one. A group sent regular that
outgrows its prediction (its samples' tokens at a weight update) moves to a long-tail replica with
what it generated so far.

    ctl = Controller(rl, cursor, encode, [ReplicaInfo(0, 1.0), ReplicaInfo(1, 0.5, long_tail=True)],
                     router, vocab_size, long_tail_alpha=0.2)
"""
import random
from types import SimpleNamespace

import pytest

from hexrl.comm.wire import decode, encode, message, trajectory_to_msg
from hexrl.control.controller import Controller, ReplicaInfo
from hexrl.control.dataset import DatasetCursor
from hexrl.control.dispatch import Dispatcher
from hexrl.control.length_predictor import LongTailWindow
from hexrl.data.problems import Problem
from hexrl.rollout.rollout_rank import PendingGroup, handback_message, resumed_group
from hexrl.rollout.sequence import Finished, Prefix
from hexrl.trajectory import Trajectory

SHORT, LONG = 4, 40  # sampled tokens of a short and a long problem's samples
N = 16  # problems; a quarter of them long


class Router:
    """A RouterChannel stand-in on which every replica has connected; keeps the prompts sent."""

    def __init__(self, replicas):
        self.peers, self.rejected, self.sent = {r.name for r in replicas}, {}, []

    def send(self, msg: dict, to: str, timeout_s: float = 5.0) -> bool:
        self.sent.append((msg, int(to.removeprefix("replica-"))))
        return True


def controller(replicas, alpha, problems, batch_size=8, concurrent=N):
    rl = SimpleNamespace(batch_size=batch_size, group_size=2, eta=None, max_concurrent_rollouts=concurrent,
                         filter_equal_groups=False, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=64, seed=0,
                         reward_bound=1e6)
    router = Router(replicas)
    ctl = Controller(rl, DatasetCursor(problems, seed=0), lambda text: [3, 4], replicas, router, vocab_size=16,
                     long_tail_alpha=alpha)
    return ctl, router


def answer(ctl, msg, replica, length):
    """The replica sends back the group's samples, each `length` tokens long."""
    for i in range(msg["n"]):
        traj = Trajectory(msg["group_id"], [3, 4], [5] * length, [-1.0] * length, [0] * length, reward=float(i),
                          finish_reason="eos", problem_id=msg["problem_id"])
        ctl._admit(replica, trajectory_to_msg(traj))


def epoch_order(n=N, epochs=1):
    """The problem indices in the order the controller's cursor (seed 0) hands them out."""
    cursor = DatasetCursor(list(range(n)), seed=0)
    return [cursor.next() for _ in range(n * epochs)]


def long_at_every_fourth(order):
    """Problem ids that come 4th, 8th, ... in `order`: a quarter of the groups, spread over the stream."""
    return {i for pos, i in enumerate(order) if pos % 4 == 3}


def test_groups_hinted_long_go_to_the_long_tail_replicas_by_their_shares():
    long_ids = long_at_every_fourth(epoch_order())
    problems = [Problem(f"q{i}", "1", id=i, kind="synthetic", length_hint=LONG if i in long_ids else SHORT)
                for i in range(N)]
    replicas = [ReplicaInfo(0, 1.0), ReplicaInfo(1, 1.0), ReplicaInfo(2, 1.0, long_tail=True),
                ReplicaInfo(3, 3.0, long_tail=True)]
    ctl, router = controller(replicas, alpha=0.25, problems=problems)
    ctl._dispatch()
    assert len(router.sent) == N
    to_tail = {msg["problem_id"] for msg, r in router.sent if r in (2, 3)}
    assert to_tail == long_ids  # every long group, and nothing else
    per_replica = [sum(r == k for _, r in router.sent) for k in range(4)]
    assert per_replica == [6, 6, 1, 3]  # regular groups split by share (1:1), long ones too (1:3)
    assert [ctl.dispatched[msg["group_id"]].long for msg, _ in router.sent] == [r >= 2 for _, r in router.sent]


def test_the_controller_learns_lengths_from_completed_groups_and_routes_the_next_epoch_by_them():
    order = epoch_order(epochs=2)
    long_ids = long_at_every_fourth(order[N:])  # spread over the second epoch
    problems = [Problem(f"q{i}", "1", id=i, kind="synthetic") for i in range(N)]  # no hints
    replicas = [ReplicaInfo(0, 1.0), ReplicaInfo(1, 1.0, long_tail=True)]
    ctl, router = controller(replicas, alpha=0.25, problems=problems, concurrent=1)  # one group at a time
    for _ in range(2 * N):
        ctl._dispatch()
        msg, replica = router.sent[-1]
        answer(ctl, msg, replica, LONG if msg["problem_id"] in long_ids else SHORT)
    assert ctl.lengths.predict(min(long_ids)) > 4 * ctl.lengths.predict(min(set(range(N)) - long_ids))
    second = router.sent[N:]
    assert {msg["problem_id"] for msg, r in second if r == 1} == long_ids  # learnt: the long ones, only
    assert ctl.dispatched == {}  # every group came back, and each was recorded once complete


def run(replicas, alpha, seed=1):
    """Dispatch 3 epochs with groups coming back in a random order; the (problem, replica) picks."""
    rng = random.Random(seed)
    problems = [Problem(f"q{i}", "1", id=i, kind="synthetic", length_hint=rng.choice([SHORT, LONG]))
                for i in range(N)]
    ctl, router = controller(replicas, alpha, problems, concurrent=5)
    while len(router.sent) < 3 * N:
        ctl._dispatch()
        open_groups = [(msg, r) for msg, r in router.sent if msg["group_id"] in ctl.dispatched]
        msg, r = rng.choice(open_groups)
        answer(ctl, msg, r, rng.choice([SHORT, LONG]))
    return [(msg["problem_id"], r) for msg, r in router.sent]


def test_alpha_zero_or_no_long_tail_replica_dispatches_exactly_as_length_blind():
    plain = [ReplicaInfo(0, 1.0), ReplicaInfo(1, 2.0), ReplicaInfo(2, 0.5)]
    marked = [ReplicaInfo(0, 1.0), ReplicaInfo(1, 2.0, long_tail=True), ReplicaInfo(2, 0.5, long_tail=True)]
    blind = run(plain, alpha=0.0)
    assert run(marked, alpha=0.0) == blind  # the plan's marks alone change nothing
    assert run(plain, alpha=0.25) == blind  # nor alpha alone
    assert run(marked, alpha=0.25) != blind  # both: by class
    ctl, _ = controller(marked, alpha=0.0, problems=[Problem("q", "1", id=0, kind="synthetic")])
    assert ctl.window is None and ctl.lengths is None  # nothing predicted, nothing recorded


def scan_pick(d: Dispatcher, long: bool) -> int | None:
    """The rule read straight: the live replica of the group's pool (else of the other) with the
    smallest (in flight / share, id)."""
    for pool in (long, not long):
        alive = [r for r in d.shares if r not in d.dead and (r in d.long_tail) == pool]
        if alive:
            return min(alive, key=lambda r: (len(d.in_flight[r]) / d.shares[r], r))
    return None


def test_dispatch_by_class_picks_what_a_scan_of_each_pool_picks():
    rng = random.Random(0)
    for _ in range(200):
        ids = rng.sample(range(100), rng.randint(1, 12))
        shares = {r: rng.choice([0.5, 1.0, 1.0, 2.0, 1 / 3]) for r in ids}
        d, gid = Dispatcher(shares, long_tail=frozenset(rng.sample(ids, rng.randint(0, len(ids))))), 0
        for _ in range(rng.choice([20, 1000])):  # 1000: outdated heap entries pile up and are cleared
            op, long = rng.random(), rng.random() < 0.3
            if op < 0.55:
                expected = scan_pick(d, long)
                assert d.assign(gid, long) == expected
                gid += 1
            elif op < 0.98 and d.owner:
                d.done(rng.choice(list(d.owner)))
            elif op >= 0.98:
                d.mark_dead(rng.choice(ids))
            assert d.pick(long) == scan_pick(d, long)
    with pytest.raises(ValueError, match=r"long-tail replicas \[7\] have no share"):
        Dispatcher({0: 1.0}, long_tail=frozenset({7}))


def mark_all(window: LongTailWindow, predictions) -> list[bool]:
    marks = []
    for p in predictions:
        marks.append(window.is_long(p))
        window.add(p, marks[-1])
    return marks


def test_the_window_marks_the_longest_alpha_of_the_last_batch_and_nothing_when_all_tie():
    assert not any(mark_all(LongTailWindow(0.25, 8), [0.0] * 40))  # nothing known: nothing marked
    stream = [40.0 if i % 4 == 3 else 4.0 for i in range(40)]  # a quarter long, all equal
    assert mark_all(LongTailWindow(0.25, 8), stream) == [p == 40.0 for p in stream]
    burst = mark_all(LongTailWindow(0.25, 8), [4.0] * 8 + [40.0] * 4 + [4.0] * 28)
    assert [i for i, m in enumerate(burst) if m] == [8, 9]  # a burst of long ones: the quota, earliest first
    rising = mark_all(LongTailWindow(0.5, 4), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert rising == [False, True, True, True, True, True]  # each beats the window it enters
    with pytest.raises(ValueError, match="alpha must be in"):
        LongTailWindow(1.0, 8)


class Store:
    """A torch.distributed Store stand-in: what start_controller publishes."""

    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = value


@pytest.mark.parametrize("alpha", [0.25, 0.0])
def test_a_plans_long_tail_replicas_and_the_jobs_alpha_reach_the_controller(tmp_path, monkeypatch, alpha):
    """start_controller hands the plan's marks, the job's alpha (and a synthetic task's token budget)
    to the controller process, whose setup (one msgpack map over its pipe) builds a Controller with them."""
    import msgpack

    from hexrl.control import controller_process
    from hexrl.data.prompts import Prompts
    from hexrl.plan.planner import plan_job
    from hexrl.schema import load_job, load_plan
    from hexrl.train import trainer_rank

    budget = {"start": 4, "end": 8, "steps": 10}
    job = {"model": {"preset": "tiny"}, "data": {"synthetic": {"task": "arithmetic", "n": 16, "budget": budget}},
           "rl": {"batch_size": 4, "group_size": 2, "max_new_tokens": 32}, "long_tail": {"alpha": alpha},
           "cluster": {"nodes": [{"name": "a", "gpu_type": "cpu", "gpus": 4}]}}
    plan = plan_job(load_job(job, check_paths=False)).to_dict()
    for r in plan["rollout"]["replicas"]:  # marked by hand: the last replica serves the long tail, with a small cap
        r["long_tail"], r["max_running"] = r is plan["rollout"]["replicas"][-1], 4
    plan = load_plan(plan, check_paths=False)
    ctx = SimpleNamespace(plan=plan, secret=b"k" * 32, store=Store(), run_dir=tmp_path,
                          info=next(info for info in plan.ranks if info.role == "train"))
    started = []  # the setups start_controller gives the process (a stand-in: no process here)
    monkeypatch.setattr(trainer_rank, "ControllerProcess",
                        lambda setup: started.append(setup) or SimpleNamespace(endpoint="tcp://127.0.0.1:1"))
    trainer_rank.start_controller(ctx, Prompts([Problem("q", "1", id=0, kind="synthetic")], [[3, 4]]))
    setup = msgpack.unpackb(controller_process._setup_bytes(started[0], b"l" * 32), raw=False)
    ctl, link = controller_process._build(setup)
    try:
        tail = {plan.replicas[-1].id}
        assert ctl.dispatcher.long_tail == (tail if alpha else set())
        assert (ctl.window.alpha if ctl.window else 0.0) == alpha
        assert ctl.budget == budget
    finally:
        ctl.router.close()
        link.close()


def handed_back(msg, finished_len, running_len):
    """What the regular replica sends when asked to hand back the group of prompt `msg`: sample 0
    finished at `finished_len` tokens, the others still running at `running_len` (through the wire)."""
    gid = msg["group_id"]
    group = PendingGroup(msg, start_version=0)
    group.outputs[0] = Finished(f"{gid}:0", [3, 4], [5] * finished_len, [-0.5] * finished_len, [0] * finished_len,
                                "eos")
    taken = {f"{gid}:{i}": Prefix([6] * running_len, [-0.25] * running_len, [0] * running_len)
             for i in range(1, msg["n"])}
    return decode(encode(handback_message(group, taken, rank=0)))


def progress(rows, version=1):
    """A `progress` report: rows of (group id, tokens so far, finished)."""
    gids, generated, finished = map(list, zip(*rows))
    return decode(encode(message("progress", rank=0, version=version, group_ids=gids, generated=generated,
                                 finished=finished)))


def test_a_group_that_outgrows_its_prediction_moves_to_a_long_tail_replica_with_its_prefix():
    problems = [Problem(f"q{i}", "1", id=i, kind="synthetic", length_hint=LONG if i % 4 == 3 else SHORT)
                for i in range(N)]
    ctl, router = controller([ReplicaInfo(0, 1.0), ReplicaInfo(1, 1.0, long_tail=True)], alpha=0.25,
                             problems=problems)
    ctl._dispatch()
    regular = [msg for msg, r in router.sent if r == 0 and msg["problem_id"] % 4 != 3]
    grows, stays = regular[0], regular[1]  # both hinted short; one of them now runs past every prediction
    assert not ctl.dispatched[grows["group_id"]].long and ctl.limits.generated == 64 > LONG + 8
    capacity, accounting = ctl.gate.capacity(0), ctl.buffer.accounting()
    ctl.publish_version(1)
    assert ctl.outbox.get()["report"] is True  # at the update, the replicas are asked for their progress
    ctl._handle("replica-0", progress([(grows["group_id"], LONG + 8, 1), (grows["group_id"], LONG + 4, 0),
                                       (stays["group_id"], SHORT, 1), (stays["group_id"], 2, 0)]))
    withdraw, to = router.sent[-1]
    assert withdraw["type"] == "withdraw" and withdraw["group_ids"] == [grows["group_id"]] and to == 0

    ctl._handle("replica-0", handed_back(grows, finished_len=3, running_len=LONG + 4))
    resume, to = router.sent[-1]
    gid = grows["group_id"]
    assert resume["type"] == "prompt" and resume["group_id"] == gid and to == 1 and ctl.moved == 1
    assert ctl.counters()["groups_moved"] == 1 and ctl.state()["counters"]["groups_moved"] == 1  # metrics, checkpoint
    assert ctl.dispatched[gid].replica == 1 and ctl.dispatched[gid].long and ctl.dispatcher.owner[gid] == 1
    assert ctl.gate.capacity(0) == capacity and ctl.buffer.accounting() == accounting  # still one in-flight group

    # the long-tail replica resumes it: sample 0 filed as finished, sample 1 from its prefix
    group, requests = resumed_group(decode(encode(resume)))
    assert group.start_version == 0 and group.outputs[0].token_ids == [5] * 3 and group.outputs[0].versions == [0] * 3
    assert [r.id for r in requests] == [f"{gid}:1"] and requests[0].prefix.token_ids == [6] * (LONG + 4)
    assert requests[0].prefix.logprobs == [-0.25] * (LONG + 4) and requests[0].seed == (grows["sampling"]["seed"] * 64
                                                                                       + 1) % (1 << 62)
    answer(ctl, grows, 0, LONG)  # a late answer from where it was is refused
    assert ctl.rejected["not_dispatched"] == 2 and gid in ctl.dispatched
    answer(ctl, grows, 1, LONG + 8)
    assert gid not in ctl.dispatched and ctl.buffer.accounting()["accepted"] == accounting["accepted"] + grows["n"]
    ctl._handle("replica-0", handed_back(stays, 1, 1))  # a hand-back nobody asked for changes nothing
    assert ctl.rejected["handback_not_dispatched"] == 1 and ctl.dispatched[stays["group_id"]].replica == 0


def test_with_alpha_zero_or_no_long_tail_replica_nothing_is_reported_or_moved():
    problems = [Problem(f"q{i}", "1", id=i, kind="synthetic", length_hint=LONG if i % 4 == 3 else SHORT)
                for i in range(N)]
    for replicas, alpha in [([ReplicaInfo(0, 1.0), ReplicaInfo(1, 1.0, long_tail=True)], 0.0),
                            ([ReplicaInfo(0, 1.0), ReplicaInfo(1, 1.0)], 0.25)]:
        ctl, router = controller(replicas, alpha=alpha, problems=problems)
        ctl._dispatch()
        sent = list(router.sent)
        ctl.publish_version(1)
        assert ctl.outbox.get() == message("weights", version=1)  # no report asked for
        grows = sent[0][0]
        ctl._handle("replica-0", progress([(grows["group_id"], LONG + 8, 1), (grows["group_id"], LONG + 4, 0)]))
        ctl._handle(f"replica-{sent[0][1]}", handed_back(grows, 3, LONG + 4))
        assert router.sent == sent and ctl.moved == 0 and ctl.dispatched[grows["group_id"]].replica == sent[0][1]
