"""hexrl.comm: msgpack messages (wire) over ZeroMQ (channel), validation of everything received, endpoint
exchange (store)."""
import dataclasses

import msgpack
import numpy as np
import pytest
import torch
import torch.distributed as dist
import zmq

from hexrl.comm import channel, store, wire
from hexrl.comm.channel import DealerChannel, RouterChannel
from hexrl.comm.wire import MessageError, message
from hexrl.trajectory import Trajectory


def one_of_each() -> list[dict]:
    """A valid message of every type in the schema."""
    return [
        message("prompt", group_id=7, problem_id="p-3", prompt_ids=[1, 2, 3], n=4,
                sampling={"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 16}, version=2),
        message("trajectory", group_id=7, prompt_ids=np.array([1, 2, 3], np.int32),
                completion_ids=np.array([4, 5], np.int32), logprobs=np.array([-0.5, -1.25], np.float32),
                versions=np.array([2, 3], np.int32), start_version=2, reward=1.0, finish_reason="eos", problem_id=3,
                meta={"k": "v"}, rank=1),
        message("heartbeat", rank=3, time=12.5),
        message("stats", rank=3, time=13, values={"tokens": 100, "kv_used": np.arange(4, dtype=np.int64)}),
        message("weights", version=5),
        message("weights", version=5, report=True),
        message("progress", rank=0, version=5, group_ids=[7, 7], generated=[120, 64], finished=[1, 0]),
        message("withdraw", group_ids=[7]),
        message("withdrawn", group_id=7, start_version=2, completion_ids=np.array([4, 5, 6], np.int32),
                logprobs=np.array([-0.5, -1.25, -0.1], np.float32), versions=np.array([2, 3, 3], np.int32),
                lengths=[2, 1], finish_reasons=["eos", ""], rank=1),
        message("stop", reason="done"),
        message("error", rank=2, cause="CUDA out of memory"),
        message("call", method="wait_delivered", args={"version": 3}),
        message("reply", method="counters", value={"trained": 8}),
        message("group", group_id=7, n=1, problem_id=3, seq=0, prompt_ids=np.array([1, 2, 3], np.int32),
                trajectories=[{"group_id": 7, "completion_ids": np.array([4], np.int32), "reward": 1.0}]),
    ]


def same(a, b) -> bool:
    """Deep equality that understands arrays and tensors (dtype included)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return type(a) is type(b) and a == b


def test_every_message_type_round_trips():
    for msg in one_of_each():
        assert same(msg, wire.decode(wire.encode(msg))), msg["type"]
    assert set(m["type"] for m in one_of_each()) == set(wire.SCHEMAS)


def test_arrays_round_trip_with_dtype_and_shape():
    g = torch.Generator().manual_seed(0)
    values = {
        "f32": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
        "f16": np.arange(5, dtype=np.float16),
        "i32": np.arange(6, dtype=np.int32)[::2],  # non-contiguous view
        "u8": np.frombuffer(b"\x00\x01\xff", dtype=np.uint8),
        "empty": np.zeros((0, 3), np.float32),
        "bf16": torch.randn(2, 3, generator=g).to(torch.bfloat16),
        "t_i64": torch.arange(10).reshape(2, 5).t(),  # non-contiguous tensor
        "t_bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
    }
    back = wire.decode(wire.encode(message("stats", rank=0, time=0.0, values=values)))["values"]
    for k, v in values.items():
        expect = np.ascontiguousarray(v) if isinstance(v, np.ndarray) else v.contiguous()
        assert same(expect, back[k]), k


def test_disallowed_dtype_and_bad_fields_refused_at_send():
    with pytest.raises(MessageError, match="float64"):
        wire.encode(message("stats", rank=0, time=0.0, values={"x": np.zeros(3)}))
    with pytest.raises(MessageError) as e:  # every problem named at once
        wire.encode(message("prompt", group_id="7", problem_id=1, prompt_ids=[1, 2.5], sampling={}, version=0))
    assert e.value.reason == "bad_fields"
    for field in ("group_id", "prompt_ids", "'n'"):
        assert field in str(e.value)
    with pytest.raises(MessageError, match="differ in length"):
        wire.encode(wire.trajectory_to_msg(Trajectory(1, [1], [2, 3], [-1.0], [0, 0], finish_reason="eos")))
    with pytest.raises(MessageError, match="bool"):  # a bool is not an int
        wire.encode(message("heartbeat", rank=True, time=1.0))


def test_a_moved_groups_messages_must_add_up():
    with pytest.raises(MessageError, match="differ in length"):
        wire.encode(message("progress", rank=0, version=1, group_ids=[7, 7], generated=[3], finished=[0, 1]))
    ids, lps, vs = np.array([4, 5, 6], np.int32), np.array([-0.5, -1.0, -0.1], np.float32), np.array([2, 3], np.int32)
    with pytest.raises(MessageError) as e:  # every problem at once
        wire.encode(message("withdrawn", group_id=7, start_version=2, completion_ids=ids, logprobs=lps, versions=vs,
                            lengths=[2, 2, -1], finish_reasons=["eos", 3]))
    for problem in ("3 lengths for 2 finish_reasons", "must be strings", "add up to the 3", "differ in length"):
        assert problem in str(e.value)


def test_trajectory_conversion_round_trip():
    traj = Trajectory(group_id=3, prompt_ids=[5, 6], completion_ids=[7, 8, 9], logprobs=[-0.1, -2.0, -0.75],
                      versions=[4, 4, 5], reward=0.5, finish_reason="length", problem_id="q1", meta={"a": [1]},
                      mask=None, start_version=4)
    msg = wire.trajectory_to_msg(traj, rank=2)
    assert {f.name for f in dataclasses.fields(Trajectory)} <= msg.keys()  # no field left behind
    back = wire.msg_to_trajectory(wire.decode(wire.encode(msg)))
    # the token fields arrive as typed arrays; log-probs as float32, the sampler's and the trainer's precision
    assert [back.prompt_ids.dtype, back.completion_ids.dtype, back.logprobs.dtype, back.versions.dtype] == [
        np.int32, np.int32, np.float32, np.int32]
    assert back.logprobs.tolist() == np.float32([-0.1, -2.0, -0.75]).tolist()
    assert back == Trajectory(**{**vars(traj), "logprobs": np.float32(traj.logprobs)})
    assert back != traj  # -0.1 is not a float32
    episode = Trajectory(3, [5], [7, 1, 9], [-0.5, -2.0], [4, 4], mask=[1, 0, 1])
    back = wire.msg_to_trajectory(wire.decode(wire.encode(wire.trajectory_to_msg(episode))))
    assert back.mask.dtype == np.uint8 and back == episode and back.num_generated == 2


def bad_array_message() -> bytes:
    """A well-formed msgpack message whose array holds fewer bytes than its shape needs."""
    arr = {"__nd__": True, "dtype": "float32", "shape": [4], "kind": "numpy", "data": b"\x00" * 12}
    return msgpack.packb(message("stats", rank=0, time=0.0, values={"x": arr}), use_bin_type=True)


def bad_payloads() -> dict[str, list[bytes]]:
    """reason -> raw payloads that must be rejected for that reason."""
    pack = lambda obj: msgpack.packb(obj, use_bin_type=True)  # noqa: E731
    ok = message("heartbeat", rank=1, time=1.0)
    return {
        "not_msgpack": [b"\xc1garbage", pack(ok)[:-3], pack(ok) + b"\x01"],  # never-used byte, truncated, trailing
        "not_a_map": [pack([1, 2, 3])],
        "bad_version": [pack({"rows": [1, 2], "owner": "someone else"}), pack({**ok, "v": 99})],
        "unknown_type": [pack({**ok, "type": "launch_missiles"}), pack({**ok, "type": [1]})],
        "bad_fields": [pack({**ok, "time": "noon"}), pack(message("stop"))],
        "bad_array": [bad_array_message(),
                      pack(message("stats", rank=0, time=0.0, values={"x": {"__nd__": True, "dtype": "object",
                                                                              "shape": [1], "data": b"\x00" * 8}}))],
        "oversize": [pack(message("stop", reason="x" * 5000))],
    }


SECRET = b"s" * 32  # a real job draws one with channel.new_secret()


def connected_pair():
    router = RouterChannel(SECRET, max_bytes=4096)
    endpoint = router.bind("127.0.0.1")
    dealer = DealerChannel("replica-0", SECRET, max_bytes=4096)
    dealer.connect(endpoint)
    return router, dealer


def test_channels_carry_every_message_type_both_ways():
    router, dealer = connected_pair()
    try:
        assert router.recv(timeout_s=0.05) is None  # nothing sent: times out, returns None
        for msg in one_of_each():
            assert dealer.send(msg)
            peer, got = router.recv(timeout_s=10)
            assert peer == "replica-0" and same(msg, got)
        assert router.peers == {"replica-0"}
        for msg in one_of_each():
            assert router.send(msg, to="replica-0")
            assert same(msg, dealer.recv(timeout_s=10))
        assert dealer.recv(timeout_s=0.05) is None
        assert not router.send(message("stop", reason="x"), to="nobody", timeout_s=0.05)
        assert router.stats()["send_failed"] == 1
    finally:
        router.close()
        dealer.close()


def test_router_broadcast_reaches_each_named_peer_and_names_the_rest():
    router, dealer = connected_pair()
    try:
        assert dealer.send(message("heartbeat", rank=0, time=0.0))
        assert router.recv(timeout_s=10)[0] == "replica-0"
        weights = message("weights", version=3)
        assert router.broadcast(weights, ["replica-0", "nobody"], timeout_s=0.05) == ["nobody"]
        assert same(weights, dealer.recv(timeout_s=10)) and dealer.recv(timeout_s=0.05) is None
        assert router.stats()["sent"] == 1 and router.stats()["send_failed"] == 1
    finally:
        router.close()
        dealer.close()


def test_router_rejects_bad_input_and_keeps_receiving():
    router, dealer = connected_pair()
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(router.endpoint)
    member = channel.Auth(SECRET, "replica-7")  # a member of the job sending bad payloads
    try:
        expected = {}
        for reason, payloads in bad_payloads().items():
            for p in payloads:
                raw.send_multipart([member.seal(p), p])
            expected[reason] = len(payloads)
        raw.send_multipart([b"a", b"b", b"c"])  # three frames where two are expected
        expected["bad_frames"] = 1
        good = wire.encode(message("heartbeat", rank=9, time=2.0))
        raw.send_multipart([member.seal(good), good])
        got = router.recv(timeout_s=10)
        assert got is not None and got[0] == "replica-7" and got[1]["rank"] == 9
        assert dict(router.rejected) == expected
        assert router.received == 1
    finally:
        raw.close()
        router.close()
        dealer.close()


def test_router_refuses_outsiders_forgeries_and_replays():
    """No secret, a wrong secret, an altered payload, a replayed frame, a spoofed routing id:
    each is refused by reason; the real peer keeps talking."""
    router, dealer = connected_pair()
    spoof = zmq.Context.instance().socket(zmq.DEALER)
    spoof.setsockopt(zmq.LINGER, 0)
    spoof.setsockopt(zmq.ROUTING_ID, b"replica-0")  # the real dealer's name as its ZeroMQ identity
    spoof.connect(router.endpoint)
    try:
        assert dealer.send(message("heartbeat", rank=0, time=0.0))
        assert router.recv(timeout_s=10)[0] == "replica-0"
        hb = wire.encode(message("heartbeat", rank=5, time=1.0))
        err = wire.encode(message("error", rank=0, cause="forged"))
        spoof.send(err)  # no auth frame at all
        spoof.send_multipart([channel.Auth(b"w" * 32, "replica-0").seal(err), err])  # wrong secret
        sealed = channel.Auth(SECRET, "replica-9").seal(hb)
        spoof.send_multipart([sealed, err])  # a member's seal on another payload
        spoof.send_multipart([sealed, hb])  # valid: accepted once...
        spoof.send_multipart([sealed, hb])  # ...and refused when replayed
        spoof.send_multipart([channel.Auth(SECRET, channel.CONTROLLER).seal(hb), hb])  # the controller's name
        got = router.recv(timeout_s=10)
        assert got[0] == "replica-9" and got[1]["rank"] == 5
        assert dealer.send(message("heartbeat", rank=0, time=3.0))  # the real replica is not cut off
        got = router.recv(timeout_s=10)
        assert got[0] == "replica-0" and got[1]["time"] == 3.0
        assert router.recv(timeout_s=0.5) is None  # the rest is refused
        assert dict(router.rejected) == {"bad_frames": 1, "bad_auth": 3, "replay": 1}
        assert router.send(message("stop", reason="x"), to="replica-0")
        assert dealer.recv(timeout_s=10)["reason"] == "x"  # replies still reach the real one
    finally:
        spoof.close()
        router.close()
        dealer.close()


def test_oversize_frame_drops_its_sender_not_the_job():
    router, dealer = connected_pair()  # max_bytes 4096
    big = zmq.Context.instance().socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    big.connect(router.endpoint)
    try:
        big.send_multipart([b"x" * 100, b"y" * 100_000])
        assert dealer.send(message("heartbeat", rank=0, time=0.0))
        assert router.recv(timeout_s=10)[0] == "replica-0"
        assert router.recv(timeout_s=0.3) is None  # the big frame never reached the channel
    finally:
        big.close()
        router.close()
        dealer.close()


def test_dealer_rejects_bad_input_and_keeps_receiving():
    raw = zmq.Context.instance().socket(zmq.ROUTER)
    raw.setsockopt(zmq.LINGER, 0)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    dealer = DealerChannel("replica-1", SECRET, max_bytes=4096)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    controller = channel.Auth(SECRET, channel.CONTROLLER)
    try:
        assert dealer.send(message("heartbeat", rank=1, time=0.0))
        ident, auth, payload = raw.recv_multipart()  # learn the dealer's routing id
        assert channel.Auth(SECRET, channel.CONTROLLER).open(auth, payload) == "replica-1"
        for payloads in bad_payloads().values():
            for p in payloads:
                raw.send_multipart([ident, controller.seal(p), p])
        other = wire.encode(message("stop", reason="from another replica"))
        raw.send_multipart([ident, channel.Auth(SECRET, "replica-2").seal(other), other])
        good = message("prompt", group_id=1, problem_id=0, prompt_ids=[3], n=2, sampling={}, version=0)
        payload = wire.encode(good)
        raw.send_multipart([ident, controller.seal(payload), payload])
        assert same(good, dealer.recv(timeout_s=10))
        assert dict(dealer.rejected) == {**{r: len(p) for r, p in bad_payloads().items()}, "bad_auth": 1}
    finally:
        raw.close()
        dealer.close()


def test_endpoint_exchange_through_tcpstore():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False)
    router = RouterChannel(SECRET)
    try:
        store.publish_endpoint(master, "controller", router.bind("127.0.0.1"))
        endpoint = store.lookup_endpoint(client, "controller", timeout_s=10)
        assert endpoint == router.endpoint and endpoint.startswith("tcp://127.0.0.1:")
        dealer = DealerChannel("replica-2", SECRET)
        dealer.connect(endpoint)
        assert dealer.send(message("heartbeat", rank=2, time=0.0))
        assert router.recv(timeout_s=10)[0] == "replica-2"
        dealer.close()
        with pytest.raises(TimeoutError, match="missing"):
            store.lookup_endpoint(client, "missing", timeout_s=0.1)
        with pytest.raises(ValueError):
            store.publish_endpoint(master, "bad", "localhost:1234")
    finally:
        router.close()


def test_wildcard_bind_advertises_a_connectable_address():
    router = RouterChannel(SECRET)
    dealer = DealerChannel("replica-3", SECRET)
    try:
        endpoint = router.bind("0.0.0.0", advertise="127.0.0.1")
        assert endpoint.startswith("tcp://127.0.0.1:")
        dealer.connect(endpoint)
        assert dealer.send(message("stop", reason="bye"))
        assert router.recv(timeout_s=10)[1]["reason"] == "bye"
    finally:
        router.close()
        dealer.close()
    with pytest.raises(ValueError, match="identity"):
        DealerChannel("", SECRET)
    with pytest.raises(ValueError, match="secret"):
        DealerChannel("replica-0", b"short")


def test_endpoint_exchange_through_hashstore():
    hash_store = dist.HashStore()
    store.publish_endpoint(hash_store, "replica-0", "tcp://10.0.0.1:5555")
    assert store.lookup_endpoint(hash_store, "replica-0", timeout_s=1) == "tcp://10.0.0.1:5555"


FLOODER = """
import sys, time, zmq
endpoint, secret_len = sys.argv[1], int(sys.argv[2])
socks = []
for _ in range(4):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.connect(endpoint)
    socks.append(s)
# well-formed auth frames under a wrong secret: the costliest junk (each one is hashed)
auth = bytes([9]) + b"replica-0" + (1).to_bytes(8, "big") + b"t" * 32
payload, sent, stop = b"p" * 64, 0, time.monotonic() + 8.0  # bounded: stops by itself
while time.monotonic() < stop:
    for s in socks:
        s.send_multipart([auth, payload])
    sent += len(socks)
    if sent == 20_000:
        print("flooding", flush=True)
"""


def test_a_flood_of_junk_does_not_hold_a_receive_past_its_timeout():
    """An outsider flooding the router's port (loopback, 8 s at most): each receive still returns
    by its deadline while the flood goes on, the junk is counted as bad_auth, and a member's
    message sent during the flood arrives within its receive's timeout."""
    import subprocess
    import sys

    router, dealer = connected_pair()
    flood = subprocess.Popen([sys.executable, "-c", FLOODER, router.endpoint, "32"], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert flood.stdout.readline().strip() == "flooding"
        for _ in range(3):
            assert router.recv(timeout_s=0.05) is None
            assert flood.poll() is None  # returned while the flood goes on (before: drained it first)
        assert router.rejected["bad_auth"] > 0 and set(router.rejected) == {"bad_auth"}
        assert dealer.send(message("heartbeat", rank=0, time=7.0))
        got = router.recv(timeout_s=2.0)  # the member's pipe is fair-queued with the flooder's
        assert got is not None and got[0] == "replica-0" and got[1]["time"] == 7.0
        assert flood.poll() is None  # the member got through during the flood
    finally:
        flood.kill()
        flood.wait()
        router.close()
        dealer.close()
