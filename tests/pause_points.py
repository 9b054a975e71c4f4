"""`python tests/pause_points.py plan.json ...`: hexrl.main with one pause point armed, for tests that
kill a node at a named moment of the run (tests/test_elastic.py, "nothing lost").

torchrun starts this script in place of `-m hexrl.main` on the launcher whose ranks should stop, with
HEXRL_TEST_PAUSE=<point>:<n>:<marker> in that launcher's environment. The rank that reaches the n-th
time the point is passed creates <marker> (its pid inside) and sleeps until it is killed, so the
test waits for the file and then kills the node at exactly that moment. Only the first rank to get
there pauses, once per marker: a restarted round runs on. The points:

    shard  after writing the n-th checkpoint shard of its model (model-s*-tp*.pt, in the checkpoint's
           temporary directory; its RNG file and the commit are still to come)
    sync   before sending its part of the n-th weight sync (the other sources' parts may be out)
    step   at the start of its n-th training step (the step's batch already taken)
    leave  not a pause: each rank waits n seconds before its clean exit (the watchdog's finish, after
           the last collective), as a rank descheduled on its way out would; <marker> is created then

The production code has no hook for this: the script wraps the functions that do the work.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

PAUSE_ENV = "HEXRL_TEST_PAUSE"


def pause_once(marker: Path) -> None:
    """Create `marker` and sleep until killed, unless some rank already did (then return)."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    while True:
        time.sleep(60)


def armed(fn, n: int, marker: Path, after: bool = False, when=lambda *a: True):
    """`fn` that pauses (pause_once) on the n-th call for which `when(*args)` holds: before the call,
    or after it with `after`."""
    calls = 0

    def wrapper(*args, **kw):
        nonlocal calls
        hit = when(*args) and (calls := calls + 1) == n
        if hit and not after:
            pause_once(marker)
        out = fn(*args, **kw)
        if hit and after:
            pause_once(marker)
        return out
    return wrapper


def arm(spec: str) -> None:
    """Wrap the function of the point HEXRL_TEST_PAUSE names."""
    point, n, marker = spec.split(":", 2)
    n, marker = int(n), Path(marker)
    if point == "shard":
        from hexrl.train import checkpoint

        checkpoint._write = armed(checkpoint._write, n, marker, after=True,
                                  when=lambda obj, path: Path(path).name.startswith("model-"))
    elif point == "sync":
        from hexrl.comm.weights import ShardSender

        ShardSender.send = armed(ShardSender.send, n, marker)
    elif point == "step":
        from hexrl.train.trainer import Trainer

        Trainer.step = armed(Trainer.step, n, marker)
    elif point == "leave":
        from hexrl.runtime.watchdog import Watchdog

        finish = Watchdog.finish

        def late(self):
            marker.touch()
            time.sleep(n)
            finish(self)
        Watchdog.finish = late
    else:
        raise ValueError(f"{PAUSE_ENV}={spec}: no pause point {point!r} (shard, sync, step or leave)")


if __name__ == "__main__":
    if os.environ.get(PAUSE_ENV):
        arm(os.environ[PAUSE_ENV])
    from hexrl.main import main

    main()
