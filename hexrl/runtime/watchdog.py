"""Job-wide failure detection through the torch.distributed store.

A crashing rank writes its cause under `hexrl/failed`; a killed rank stops refreshing its
heartbeat. Rank 0 watches every heartbeat, every rank watches rank 0 and the failure key,
so any death ends the whole job within `timeout_s` with the failing rank named (O(world)
store traffic, not O(world^2)). The store lives in torchrun's agent, so it outlives workers, except
in an elastic launch, where rank 0 hosts it: there rank 0 is the last rank to leave.

Across nodes the store lives in node 0's launcher. When another node's launcher (or machine)
dies, all its ranks go silent together: the message names them grouped by node, and a rank
whose collective broke because of it names the silent ranks, not itself (`lost_peers`).
"""
from __future__ import annotations

import os
import threading
import time
import traceback
from datetime import timedelta

from hexrl.runtime import errors

FAILED = "hexrl/failed"


def _hb_key(rank: int) -> str:
    return f"hexrl/hb/{rank}"


def _done_key(rank: int) -> str:
    return f"hexrl/done/{rank}"


class Watchdog:
    """Background thread: heartbeat this rank, end the process when any other rank has failed."""

    def __init__(self, store, rank: int, world_size: int, describe: dict[int, str],
                 interval_s: float = 2.0, timeout_s: float = 30.0, on_failure=None,
                 nodes: dict[int, str] | None = None):
        self.store, self.rank, self.world = store, rank, world_size
        self.describe, self.interval, self.timeout = describe, interval_s, timeout_s
        self.nodes = nodes or {}  # rank -> its node's label, to name a lost node's ranks together
        self._launcher = os.getppid()  # torchrun's agent on this node
        self.on_failure = on_failure or _exit_now
        self._stop = threading.Event()
        self._started = time.time()
        self.beat()
        self._thread = threading.Thread(target=self._run, name="hexrl-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def finish(self) -> None:
        """A clean exit: stop watching and tell the others this rank's silence is expected. Rank 0
        then waits (up to the timeout) until every rank has said so: in an elastic launch the store
        lives in rank 0's process (hexrl/main.py), and a rank still beating when it exits would find
        the store gone, fail at the very end and be restarted by its launcher."""
        self.stop()
        self.store.set(_done_key(self.rank), "1")
        if self.rank == 0:
            try:
                self.store.wait([_done_key(r) for r in range(self.world)], timedelta(seconds=self.timeout))
            except RuntimeError:  # a rank that died after the last collective: nothing to wait for
                pass

    def beat(self) -> None:
        self.store.set(_hb_key(self.rank), str(time.time()))

    def report_failure(self, cause: str) -> None:
        """Tell every rank that this one failed (first report wins the message)."""
        msg = f"rank {self.rank} ({self.describe.get(self.rank, '?')}) failed: {cause}"
        try:
            if not self.store.check([FAILED]):
                self.store.set(FAILED, msg)
        except Exception:  # the store may already be gone while the job is tearing down
            pass

    def check(self) -> str | None:
        """The failure message that should end this rank, or None while all is well."""
        if self.store.check([FAILED]):
            return self.store.get(FAILED).decode()
        watched = range(self.world) if self.rank == 0 else [0]
        now, ages, never = time.time(), {}, []
        for r in watched:
            if r == self.rank or self.store.check([_done_key(r)]):
                continue
            if not self.store.check([_hb_key(r)]):
                if now - self._started > self.timeout:
                    never.append(r)
                continue
            ages[r] = now - float(self.store.get(_hb_key(r)).decode())
        if max(ages.values(), default=0.0) > self.timeout:
            # a lost node's ranks stop together, but their last beats lie up to an interval apart:
            # name every rank silent for half the timeout, not just the first past it
            silent = sorted(r for r, age in ages.items() if age > self.timeout / 2)
            return self._dead(silent, f"no heartbeat for {max(ages.values()):.0f} s (killed or hung)")
        return self._dead(never, "never sent a heartbeat") if never else None

    def lost_peers(self, wait_s: float | None = None) -> str | None:
        """After a broken collective: which other ranks stopped beating over `wait_s`? A message
        naming them (written as the job's failure) or None when every other rank is alive."""
        def beats():
            return {r: self.store.get(_hb_key(r)) for r in range(self.world) if r != self.rank
                    and self.store.check([_hb_key(r)]) and not self.store.check([_done_key(r)])}
        before = beats()
        time.sleep(wait_s if wait_s is not None else 3 * self.interval)
        after = beats()
        silent = [r for r in before if after.get(r) == before[r]]
        if not silent:
            return None
        return self._dead(silent, f"no heartbeat since rank {self.rank}'s collective with them broke")

    def launcher_lost(self) -> str | None:
        """This node's torchrun agent died (killed, or its machine going down): its workers would
        run on orphaned and the other nodes' agents wait for it at exit. A message naming this
        node's ranks (written as the job's failure), or None while the agent lives."""
        if os.getppid() == self._launcher:
            return None
        node = self.nodes.get(self.rank)
        mine = sorted(r for r, n in self.nodes.items() if n == node) if node else [self.rank]
        why = f"lost their launcher (torchrun agent, pid {self._launcher}): killed, or its machine is going down"
        return self._dead(mine, why) if len(mine) > 1 else self._dead(mine, why.replace("their", "its"))

    def name_ranks(self, ranks: list[int]) -> str:
        """'rank 2 (rollout on ...)' or, for several, 'ranks 2, 3 on node 1 'B' (127.0.0.2) (all its ranks)'."""
        if len(ranks) == 1:
            return f"rank {ranks[0]} ({self.describe.get(ranks[0], '?')})"
        by_node: dict[str, list[int]] = {}
        for r in sorted(ranks):
            by_node.setdefault(self.nodes.get(r, "an unknown node"), []).append(r)
        parts = []
        for node, rs in by_node.items():
            whole = len(rs) == sum(1 for v in self.nodes.values() if v == node)
            parts.append(f"ranks {', '.join(map(str, rs))} on {node}" + (" (all its ranks)" if whole else ""))
        return "; ".join(parts)

    def _dead(self, ranks: list[int], why: str) -> str:
        """Write (first report wins) and return the job's failure message naming `ranks`."""
        msg = f"{self.name_ranks(ranks)} {'is' if len(ranks) == 1 else 'are'} gone: {why}"
        try:
            if not self.store.check([FAILED]):
                self.store.set(FAILED, msg)
            return self.store.get(FAILED).decode()
        except Exception:
            return msg

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                # the launcher first: a local check, and the store may have died with it (rank 0's
                # agent hosts it), which leaves beat() waiting out the store's timeout
                msg = self.launcher_lost()
                if msg is None:
                    self.beat()
                    msg = self.check()
            except Exception as e:  # losing the store means the job's agent is gone
                msg = f"lost the rendezvous store ({e!r}); the job is ending"
            if msg and not self._stop.is_set():
                self.on_failure(msg)
                return


def _exit_now(msg: str) -> None:
    try:  # stderr may be a pipe whose reader died with the launcher: exit all the same
        errors.refuse_with(f"[hexrl] stopping: {msg}")  # also what torchrun's summary shows
    finally:
        os._exit(1)


def describe_exception(e: BaseException) -> str:
    """One line for the console, the last frame of the traceback included."""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
    return f"{type(e).__name__}: {e}{where}"
