"""A restarted attempt reads two things no user wrote: torchrun's restart count and the run's
checkpoints/latest. Both are read as strictly as every other input: one line naming the variable or
the file, exit 2, and the old run's metrics left where they are."""
import json

import pytest
from runtime_utils import write_job
from test_bad_inputs import layout_checkpoint

from hexrl.main import RESTART_ENV, main, parse_args, recorded_plan, restart_resume
from hexrl.train import checkpoint as ckpt


def start(monkeypatch, plan, run_dir, count: str) -> int:
    """hexrl.main as rank 0 of 3 in attempt `count`; its exit code (it refuses before any process group)."""
    env = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3", RESTART_ENV: count}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        main([str(plan), "--run-dir", str(run_dir)])
    return e.value.code


@pytest.mark.parametrize("count", ["abc", "1.5", "-1", "", "²"])
def test_a_restart_count_that_is_not_one_is_refused(tmp_path, monkeypatch, capsys, count):
    plan, run_dir = write_job(tmp_path, steps=1), tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')  # an old run, which -1 renamed and started over
    if count == "":  # unset counts as the first attempt: the old run is refused as before
        assert start(monkeypatch, plan, run_dir, count) == 2 and "already holds a run" in capsys.readouterr().err
        return
    assert start(monkeypatch, plan, run_dir, count) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"hexrl.main (rank 0): {RESTART_ENV}={count!r}: not a restart count (a whole number >= 0, "
                   "set by torchrun)"], err
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]


def test_a_latest_naming_a_missing_step_is_named_on_a_restart(tmp_path, monkeypatch, capsys):
    plan, run_dir = write_job(tmp_path, steps=1), tmp_path / "run"
    root = run_dir / "checkpoints"
    root.mkdir(parents=True)
    (root / "latest").write_text("step00000007")
    assert start(monkeypatch, plan, run_dir, "1") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"hexrl.main (rank 0): {root / 'latest'}: names step00000007, which is missing, and no other "
                   "step here is complete"], err
    trainer = json.loads(plan.read_text())["trainer"]
    layout_checkpoint(root, 3, trainer)  # an older complete step: the restart falls back to it
    (root / "latest").write_text("step00000007")
    args = parse_args([str(plan), "--run-dir", str(run_dir)])
    assert restart_resume(args, 0) == str(root) and ckpt.resolve_complete(root)[0].name == "step00000003"


@pytest.mark.parametrize("text", [b"\xff\xfestep1", b"../../elsewhere", b""])
def test_a_latest_that_holds_no_step_name_is_named(tmp_path, monkeypatch, capsys, text):
    plan, run_dir = write_job(tmp_path, steps=1), tmp_path / "run"
    trainer = json.loads(plan.read_text())["trainer"]
    root = run_dir / "checkpoints"
    layout_checkpoint(root, 1, trainer)
    (root / "latest").write_bytes(text)
    found = ckpt.problems(root, trainer)  # --resume, before launch
    assert len(found) == 1 and found[0].startswith(f"{root / 'latest'}: "), found
    assert start(monkeypatch, plan, run_dir, "2") == 2  # a restart
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{root / 'latest'}: " in err[0], err


def another_jobs(plan: dict) -> str:
    return json.dumps({**plan, "rl": {**plan["rl"], "lr": plan["rl"]["lr"] * 10}})


@pytest.mark.parametrize("write, says", [
    (lambda plan: json.dumps(plan)[:300], "not a valid plan, refusing to run it: "),  # torn
    (lambda plan: json.dumps({**plan, "ranks": "all"}), "not a valid plan, refusing to run it: "),
    (another_jobs, "the plan of another job (rl differ from this job's), refusing to run it"),
    (lambda plan: json.dumps({**plan, "cluster": {**plan["cluster"], "nodes": [
        {**n, "name": "elsewhere"} for n in plan["cluster"]["nodes"]]}}),
     "the plan of another job (cluster.nodes differ"),
])
def test_a_recorded_plan_a_restart_cannot_trust_is_refused_naming_it(tmp_path, monkeypatch, capsys, write, says):
    """A restart runs the run's newest recorded plan (RUN_DIR/plans/<round>.json, where a switch of plans
    or an elastic round wrote it): one torn or edited, or another job's, is refused, never run."""
    plan, run_dir = write_job(tmp_path, steps=1), tmp_path / "run"
    (run_dir / "plans").mkdir(parents=True)
    (run_dir / "plans" / "0.json").write_text(json.dumps(json.loads(plan.read_text())))
    recorded = run_dir / "plans" / "1.json"
    recorded.write_text(write(json.loads(plan.read_text())))
    assert start(monkeypatch, plan, run_dir, "1") == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith(f"hexrl.main (rank 0): {recorded}: {says}"), err
    recorded.unlink()  # the plan it ran before, this job's own, is what the restart runs
    args = parse_args([str(plan), "--run-dir", str(run_dir)])
    assert recorded_plan(args, 1) == json.loads(plan.read_text())
