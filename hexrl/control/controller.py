"""The controller: a thread that feeds prompts and collects trajectories.

It hands out prompt groups while the staleness gate allows, spreads them over the rollout
replicas (with a long-tail class: the groups predicted longest to the long-tail replicas, and a
group sent regular that outgrows its prediction moved to one at a weight update), files
returning trajectories into the replay buffer, and gives the trainer thread batches of B complete
groups. Only this thread touches the ZeroMQ socket; the trainer thread talks to it through
`next_batch`, `publish_version` and `state` under one lock. A run keeps it off the trainer's GIL: it
runs in a process of its own, whose main thread makes the trainer's calls
(hexrl/control/controller_process.py).
"""
from __future__ import annotations

import math
import queue
import sys
import threading
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass

from hexrl.comm.channel import RouterChannel
from hexrl.comm.wire import RESUME_FIELDS, message, msg_to_trajectory
from hexrl.control.admission import Dispatched, handback_problem, token_limits, trajectory_problem
from hexrl.control.auto_eta import AutoEta
from hexrl.control.buffer import Group, ReplayBuffer
from hexrl.control.dataset import DatasetCursor
from hexrl.control.dispatch import Dispatcher
from hexrl.control.gate import StalenessGate
from hexrl.control.heartbeat import Heartbeats
from hexrl.control.length_predictor import LengthPredictor, LongTailWindow, outgrew
from hexrl.control.progress_watch import ProgressWatch
from hexrl.data.datasets import token_budget
from hexrl.trajectory import ID_DTYPE, to_array


@dataclass
class ReplicaInfo:
    id: int
    share: float
    long_tail: bool = False  # serves the groups predicted longest (the plan's replica mark)

    @property
    def name(self) -> str:  # the ZeroMQ identity its leader connects with
        return f"replica-{self.id}"


class ControllerFailure(RuntimeError):
    """A rollout replica reported an error or went silent, or the controller thread crashed."""


