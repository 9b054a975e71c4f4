"""The controller in its own process: it trains what the thread trains, its state goes in and out of
a checkpoint, and its end (or the trainer's) ends the other side promptly, with the cause named."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from runtime_utils import wait_for

from hexrl.comm import channel
from hexrl.comm.channel import DealerChannel, RouterChannel
from hexrl.comm.wire import message, trajectory_to_msg
from hexrl.control.controller import Controller, ControllerFailure, ReplicaInfo
from hexrl.control.controller_process import ControllerProcess, ControllerSetup
from hexrl.control.dataset import DatasetCursor
from hexrl.data.problems import Problem
from hexrl.trajectory import Trajectory

ROOT = Path(__file__).resolve().parents[1]
SECRET = channel.new_secret()
VOCAB = 64
REPLICAS = [ReplicaInfo(0, 1.0), ReplicaInfo(1, 1.0)]
ENV = SimpleNamespace(name="test", max_turns=2, timeout_s=1.0, max_obs_tokens=4, workers=1, options={})


def rl_config():
    return SimpleNamespace(batch_size=2, group_size=3, eta=0, max_concurrent_rollouts=None, filter_equal_groups=False,
                           temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4, seed=7, reward_bound=1e6)


PROBLEMS = [Problem(f"{i}+{i}=", str(2 * i), id=i, kind="synthetic") for i in range(40)]


def encode(text: str) -> list[int]:
    """The test's tokenizer: one id per character."""
    return [ord(c) % VOCAB for c in text]


def thread_controller() -> tuple[Controller, str]:
    router = RouterChannel(SECRET)
    endpoint = router.bind("127.0.0.1")
    return Controller(rl_config(), DatasetCursor(PROBLEMS, seed=7), encode, REPLICAS, router, vocab_size=VOCAB,
                      env=ENV), endpoint


def process_controller(replicas: list[ReplicaInfo] = REPLICAS) -> ControllerProcess:
    setup = ControllerSetup(rl_config(), PROBLEMS, [encode(p.prompt) for p in PROBLEMS], replicas, VOCAB, SECRET,
                            env=ENV)
    return ControllerProcess(setup)


def answers(prompt: dict, rank: int) -> list[dict]:
    """A replica's trajectories for a prompt, drawn from its sampling seed (so any replica answers alike):
    episodes of 1-6 tokens, some of them observations (mask 0)."""
    rng = np.random.default_rng(prompt["sampling"]["seed"])
    out = []
    for _ in range(prompt["n"]):
        length = int(rng.integers(1, 7))
        mask = rng.integers(0, 2, length).astype(np.uint8)
        mask[0] = 1
        sampled = int(mask.sum())
        traj = Trajectory(prompt["group_id"], list(prompt["prompt_ids"]), rng.integers(0, VOCAB, length).tolist(),
                          (-rng.random(sampled)).astype(np.float32), [prompt["version"]] * sampled,
                          reward=float(rng.random()), finish_reason="eos", problem_id=prompt["problem_id"],
                          mask=mask, start_version=prompt["version"])
        out.append(trajectory_to_msg(traj, rank=rank))
    return out


class Rollouts:
    """The replicas' leaders, in a thread of this process: every prompt answered at once (`answers`)."""

    def __init__(self, endpoint: str):
        self.dealers = [DealerChannel(r.name, SECRET) for r in REPLICAS]
        for rank, d in enumerate(self.dealers):
            d.connect(endpoint)
            d.send(message("heartbeat", rank=rank, time=0.0))
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.done.is_set():
            for rank, d in enumerate(self.dealers):
                msg = d.recv(timeout_s=0.01)
                if msg is not None and msg["type"] == "prompt":
                    for m in answers(msg, rank):
                        assert d.send(m)

    def close(self) -> None:
        self.done.set()
        self.thread.join()
        for d in self.dealers:
            d.close()


