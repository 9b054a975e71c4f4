"""The controller in its own process, and the trainer's handle on it.

Rank 0's trainer runs Python between its kernels (batch hand-off, packing, bookkeeping); a controller
thread beside it shared its GIL and took in ~5x fewer trajectories (docs/fast-paths.md). So the
controller rank starts `ControllerProcess`: a fresh interpreter (`worker_pool.spawn`, as the reward
workers start: it imports the controller, ZeroMQ and numpy, not torch or the trainer) that runs the
same `Controller`, thread and all, and a proxy in the trainer with the methods the trainer calls.

    controller = ControllerProcess(setup)   # spawned, its rollout router bound: controller.endpoint
    controller.load_state(saved); controller.start()
    groups = controller.next_batch()       # Groups of Trajectories, token fields as typed arrays

Setup: one msgpack map over a private pipe (the job's secret, the rl and env settings, the prompts
already tokenized as one int32 buffer): nothing goes through argv, the environment (the child's is
`worker_env()`, without HEXRL_SECRET) or a file. The child binds the rollout router where the thread
did, and a link socket on 127.0.0.1 under a fresh secret only the two processes know, and sends both
endpoints back on the pipe.

Link: hexrl.comm's authenticated channels and wire messages (msgpack, never pickle). The proxy sends
a "call" (a method and its arguments); the child's main thread runs it on the Controller and answers
with a "reply" (the value, or the failure to raise). `next_batch` first sends the batch's groups, one
"group" message each: the prompt's ids once, each trajectory's fields as the typed arrays the rollout
sent (schema-checked again on arrival, no per-token loop).

Lifetimes: the pipe stays open for the run. The child exits when it reads EOF there (the trainer is
gone); the proxy raises ControllerFailure naming the exit code as soon as the child is gone.
"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import SimpleNamespace

import msgpack
import numpy as np

from hexrl.comm.channel import DealerChannel, RouterChannel, new_secret
from hexrl.comm.wire import SCHEMA_VERSION, MessageError, message, msg_to_trajectory, trajectory_to_msg, validate
from hexrl.control.buffer import Group
from hexrl.control.controller import Controller, ControllerFailure, ReplicaInfo
from hexrl.control.dataset import DatasetCursor
from hexrl.data.problems import Problem
from hexrl.trajectory import ID_DTYPE

TRAINER = "trainer"  # the proxy's name on the link
METHODS = frozenset({"start", "next_batch", "wait_delivered", "publish_version", "choose_eta", "counters", "state",
                     "load_state", "stop"})  # what the proxy may call
POLL_S = 0.2  # how often a waiting proxy checks that the process is alive
SEND_S = 60.0  # how long a link send may wait for room
STOP_S = 60.0  # how long stopping may take (the controller's own stop waits up to 15 s)
CALL_S = 600.0  # how long a call that does not wait on rollouts may take: its work is a lock and a copy
WAITING = frozenset({"next_batch", "wait_delivered"})  # calls that wait on the rollouts, as long as they take


@dataclass
class ControllerSetup:
    """What the controller process is built from."""

    rl: object  # the job's RLSpec (any object with its fields: the child reads its attributes)
    problems: list[Problem]
    prompt_ids: list[list[int]]  # each problem's encoded chat prompt (hexrl.data.prompts)
    replicas: list[ReplicaInfo]
    vocab_size: int
    secret: bytes  # the job's channel secret (hexrl.comm.secret)
    host: str = "127.0.0.1"  # the interface the rollout router binds
    advertise: str | None = None  # the address replicas connect to (default: host)
    env: object | None = None  # the job's EnvSpec, or None
    heartbeat_timeout_s: float = 60.0
    long_tail_alpha: float = 0.0  # the job's long_tail.alpha (0: length-blind dispatch)
    budget: dict | None = None  # a synthetic task's drifting token budget (data.synthetic.budget), or None


# ---------------------------------------------------------------- the controller process


def serve(fd: int) -> None:
    """The controller process's main: its setup from the pipe on `fd`, "ready" with the endpoints (or
    "failed" with the error), then calls from the trainer until "stop" or EOF on the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    conn = Connection(fd)
    try:
        setup = msgpack.unpackb(conn.recv_bytes(), raw=False)
        controller, link = _build(setup)
    except EOFError:  # the trainer went before it sent the setup
        return
    except BaseException as e:  # a bad setup, a port that would not bind
        conn.send_bytes(msgpack.packb({"failed": f"{type(e).__name__}: {e}"[:1000]}))
        return
    conn.send_bytes(msgpack.packb({"endpoint": controller.router.endpoint, "link": link.endpoint}))
    threading.Thread(target=_exit_with_parent, args=(conn,), name="hexrl-parent-watch", daemon=True).start()
    signal.signal(signal.SIGTERM, _terminated)
    server = _Server(controller, link)
    try:
        server.run()
    except _Terminated:  # the trainer stops while a call of its is still running here
        server.stop("terminated")


