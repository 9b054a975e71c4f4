"""Only the job's own ranks can talk to the controller, and it trains only what it asked for.

The controller tests use real ZeroMQ channels in this process; the job test starts a real CPU
job under torchrun and attacks it from this (another) process: a spoofed replica identity,
forged and replayed messages, garbage, an oversize frame and a forged `error`."""
import math
import time
from collections import Counter
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest
import zmq
from runtime_utils import metrics, torchrun, wait_for, write_job

from hexrl.comm import channel, wire
from hexrl.comm.channel import DealerChannel, RouterChannel
from hexrl.comm.wire import message, trajectory_to_msg
from hexrl.control.controller import Controller, ControllerFailure, ReplicaInfo
from hexrl.control.dataset import DatasetCursor
from hexrl.data.problems import Problem
from hexrl.train.loss import group_advantages
from hexrl.trajectory import Trajectory

SECRET = channel.new_secret()
PROMPT = [3, 4, 5]  # what the controller's encoder returns for every problem
VOCAB = 16


def trajectory(gid, problem_id, prompt=PROMPT, tokens=(6, 7), reward=1.0, logprob=-0.5, versions=0, start_version=0):
    return trajectory_to_msg(Trajectory(gid, list(prompt), list(tokens), [logprob] * len(tokens),
                                        [versions] * len(tokens), reward=reward, finish_reason="eos",
                                        problem_id=problem_id, start_version=start_version))


@pytest.fixture
def job():
    """A controller (B=1, n=2, eta=0: one group at a time) with two connected replicas."""
    rl = SimpleNamespace(batch_size=1, group_size=2, eta=0, max_concurrent_rollouts=None, filter_equal_groups=False,
                         temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4, seed=0,
                         reward_bound=1e6)
    problems = [Problem(f"{i}+{i}=", str(2 * i), id=i, kind="synthetic") for i in range(20)]
    router = RouterChannel(SECRET)
    endpoint = router.bind("127.0.0.1")
    ctl = Controller(rl, DatasetCursor(problems, seed=0), lambda text: PROMPT,
                     [ReplicaInfo(0, 1.0), ReplicaInfo(1, 1.0)], router, vocab_size=VOCAB)
    ctl.start()
    dealers = [DealerChannel(f"replica-{i}", SECRET) for i in range(2)]
    for i, d in enumerate(dealers):
        d.connect(endpoint)
        d.send(message("heartbeat", rank=i, time=0.0))
    assert wait_for(lambda: router.peers == {"replica-0", "replica-1"}, 10)
    yield ctl, dealers
    ctl.stop()
    for d in dealers:
        d.close()
    router.close()


def next_prompt(dealer) -> dict:
    while (msg := dealer.recv(timeout_s=10)) is not None:
        if msg["type"] == "prompt":
            return msg
    raise AssertionError("no prompt within 10 s")


def settle(ctl, key, value):
    assert wait_for(lambda: ctl.counters()[key] == value, 10), ctl.counters()


def test_controller_trains_only_what_it_dispatched_to_that_peer(job):
    ctl, (d0, d1) = job
    p = next_prompt(d0)  # eta 0, B 1: one group, to replica 0 (least loaded, smallest id)
    gid, pid = p["group_id"], p["problem_id"]
    d1.send(trajectory(gid, pid))  # replica 1 never got this group
    d0.send(trajectory(gid + 100, pid))  # a group nobody was given
    settle(ctl, "rejected_messages", 2)
    d0.send(trajectory(gid, pid, reward=0.0))
    d0.send(trajectory(gid, pid, reward=1.0))
    batch = ctl.next_batch(timeout_s=10)
    assert [g.group_id for g in batch] == [gid] and sorted(batch[0].rewards) == [0.0, 1.0]

    ctl.publish_version(1)  # the gate opens for one more group; each rejected group frees its slot
    bad = [("bad_tokens", dict(tokens=(6, VOCAB))), ("not_finite", dict(reward=math.nan)),
           ("not_finite", dict(logprob=-math.inf)), ("wrong_prompt", dict(prompt=[3, 4, 9]))]
    for i, (_why, fields) in enumerate(bad):
        p = next_prompt(d0)
        d0.send(trajectory(p["group_id"], p["problem_id"], **fields))
        settle(ctl, "rejected_messages", 2 + i + 1)
    c = ctl.counters()
    assert c["rejected_reasons"] == {"not_dispatched": 2, "bad_tokens": 1, "not_finite": 2, "wrong_prompt": 1}
    assert c["trained"] == 2 and c["produced"] == 2 and c["balanced"]  # only the two real samples
    assert sum(c["dropped"].values()) == 0  # the rejected groups held no filed sample


