"""The whole job under torchrun on CPU: 2 trainer ranks + 1 rollout rank on a tiny model."""
import contextlib
import json
import os
import signal
import time
from collections import Counter

import msgpack
import pytest
import zmq
from runtime_utils import metrics, torchrun, wait_for, worker_pids, write_job

from hexrl.comm.wire import SCHEMA_VERSION
from hexrl.control.metrics import read_metrics

REQUIRED = ("step", "version", "reward_mean", "trajectories_accepted", "trajectories_filtered",
            "trajectories_dropped", "max_staleness", "rollout_tokens_per_s", "train_tokens_per_s", "weight_sync_s")


def finish(proc, timeout_s=240):
    out, _ = proc.communicate(timeout=timeout_s)
    return proc.returncode, out


def test_short_run_writes_balanced_metrics_and_a_loadable_model(tmp_path):
    plan = write_job(tmp_path, steps=3, eta=1, heldout=20, eval_every=2, policy_kl_probe=4)
    proc = torchrun(plan, tmp_path / "run")
    # a foreign and a corrupted message to the controller must be rejected and counted
    assert wait_for(lambda: (tmp_path / "run" / "controller_endpoint").exists(), 120, proc)
    endpoint = (tmp_path / "run" / "controller_endpoint").read_text().strip()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send(b"\xc1 not msgpack")
    sock.send(msgpack.packb({"v": SCHEMA_VERSION, "type": "trajectory", "group_id": "x"}))
    sock.send(msgpack.packb({"hello": "world"}))
    code, out = finish(proc)
    sock.close()
    assert code == 0, out
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert all(k in r for k in REQUIRED), r
        assert r["max_staleness"] <= 1  # eta
        # the staleness metrics (each checked against a reference in test_staleness_metrics.py)
        assert sum(r["token_staleness_hist"].values()) == r["tokens_trained"] > 0
        assert set(r["token_staleness_hist"]) <= {"0", "1"} and r["policy_kl"] >= 0
        assert r["w_p05"] <= r["w_p50"] <= r["w_p95"] and r["w_std"] >= 0
        # the same weights on both sides in float32 on CPU: the lag-0 mismatch is ~0
        assert r["logprob_mismatch_tokens"] == 0 or r["logprob_mismatch_p99"] <= 1e-4, r
        assert r["equal_reward_share"] in (0.0, None)  # None: no group completed during the step
        # every trajectory produced is trained, filtered or dropped (or still pending)
        assert r["trajectories_produced"] == (r["trajectories_trained"] + r["trajectories_filtered"] +
                                              r["trajectories_dropped"] + r["trajectories_pending"])
    assert rows[-1]["version"] == 3 and rows[-1]["trajectories_trained"] == 3 * 2 * 2
    assert rows[-1]["rejected_messages"] + rows[-1].get("unknown_peer", 0) >= 1
    ids = [i for r in rows for i in r["problem_ids"]]
    assert len(ids) == len(set(ids)), "a prompt was trained twice"
    # each trained sample's problem, group and generated length, one row per step, in lengths.jsonl
    lengths = read_metrics(tmp_path / "run" / "lengths.jsonl")
    assert [r["step"] for r in lengths] == [1, 2, 3]
    for r, m in zip(lengths, rows):
        assert len(r["problem_ids"]) == len(r["group_ids"]) == len(r["lengths"]) == 2 * 2  # batch x group
        assert sorted(set(r["problem_ids"]), key=str) == m["problem_ids"]
        assert sorted(Counter(r["group_ids"]).values()) == [2, 2]
        assert all(isinstance(n, int) and 0 <= n <= 3 for n in r["lengths"])  # max_new_tokens
    engine = json.loads((tmp_path / "run" / "engine" / "replica0.json").read_text())  # how full the batches were
    assert sum(engine["finished"].values()) >= rows[-1]["trajectories_produced"] and engine["steps"] > 0
    assert 1 <= engine["mean_batch"] == engine["generated_tokens"] / engine["steps"]
    assert 0 < engine["mixed_steps"] <= engine["steps"] and engine["seconds"] > 0
    # the leader's time trace: cumulative counters, the last line written as it stopped
    trace = [json.loads(x) for x in (tmp_path / "run" / "engine" / "replica0.jsonl").read_text().splitlines()]
    assert all(a["sent"] <= b["sent"] and a["time"] <= b["time"] for a, b in zip(trace, trace[1:]))
    assert trace[-1]["sent"] >= rows[-1]["trajectories_produced"] and trace[-1]["steps"] == engine["steps"]
    assert trace[-1]["engine_step_s"] <= trace[-1]["engine_s"] < trace[-1]["time"] - trace[0]["time"] + 2.0
    from hexrl.model.hf_checkpoint import load_pretrained

    assert load_pretrained(tmp_path / "run" / "final").cfg.num_hidden_layers == 4
    evals = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2, 3] and all(e["n"] == 20 for e in evals)
    assert [r["heldout_accuracy"] is not None for r in rows] == [False, True, True]
    run_dir_is_complete_and_summarized(tmp_path / "run", evals)


