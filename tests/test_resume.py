"""Stop -> resume -> compare with an uninterrupted run (real torchrun jobs on CPU).

A resume must waste nothing: the staleness gate continues where it was (so the rollout does not
run ahead and no group goes stale), steps continue with no gap or repeat, and the cumulative
counters in metrics.jsonl continue instead of restarting from zero.
"""
import json
import os
import re
import signal
import threading
import time

from runtime_utils import metrics, torchrun, wait_for, worker_pids, write_job

B, N, ETA, STEPS, STOP = 2, 2, 1, 8, 4


def run(plan, run_dir, *args):
    proc = torchrun(plan, run_dir, *args)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-4000:]
    return metrics(run_dir)


def check_run(rows, steps=STEPS):
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # no gap, no repeat
    for r in rows:
        assert r["max_staleness"] <= ETA and r["too_stale"] == 0, r
        assert r["dropped_reasons"].get("stale", 0) == 0, r
        assert r["trajectories_trained"] == r["step"] * B * N, r  # the counter continues
        assert r["trajectories_produced"] == (r["trajectories_trained"] + r["trajectories_filtered"]
                                              + r["trajectories_dropped"] + r["trajectories_pending"])
    ids = [i for r in rows for i in r["problem_ids"]]
    assert len(ids) == len(set(ids)), "a prompt was trained twice"


def test_stop_then_resume_drops_nothing_an_uninterrupted_run_keeps(tmp_path):
    plan = write_job(tmp_path, steps=STEPS, eta=ETA, checkpoint_every=STOP)
    whole = run(plan, tmp_path / "whole")
    check_run(whole)

    resumed_dir = tmp_path / "resumed"
    first = run(plan, resumed_dir, "--steps", str(STOP))
    assert [r["step"] for r in first] == list(range(1, STOP + 1))
    rows = run(plan, resumed_dir, "--resume", str(resumed_dir / "checkpoints"))
    check_run(rows)
    before, after = rows[STOP - 1], rows[STOP]
    assert after["version"] == before["version"] + 1
    # produced and accepted continue from the checkpoint (work pending there is redone, not counted twice)
    assert after["trajectories_produced"] >= before["trajectories_trained"] + B * N
    assert after["trajectories_accepted"] >= before["trajectories_trained"] + B * N
    for key in ("trajectories_produced", "trajectories_accepted", "trajectories_trained"):
        assert [r[key] for r in rows] == sorted(r[key] for r in rows), key
    assert rows[-1]["trajectories_trained"] == whole[-1]["trajectories_trained"]
    # the gate ran no further ahead than eta: at most (eta + 1) * B groups were held at the end
    for run_dir in (tmp_path / "whole", resumed_dir):
        saved = json.loads((run_dir / "checkpoints" / f"step{STEPS:08d}" / "extra.json").read_text())["controller"]
        assert saved["gate"]["accepted"] == STEPS * B
        assert len(saved["redo"]) <= (ETA + 1) * B, saved["redo"]



RESTART = re.compile(r"hexrl.main: torchrun restart \d+: resuming from .*checkpoint, step(\d+)\)")


def attempts(text: str) -> tuple[list[list[int]], list[int]]:
    """(steps each attempt printed on the console, the checkpoint step each restart resumed from)."""
    parts = RESTART.split(text)
    return [[int(s) for s in re.findall(r"^step (\d+) v", p, re.M)] for p in parts[::2]], [int(s) for s in parts[1::2]]


def test_killed_ranks_restart_the_job_from_its_newest_checkpoint(tmp_path):
    """torchrun --max-restarts 2: SIGKILL the rollout rank, then (in the restarted attempt) trainer rank 0,
    which hosts the controller. Each restart resumes from RUN_DIR/checkpoints by itself, redoes at most
    checkpoint_every steps, and the run ends as an uninterrupted one: no step twice, counters continuing."""
    steps, every = 8, 2  # the first restart resumes by step 4 at the latest: the second kill finds steps to cut
    plan = write_job(tmp_path, steps=steps, eta=ETA, checkpoint_every=every)
    run_dir = tmp_path / "run"
    proc = torchrun(plan, run_dir, restarts=2)
    out: list[str] = []
    threading.Thread(target=lambda: [out.append(line) for line in proc.stdout], daemon=True).start()

    def printed(attempt: int, n: int) -> bool:  # attempt `attempt` has printed n steps
        logged = attempts("".join(out))[0]
        return len(logged) > attempt and len(logged[attempt]) >= n

    for attempt, (victim, n) in enumerate([(2, 3), (0, 2)]):  # rollout after 3 steps, trainer after 2 more
        assert wait_for(lambda: printed(attempt, n), 240, proc), "".join(out)[-4000:]  # noqa: B023 - called at once
        os.kill(worker_pids(proc)[victim], signal.SIGKILL)
    assert proc.wait(timeout=300) == 0, "".join(out)[-4000:]
    time.sleep(0.5)  # the reader thread's last lines
    logged, resumed = attempts("".join(out))
    assert len(resumed) == 2, "".join(out)[-4000:]
    for before, start in zip(logged, resumed):
        # redone: the steps logged since the checkpoint, plus the one cut short when the kill came mid-step
        # (then at most every - 1 were logged); a kill between a step's row and its checkpoint redoes `every`
        assert max(before) - start <= every
    assert logged[-1] == list(range(resumed[-1] + 1, steps + 1))
    check_run(metrics(run_dir), steps)  # no step twice, counters continue, trajectories balance, gate held