def test_the_controller_counts_each_replicas_generated_tokens(job):
    ctl, (d0, _) = job
    p = next_prompt(d0)
    for reward in (0.0, 1.0):
        d0.send(trajectory(p["group_id"], p["problem_id"], tokens=(6, 7, 8), reward=reward))
    settle(ctl, "completion_tokens", 6)
    assert ctl.counters()["replica_tokens"] == {0: 6, 1: 0}  # the step rows' replica_tokens_per_s come from it


def nd(dtype: str, shape: list, data: bytes, kind: str = "numpy") -> dict:
    """An array as the wire carries it (hexrl.comm.wire's tagged map), with whatever a forger puts in it."""
    return {"__nd__": True, "dtype": dtype, "shape": shape, "kind": kind, "data": data}


def forged_payloads(gid, problem_id) -> dict[str, list[bytes]]:
    """reason -> payloads the channel must refuse: the token fields' arrays forged in every way."""
    good = trajectory(gid, problem_id)
    pack = lambda **over: msgpack.packb({**good, **over}, default=wire._default, use_bin_type=True)  # noqa: E731
    return {
        "bad_fields": [pack(completion_ids=np.array([6, 7], np.int64)),  # wrong dtype
                       pack(logprobs=np.array([-0.5, -0.5], np.float16)),
                       pack(completion_ids=[6, 7]),  # a list: the old format
                       pack(completion_ids=np.array([[6, 7]], np.int32)),  # 2-D
                       pack(versions=nd("int32", [2], b"\0" * 8, kind="torch")),  # a tensor, not an array
                       pack(logprobs=np.array([-0.5], np.float32)),  # length mismatch with the ids
                       pack(mask=np.array([1, 1, 1], np.uint8))],  # a mask for 3 tokens of 2
        "bad_array": [pack(completion_ids=nd("int32", [2], b"\0" * 7)),  # a bin of odd byte length
                      pack(completion_ids=nd("int32", [2], b"\0" * 4)),  # truncated array
                      pack(completion_ids=nd("int32", [1 << 40], b"\0" * 8)),  # a shape far past its bytes
                      pack(logprobs=nd("float64", [2], b"\0" * 16)),  # a dtype the wire does not carry
                      pack(completion_ids=nd("object", [1], b"\0" * 8))],  # a dtype numpy would unpickle
        "not_msgpack": [pack()[:-5]],  # the message cut short
    }


def test_forged_token_arrays_are_refused_by_reason_and_nothing_is_filed(job):
    """A trajectory's token ids, log-probs, versions and mask travel as typed arrays: every forged array is
    refused with a named reason (the channel's for the format, the controller's for the values), counted in
    rejected_reasons, and the run goes on."""
    ctl, (d0, _) = job
    p = next_prompt(d0)
    expected = Counter()
    for reason, payloads in forged_payloads(p["group_id"], p["problem_id"]).items():
        for payload in payloads:
            d0.sock.send_multipart([d0.auth.seal(payload), payload])
            expected[reason] += 1
    settle(ctl, "rejected_messages", sum(expected.values()))
    forged_values = [("bad_tokens", dict(tokens=(6, VOCAB))), ("bad_tokens", dict(tokens=(-1, 6))),
                     ("bad_tokens", dict(tokens=(6,) * 5)),  # more than max_new_tokens = 4
                     ("not_finite", dict(logprob=math.nan)), ("not_finite", dict(logprob=math.inf)),
                     ("bad_versions", dict(versions=1)), ("bad_versions", dict(start_version=1))]
    for why, fields in forged_values:  # each for a group just handed out: it is given up, its slot freed
        d0.send(trajectory(p["group_id"], p["problem_id"], **fields))
        expected[why] += 1
        settle(ctl, "rejected_messages", sum(expected.values()))
        p = next_prompt(d0)
    c = ctl.counters()
    assert c["rejected_reasons"] == expected and c["produced"] == 0
    for reward in (0.0, 1.0):
        d0.send(trajectory(p["group_id"], p["problem_id"], reward=reward))
    [group] = ctl.next_batch(timeout_s=10)
    t = group.trajectories[0]
    assert (t.completion_ids.dtype, t.logprobs.dtype, t.versions.dtype) == (np.int32, np.float32, np.int32)
    assert t.completion_ids.tolist() == [6, 7] and t.logprobs.tolist() == [-0.5, -0.5]
    assert t.prompt_ids.tolist() == PROMPT and t.prompt_ids is group.trajectories[1].prompt_ids  # one copy per group
    assert not any(a.flags.writeable for a in (t.prompt_ids, t.completion_ids, t.logprobs, t.versions))