def run_dir_is_complete_and_summarized(run, evals):
    """Every model directory the run wrote loads with its tokenizer; `hexrl.generate` answers from the run
    directory (final/) and from its checkpoint alone, alike; the summary tells the run's story."""
    from hexrl.control.summary import summarize
    from hexrl.data.tokenizer import CharTokenizer, load_tokenizer
    from hexrl.generate import main as generate

    for model_dir in (run / "final", run / "eval_model", run / "checkpoints"):
        assert isinstance(load_tokenizer(model_dir), CharTokenizer), model_dir
    answers = []
    for where in (run, run / "checkpoints"):  # final/, then the latest checkpoint (the same weights)
        out = run.parent / f"answer-{len(answers)}.json"
        with open(out, "w") as f, contextlib.redirect_stdout(f):
            assert generate([str(where), "--prompt", "3+4=", "--prompt", "8+1=", "--temperature", "0",
                             "--max-new-tokens", "3", "--json"]) == 0
        answers.append([json.loads(line)["token_ids"] for line in out.read_text().splitlines()])
    assert answers[0] == answers[1] and len(answers[0]) == 2
    text = summarize(run, launch_s=12.0)
    last = metrics(run)[-1]
    assert f"held-out accuracy: {evals[0]['heldout_accuracy']:.3f} at step 0 -> " \
           f"{evals[-1]['heldout_accuracy']:.3f} at step 3 (20 problems" in text
    assert "3 steps" in text and "12 s launch to exit" in text and f"{last['wall_s']:.0f} s training" in text
    assert (f"produced {last['trajectories_produced']} = trained {last['trajectories_trained']} + filtered "
            f"{last['trajectories_filtered']} + dropped {last['trajectories_dropped']} + pending "
            f"{last['trajectories_pending']} (balanced)") in text


def test_kill_9_then_resume_continues_from_the_last_checkpoint(tmp_path):
    plan = write_job(tmp_path, steps=6, eta=2, checkpoint_every=1)
    run = tmp_path / "run"
    proc = torchrun(plan, run)
    assert wait_for(lambda: len(metrics(run)) >= 2, 180, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = max(r["step"] for r in metrics(run))
    latest = (run / "checkpoints" / "latest").read_text().strip()
    saved = json.loads((run / "checkpoints" / latest / "meta.json").read_text())
    assert saved["version"] >= 1  # one step per version: the checkpoint of step `version`
    code, out = finish(torchrun(plan, run, "--resume", str(run / "checkpoints")))
    assert code == 0, out
    rows = metrics(run)
    steps = [r["step"] for r in rows]
    assert steps == sorted(steps) and steps[-1] == 6 and len(steps) == len(set(steps)), steps
    resumed = [r for r in rows if r["step"] > saved["version"]]
    assert resumed[0]["version"] == saved["version"] + 1  # the version continued, not restarted
    ids = [i for r in rows for i in r["problem_ids"]]
    assert len(ids) == len(set(ids)), "a prompt was trained twice across the resume"
    assert [r["step"] for r in read_metrics(run / "lengths.jsonl")] == steps  # truncated like metrics
    assert done >= 2


def test_killing_one_rank_ends_every_rank_with_its_name(tmp_path):
    plan = write_job(tmp_path, steps=1000, eta=1)
    run = tmp_path / "run"
    proc = torchrun(plan, run)
    assert wait_for(lambda: len(metrics(run)) >= 1, 180, proc)
    pids = worker_pids(proc)
    assert sorted(pids) == [0, 1, 2]
    os.kill(pids[2], signal.SIGKILL)  # the rollout rank
    t0 = time.time()
    code, out = finish(proc, timeout_s=60)
    assert time.time() - t0 < 60
    assert code != 0
    assert "rank      : 2" in out or "rank 2" in out, out[-3000:]
    for pid in pids.values():
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()


def test_invalid_plan_is_refused_before_any_collective(tmp_path):
    plan_path = write_job(tmp_path, steps=1)
    plan = json.loads(plan_path.read_text())
    plan["ranks"][2]["role"] = "critic"
    plan["ranks"][1]["rank"] = 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(plan))
    code, out = finish(torchrun(bad, tmp_path / "run", nproc=2), timeout_s=60)
    assert code != 0
    assert "WORLD_SIZE=2 but the plan has 3 ranks" in out
    assert "unknown role 'critic'" in out and "rank 0 listed twice" in out
    summary = out[out.rindex("Root Cause"):]  # torchrun's last words: hexrl's message, not a pointer to docs
    assert "WORLD_SIZE=2 but the plan has 3 ranks" in summary and "To enable traceback" not in summary
    assert "metrics.jsonl" not in os.listdir(tmp_path / "run") if (tmp_path / "run").exists() else True


def test_a_fresh_run_refuses_a_run_dir_that_holds_a_run(tmp_path, capsys):
    from hexrl.main import check_run_dir

    check_run_dir(tmp_path, resume=None, rank=0)  # empty: fine
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(SystemExit) as e:
        check_run_dir(tmp_path, resume=None, rank=0)
    assert e.value.code == 2 and "--resume" in capsys.readouterr().err
    check_run_dir(tmp_path, resume=str(tmp_path / "checkpoints"), rank=0)  # continuing it: fine
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'  # nothing touched