class Controller:
    """Prompt dispatch, staleness gate, replay buffer and version bookkeeping (see module doc)."""

    def __init__(self, rl, cursor: DatasetCursor, encode_prompt, replicas: list[ReplicaInfo],
                 router: RouterChannel, vocab_size: int, heartbeat_timeout_s: float = 60.0, env=None,
                 long_tail_alpha: float = 0.0, budget: dict | None = None):
        """`env` (the job's EnvSpec, or None): trajectories are episodes of that environment.
        `long_tail_alpha` (the job's long_tail.alpha): with it above 0 and a replica marked long_tail,
        the groups predicted among the longest alpha of the last batch's worth dispatched go to the
        long-tail replicas; otherwise (alpha 0, or none marked) every group is dispatched by share.
        `budget` (a synthetic task's, or None): each sample's token budget drifts with the version it
        is sampled at (hexrl.data.datasets.token_budget), in place of rl.max_new_tokens."""
        self.rl, self.cursor, self.encode_prompt, self.router = rl, cursor, encode_prompt, router
        self.budget = budget
        self.limits = token_limits(rl, env)
        self.vocab_size = vocab_size  # token ids at or above it are refused (the trainer has no row for them)
        self.replicas = {r.id: r for r in replicas}
        self.by_name = {r.name: r.id for r in replicas}
        self.auto = AutoEta(rl.eta_max, rl.eta_w_std_target) if rl.eta == "auto" else None  # rl.eta "auto"
        self.gate = StalenessGate(rl.batch_size, self.auto.eta if self.auto else rl.eta, rl.max_concurrent_rollouts,
                                  max_lag=rl.eta_max if self.auto else None)
        self.buffer = ReplayBuffer(self.gate, rl.filter_equal_groups)
        self.progress = ProgressWatch(rl.batch_size, rl.group_size, env)  # says when the run makes no progress
        tail = frozenset(r.id for r in replicas if r.long_tail) if long_tail_alpha > 0 else frozenset()
        self.dispatcher = Dispatcher({r.id: r.share for r in replicas}, long_tail=tail)
        self.lengths = LengthPredictor() if tail else None  # learns each completed group's lengths
        self.window = LongTailWindow(long_tail_alpha, rl.batch_size) if tail else None
        self.moving: set[int] = set()  # groups a regular replica was asked to hand back (outgrew their prediction)
        self.moved = 0  # groups moved to a long-tail replica with their prefixes
        self.heartbeats = Heartbeats(heartbeat_timeout_s)
        self.version = 0
        self.next_group = 0
        self.in_flight: dict[int, int] = {}  # group id -> dataset index, until trained or given up
        self.dispatched: dict[int, Dispatched] = {}  # group id -> what was sent to whom, until it completes
        self.delivered = 0  # newest version every live replica was told about
        self.redo: deque[int] = deque()  # dataset indices to hand out again first (after a resume)
        self.completion_tokens = 0  # counted as trajectories arrive, for rollout tokens/s
        self.replica_tokens = {r.id: 0 for r in replicas}  # the same, per replica (this attempt only)
        self.rewards_clipped = 0  # trajectories whose reward was beyond rl.reward_bound
        self.failure: str | None = None
        self.rejected: Counter[str] = Counter()  # messages refused here (the router counts its own)
        self.lock = threading.Condition()
        self.outbox: queue.Queue[dict] = queue.Queue()  # broadcast to every replica by this thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hexrl-controller", daemon=True)

    # ------------------------------------------------------------------ trainer-thread API
    def start(self) -> "Controller":
        for r in self.replicas:
            self.heartbeats.expect(r)
        self._thread.start()
        return self

    def next_batch(self, timeout_s: float | None = None) -> list[Group]:
        """Block until B complete groups fit the staleness bound; raise if the rollouts failed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.lock:
            while True:
                if self.failure:
                    raise ControllerFailure(self.failure)
                for gid in self.buffer.drop_stale(self.version):
                    self.in_flight.pop(gid, None)  # consumed: a resume must not hand it out again
                batch = self.buffer.pop_batch(self.rl.batch_size)
                if batch is not None:
                    for g in batch:
                        self.in_flight.pop(g.group_id, None)
                    return batch
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"no batch of {self.rl.batch_size} groups within {timeout_s} s")
                self.lock.wait(0.5)

    def wait_delivered(self, version: int) -> None:
        """Block until every live replica was told to join the broadcast of `version` (so the
        trainer enters the collective only when they will too); raise if the rollouts failed."""
        with self.lock:
            while True:
                if self.failure:  # first: a failed delivery also counts as delivered
                    raise ControllerFailure(self.failure)
                if self.delivered >= version:
                    return
                self.lock.wait(0.5)

    def publish_version(self, version: int) -> None:
        """The trainer finished `version`: open the gate and tell replicas to join the broadcast."""
        with self.lock:
            self.version = version
        # with a long-tail class, the replicas report their running groups at the update (moves)
        self.outbox.put(message("weights", version=version, **({"report": True} if self.window else {})))

    def choose_eta(self, wait_s: float, busy_s: float, w_std: float | None, lag_hist: dict) -> int | None:
        """After a trainer step, before its version is published: with rl.eta "auto", the bound for the
        next version from the step's signals (hexrl/control/auto_eta.py); the bound in force either way."""
        if self.auto is None:
            return self.gate.eta
        eta = self.auto.update(wait_s, busy_s, w_std, lag_hist)
        with self.lock:
            self.gate.eta = eta
        return eta

    def stop(self, reason: str = "done") -> None:
        self.outbox.put(message("stop", reason=reason))
        deadline = time.monotonic() + 5
        while not self.outbox.empty() and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        self._stop.set()
        if self._thread.ident is not None:  # stopped before it started (a failed resume): no thread to wait for
            self._thread.join(timeout=10)
        with self.lock:
            self.buffer.drain("shutdown")

    def state(self) -> dict:
        """What a checkpoint needs so a resume neither repeats nor skips a prompt, lets the gate run
        exactly as far ahead as an uninterrupted run, and continues every counter.

        Work not yet trained (open and ready groups) is redone after a resume, so the saved
        counters leave it out, as if it had never been produced.
        """
        with self.lock:
            ready = self.buffer.ready
            return {"cursor": self.cursor.state(), "next_group": self.next_group,
                    "redo": sorted(set(self.in_flight.values()) | set(self.redo)), "version": self.version,
                    # gate.accepted counts trained + ready groups; the ready ones will be redone
                    "gate": {"accepted": self.gate.accepted - len(ready), "released": dict(self.gate.released),
                             "too_stale": self.gate.too_stale},
                    "counters": {**self.buffer.counters(), "completion_tokens": self.completion_tokens,
                                 "rewards_clipped": self.rewards_clipped, "env_timeouts": self.progress.env_timeouts,
                                 "groups_moved": self.moved, "rejected": dict(self._rejected())},
                    **({"auto_eta": self.auto.state()} if self.auto else {})}

    def load_state(self, state: dict) -> None:
        """Continue from `state()` of a checkpoint (older checkpoints lack "gate"/"counters")."""
        self.cursor.load_state(state["cursor"])
        self.next_group = state["next_group"]
        self.redo = deque(state["redo"])
        self.version = state["version"]
        gate = state.get("gate", {"accepted": self.version * self.rl.batch_size})  # trained groups
        self.gate.accepted = gate["accepted"]
        self.gate.released.update(gate.get("released", {}))
        self.gate.too_stale = gate.get("too_stale", 0)
        if self.auto and "auto_eta" in state:  # the bound it had chosen, not a fresh start at 1
            self.auto.load_state(state["auto_eta"])
            self.gate.eta = self.auto.eta
        counters = state.get("counters", {})
        self.buffer.load_counters(counters)
        self.completion_tokens = counters.get("completion_tokens", 0)
        self.rewards_clipped = counters.get("rewards_clipped", 0)
        self.moved = counters.get("groups_moved", 0)
        self.progress.env_timeouts = counters.get("env_timeouts", 0)
        self.rejected.update(counters.get("rejected", {}))

    def counters(self) -> dict:
        with self.lock:
            acc = self.buffer.accounting()
            rejected = self._rejected()
            per_replica = {str(r): n for r, n in self.replica_tokens.items()}  # str keys: msgpack maps take no ints
            return {**acc, "completion_tokens": self.completion_tokens, "replica_tokens": per_replica,
                    "too_stale": self.gate.too_stale,
                    "rewards_clipped": self.rewards_clipped, "env_timeouts": self.progress.env_timeouts,
                    "equal_groups_in_a_row": self.progress.equal_in_a_row, "groups_moved": self.moved,
                    "rejected_messages": sum(rejected.values()), "rejected_reasons": dict(rejected)}

    def _rejected(self) -> Counter:
        """Messages refused, by reason: here and by the channel (copied at once: the controller
        thread adds to the channel's counter without the lock)."""
        return Counter(dict(self.router.rejected)) + self.rejected

    # ------------------------------------------------------------------ controller thread
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._flush_outbox()
                with self.lock:
                    self._dispatch()
                self._receive(timeout_s=0.02)
                self._check_replicas()
            except Exception as e:  # surface to the trainer thread instead of dying silently
                with self.lock:
                    self.failure = f"controller thread crashed: {type(e).__name__}: {e}"
                    self.lock.notify_all()
                return

    def _flush_outbox(self) -> None:
        if self.outbox.empty():  # the common pass: nothing to broadcast, nothing per replica to check
            return
        live = [r.name for r in self.replicas.values() if r.id not in self.dispatcher.dead]
        peers = self.router.peers
        if any(name not in peers for name in live):
            return  # every replica must hear a version change: wait until all have connected
        while not self.outbox.empty():
            msg = self.outbox.get()
            for name in self.router.broadcast(msg, live, timeout_s=30):
                self._fail(f"could not deliver {msg['type']} to {name}")
            if msg["type"] == "weights":
                with self.lock:
                    self.delivered = max(self.delivered, msg["version"])
                    self.lock.notify_all()

    def _dispatch(self) -> None:
        # work for version v goes out only once every replica was told of v: its prompts then queue
        # behind the weights message, so none is sampled by older weights and dropped as stale
        version = min(self.version, self.delivered)
        while self.gate.capacity(version) > 0:
            index, replica, long, guess = self._route()
            if index is None:
                return  # no live replica (of the group's class) has connected yet
            problem = self.cursor.problems[index]
            gid, prompt_ids = self.next_group, self.encode_prompt(problem.prompt)
            msg = message("prompt", group_id=gid, problem_id=problem.id, prompt_ids=prompt_ids,
                          n=self.rl.group_size, sampling=self._sampling(gid, version), version=version,
                          answer=str(problem.answer), **({"tests": problem.tests} if problem.tests else {}))
            if not self.router.send(msg, to=self.replicas[replica].name, timeout_s=5):
                self.redo.appendleft(index)
                return
            self.gate.try_acquire(version)
            self.buffer.expect(gid, self.rl.group_size, problem.id)
            self.dispatcher.assign(gid, long)
            if self.window is not None:
                self.window.add(guess, long)
            prompt = to_array(prompt_ids, ID_DTYPE, "prompt_ids")
            prompt.flags.writeable = False  # the group's trajectories will share it, read-only like their own arrays
            self.dispatched[gid] = Dispatched(replica, problem.id, prompt, long, msg=msg)
            self.in_flight[gid] = index
            self.next_group += 1

    def _route(self) -> tuple[int | None, int | None, bool, float]:
        """The next problem's dataset index, its replica, whether it goes as the long tail, and its
        predicted length; index None (and no problem taken) while that replica has not connected.
        One class: the replica first. Two classes: the problem first, its predicted length chooses
        the pool."""
        if self.window is None:
            replica = self.dispatcher.pick()
            return (self._next_index() if self._connected(replica) else None), replica, False, 0.0
        index = self._next_index()
        problem = self.cursor.problems[index]
        guess = self.lengths.predict(problem.id, hint=problem.length_hint)
        long = self.window.is_long(guess)
        replica = self.dispatcher.pick(long)
        if not self._connected(replica):
            self.redo.appendleft(index)  # handed out first once it has
            return None, replica, long, guess
        return index, replica, long, guess

    def _connected(self, replica: int | None) -> bool:
        """A live replica whose leader has connected (None: every replica is dead)."""
        return replica is not None and self.replicas[replica].name in self.router.peers

    def _next_index(self) -> int:
        """The dataset index of the next problem to hand out: one to redo first, else the cursor's next."""
        return self.redo.popleft() if self.redo else self.cursor.next_indexed()[0]

    def _sampling(self, gid: int, version: int) -> dict:
        rl = self.rl
        budget = rl.max_new_tokens if self.budget is None else token_budget(self.budget, version)
        return {"temperature": rl.temperature, "top_p": rl.top_p, "top_k": rl.top_k,
                "max_new_tokens": budget, "seed": rl.seed * 1_000_003 + gid}

    def _receive(self, timeout_s: float) -> None:
        # drain everything waiting before dispatching again: replacements for filtered groups then go
        # out together and the engine admits them in one batch (a capped drain made batches smaller and
        # steps slower; docs/learning.md)
        got = self.router.recv(timeout_s)
        while got is not None:
            self._handle(*got)
            got = self.router.recv(0)

    def _handle(self, peer: str, msg: dict) -> None:
        replica = self.by_name.get(peer)
        if replica is None:
            self.rejected["unknown_peer"] += 1
            return
        self.heartbeats.beat(replica)
        kind = msg["type"]
        if kind == "trajectory":
            with self.lock:
                self._admit(replica, msg)
                self.lock.notify_all()
        elif kind == "progress":
            with self.lock:
                self._on_progress(replica, msg)
        elif kind == "withdrawn":
            with self.lock:
                self._move(replica, msg)
                self.lock.notify_all()
        elif kind == "error":
            self._fail(f"rollout rank {msg['rank']} ({peer}) failed: {msg['cause']}")

    def _admit(self, replica: int, msg: dict) -> None:
        """File a trajectory from `replica` if it is one it was asked for (see admission.py)."""
        gid = msg["group_id"]
        sent = self.dispatched.get(gid)
        why = trajectory_problem(msg, sent, replica, self.vocab_size, self.limits, self.version)
        if why is not None:
            self.rejected[why] += 1
            if why != "not_dispatched":  # the group cannot complete as sent: give it up
                self.buffer.abandon(gid, f"rejected_{why}")
                self._group_done(gid, trained=False)
            return
        traj = msg_to_trajectory(msg)
        traj.prompt_ids = sent.prompt_ids  # equal (checked): the group's samples then hold one copy
        if abs(traj.reward) > self.rl.reward_bound:  # before anything adds, squares or compares rewards
            traj.reward = math.copysign(self.rl.reward_bound, traj.reward)
            self.rewards_clipped += 1
        self.completion_tokens += traj.num_generated  # sampled tokens (an episode's observations are not)
        sent.lengths.append(traj.num_generated)
        self.replica_tokens[replica] += traj.num_generated
        status = self.buffer.add(traj)
        if self.lengths is not None and status in ("accepted", "filtered"):  # complete: all n lengths known
            self.lengths.record(sent.problem_id, sent.lengths)
        if status != "pending":
            self._group_done(gid, trained=status == "accepted")
        self._watch_progress(traj.finish_reason, status)

    def _on_progress(self, replica: int, msg: dict) -> None:
        """A regular replica's running groups at a weight update: ask it to hand back those that
        outgrew their prediction, when a long-tail replica is alive to take them."""
        if self.window is None or replica in self.dispatcher.long_tail or not self.dispatcher.has_live(True):
            return
        if any(not 0 <= n <= self.limits.generated for n in msg["generated"]):
            self.rejected["bad_progress"] += 1  # the predictor refuses such lengths: refuse them here
            return
        samples: dict[int, tuple[list, list]] = defaultdict(lambda: ([], []))  # gid -> (finished, running)
        for gid, n, done in zip(msg["group_ids"], msg["generated"], msg["finished"]):
            samples[int(gid)][0 if done else 1].append(int(n))
        move = [gid for gid, (finished, running) in samples.items() if self._outgrew(replica, gid, finished, running)]
        if move and self.router.send(message("withdraw", group_ids=move), to=self.replicas[replica].name,
                                     timeout_s=5):
            self.moving.update(move)

    def _outgrew(self, replica: int, gid: int, finished: list[int], running: list[int]) -> bool:
        """Whether the group `gid`, sent regular to `replica`, would now be marked long."""
        sent = self.dispatched.get(gid)
        if sent is None or sent.replica != replica or sent.long or gid in self.moving:
            return False
        if len(finished) + len(running) != self.rl.group_size:
            return False
        hint = self.cursor.problems[self.in_flight[gid]].length_hint
        return outgrew(self.lengths, self.window, sent.problem_id, hint, finished, running, self.rl.group_size)

    def _move(self, replica: int, msg: dict) -> None:
        """A group handed back: send it on to a long-tail replica with what its samples generated so
        far. It stays the same in-flight group (the gate and the buffer see no change)."""
        gid = msg["group_id"]
        sent = self.dispatched.get(gid)
        why = handback_problem(msg, sent, replica, gid in self.moving, self.rl.group_size, self.vocab_size,
                               self.limits, self.version)
        if why is not None:
            self.rejected[f"handback_{why}"] += 1
            if why != "not_dispatched":
                self.buffer.abandon(gid, f"rejected_{why}")
                self._group_done(gid, trained=False)
            return
        self.moving.discard(gid)
        self.dispatcher.done(gid)
        target = self.dispatcher.assign(gid, long=True)
        resume = {k: msg[k] for k in RESUME_FIELDS}
        if target is None or not self.router.send({**sent.msg, "resume": resume}, to=self.replicas[target].name,
                                                  timeout_s=5):
            self.buffer.abandon(gid, "move_failed")
            self._group_done(gid, trained=False)
            return
        sent.replica, sent.long = target, target in self.dispatcher.long_tail  # regular if every long-tail one died
        self.moved += 1

    def _watch_progress(self, finish_reason: str, status: str) -> None:
        """Count what keeps a run from progressing; print a warning when one is due."""
        self.progress.on_trajectory(finish_reason)
        if status in ("accepted", "filtered"):
            self.progress.on_group(equal=status == "filtered")  # the buffer's one filter: equal rewards
        for line in self.progress.warnings():
            print(line, file=sys.stderr, flush=True)

    def _group_done(self, gid: int, trained: bool) -> None:
        """A group left the replica: it is complete (kept for training) or will never be trained."""
        self.dispatcher.done(gid)
        self.dispatched.pop(gid, None)
        self.moving.discard(gid)
        if not trained:
            self.in_flight.pop(gid, None)

    def _check_replicas(self) -> None:
        for replica in self.heartbeats.dead():
            with self.lock:
                for gid in self.dispatcher.mark_dead(replica):
                    self.buffer.abandon(gid, "replica_dead")
                    self.dispatched.pop(gid, None)
                    self.moving.discard(gid)
                    self.redo.append(self.in_flight.pop(gid))
                self.heartbeats.forget(replica)
                # its ranks are in every weight broadcast: without them the next sync would hang
                self._fail(f"rollout replica {self.replicas[replica].name} sent nothing for "
                           f"{self.heartbeats.timeout_s:.0f} s (hung, or cut off from the controller)")

    def _fail(self, why: str) -> None:
        with self.lock:
            self.failure = self.failure or why
            self.lock.notify_all()