def trained(controller, steps: int) -> list[tuple]:
    """What the trainer trains over `steps` steps (eta 0), each trajectory's fields in the batch's order."""
    rows = []
    for version in range(1, steps + 1):
        for g in sorted(controller.next_batch(timeout_s=120), key=lambda g: g.group_id):
            for t in g.trajectories:
                rows.append((t.group_id, t.problem_id, t.prompt_ids.tolist(), t.completion_ids.tolist(),
                             t.mask.tolist(), t.logprobs.tobytes(), t.versions.tolist(), t.reward, t.start_version))
                assert t.completion_ids.dtype == np.int32 and t.logprobs.dtype == np.float32
        assert controller.choose_eta(0.5, 1.0, 0.05, {"0": len(rows)}) == 0  # rl.eta, not "auto"
        controller.publish_version(version)
        controller.wait_delivered(version)
    return rows


def run(make, steps: int = 3):
    """`trained` on a controller from `make`, then its state and counters."""
    controller = make()
    controller, endpoint = controller if isinstance(controller, tuple) else (controller, controller.endpoint)
    rollouts = Rollouts(endpoint)
    try:
        controller.start()
        rows = trained(controller, steps)
        return rows, controller.counters()
    finally:
        controller.stop()
        rollouts.close()
        if isinstance(controller, Controller):
            controller.router.close()


def test_the_process_trains_exactly_what_the_thread_trains():
    thread_rows, thread_counters = run(thread_controller)
    process_rows, counters = run(process_controller)
    assert len(thread_rows) == 3 * 2 * 3  # steps x groups x samples
    assert process_rows == thread_rows
    assert counters["trained"] == 18 and counters["rejected_messages"] == 0
    # every counter crosses the link, the per-replica token counts (a map) included; how many arrive
    # beyond the trained batches depends on timing, so only the replicas and the sum's floor compare
    assert counters["replica_tokens"].keys() == thread_counters["replica_tokens"].keys()
    assert sum(counters["replica_tokens"].values()) >= sum(sum(row[4]) for row in process_rows) > 0  # sampled


def test_the_state_round_trips_through_the_process_for_a_checkpoint():
    controller, endpoint = thread_controller()
    rollouts = Rollouts(endpoint)
    try:
        controller.start()
        trained(controller, 2)
        saved = controller.state()
    finally:
        controller.stop()
        rollouts.close()
        controller.router.close()
    resumed = process_controller()
    try:
        resumed.load_state(saved)
        assert resumed.state() == saved
        assert saved["version"] == 2 and saved["counters"]["trained"] == 12
    finally:
        resumed.stop()


def test_auto_eta_chooses_the_same_bounds_in_the_process_and_its_state_round_trips():
    rl = SimpleNamespace(**{**vars(rl_config()), "eta": "auto", "eta_max": 3, "eta_w_std_target": 0.1})
    thread = Controller(rl, DatasetCursor(PROBLEMS, seed=7), encode, REPLICAS, RouterChannel(SECRET), VOCAB)
    process = ControllerProcess(ControllerSetup(rl, PROBLEMS, [encode(p.prompt) for p in PROBLEMS], REPLICAS, VOCAB,
                                                SECRET))
    try:
        steps = [(0.5, 1.0, 0.01, {"0": 90, "1": 10}), (0.6, 1.0, 0.02, {"0": 50, "1": 50}),
                 (0.9, 1.0, 0.2, {"1": 60, "2": 40}), (0.7, 1.0, float("nan"), {"0": 10})]
        chosen = [(thread.choose_eta(*s), process.choose_eta(*s)) for s in steps]
        assert [a for a, _ in chosen] == [b for _, b in chosen] and len({a for a, _ in chosen}) > 1, chosen
        assert process.state()["auto_eta"] == thread.state()["auto_eta"]
        process.load_state(thread.state())
        assert process.state() == thread.state()
    finally:
        process.stop()
        thread.router.close()


