"""Worker pools: run calls in worker processes, with a per-call timeout.

`WorkerPool` runs `fn(*args)` for queued items; a call that raises, returns garbage (its
`check` raises), crashes its process or hangs fails with a status ("error" or "timeout") and is
counted in `pool.stats`; a hung or dead worker is killed and replaced, so the caller keeps
going. `submit` + `finished` run without waiting (the rollout leader decodes on meanwhile).
`RewardPool` scores completions (a failure scores 0.0; `score` waits for its batch); the
environments' calls (hexrl/envs/pool.py) use the same mechanism.

An idle worker is handed a chunk of queued items in one message and streams a reply per item,
so a worker keeps scoring while its caller decodes, however rarely the caller polls. Each item
still has its own `timeout_s`: the clock restarts at every reply.

A worker is a fresh `python -c BOOT` (`spawn`) (not multiprocessing's spawn, which re-imports the
launching module, `hexrl.main` and torch with it, in every worker): it imports this module and what
its functions need, so replacing one is cheap. It starts with `worker_env()`, none of the job's
variables: model output reaches workers, the job's secret must not.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Callable, Iterable, Mapping

from hexrl.rewards.code import code_reward, unsafe_default
from hexrl.rewards.gym import gym_reward, import_gym
from hexrl.rewards.math import math_reward
from hexrl.rewards.sandbox import check_isolation
from hexrl.rewards.synthetic import exact_match_reward

RewardFn = Callable[[str, object], float]

REWARD_FNS: dict[str, RewardFn] = {"math": math_reward, "exact": exact_match_reward, "code": code_reward,
                                   "gym": gym_reward}


def reward_fn_by_name(name: str) -> RewardFn:
    """The reward function called `name`: "math", "exact", "code" or "gym"."""
    if name not in REWARD_FNS:
        raise ValueError(f"unknown reward {name!r}; choose one of {sorted(REWARD_FNS)}")
    return REWARD_FNS[name]


@dataclass
class PoolStats:
    """How calls ended (restarts counts replaced worker processes)."""

    ok: int = 0
    error: int = 0
    timeout: int = 0
    restarts: int = 0


def _picklable(item) -> bool:
    """Whether `Connection.send` can pickle `item` (it uses this pickler)."""
    try:
        ForkingPickler.dumps(item)
        return True
    except Exception:
        return False


def _warm_up(fn: RewardFn) -> None:
    """Pay one-time import costs before the first timed call (math-verify's first: seconds)."""
    if fn is math_reward:
        math_reward("\\boxed{\\sqrt{4}}", "2")
    if fn is gym_reward:  # importing reasoning-gym's ~100 tasks takes seconds
        import_gym()


MAX_CHUNK = 32  # items handed to one worker at once: enough to outlast a decode step


def _identity(value):
    return value


def _finite_float(value) -> float:
    """A reward's check: a finite float, else ValueError."""
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"reward returned {value}")
    return value


# a worker's variables: what Python, the locale and thread pools read, and the code reward's opt-out
KEPT_ENV = frozenset({"PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "VIRTUAL_ENV",
                      "CUDA_VISIBLE_DEVICES", "HEXRL_CODE_REWARD_UNSAFE"})
# a fresh interpreter's first line: this process's sys.path, then `serve(fd)` of the module named
BOOT = "import json, sys; sys.path[:] = json.loads(sys.argv[2]); from {module} import serve; serve(int(sys.argv[1]))"


def worker_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables a worker process starts with: KEPT_ENV, LC_*, PYTHON* and *_THREADS of `environ`;
    nothing else of the job's (HEXRL_SECRET, tokens, keys)."""
    return {k: v for k, v in environ.items()
            if k in KEPT_ENV or k.startswith(("LC_", "PYTHON")) or k.endswith("_THREADS")}