def test_a_reward_beyond_the_bound_is_clipped_before_any_arithmetic(job):
    """An environment's reward of 1e308 is finite, but its group's mean and std are not: the controller
    clips it to rl.reward_bound (1e6 here) as it arrives, and counts it."""
    ctl, (d0, _) = job
    p = next_prompt(d0)
    for reward in (1e308, -1e308):
        d0.send(trajectory(p["group_id"], p["problem_id"], reward=reward))
    batch = ctl.next_batch(timeout_s=10)
    rewards = [t.reward for t in batch[0].trajectories]
    assert sorted(rewards) == [-1e6, 1e6] and ctl.counters()["rewards_clipped"] == 2
    assert group_advantages(rewards, [0, 0]) == pytest.approx([math.sqrt(0.5) * math.copysign(1, r) for r in rewards])
    assert ctl.state()["counters"]["rewards_clipped"] == 2  # continued after a resume


def test_a_stale_group_leaves_in_flight_so_a_resume_does_not_redo_it(job):
    ctl, (d0, _) = job
    p = next_prompt(d0)
    with ctl.lock:
        index = ctl.in_flight[p["group_id"]]
    for reward in (0.0, 1.0):
        d0.send(trajectory(p["group_id"], p["problem_id"], reward=reward))  # tokens of version 0
    settle(ctl, "accepted", 2)
    ctl.publish_version(2)  # the trainer moved on: the ready group is now 2 > eta = 0 versions old
    with pytest.raises(TimeoutError):
        ctl.next_batch(timeout_s=1)
    c, state = ctl.counters(), ctl.state()
    assert c["dropped"] == {"stale": 2} and c["too_stale"] == 1
    assert index not in state["redo"] and len(state["redo"]) == len(ctl.in_flight)  # consumed, not redone
    assert state["gate"]["accepted"] == 0  # nothing trained


def test_a_replica_error_wakes_every_trainer_wait_within_seconds(job):
    ctl, (d0, _) = job
    next_prompt(d0)
    d0.send(message("error", rank=2, cause="CUDA error: an illegal memory access"))
    t0 = time.monotonic()
    with pytest.raises(ControllerFailure, match="rollout rank 2 .replica-0. failed: CUDA error"):
        ctl.next_batch()
    with pytest.raises(ControllerFailure, match="CUDA error"):
        ctl.wait_delivered(5)  # the weight-sync readiness wait
    assert time.monotonic() - t0 < 10


def attack(endpoint: str) -> int:
    """Everything an outsider on this host can try; returns how many messages it sent."""
    zmq_context = zmq.Context.instance()
    socks = []
    for ident in (b"replica-0", None):
        s = zmq_context.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if ident:
            s.setsockopt(zmq.ROUTING_ID, ident)  # the real replica's identity: no handover any more
        s.connect(endpoint)
        socks.append(s)
    spoof, other = socks
    forged = wire.encode(trajectory(0, "evil", prompt=[1], tokens=(63,), reward=1e9))
    error = wire.encode(message("error", rank=2, cause="forged by an outsider"))
    sent = 0
    for _ in range(3):  # and replayed
        for s in socks:
            s.send(forged)  # the old wire format: one frame, no auth
            s.send_multipart([channel.Auth(b"x" * 32, "replica-0").seal(forged), forged])
            s.send_multipart([channel.Auth(b"x" * 32, "replica-0").seal(error), error])
            s.send(b"\xc1 garbage")
            s.send(msgpack.packb({"v": wire.SCHEMA_VERSION, "type": "error", "rank": 2, "cause": "forged"}))
            sent += 5
    other.send_multipart([b"a", b"b" * (wire.MAX_MESSAGE_BYTES + 4096)])  # oversize: drops this connection
    for s in socks:
        s.close()
    return sent


def test_outsiders_cannot_inject_or_stop_a_running_job(tmp_path):
    steps, B, n = 4, 2, 2
    plan = write_job(tmp_path, steps=steps, eta=1)
    run = tmp_path / "run"
    proc = torchrun(plan, run)
    assert wait_for(lambda: (run / "controller_endpoint").exists(), 120, proc)
    endpoint = (run / "controller_endpoint").read_text().strip()
    sent = attack(endpoint)  # before the real replica connects, most likely
    assert wait_for(lambda: len(metrics(run)) >= 1, 180, proc)
    sent += attack(endpoint)  # and while it trains
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    last = rows[-1]
    assert last["trajectories_trained"] == steps * B * n
    assert all(isinstance(i, int) for r in rows for i in r["problem_ids"])  # no "evil" problem trained
    assert last["rejected_messages"] == sent, last["rejected_reasons"]
    assert set(last["rejected_reasons"]) <= {"bad_frames", "bad_auth"}, last["rejected_reasons"]