class _Terminated(BaseException):
    """SIGTERM: raised in the main thread, whatever call it is running (never caught as an Exception)."""


def _terminated(signum, frame) -> None:
    raise _Terminated()


def _build(s: dict) -> tuple[Controller, RouterChannel]:
    """The Controller of a setup map (its rollout router bound) and the link's bound router."""
    router = RouterChannel(s["secret"])
    router.bind(s["host"], advertise=s["advertise"])
    problems = [Problem(**p) for p in s["problems"]]
    encode = PromptIds(problems, np.frombuffer(s["prompt_ids"], ID_DTYPE), s["prompt_offsets"])
    env = SimpleNamespace(**s["env"]) if s["env"] is not None else None
    controller = Controller(SimpleNamespace(**s["rl"]), DatasetCursor(problems, seed=s["rl"]["seed"]),
                            encode, [ReplicaInfo(i, share, tail) for i, share, tail in s["replicas"]], router,
                            vocab_size=s["vocab_size"], heartbeat_timeout_s=s["heartbeat_timeout_s"], env=env,
                            long_tail_alpha=s["long_tail_alpha"], budget=s["budget"])
    link = RouterChannel(s["link_secret"])
    link.bind("127.0.0.1")
    return controller, link


class PromptIds:
    """The controller's prompt encoder: a prompt's ids from the trainer's tokenization, as a list (what a
    prompt message carries), sliced from one buffer only when the prompt is handed out."""

    def __init__(self, problems: list[Problem], flat: np.ndarray, offsets: list[int]):
        self.flat, self.offsets = flat, offsets
        self.index = {p.prompt: i for i, p in enumerate(problems)}  # equal prompts encode alike

    def __call__(self, prompt: str) -> list[int]:
        i = self.index[prompt]
        return self.flat[self.offsets[i]:self.offsets[i + 1]].tolist()


def _exit_with_parent(conn: Connection) -> None:
    """Block on the pipe; the trainer never writes to it, so a read returns only when it is gone."""
    try:
        conn.recv_bytes()
    except (EOFError, OSError):
        pass
    print(f"[hexrl] controller process {os.getpid()}: the trainer process is gone; exiting", file=sys.stderr,
          flush=True)
    os._exit(1)


class _Server:
    """Runs the trainer's calls on the Controller, one at a time, in the order they come."""

    def __init__(self, controller: Controller, link: RouterChannel):
        self.controller, self.link = controller, link

    def run(self) -> None:
        while True:
            got = self.link.recv(timeout_s=1.0)
            if got is None:
                continue
            peer, msg = got
            if peer != TRAINER or msg["type"] != "call" or msg["method"] not in METHODS:
                continue  # only the trainer holds the link's secret: nothing else arrives here
            if msg["method"] == "stop":
                self.stop(msg["args"].get("reason", "done"))
                return
            self._send(self._answer(msg["method"], msg["args"]))

    def stop(self, reason: str) -> None:
        """Stop the controller (it tells the replicas), answer a stop call, close the sockets."""
        self.controller.stop(reason)
        self.link.send(message("reply", method="stop", value=None), to=TRAINER, timeout_s=1.0)
        self.link.close()
        self.controller.router.close()

    def _answer(self, method: str, args: dict) -> dict:
        try:
            value = getattr(self.controller, method)(**args)
            if method == "next_batch":
                for group in value:
                    self._send(group_message(group))
                value = len(value)
            elif method == "start":
                value = None
            return message("reply", method=method, value=value)
        except ControllerFailure as e:
            return message("reply", method=method, error="ControllerFailure", detail=str(e))
        except TimeoutError as e:
            return message("reply", method=method, error="TimeoutError", detail=str(e))
        except Exception as e:  # a bug here must reach the trainer as a failure, not hang it
            return message("reply", method=method, error="ControllerFailure",
                           detail=f"controller process: {method} raised {type(e).__name__}: {e}"[:1000])

    def _send(self, msg: dict) -> None:
        if not self.link.send(msg, to=TRAINER, timeout_s=SEND_S):
            raise SystemExit(f"[hexrl] controller process: the trainer took no {msg['type']} for {SEND_S:.0f} s")