def spawn(module: str) -> tuple[subprocess.Popen, Connection]:
    """A fresh interpreter (`python -c BOOT`) running `module`'s serve(fd) on the child end of a pipe,
    with worker_env() and this process's sys.path; returns it and the pipe's parent end."""
    parent, child = Pipe()
    argv = [sys.executable, "-c", BOOT.format(module=module), str(child.fileno()), json.dumps(sys.path)]
    try:
        proc = subprocess.Popen(argv, pass_fds=(child.fileno(),), env=worker_env(), stdin=subprocess.DEVNULL)
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()
    return proc, parent


def serve(fd: int) -> None:
    """A worker process's main: (fn, check, warm_up) from the pipe on `fd`, `warm_up()`, then a chunk
    of (job, *args) in, one (job, "ok"|"error", check(fn(*args))) out per item, in order; None stops
    it. A start that fails is reported as ("failed", its error)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    conn = Connection(fd)
    try:
        fn, check, warm_up = conn.recv()
        if warm_up is not None:  # before "ready": one-time costs never count against a call's timeout
            warm_up()
    except EOFError:  # the pool closed before it sent them
        return
    except BaseException as e:  # an import or an environment's __init__ that raises, or exits
        conn.send(("failed", f"{type(e).__name__}: {e}"[:1000]))
        return
    conn.send(("ready",))
    while True:
        try:
            chunk = conn.recv()
        except EOFError:
            return
        if chunk is None:
            return
        for job, *args in chunk:
            try:
                conn.send((job, "ok", check(fn(*args))))
            except BaseException as e:  # SystemExit too: the worker must survive its call
                conn.send((job, "error", f"{type(e).__name__}: {e}"[:300]))


@dataclass
class _Batch:
    """One submitted batch: a result per item (None until done) and how many are still out."""

    results: list
    left: int


@dataclass
class _Worker:
    proc: subprocess.Popen
    conn: Connection
    started: float
    ready: bool = False
    jobs: deque = field(default_factory=deque)  # its chunk's unscored items, oldest (being scored) first
    deadline: float = math.inf  # for the oldest item


class WorkerPool:
    """Run `check(fn(*args))` for each submitted item in `workers` spawned processes.

    `fn`, `check` and `warm_up` (run once per worker before it takes work) are picklable
    module-level functions (or partials of them). Items run first in, first out, across batches;
    a lock makes the pool thread-safe. A failed item's result is
    `self.failed(status, message)` (subclasses choose it; here `(status, message)`).
    """

    name = "WorkerPool"

    def __init__(self, fn: Callable, workers: int = 2, timeout_s: float = 10.0,
                 start_timeout_s: float = 60.0, check: Callable | None = None, warm_up: Callable | None = None):
        self.fn, self.check, self.warm_up = fn, check or _identity, warm_up
        problems = []
        if not callable(self.fn):
            problems.append(f"fn must be callable, got {type(self.fn).__name__}")
        if not isinstance(workers, int) or workers < 1:
            problems.append(f"workers must be an int >= 1, got {workers!r}")
        if not timeout_s > 0:
            problems.append(f"timeout_s must be > 0, got {timeout_s!r}")
        if problems:
            raise ValueError(f"{self.name}: " + "; ".join(problems))
        try:
            self._setup = ForkingPickler.dumps((self.fn, self.check, self.warm_up))
        except Exception as e:  # typically a lambda or a local function
            raise ValueError(f"{self.name} fn {self.fn!r} cannot be sent to a worker process "
                             f"(use a module-level function): {e}") from e
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.stats = PoolStats()
        self.recent_errors: deque[str] = deque(maxlen=20)
        self._lock = threading.Lock()
        self._closed = False
        self._queue: deque[tuple] = deque()  # ((ticket, i), *args)
        self._batches: dict[int, _Batch] = {}
        self._tickets = itertools.count()
        self._workers: list[_Worker] = []
        self._stop = weakref.finalize(self, _stop_workers, self._workers)  # at close, collection or exit
        try:
            self._workers.extend(self._start() for _ in range(workers))
            self._wait_all_ready()
        except BaseException:
            self.close()
            raise

    # -- workers ---------------------------------------------------------------

    def _start(self) -> _Worker:
        proc, parent = spawn("hexrl.rewards.worker_pool")
        try:
            parent.send_bytes(self._setup)
        except OSError:
            pass  # it died at once: _receive reports it
        return _Worker(proc, parent, started=time.monotonic())

    def _replace(self, i: int) -> None:
        _kill(self._workers[i])
        self.stats.restarts += 1
        self._workers[i] = self._start()

    def _wait_all_ready(self) -> None:
        while not all(w.ready for w in self._workers):
            self._poll(wait_s=0.5)

    # -- scoring ---------------------------------------------------------------

    def failed(self, status: str, message: str):
        """The result of an item that failed with `status` ("error" or "timeout")."""
        return (status, message)

    def submit(self, items: Iterable[tuple]) -> int:
        """Queue argument tuples and return at once; the ticket names the batch in what `finished`
        returns."""
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        items = list(items)
        with self._lock:
            ticket = next(self._tickets)
            self._batches[ticket] = _Batch([None] * len(items), len(items))
            self._queue.extend(((ticket, i), *args) for i, args in enumerate(items))
            self._dispatch()
        return ticket

    def finished(self, wait_s: float = 0.0) -> dict[int, list]:
        """Every submitted batch now complete, by ticket: its results in order. Waits up to
        `wait_s` for replies when items are out."""
        with self._lock:
            if self._queue or any(w.jobs for w in self._workers):  # (a queue may wait on a restart)
                self._poll(wait_s)
                self._dispatch()
            done = [t for t, b in self._batches.items() if b.left == 0]
            return {t: self._batches.pop(t).results for t in done}

    @property
    def pending(self) -> int:
        """Submitted batches not yet returned by `finished`."""
        return len(self._batches)

    def run(self, items: Iterable[tuple]) -> list:
        """The results of argument tuples, in order, once all are done."""
        ticket = self.submit(items)
        with self._lock:
            while self._batches[ticket].left:
                self._poll(wait_s=1.0)
                self._dispatch()
            return self._batches.pop(ticket).results

    def _dispatch(self) -> None:
        """Share the queue among the idle workers, one chunk each (a busy worker gets nothing:
        it reads its next message only once its chunk is scored, so a send never blocks)."""
        idle = [i for i, w in enumerate(self._workers) if w.ready and not w.jobs]
        for n, i in enumerate(idle):
            if not self._queue:
                return
            take = min(MAX_CHUNK, -(-len(self._queue) // (len(idle) - n)))
            chunk = [self._queue.popleft() for _ in range(take)]
            w = self._workers[i]
            try:
                w.conn.send(chunk)
            except (BrokenPipeError, ConnectionError, EOFError):  # died while idle: not the items' fault
                self._queue.extendleft(reversed(chunk))
                self._replace(i)
                continue
            except Exception as e:  # nothing was sent (pickling comes first): fail what cannot be pickled
                bad = [item for item in chunk if not _picklable(item)] or chunk
                for job, *_ in bad:
                    self._finish(job, "error", f"cannot send item: {e}")
                self._queue.extendleft(reversed([item for item in chunk if item not in bad]))
                continue
            w.jobs.extend(chunk)
            w.deadline = time.monotonic() + self.timeout_s

    def _poll(self, wait_s: float) -> None:
        """Wait for messages (or the nearest deadline), then handle replies, deaths and timeouts."""
        now = time.monotonic()
        nearest = min([w.deadline for w in self._workers if w.jobs], default=math.inf)
        for conn in wait([w.conn for w in self._workers], timeout=max(0.0, min(wait_s, nearest - now))):
            i = next(k for k, w in enumerate(self._workers) if w.conn is conn)
            while self._workers[i].conn is conn and self._receive(i) and conn.poll():
                pass  # every reply already there: a chunk streams one per item
        now = time.monotonic()
        for i, w in enumerate(self._workers):
            if w.jobs and now >= w.deadline:
                self._finish(w.jobs.popleft()[0], "timeout", f"no result within {self.timeout_s}s")
                self._requeue(w)
                self._replace(i)
            elif not w.ready and now - w.started > self.start_timeout_s:
                raise RuntimeError(f"{self.name} worker did not start within {self.start_timeout_s}s")

    def _receive(self, i: int) -> bool:
        """Handle one message from worker i; False if it died (and was replaced)."""
        w = self._workers[i]
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            code = _exit_code(w.proc)
            if not w.ready:
                raise RuntimeError(f"{self.name} worker died while starting (exit code {code}); "
                                   f"is {self.fn!r} importable in a fresh process?") from None
            if w.jobs:  # replies come in order: the oldest unscored item is the one it died on
                self._finish(w.jobs.popleft()[0], "error", f"worker process died (exit code {code})")
                self._requeue(w)
            self._replace(i)
            return False
        if msg == ("ready",):
            w.ready = True
            return True
        if msg[0] == "failed":
            raise RuntimeError(f"{self.name} worker could not start: {msg[1]}")
        job, status, value = msg
        if w.jobs and job == w.jobs[0][0]:
            w.jobs.popleft()
            self._finish(job, status, value)
            w.deadline = time.monotonic() + self.timeout_s if w.jobs else math.inf
        return True

    def _requeue(self, w: _Worker) -> None:
        """Put a failed worker's unscored items back at the head of the queue, in order."""
        self._queue.extendleft(reversed(w.jobs))
        w.jobs.clear()

    def _finish(self, job: tuple[int, int], status: str, value) -> None:
        setattr(self.stats, status, getattr(self.stats, status) + 1)
        ticket, idx = job
        batch = self._batches[ticket]
        batch.results[idx] = value if status == "ok" else self.failed(status, value)
        batch.left -= 1
        if status != "ok":
            self.recent_errors.append(f"item {idx}: {status}: {value}")

    # -- lifetime --------------------------------------------------------------

    def close(self) -> None:
        """Stop every worker (politely, then by force). Safe to call twice."""
        self._closed = True
        self._stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _exit_code(proc: subprocess.Popen, wait_s: float = 1.0) -> int | None:
    """The process's exit code once it has ended (within `wait_s`), else None."""
    try:
        return proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        return None


