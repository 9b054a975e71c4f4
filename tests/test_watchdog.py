"""The watchdog ends a rank when another one failed or went silent, naming it."""
import time

from torch.distributed import HashStore

from hexrl.watchdog import Watchdog


def make(store, rank, failures, timeout_s=0.5):
    return Watchdog(store, rank, 3, {0: "train", 1: "train", 2: "rollout"}, interval_s=0.05,
                    timeout_s=timeout_s, on_failure=failures.append)


def wait_for(cond, limit_s=5.0):
    end = time.time() + limit_s
    while not cond() and time.time() < end:
        time.sleep(0.02)
    return cond()


def test_reported_failure_reaches_every_rank():
    store, seen = HashStore(), {0: [], 1: [], 2: []}
    dogs = [make(store, r, seen[r]).start() for r in range(3)]
    dogs[2].report_failure("ValueError: boom")
    assert wait_for(lambda: seen[0] and seen[1])
    assert seen[1][0] == "rank 2 (rollout) failed: ValueError: boom"
    for d in dogs:
        d.stop()


def test_silent_rank_is_declared_dead_by_rank_0_and_then_everyone():
    store, seen = HashStore(), {0: [], 1: [], 2: []}
    dogs = [make(store, r, seen[r]).start() for r in range(3)]
    dogs[2].stop()  # like kill -9: no more heartbeats, no message
    assert wait_for(lambda: seen[0] and seen[1])
    assert "rank 2 (rollout) is gone: no heartbeat" in seen[0][0]
    assert seen[1][0] == seen[0][0]
    for d in dogs:
        d.stop()


def test_clean_finish_is_not_a_failure():
    store, seen = HashStore(), {0: [], 1: [], 2: []}
    dogs = [make(store, r, seen[r]).start() for r in range(3)]
    dogs[1].finish()
    dogs[2].finish()
    time.sleep(1.0)  # twice the timeout: silence of finished ranks must be ignored
    assert seen[0] == []
    dogs[0].finish()