def group_message(group: Group) -> dict:
    """A "group" message: the group's fields, its prompt's ids once, each trajectory's other fields as
    a trajectory message carries them (typed arrays, as they arrived)."""
    trajectories = []
    for t in group.trajectories:
        m = trajectory_to_msg(t)
        for key in ("v", "type", "prompt_ids"):
            del m[key]
        trajectories.append(m)
    prompt = group.trajectories[0].prompt_ids if group.trajectories else np.zeros(0, ID_DTYPE)
    return message("group", group_id=group.group_id, n=group.n, problem_id=group.problem_id, seq=group.seq,
                   prompt_ids=prompt, trajectories=trajectories)


def group_from_message(msg: dict) -> Group:
    """The Group of a "group" message; MessageError if a trajectory in it fails its schema."""
    group = Group(msg["group_id"], msg["n"], msg["problem_id"], seq=msg["seq"])
    for item in msg["trajectories"]:
        if not isinstance(item, dict):
            raise MessageError("bad_fields", f"group {group.group_id}: a trajectory is a {type(item).__name__}")
        traj = {**item, "v": SCHEMA_VERSION, "type": "trajectory", "prompt_ids": msg["prompt_ids"]}
        validate(traj)
        group.trajectories.append(msg_to_trajectory(traj))
    return group


# ---------------------------------------------------------------- the trainer's proxy


