"""Bad input files get one clear message naming the file and the problem, and exit code 2, before
any rank starts: a binary job file, prompts the tokenizer cannot encode, empty or all-bad datasets,
a corrupt checkpoint to resume from, a garbage tokenizer file."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runtime_utils import ROOT, metrics, torchrun, write_job

from hexrl.data.tokenizer import TokenizerError, load_tokenizer
from hexrl.main import load_checked_plan
from hexrl.model.tiny import make_tiny_model
from hexrl.runtime.preflight import check_inputs, run_prompts
from hexrl.schema import load_job
from hexrl.train import checkpoint as ckpt

GOOD = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(1, 5)]
BAD = {"prompt": "Ünïcode ⊕ 1+1=", "answer": "2"}  # upper case and non-ASCII: outside the char alphabet


def job_with_data(tmp: Path, records: list, steps: int = 2) -> Path:
    """A tiny CPU job reading `records` from a JSONL file; returns job.json."""
    model = tmp / "model"
    if not model.exists():
        make_tiny_model(model, tokenizer="char")
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    job = {"name": "t", "model": {"path": str(model)}, "data": {"path": str(data)},
           "reward": {"name": "exact", "timeout_s": 5},
           "rl": {"batch_size": 2, "group_size": 2, "eta": 1, "max_new_tokens": 3, "steps": steps, "seed": 0,
                  "filter_equal_groups": False},
           "cluster": {"nodes": [{"name": "local", "gpu_type": "cpu", "gpus": 3}]},
           "layout": {"train_gpus": 2, "dp": 2}}
    (tmp / "job.json").write_text(json.dumps(job))
    return tmp / "job.json"


def plan_cli(job: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hexrl.plan", str(job), "-o", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_binary_job_file_is_named_not_a_traceback(tmp_path):
    job = tmp_path / "job.json"
    job.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe binary")
    res = plan_cli(job, tmp_path / "plan.json")
    assert res.returncode == 2, res.stderr
    assert str(job) in res.stderr and "not UTF-8" in res.stderr and "Traceback" not in res.stderr


def test_prompts_outside_the_alphabet_are_skipped_and_counted(tmp_path):
    job = load_job(job_with_data(tmp_path, GOOD[:2] + [BAD] + GOOD[2:]))
    train, _ = run_prompts(job, load_tokenizer(job.model.path))
    assert [p.prompt for p in train.problems] == [r["prompt"] for r in GOOD]
    assert len(train.skipped) == 1 and train.skipped[0][0] == 3  # the line number is its id
    assert "'Ü'" in train.skipped[0][1]  # the reason names the character
    checked = check_inputs(job)
    assert checked.problems == []  # a few bad prompts do not stop a run
    assert checked.train.problems == train.problems  # and the run takes the prompts from the checks


def test_a_run_with_a_bad_prompt_trains_on_the_others(tmp_path):
    """Every prompt is drawn within the first step (4 usable, eta 1, B 2): a crash would show."""
    job = job_with_data(tmp_path, GOOD + [BAD], steps=2)
    assert plan_cli(job, tmp_path / "plan.json").returncode == 0
    proc = torchrun(tmp_path / "plan.json", tmp_path / "run")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "skipped 1 training prompts" in out
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and 5 not in {i for r in rows for i in r["problem_ids"]}


@pytest.mark.parametrize("records, why", [([], "is empty"), ([BAD, BAD | {"prompt": "ÄÖ"}], "none of its 2")])
def test_empty_or_all_bad_dataset_refused_before_launch(tmp_path, records, why):
    job = job_with_data(tmp_path, records)
    res = plan_cli(job, tmp_path / "plan.json")
    assert res.returncode == 2 and why in res.stderr and "data.jsonl" in res.stderr, res.stderr
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize("name, content", [("tokenizer.json", b"\xff\xfe\x00garbage"),
                                           ("hexrl_tokenizer.json", b"{not json")])
def test_garbage_tokenizer_file_is_named(tmp_path, name, content):
    model = make_tiny_model(tmp_path / "model", tokenizer="char")
    (model / "hexrl_tokenizer.json").unlink()
    (model / name).write_bytes(content)
    with pytest.raises(TokenizerError, match=str(model / name)):
        load_tokenizer(model)
    res = plan_cli(job_with_data(tmp_path, GOOD), tmp_path / "plan.json")
    assert res.returncode == 2 and str(model / name) in res.stderr, res.stderr


def fake_checkpoint(root: Path) -> Path:
    d = root / "step00000001"
    d.mkdir(parents=True)
    torch.save({"w": torch.zeros(3)}, d / "model-s0-tp0.pt")
    (d / "meta.json").write_text(json.dumps({"version": 1, "layout": {"dp": 1, "stages": []}}))
    (d / "extra.json").write_text(json.dumps({"step": 1}))
    (root / "latest").write_text(d.name)
    return d


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("file, damage, why", [
    ("meta.json", lambda p: p.write_text('{"version": 1, "lay'), "corrupt, not a JSON object"),
    ("extra.json", lambda p: p.write_text(""), "corrupt, not a JSON object"),
    ("model-s0-tp0.pt", truncate, "corrupt or truncated"),
])
def test_corrupt_checkpoint_is_named_and_refused_before_launch(tmp_path, capsys, file, damage, why):
    d = fake_checkpoint(tmp_path / "ck")
    assert ckpt.problems(tmp_path / "ck") == []
    damage(d / file)
    found = ckpt.problems(tmp_path / "ck")
    assert len(found) == 1 and str(d / file) in found[0] and why in found[0], found
    plan = write_job(tmp_path, steps=1)
    with pytest.raises(SystemExit) as e:
        load_checked_plan(str(plan), 0, 3, 3, None, resume=str(tmp_path / "ck"))
    err = capsys.readouterr().err
    assert e.value.code == 2 and str(d / file) in err and why in err, err


def test_torn_shard_is_named_at_load_too(tmp_path):
    d = fake_checkpoint(tmp_path / "ck")
    truncate(d / "model-s0-tp0.pt")
    with pytest.raises(ValueError, match="model-s0-tp0.pt: corrupt or truncated"):
        ckpt._torch_load(d / "model-s0-tp0.pt")
