"""ZeroMQ channels carrying msgpack messages between the controller and the rollout replicas.

A message is a dict with `"v": SCHEMA_VERSION`, `"type"` and the fields that `SCHEMAS[type]`
names. Arrays (numpy or torch) travel as a tagged map of raw bytes; pickle is never used.
Every received message is validated; a bad one is counted in `channel.rejected[reason]` and
skipped, so a receive loop never sees an exception from foreign or corrupted input.

Topology: the controller binds a `RouterChannel`; each rollout leader connects a
`DealerChannel` named after its replica. Prompts go router -> dealer (addressed by name);
trajectories, heartbeats and stats go dealer -> router. Endpoints travel through a
torch.distributed Store (`publish_endpoint` / `lookup_endpoint`). A channel belongs to one
thread: ZeroMQ sockets are not thread-safe.

Trust: any local process can connect to a TCP port, so every message carries an auth frame,
`[len(name)][name][seq: 8 bytes][HMAC-SHA256(secret, everything before it + payload)]`, under a
per-job secret that rank 0 generates and hands out through the torchrun store (never env or
argv, which other local users can read). A peer's name is what its valid auth frame says, never
its ZeroMQ routing id (no ROUTER_HANDOVER: a newcomer cannot take a replica's place); `seq` must
grow per sender, so a replayed frame is refused. Frames are checked before msgpack sees them, and
ZeroMQ's MAXMSGSIZE disconnects a peer that sends an oversize frame.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import math
import secrets
import socket
import time
from collections import Counter
from datetime import timedelta

import msgpack
import numpy as np
import torch
import torch.distributed as dist
import zmq

from hexrl.trajectory import Trajectory

SCHEMA_VERSION = 1
MAX_MESSAGE_BYTES = 64 << 20  # a 32k-token trajectory is well under 1 MiB
DEFAULT_HWM = 10_000  # messages queued per peer before senders wait (never silently dropped)
CONTROLLER = "controller"  # the router's name in its auth frames (no replica may claim it)
_TAG = 32  # bytes of an HMAC-SHA256

log = logging.getLogger("hexrl.comm")

# Field specs: "int", "float", "str", "bool", "dict", "list", "list[int]", "list[float]", "None",
# joined by "|"; a leading "?" marks an optional field. list[...] also accepts a 1-D array.
SCHEMAS: dict[str, dict[str, str]] = {
    "prompt": {"group_id": "int", "problem_id": "int|str", "prompt_ids": "list[int]", "n": "int",
               "sampling": "dict", "version": "int",
               # what the rollout side's reward needs: rewards run next to generation
               "answer": "?str", "tests": "?list"},
    "trajectory": {"group_id": "int", "prompt_ids": "list[int]", "completion_ids": "list[int]",
                   "logprobs": "list[float]", "versions": "list[int]", "reward": "float",
                   "finish_reason": "str", "problem_id": "?int|str|None", "meta": "?dict",
                   "rank": "?int"},
    "heartbeat": {"rank": "int", "time": "float"},
    "stats": {"rank": "int", "time": "float", "values": "dict"},
    "weights": {"version": "int"},  # trainer published `version`: join the weight broadcast
    "stop": {"reason": "str"},
    "error": {"rank": "int", "cause": "str"},
}

# dtype name -> numpy dtype of the raw bytes (bfloat16 travels as its uint16 bit pattern)
_ARRAY_DTYPES = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2", "int64": "<i8",
                 "int32": "<i4", "uint8": "u1", "bool": "?"}
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8, "bool": torch.bool}


class MessageError(ValueError):
    """A message that cannot be sent or was rejected on receipt; `reason` is a short tag."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# ---------------------------------------------------------------- arrays


