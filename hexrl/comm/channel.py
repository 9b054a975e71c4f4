"""Authenticated ZeroMQ channels carrying wire messages (hexrl.comm.wire) between the controller
and the rollout replicas.

Topology: the controller binds a `RouterChannel`; each rollout leader connects a
`DealerChannel` named after its replica. Prompts go router -> dealer (addressed by name);
trajectories, heartbeats and stats go dealer -> router. Endpoints travel through a
torch.distributed Store (hexrl.comm.store). A channel belongs to one thread: ZeroMQ sockets
are not thread-safe. Every received message is validated; a bad one is counted in
`channel.rejected[reason]` and skipped.

Trust: any local process can connect to a TCP port, so every message carries an auth frame,
`[len(name)][name][seq: 8 bytes][HMAC-SHA256(secret, everything before it + payload)]`, under a
per-job secret that never crosses the torchrun store (hexrl.comm.secret: a 0600 file in the run
directory, or HEXRL_SECRET on every launcher). A peer's name is what its valid auth frame says, never
its ZeroMQ routing id (no ROUTER_HANDOVER: a newcomer cannot take a replica's place); `seq` must
grow per sender, so a replayed frame is refused. Frames are checked before msgpack sees them, and
ZeroMQ's MAXMSGSIZE disconnects a peer that sends an oversize frame.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import socket
import time
from collections import Counter
from collections.abc import KeysView

import zmq

from hexrl.comm.wire import MAX_MESSAGE_BYTES, MessageError, decode, encode

DEFAULT_HWM = 10_000  # messages queued per peer before senders wait (never silently dropped)
CONTROLLER = "controller"  # the router's name in its auth frames (no replica may claim it)
_TAG = 32  # bytes of an HMAC-SHA256

log = logging.getLogger("hexrl.comm")


# ---------------------------------------------------------------- authentication


def new_secret() -> bytes:
    """A fresh per-job secret (rank 0 makes it; hexrl.comm.secret hands it to the job's ranks)."""
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
        ("bad_auth" or "replay"). A malformed frame is refused before any hashing (cheapest first)."""
        if not 1 + 8 + _TAG < len(auth) <= 1 + 255 + 8 + _TAG or len(auth) != 1 + auth[0] + 8 + _TAG:
            raise MessageError("bad_auth", f"auth frame of {len(auth)} bytes is malformed")
        auth = bytes(auth)
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

    def __init__(self, kind: int, secret: bytes, name: str, hwm: int, max_bytes: int,
                 zmq_context: zmq.Context | None):
        self.auth = Auth(secret, name)
        self.sock = (zmq_context or zmq.Context.instance()).socket(kind)
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
        return self._send_payload(route, encode(msg, self.max_bytes), timeout_s)

    def _send_payload(self, route: list, payload: bytes, timeout_s: float) -> bool:
        """Seal and send an encoded message (see _send_frames)."""
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
        """Next (frames, message) that passes validation within `timeout_s`, else None.

        The deadline bounds the work, not only the wait: under a flood of junk frames the call
        still returns on time (the queue is never drained first), so a caller's loop keeps its
        other duties; the fair-queued member pipes get their turn on the next call."""
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
                if time.monotonic() >= deadline:
                    return None
                continue
            self.received += 1
            return head, name, msg

    def _reject(self, e: MessageError) -> None:
        self.rejected[e.reason] += 1  # reported in the controller's metrics (rejected_reasons)
        if self.rejected[e.reason] == 1:  # a flood costs one counter increment per frame, no logging
            log.warning("rejected message on %s: %s", self.endpoint, e)

    def _split(self, frames):
        raise NotImplementedError


class RouterChannel(_Channel):
    """Controller side: one socket talking to many named peers (rollout replica leaders).

    A peer is known by the name in its first valid auth frame; replies go to the connection
    that sent it (the newest valid one, should a member reconnect)."""

    def __init__(self, secret: bytes, hwm: int = DEFAULT_HWM, max_bytes: int = MAX_MESSAGE_BYTES,
                 zmq_context: zmq.Context | None = None):
        super().__init__(zmq.ROUTER, secret, CONTROLLER, hwm, max_bytes, zmq_context)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer -> error, not a silent drop
        self.routes: dict[str, bytes] = {}  # authenticated name -> ZeroMQ routing id

    @property
    def peers(self) -> KeysView[str]:
        """Names heard from (authenticated) so far: a live read-only view (O(1), nothing copied);
        compares equal to a set of the same names."""
        return self.routes.keys()

    def send(self, msg: dict, to: str, timeout_s: float = 5.0) -> bool:
        """Send `msg` to peer `to`; False if it is unknown or its queue stays full for `timeout_s`."""
        route = self.routes.get(to)
        if route is None:
            self.send_failed += 1
            return False
        return self._send_frames([route], msg, timeout_s)

    def broadcast(self, msg: dict, to: list[str], timeout_s: float = 5.0) -> list[str]:
        """Send `msg` to each peer in `to` (encoded once, sealed per peer); the names it could not
        reach (unknown, or full for `timeout_s` each)."""
        payload = encode(msg, self.max_bytes)
        failed = []
        for name in to:
            route = self.routes.get(name)
            if route is None or not self._send_payload([route], payload, timeout_s):
                self.send_failed += route is None
                failed.append(name)
        return failed

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
                 zmq_context: zmq.Context | None = None):
        raw = identity.encode()
        if not raw or len(raw) > 255 or raw[0] == 0 or identity == CONTROLLER:
            raise ValueError(f"identity must be 1..255 bytes, not starting with NUL, not {CONTROLLER!r}; "
                             f"got {identity!r}")
        super().__init__(zmq.DEALER, secret, identity, hwm, max_bytes, zmq_context)
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
