"""The watchdog ends a rank when another one failed or went silent, naming it."""
import threading
import time

from torch.distributed import HashStore

from hexrl.runtime.watchdog import Watchdog


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


def test_rank_0_finishes_last_so_the_store_it_hosts_outlives_every_rank():
    """In an elastic launch the store lives in rank 0's process (hexrl/main.py): rank 0's finish
    returns only once every rank has finished, so no rank still beating finds the store gone (and
    exits 1 at the very end, which its launcher would take for a failure and restart)."""
    store, seen, order = HashStore(), [], []
    dogs = [make(store, r, seen, timeout_s=10) for r in range(3)]
    rank_0 = threading.Thread(target=lambda: (dogs[0].finish(), order.append("rank 0 left")))
    rank_0.start()
    time.sleep(0.3)  # ranks 1 and 2 still on their way out of the last collective
    for d in dogs[1:]:
        order.append(f"rank {d.rank} finished")
        d.finish()
    rank_0.join(10)
    assert order == ["rank 1 finished", "rank 2 finished", "rank 0 left"]


def test_ranks_of_a_lost_node_are_named_together_though_their_last_beats_differ():
    """Node B's ranks 2 and 3 die together, but rank 3 had beaten once more (a third of the timeout
    later): the report must name both, by node, not only the first to pass the timeout."""
    store, seen = HashStore(), []
    nodes = {0: "node 0 'A'", 1: "node 0 'A'", 2: "node 1 'B'", 3: "node 1 'B'"}
    dogs = [Watchdog(store, r, 4, {r: "train" for r in range(4)}, interval_s=0.05, timeout_s=0.6,
                     on_failure=seen.append if r == 0 else (lambda msg: None), nodes=nodes) for r in range(4)]
    for d in dogs:
        d.start()
    dogs[2].stop()
    time.sleep(0.2)
    dogs[3].stop()
    assert wait_for(lambda: seen)
    assert seen[0].startswith("ranks 2, 3 on node 1 'B' (all its ranks) are gone: no heartbeat"), seen[0]
    for d in dogs:
        d.stop()