def _encode_array(obj) -> dict:
    """numpy array or torch tensor -> tagged map of raw bytes (a view, not a copy, when contiguous)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        name = str(t.dtype).removeprefix("torch.")
        if name not in _ARRAY_DTYPES:
            raise MessageError("bad_array", f"tensor dtype {name} not allowed; use one of {sorted(_ARRAY_DTYPES)}")
        arr = (t.view(torch.uint16) if name == "bfloat16" else t).numpy()
        kind = "torch"
    else:
        arr = np.ascontiguousarray(obj)
        name = arr.dtype.name
        if name not in _ARRAY_DTYPES:
            raise MessageError("bad_array", f"array dtype {name} not allowed; use one of {sorted(_ARRAY_DTYPES)}")
        kind = "numpy"
    arr = arr.astype(_ARRAY_DTYPES[name], copy=False)  # a no-op on little-endian hosts
    return {"__nd__": True, "dtype": name, "shape": list(arr.shape), "kind": kind,
            "data": memoryview(arr.reshape(-1)).cast("B")}


def _decode_array(d: dict):
    """Tagged map -> numpy array (read-only view of the message bytes) or torch tensor."""
    name, shape, data = d.get("dtype"), d.get("shape"), d.get("data")
    if name not in _ARRAY_DTYPES:
        raise MessageError("bad_array", f"dtype {name!r} not allowed")
    if not (isinstance(shape, list) and len(shape) <= 32 and all(type(s) is int and s >= 0 for s in shape)):
        raise MessageError("bad_array", f"shape {shape!r} is not a list of at most 32 non-negative ints")
    if not isinstance(data, bytes):
        raise MessageError("bad_array", "data is not bytes")
    raw = np.dtype(_ARRAY_DTYPES[name])
    if math.prod(shape) * raw.itemsize != len(data):
        raise MessageError("bad_array", f"{len(data)} bytes do not hold shape {shape} of {name}")
    arr = np.frombuffer(data, dtype=raw).reshape(shape)
    if d.get("kind") != "torch" and name != "bfloat16":
        return arr
    t = torch.from_numpy(arr.copy())  # torch wants a writable buffer
    return t.view(torch.bfloat16) if name == "bfloat16" else t


def _default(obj):
    """msgpack hook for what it cannot pack natively."""
    if isinstance(obj, (np.ndarray, torch.Tensor)):
        return _encode_array(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__} "
                    "(msgpack only: dict, list, str, int, float, bool, None, bytes, arrays)")


def _object_hook(d: dict):
    return _decode_array(d) if d.get("__nd__") is True else d


# ---------------------------------------------------------------- schema


def _is_array(v) -> bool:
    return isinstance(v, (np.ndarray, torch.Tensor))


def _array_elem(v) -> str:
    """"int", "float" or "other": what a 1-D array may stand in for (bool is neither)."""
    if isinstance(v, torch.Tensor):
        return "other" if v.dtype == torch.bool else "float" if v.is_floating_point() else "int"
    return {"f": "float", "i": "int", "u": "int"}.get(v.dtype.kind, "other")


_ELEM_TYPES = {"int": {int}, "float": {int, float}}  # exact types: a bool is not a number here


def _check_one(value, kind: str) -> bool:
    """Does `value` match one alternative of a field spec (bool never counts as a number)?"""
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "None":
        return value is None
    if kind in ("list[int]", "list[float]"):
        elem = kind[5:-1]
        if _is_array(value):
            return value.ndim == 1 and _array_elem(value) == elem
        return isinstance(value, list) and set(map(type, value)) <= _ELEM_TYPES[elem]  # C-speed scan
    return isinstance(value, {"str": str, "bool": bool, "dict": dict, "list": list}[kind])


def _length(v) -> int:
    return len(v) if not _is_array(v) else int(v.shape[0])


def _semantic_problems(msg: dict) -> list[str]:
    """Checks across fields (only run once every field has the right type)."""
    kind = msg["type"]
    if kind == "prompt" and msg["n"] < 1:
        return [f"n must be >= 1, got {msg['n']}"]
    if kind == "trajectory":
        lens = {f: _length(msg[f]) for f in ("completion_ids", "logprobs", "versions")}
        if len(set(lens.values())) != 1:
            return [f"completion_ids, logprobs and versions differ in length: {lens}"]
    return []


def validate(msg) -> None:
    """Raise MessageError naming every problem of `msg` against its schema."""
    if not isinstance(msg, dict):
        raise MessageError("not_a_map", f"message is a {type(msg).__name__}, not a map")
    v, kind = msg.get("v"), msg.get("type")
    if type(v) is not int or v != SCHEMA_VERSION:
        raise MessageError("bad_version", f"schema version {v!r}, expected {SCHEMA_VERSION}")
    schema = SCHEMAS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise MessageError("unknown_type", f"type {kind!r}; known: {sorted(SCHEMAS)}")
    problems = []
    for field, spec in schema.items():
        optional, spec = spec.startswith("?"), spec.lstrip("?")
        if field not in msg:
            if not optional:
                problems.append(f"missing field {field!r}")
        elif not any(_check_one(msg[field], k) for k in spec.split("|")):
            problems.append(f"field {field!r} should be {spec}, got {type(msg[field]).__name__}")
    problems = problems or _semantic_problems(msg)
    if problems:
        raise MessageError("bad_fields", f"{msg['type']}: " + "; ".join(problems))


def message(type: str, **fields) -> dict:
    """A message of `type` with the schema version set, e.g. message("stop", reason="done")."""
    return {"v": SCHEMA_VERSION, "type": type, **fields}


def encode(msg: dict, max_bytes: int = MAX_MESSAGE_BYTES) -> bytes:
    """Validate and pack; raises MessageError (sending a bad message is the sender's bug)."""
    validate(msg)
    try:
        data = msgpack.packb(msg, default=_default, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise MessageError("unencodable", str(e)) from None
    if len(data) > max_bytes:
        raise MessageError("oversize", f"{len(data)} bytes > limit {max_bytes}")
    return data


def decode(data, max_bytes: int = MAX_MESSAGE_BYTES) -> dict:
    """Unpack and validate bytes from the wire; raises MessageError with a reason tag."""
    size = memoryview(data).nbytes
    if size > max_bytes:
        raise MessageError("oversize", f"{size} bytes > limit {max_bytes}")
    try:
        msg = msgpack.unpackb(data, raw=False, object_hook=_object_hook, strict_map_key=True)
    except MessageError:
        raise
    except Exception as e:  # msgpack raises many types on garbage (ExtraData, ValueError, StackError, ...)
        raise MessageError("not_msgpack", f"{type(e).__name__}: {e}"[:200]) from None
    validate(msg)
    return msg


# ---------------------------------------------------------------- trajectories


def trajectory_to_msg(traj: Trajectory, rank: int | None = None) -> dict:
    """A `trajectory` message holding every field of `traj` (rank: the sending replica, optional)."""
    msg = message("trajectory", group_id=traj.group_id, prompt_ids=traj.prompt_ids,
                  completion_ids=traj.completion_ids, logprobs=traj.logprobs, versions=traj.versions,
                  reward=traj.reward, finish_reason=traj.finish_reason, problem_id=traj.problem_id,
                  meta=traj.meta)
    if rank is not None:
        msg["rank"] = rank
    return msg


def _as_list(v) -> list:
    return v.tolist() if _is_array(v) else v


def msg_to_trajectory(msg: dict) -> Trajectory:
    """The Trajectory of a validated `trajectory` message (arrays become lists)."""
    if msg.get("type") != "trajectory":
        raise MessageError("bad_fields", f"expected a trajectory message, got type {msg.get('type')!r}")
    return Trajectory(group_id=msg["group_id"], prompt_ids=_as_list(msg["prompt_ids"]),
                      completion_ids=_as_list(msg["completion_ids"]),
                      logprobs=list(map(float, _as_list(msg["logprobs"]))),
                      versions=_as_list(msg["versions"]), reward=float(msg["reward"]),
                      finish_reason=msg["finish_reason"], problem_id=msg.get("problem_id"),
                      meta=dict(msg.get("meta") or {}))


# ---------------------------------------------------------------- authentication


def new_secret() -> bytes:
    """A fresh per-job secret (rank 0 makes it; `publish_secret` hands it to the job's ranks)."""
    return secrets.token_bytes(32)


class Auth:
    """Seals outgoing payloads under the job's secret as `name`; opens (checks) incoming ones."""

    def __init__(self, secret: bytes, name: str):
        if not isinstance(secret, bytes) or len(secret) < 16:
            raise ValueError("the channel secret must be at least 16 random bytes (see new_secret)")
        raw = name.encode()
        if not raw or len(raw) > 255:
            raise ValueError(f"name must be 1..255 bytes, got {name!r}")
        self.key, self.name, self.seq = secret, raw, 0
        self.last_seq: dict[bytes, int] = {}  # sender name -> highest seq accepted

    def _tag(self, head: bytes, payload) -> bytes:
        mac = hmac.new(self.key, head, hashlib.sha256)
        mac.update(payload)
        return mac.digest()

    def seal(self, payload) -> bytes:
        """The auth frame for `payload` (each call takes the next sequence number)."""
        self.seq += 1
        head = bytes([len(self.name)]) + self.name + self.seq.to_bytes(8, "big")
        return head + self._tag(head, payload)

    def open(self, auth, payload) -> str:
        """The sender's name if `auth` is a valid, fresh seal of `payload`; else MessageError
        ("bad_auth" or "replay")."""
        auth = bytes(auth)
        if not auth or len(auth) != 1 + auth[0] + 8 + _TAG:
            raise MessageError("bad_auth", f"auth frame of {len(auth)} bytes is malformed")
        head, tag = auth[:-_TAG], auth[-_TAG:]
        if not hmac.compare_digest(tag, self._tag(head, payload)):
            raise MessageError("bad_auth", "wrong MAC (not a member of this job, or altered)")
        name, seq = head[1:-8], int.from_bytes(head[-8:], "big")
        if seq <= self.last_seq.get(name, 0):
            raise MessageError("replay", f"{name!r} seq {seq} <= {self.last_seq.get(name, 0)} already seen")
        self.last_seq[name] = seq
        return name.decode("utf-8", "replace")


# ---------------------------------------------------------------- channels


class _Channel:
    """A ZeroMQ socket sending/receiving validated messages; counts what it rejects."""

    def __init__(self, kind: int, secret: bytes, name: str, hwm: int, max_bytes: int, ctx: zmq.Context | None):
        self.auth = Auth(secret, name)
        self.sock = (ctx or zmq.Context.instance()).socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_bytes + 1024)  # a bigger frame drops its sender
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        self.max_bytes = max_bytes
        self.rejected: Counter[str] = Counter()  # reason -> count of messages thrown away
        self.sent = self.received = self.send_failed = 0
        self.endpoint: str | None = None

    def bind(self, host: str = "127.0.0.1", advertise: str | None = None) -> str:
        """Bind a random free TCP port on `host`; returns the endpoint peers should connect to.

        With a wildcard host ("*", "0.0.0.0") the endpoint names `advertise`, else this host's IP.
        """
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        if advertise is None:
            advertise = socket.gethostbyname(socket.gethostname()) if host in ("*", "0.0.0.0") else host
        self.endpoint = f"tcp://{advertise}:{port}"
        return self.endpoint

    def connect(self, endpoint: str) -> None:
        """Connect to a bound peer (returns at once; ZeroMQ connects and reconnects in the background)."""
        self.sock.connect(endpoint)
        self.endpoint = endpoint

    def close(self) -> None:
        """Close now, discarding unsent messages (linger 0)."""
        self.sock.close(linger=0)

    def stats(self) -> dict:
        """Counters: sent, received, send_failed, rejected (by reason)."""
        return {"sent": self.sent, "received": self.received, "send_failed": self.send_failed,
                "rejected": dict(self.rejected)}

    def _send_frames(self, route: list, msg: dict, timeout_s: float) -> bool:
        """Encode, seal and send without ever blocking past `timeout_s`; False when the peer is
        unknown or full. `route`: the frames before the auth frame (a router's peer id)."""
        payload = encode(msg, self.max_bytes)
        frames = [*route, self.auth.seal(payload), payload]
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                self.sent += 1
                return True
            except zmq.Again:
                pass
            except zmq.ZMQError as e:
                if e.errno != zmq.EHOSTUNREACH:  # unknown router peer: may still be handshaking
                    raise
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.send_failed += 1
                return False
            time.sleep(min(remaining, 0.005))

    def _recv_frames(self, timeout_s: float):
        """Next (frames, message) that passes validation within `timeout_s`, else None."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while True:
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self.sock.poll(remaining_ms, zmq.POLLIN):
                return None
            frames = self.sock.recv_multipart(copy=False)
            try:
                head, auth, payload = self._split(frames)
                name = self.auth.open(auth.buffer, payload.buffer)  # before msgpack sees a byte
                msg = decode(payload.buffer, self.max_bytes)
            except MessageError as e:
                self._reject(e)
                continue
            self.received += 1
            return head, name, msg

    def _reject(self, e: MessageError) -> None:
        self.rejected[e.reason] += 1
        level = logging.WARNING if self.rejected[e.reason] == 1 else logging.DEBUG
        log.log(level, "rejected message on %s: %s", self.endpoint, e)

    def _split(self, frames):
        raise NotImplementedError


class RouterChannel(_Channel):
    """Controller side: one socket talking to many named peers (rollout replica leaders).

    A peer is known by the name in its first valid auth frame; replies go to the connection
    that sent it (the newest valid one, should a member reconnect)."""

    def __init__(self, secret: bytes, hwm: int = DEFAULT_HWM, max_bytes: int = MAX_MESSAGE_BYTES,
                 ctx: zmq.Context | None = None):
        super().__init__(zmq.ROUTER, secret, CONTROLLER, hwm, max_bytes, ctx)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer -> error, not a silent drop
        self.routes: dict[str, bytes] = {}  # authenticated name -> ZeroMQ routing id

    @property
    def peers(self) -> set[str]:
        """Names heard from (authenticated) so far."""
        return set(self.routes)

    def send(self, msg: dict, to: str, timeout_s: float = 5.0) -> bool:
        """Send `msg` to peer `to`; False if it is unknown or its queue stays full for `timeout_s`."""
        route = self.routes.get(to)
        if route is None:
            self.send_failed += 1
            return False
        return self._send_frames([route], msg, timeout_s)

    def recv(self, timeout_s: float) -> tuple[str, dict] | None:
        """(peer name, message) of the next valid message within `timeout_s`, else None."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while (got := self._recv_frames(deadline - time.monotonic())) is not None:
            route, name, msg = got
            if name == CONTROLLER:  # a controller's own frame sent back at it
                self._reject(MessageError("bad_auth", "a peer used the controller's name"))
                continue
            self.routes[name] = route
            return name, msg
        return None

    def _split(self, frames):
        if len(frames) != 3:
            raise MessageError("bad_frames", f"expected [peer, auth, payload], got {len(frames)} frames")
        return frames[0].bytes, frames[1], frames[2]


class DealerChannel(_Channel):
    """Rollout side: talks to the controller's RouterChannel under the name `identity`."""

    def __init__(self, identity: str, secret: bytes, hwm: int = DEFAULT_HWM, max_bytes: int = MAX_MESSAGE_BYTES,
                 ctx: zmq.Context | None = None):
        raw = identity.encode()
        if not raw or len(raw) > 255 or raw[0] == 0 or identity == CONTROLLER:
            raise ValueError(f"identity must be 1..255 bytes, not starting with NUL, not {CONTROLLER!r}; "
                             f"got {identity!r}")
        super().__init__(zmq.DEALER, secret, identity, hwm, max_bytes, ctx)
        self.identity = identity

    def send(self, msg: dict, timeout_s: float = 5.0) -> bool:
        """Send `msg` to the router; False if not connected or its queue stays full for `timeout_s`."""
        return self._send_frames([], msg, timeout_s)

    def recv(self, timeout_s: float) -> dict | None:
        """The next valid message from the controller within `timeout_s`, else None."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while (got := self._recv_frames(deadline - time.monotonic())) is not None:
            if got[1] == CONTROLLER:
                return got[2]
            self._reject(MessageError("bad_auth", f"a message signed by {got[1]!r}, not the controller"))
        return None

    def _split(self, frames):
        if len(frames) != 2:
            raise MessageError("bad_frames", f"expected [auth, payload], got {len(frames)} frames")
        return None, frames[0], frames[1]


# ---------------------------------------------------------------- endpoint exchange

_KEY_PREFIX = "hexrl/endpoint/"


def publish_endpoint(store, name: str, endpoint: str) -> None:
    """Publish `endpoint` under `name` in a torch.distributed Store (TCPStore, HashStore, ...)."""
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"endpoint {endpoint!r} is not a ZeroMQ endpoint (tcp://host:port)")
    store.set(_KEY_PREFIX + name, endpoint)


def lookup_endpoint(store, name: str, timeout_s: float = 60.0) -> str:
    """The endpoint published under `name`, waiting up to `timeout_s`; raises TimeoutError."""
    key = _KEY_PREFIX + name
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except RuntimeError as e:  # DistStoreError is a RuntimeError
        raise TimeoutError(f"no endpoint {name!r} published within {timeout_s}s ({e})") from None
    return store.get(key).decode()


_SECRET_KEY = "hexrl/secret"


def publish_secret(store, secret: bytes) -> None:
    """Hand the job's channel secret to its ranks through the torchrun store (rank 0 only)."""
    store.set(_SECRET_KEY, secret)


def lookup_secret(store, timeout_s: float = 300.0) -> bytes:
    """The job's channel secret, waiting up to `timeout_s` for rank 0 to publish it."""
    try:
        store.wait([_SECRET_KEY], timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise TimeoutError(f"no channel secret published within {timeout_s}s ({e})") from None
    return store.get(_SECRET_KEY)


def broadcast_bytes(payload: bytes | None, src: int, group, device="cpu") -> bytes:
    """Raw bytes from global rank `src` (which passes them; others pass None) to every rank of a
    torch.distributed group: the length, then the payload. Callers put msgpack in it, never pickle."""
    size = torch.tensor([len(payload or b"")], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    if payload:
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src, group=group)
    return payload if payload is not None else buf.cpu().numpy().tobytes()