def test_a_replica_error_reaches_the_trainer_through_the_process():
    controller = process_controller()
    dealer = DealerChannel("replica-0", SECRET)
    try:
        controller.start()
        dealer.connect(controller.endpoint)
        dealer.send(message("error", rank=3, cause="CUDA out of memory"))
        with pytest.raises(ControllerFailure, match="rollout rank 3 .replica-0. failed: CUDA out of memory"):
            controller.next_batch()
    finally:
        controller.stop()
        dealer.close()


def test_a_killed_controller_process_ends_the_trainers_wait_naming_it():
    controller = process_controller()
    try:
        controller.start()
        os.kill(controller.pid, signal.SIGKILL)
        with pytest.raises(ControllerFailure, match=f"controller process .pid {controller.pid}. was killed by SIGKILL"):
            controller.next_batch()  # no replica ever connects: only the process's death can end this wait
    finally:
        controller.stop()


def test_a_controller_process_stopped_before_it_started_exits_cleanly(capfd):
    """A trainer that fails between starting the process and its start() (a checkpoint's state refused)
    stops it: the process exits 0, without a traceback (Controller.stop joined a thread never started)."""
    controller = process_controller()
    controller.stop()
    assert controller.proc.returncode == 0
    assert "Traceback" not in capfd.readouterr().err


def test_a_controller_process_that_stops_answering_ends_a_call_naming_it(monkeypatch):
    """A process alive but stuck (here SIGSTOP) ended no call: the trainer waited for ever, saying nothing.
    A call that does not wait on the rollouts now has CALL_S to answer."""
    from hexrl.control import controller_process

    monkeypatch.setattr(controller_process, "CALL_S", 1.0)
    controller = process_controller()
    try:
        os.kill(controller.pid, signal.SIGSTOP)
        with pytest.raises(ControllerFailure, match="the controller process did not answer counters within 1 s"):
            controller.counters()
    finally:
        os.kill(controller.pid, signal.SIGCONT)
        controller.stop()


def interrupt(signum, frame):
    raise KeyboardInterrupt  # as Ctrl-C does


def test_a_trainer_interrupted_in_a_wait_still_stops_the_process_cleanly():
    """Ctrl-C while the trainer waits in next_batch: the process is busy in that call, so stop() ends it
    with SIGTERM, and it still stops the controller (telling the replicas) and exits on its own."""
    controller = process_controller([ReplicaInfo(0, 1.0)])
    dealer = DealerChannel("replica-0", SECRET)
    dealer.connect(controller.endpoint)
    dealer.send(message("heartbeat", rank=0, time=0.0))
    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        controller.start()
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(KeyboardInterrupt):
            controller.next_batch()  # the replica never answers its prompts
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        controller.stop()
    assert controller.proc.returncode == 0  # it stopped itself: not killed
    while (msg := dealer.recv(timeout_s=10)) is not None and msg["type"] != "stop":
        pass
    dealer.close()
    assert msg is not None and msg["reason"] == "terminated"


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_controller_process_exits_when_its_trainer_dies(tmp_path):
    trainer = textwrap.dedent(f"""
        import time
        from types import SimpleNamespace
        from hexrl.control.controller import ReplicaInfo
        from hexrl.control.controller_process import ControllerProcess, ControllerSetup
        from hexrl.data.problems import Problem
        rl = SimpleNamespace(batch_size=1, group_size=2, eta=0, max_concurrent_rollouts=None,
                             filter_equal_groups=False, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4,
                             seed=0, reward_bound=1e6)
        setup = ControllerSetup(rl, [Problem("1+1=", "2", id=0, kind="synthetic")], [[1, 2]], [ReplicaInfo(0, 1.0)],
                                {VOCAB}, bytes(32))
        controller = ControllerProcess(setup).start()
        print(controller.pid, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", trainer], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        child = int(proc.stdout.readline())
        assert not gone(child)
        proc.kill()  # SIGKILL: no finalizer, no atexit
        proc.wait()
        assert wait_for(lambda: gone(child), 60), f"controller process {child} outlived its trainer"
    finally:
        proc.kill()
        proc.wait()