def _kill(w: _Worker) -> None:
    w.proc.kill()
    _exit_code(w.proc, 5.0)
    w.conn.close()


def _stop_workers(workers: list[_Worker]) -> None:
    """Ask every worker to stop, wait up to 2 s for each, kill what is left."""
    for w in workers:
        try:
            w.conn.send(None)
        except Exception:
            pass
    for w in workers:
        if _exit_code(w.proc, 2.0) is None:
            _kill(w)
        w.conn.close()


class RewardPool(WorkerPool):
    """Score `fn(completion, answer) -> float` in worker processes; a failed call scores 0.0.

    `fn` is a reward name ("math", "exact", "code") or a picklable module-level function.
    `submit` takes (completion, answer) pairs; `finished` returns rewards by ticket.
    """

    name = "RewardPool"

    def __init__(self, fn: RewardFn | str, workers: int = 2, timeout_s: float = 10.0,
                 start_timeout_s: float = 60.0):
        fn = reward_fn_by_name(fn) if isinstance(fn, str) else fn
        if fn is code_reward:  # refuse now, loudly, rather than score every sample 0.0
            check_isolation(unsafe_default())
        super().__init__(fn, workers, timeout_s, start_timeout_s, check=_finite_float, warm_up=partial(_warm_up, fn))

    def failed(self, status: str, message: str) -> float:
        return 0.0

    def score(self, items: Iterable[tuple[str, object]]) -> list[float]:
        """Rewards for (completion, answer) pairs, in order, once all are scored; failures score 0.0."""
        return self.run(items)