class ControllerProcess:
    """The controller in a process of its own, behind `Controller`'s trainer-thread methods (module doc)."""

    def __init__(self, setup: ControllerSetup, start_timeout_s: float = 120.0):
        from hexrl.rewards.worker_pool import spawn  # the parent's only: the child never needs it

        link_secret = new_secret()
        self.proc, parent = spawn("hexrl.control.controller_process")
        self.pid, self.conn = self.proc.pid, parent
        self.waiting = False  # a call was sent and its reply not read (the trainer was interrupted in it)
        self._end = weakref.finalize(self, _end_process, self.proc, parent)  # at stop, collection or exit
        try:
            parent.send_bytes(_setup_bytes(setup, link_secret))
            ready = self._ready(start_timeout_s)
        except BaseException:
            self._end()
            raise
        self.endpoint: str = ready["endpoint"]  # where the rollout leaders connect
        self.link = DealerChannel(TRAINER, link_secret)
        self.link.connect(ready["link"])

    def _ready(self, timeout_s: float) -> dict:
        """The child's "ready" map; ControllerFailure if it failed, died or stayed silent."""
        if not self.conn.poll(timeout_s):
            raise ControllerFailure(self._gone() or f"the controller process did not start within {timeout_s:.0f} s")
        try:
            ready = msgpack.unpackb(self.conn.recv_bytes(), raw=False)
        except (EOFError, OSError):
            raise ControllerFailure(self._gone(wait_s=5.0) or "the controller process closed its pipe") from None
        if "failed" in ready:
            raise ControllerFailure(f"the controller process could not start: {ready['failed']}")
        return ready

    # ------------------------------------------------------------------ Controller's methods
    def start(self) -> "ControllerProcess":
        self._call("start")
        return self

    def next_batch(self, timeout_s: float | None = None) -> list[Group]:
        """Block until B complete groups fit the staleness bound; raise if the rollouts failed."""
        groups: list[Group] = []
        count = self._call("next_batch", {"timeout_s": timeout_s}, groups)
        if count != len(groups):
            raise ControllerFailure(f"the controller process announced {count} groups and sent {len(groups)}")
        return groups

    def wait_delivered(self, version: int) -> None:
        """Block until every live replica was told to join the broadcast of `version`."""
        self._call("wait_delivered", {"version": version})

    def publish_version(self, version: int) -> None:
        """The trainer finished `version`: open the gate and tell replicas to join the broadcast."""
        self._call("publish_version", {"version": version})

    def choose_eta(self, wait_s: float, busy_s: float, w_std: float | None, lag_hist: dict) -> int | None:
        """The staleness bound for the next version (Controller.choose_eta)."""
        return self._call("choose_eta", {"wait_s": wait_s, "busy_s": busy_s, "w_std": w_std,
                                         "lag_hist": {str(k): v for k, v in lag_hist.items()}})

    def counters(self) -> dict:
        return self._call("counters")

    def state(self) -> dict:
        """What a checkpoint needs (Controller.state)."""
        return self._call("state")

    def load_state(self, state: dict) -> None:
        """Continue from `state()` of a checkpoint (before `start`)."""
        self._call("load_state", {"state": state})

    def stop(self, reason: str = "done") -> None:
        """Stop the controller (it tells the replicas) and its process; never raises (it runs in `finally`)."""
        try:
            if self.proc.poll() is None and self.waiting:  # it is still running that call: SIGTERM ends it
                self.proc.terminate()
            elif self.proc.poll() is None:
                self._call("stop", {"reason": reason}, wait_s=STOP_S)
            self.proc.wait(timeout=STOP_S)  # it exits after stopping: then the pipe's EOF is no news to it
        except (ControllerFailure, subprocess.TimeoutExpired):
            pass
        self.link.close()
        self._end()

    # ------------------------------------------------------------------ the link
    def _call(self, method: str, args: dict | None = None, groups: list[Group] | None = None,
              wait_s: float = math.inf):
        """Call `method` with keyword `args` and wait up to `wait_s` for its reply (and, for next_batch, the
        groups before it into `groups`)."""
        if self.proc.poll() is not None:
            raise ControllerFailure(self._gone())
        if not self.link.send(message("call", method=method, args=args or {}), timeout_s=SEND_S):
            raise ControllerFailure(self._gone() or f"the controller process took no call for {SEND_S:.0f} s")
        self.waiting = True
        wait_s = min(wait_s, math.inf if method in WAITING else CALL_S)  # a process stopped (SIGSTOP) or stuck
        deadline = time.monotonic() + wait_s
        while True:
            msg = self.link.recv(timeout_s=POLL_S)
            if msg is None:
                if self.proc.poll() is not None:
                    raise ControllerFailure(self._gone())
                if time.monotonic() > deadline:
                    raise ControllerFailure(f"the controller process did not answer {method} within {wait_s:.0f} s")
            elif msg["type"] == "group" and groups is not None:
                try:
                    groups.append(group_from_message(msg))
                except MessageError as e:
                    raise ControllerFailure(f"the controller process sent a bad group: {e}") from None
            elif msg["type"] == "reply" and msg["method"] == method:
                self.waiting = False
                return _value(msg)

    def _gone(self, wait_s: float = 0.0) -> str | None:
        """Why the process is gone (its exit code or signal), or None while it runs."""
        try:
            code = self.proc.wait(timeout=wait_s) if wait_s else self.proc.poll()
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            return None
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return f"the controller process (pid {self.pid}) {how}; its last words, if any, are above in this rank's log"


def _value(reply: dict):
    """A reply's value, or the exception it carries raised here."""
    error = reply.get("error")
    if error is None:
        return reply.get("value")
    if error == "TimeoutError":
        raise TimeoutError(reply["detail"])
    raise ControllerFailure(reply["detail"])


def _setup_bytes(s: ControllerSetup, link_secret: bytes) -> bytes:
    """The setup as one msgpack map (the prompts as one int32 buffer and their offsets)."""
    lengths = [len(ids) for ids in s.prompt_ids]
    flat = np.concatenate([np.asarray(ids, ID_DTYPE) for ids in s.prompt_ids]) if lengths else np.zeros(0, ID_DTYPE)
    return msgpack.packb({
        "rl": dict(vars(s.rl)), "env": None if s.env is None else dict(vars(s.env)),
        "problems": [p.to_dict() for p in s.problems], "prompt_ids": flat.tobytes(),
        "prompt_offsets": np.concatenate([[0], np.cumsum(lengths)]).tolist(),
        "replicas": [(r.id, r.share, r.long_tail) for r in s.replicas], "vocab_size": s.vocab_size,
        "secret": s.secret, "link_secret": link_secret, "host": s.host, "advertise": s.advertise,
        "heartbeat_timeout_s": s.heartbeat_timeout_s, "long_tail_alpha": s.long_tail_alpha,
        "budget": s.budget}, use_bin_type=True)


def _end_process(proc: subprocess.Popen, conn: Connection) -> None:
    """Close the pipe (the child exits on its EOF), wait a little, kill what is left."""
    conn.close()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
