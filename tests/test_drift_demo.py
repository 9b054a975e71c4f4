"""Drift re-planning at run time on CPU (tools/experiments/drift_demo.py): a job whose outputs lengthen
as it trains (data.synthetic.budget) starts on a plan made for short outputs and switches itself
toward generation once the measured lengths make generation the bottleneck."""
import json

import pytest

from hexrl.control.metrics import read_events, read_metrics
from tools.experiments import drift_demo


@pytest.mark.slow
def test_a_job_whose_outputs_lengthen_switches_toward_generation(tmp_path):
    args = drift_demo.parser().parse_args([
        str(tmp_path), "--workloads", "lengthen", "--arms", "on", "--steps", "16", "--ramp", "2",
        "--every-s", "3", "--horizon-s", "3600", "--switch-s", "1", "--max-restarts", "1"])
    (arm,) = drift_demo.prepare(args)
    drift_demo.launch(arm, args.max_restarts)
    drift_demo.wait_all([arm], timeout_s=600)
    assert arm.proc.returncode == 0, (arm.run / "log.txt").read_text()[-4000:]
    assert [r["step"] for r in read_metrics(arm.run / "metrics.jsonl")] == list(range(1, 17))
    (switch, *_) = [d for d in read_events(arm.run / "metrics.jsonl", "replan") if d["taken"]]
    assert switch["running_split"] == {"train": {"cpu": 2}, "rollout": {"cpu": 1}}  # planned for 8 tokens
    assert switch["new_split"] == {"train": {"cpu": 1}, "rollout": {"cpu": 2}}
    assert switch["measured"]["output_len_mean"] > 32
    recorded = json.loads((arm.run / "plans" / "0.json").read_text())
    assert sorted(r["role"] for r in recorded["ranks"]) == ["rollout", "rollout", "train"]
    assert "resuming from" in (arm.run / "log.txt").read_text()  # the new plan went on from the checkpoint
