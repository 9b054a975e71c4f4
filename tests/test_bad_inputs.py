"""Bad input files get one clear message naming the file and the problem, and exit code 2, before
any rank starts: a binary job file, prompts the tokenizer cannot encode, empty or all-bad datasets,
a corrupt checkpoint to resume from, a garbage tokenizer file."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runtime_utils import ROOT, metrics, torchrun, write_job

from hexrl.data.prompts import run_prompts
from hexrl.data.tokenizer import TokenizerError, load_tokenizer
from hexrl.main import load_checked_plan
from hexrl.model.config import ModelConfig
from hexrl.model.tiny import make_tiny_model
from hexrl.preflight import check_inputs
from hexrl.schema import TrainerLayout, load_job
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
    # the run directory is private (0700, its files 0600) unless the job shares it
    run = [tmp_path / "run", *(tmp_path / "run").rglob("*")]
    modes = {str(p.relative_to(tmp_path)): p.stat().st_mode & 0o777 for p in run}
    assert modes["run"] == 0o700 and modes["run/metrics.jsonl"] == 0o600, modes
    assert any("checkpoints" in p for p in modes) and set(modes.values()) <= {0o700, 0o600}, modes


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
    ("extra.json", lambda p: p.write_text("[" * 100_000), "corrupt, not a JSON object"),  # RecursionError
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


# ----------------------------------------------------------------------------- hostile inputs (docs/reliability.md)


def layout_files(layout: dict) -> list[str]:
    """The files a checkpoint saved with `layout` holds (hexrl/train/checkpoint.py's module doc)."""
    return [f for s, st in enumerate(layout["stages"]) for t in range(st["tp"])
            for f in [f"model-s{s}-tp{t}.pt"] + [f"rng-s{s}-dp{d}-tp{t}.pt" for d in range(layout["dp"])]]


def layout_checkpoint(root: Path, version: int, plan_trainer: dict, skip: tuple[str, ...] = (),
                      model: Path | None = None) -> Path:
    """A checkpoint step saved with the plan's trainer layout, every file present but `skip`; its
    model shards hold zeros of the shapes of `model` (a model directory), or a stand-in without one."""
    d = root / f"step{version:08d}"
    d.mkdir(parents=True)
    for name in layout_files(plan_trainer):
        if name not in skip:
            torch.save({"w": torch.zeros(3)}, d / name)
    if model is not None:  # model shards of the shapes `model`'s stages have
        cfg = ModelConfig.from_dir(model)
        for s, stage in enumerate(TrainerLayout.from_dict(plan_trainer).stages):
            for t in range(stage.tp):
                if f"model-s{s}-tp{t}.pt" not in skip:
                    state = ckpt.meta_stage(cfg, stage.layers, stage.tp).state_dict()
                    torch.save({"model": {k: torch.zeros(v.shape) for k, v in state.items()}, "optim": {}},
                               d / f"model-s{s}-tp{t}.pt")
    (d / "meta.json").write_text(json.dumps({"version": version, "layout": plan_trainer}))
    (d / "extra.json").write_text(json.dumps({"step": version}))
    (root / "latest").write_text(d.name)
    return d


@pytest.mark.parametrize("missing", ["model-s0-tp0.pt", "rng-s0-dp1-tp0.pt"])
def test_an_incomplete_step_is_named_and_resume_falls_back(tmp_path, capsys, missing):
    """Item 6: a step lacking a file its layout implies is not resumed from: preflight names the
    file; given the root, the run resumes from the previous complete step and says so."""
    plan = write_job(tmp_path, steps=1)
    trainer = json.loads(plan.read_text())["trainer"]
    assert layout_files(trainer) == ckpt.expected_files(trainer) == [
        "model-s0-tp0.pt", "rng-s0-dp0-tp0.pt", "rng-s0-dp1-tp0.pt"]
    root = tmp_path / "ck"
    layout_checkpoint(root, 1, trainer, model=tmp_path / "model")
    step2 = layout_checkpoint(root, 2, trainer, skip=(missing,), model=tmp_path / "model")
    found = ckpt.problems(step2)  # the step named directly: refused, naming the file
    assert len(found) == 1 and str(step2) in found[0] and missing in found[0], found
    with pytest.raises(SystemExit) as e:
        load_checked_plan(str(plan), 0, 3, 3, None, resume=str(step2))
    assert e.value.code == 2 and missing in capsys.readouterr().err
    assert ckpt.problems(root, trainer) == []  # the root: its newest complete step
    load_checked_plan(str(plan), 0, 3, 3, None, resume=str(root))
    err = capsys.readouterr().err
    assert "step00000002 is incomplete" in err and missing in err and "resuming from step00000001" in err, err


def test_resume_into_other_stages_passes_preflight_unless_another_model(tmp_path, capsys):
    """A checkpoint saved with other stages and TP degrees is resharded on load, so it passes the
    checks before launch; one whose stages tile another number of layers is of another model: refused."""
    plan = write_job(tmp_path, steps=1)
    trainer = json.loads(plan.read_text())["trainer"]
    other = {"dp": 1, "stages": [{"tp": 1, "layers": [0, 1]}, {"tp": 2, "layers": [1, 4]}]}
    layout_checkpoint(tmp_path / "ck", 1, other, model=tmp_path / "model")
    assert ckpt.problems(tmp_path / "ck") == [] and ckpt.problems(tmp_path / "ck", trainer) == []
    load_checked_plan(str(plan), 0, 3, 3, None, resume=str(tmp_path / "ck"))
    fewer = {"dp": 1, "stages": [{"tp": 1, "layers": [0, 2]}, {"tp": 1, "layers": [2, 3]}]}
    layout_checkpoint(tmp_path / "ck3", 1, fewer)
    assert ckpt.problems(tmp_path / "ck3") == []  # whole, for its own layout
    found = ckpt.problems(tmp_path / "ck3", trainer)
    assert len(found) == 1 and "saved with stages" in found[0] and "another model" in found[0], found
    with pytest.raises(SystemExit) as e:
        load_checked_plan(str(plan), 0, 3, 3, None, resume=str(tmp_path / "ck3"))
    assert e.value.code == 2 and "model of 4 layers" in capsys.readouterr().err


@pytest.mark.parametrize("layout", [{"dp": 10 ** 9, "stages": [{"tp": 1}]}, {"dp": 1, "stages": [{"tp": 0}]},
                                    {"dp": -1, "stages": [{"tp": 1}]}])
def test_a_damaged_layout_is_named_not_expanded(tmp_path, layout):
    """A meta.json whose layout claims a billion ranks (or none) is corrupt: named at once, never
    turned into a billion file names."""
    d = tmp_path / "step00000001"
    d.mkdir()
    (d / "meta.json").write_text(json.dumps({"version": 1, "layout": layout}))
    (d / "extra.json").write_text(json.dumps({"step": 1}))
    found = ckpt.incomplete(d)
    assert len(found) == 1 and "meta.json" in found[0] and "malformed" in found[0], found


def damage_header(path: Path) -> None:
    path.write_bytes((10 ** 15).to_bytes(8, "little") + path.read_bytes()[8:])


@pytest.mark.parametrize("damage, why", [(truncate, "truncated"), (damage_header, "header length 1000000000000000"),
                                         (lambda p: p.write_bytes(b"\x05"), "header length -1")])
def test_a_broken_safetensors_file_is_refused_at_plan_time(tmp_path, damage, why):
    """Item 7: each header and data extent is checked against the file size, naming the file."""
    job = job_with_data(tmp_path, GOOD)
    weights = tmp_path / "model" / "model.safetensors"
    damage(weights)
    res = plan_cli(job, tmp_path / "plan.json")
    assert res.returncode == 2 and str(weights) in res.stderr and why in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "plan.json").exists()


def safetensors_file(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


@pytest.mark.parametrize("entry, why", [
    ({"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}, None),
    ({"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}, "shape [4] needs 16"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "ends at data byte 16, the file holds 12"),
    ({"dtype": "F33", "shape": [3], "data_offsets": [0, 12]}, "malformed entry"),
    ({"dtype": "F32", "shape": [-3], "data_offsets": [0, 12]}, "malformed entry"),
])
def test_safetensors_header_checks_name_the_tensor(tmp_path, entry, why):
    from hexrl.model.safetensors_header import header_problems
    f = safetensors_file(tmp_path / "w.safetensors", {"__metadata__": {"format": "pt"}, "w": entry}, bytes(12))
    found = header_problems(f)
    if why is None:
        assert found == []
    else:
        assert len(found) == 1 and f"{f}: tensor 'w'" in found[0] and why in found[0], found


def test_a_deeply_nested_job_file_is_named_not_a_traceback(tmp_path):
    """Item 8."""
    job = tmp_path / "job.json"
    job.write_text("[" * 100000 + "]" * 100000)
    res = plan_cli(job, tmp_path / "plan.json")
    assert res.returncode == 2 and str(job) in res.stderr and "nested too deeply" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and "RecursionError" not in res.stderr


def preset_job(tmp: Path, data: str) -> Path:
    job = {"name": "t", "model": {"preset": "tiny"}, "data": {"path": data},
           "rl": {"batch_size": 2, "group_size": 2, "max_new_tokens": 3, "steps": 2},
           "cluster": {"nodes": [{"name": "local", "gpu_type": "cpu", "gpus": 3}]},
           "layout": {"train_gpus": 2, "dp": 2}}
    (tmp / "job.json").write_text(json.dumps(job))
    return tmp / "job.json"


def test_a_preset_job_with_an_empty_dataset_is_refused(tmp_path):
    """Item 9: no tokenizer to encode prompts with, yet the dataset must hold problems."""
    (tmp_path / "data.jsonl").write_text("")
    res = plan_cli(preset_job(tmp_path, "data.jsonl"), tmp_path / "plan.json")
    assert res.returncode == 2 and "data.path" in res.stderr and "data.jsonl" in res.stderr, res.stderr
    (tmp_path / "data.jsonl").write_text(json.dumps(GOOD[0]) + "\n")
    assert plan_cli(preset_job(tmp_path, "data.jsonl"), tmp_path / "plan.json").returncode == 0


def test_a_missing_dataset_is_a_loud_warning_at_plan_time(tmp_path):
    """Item 9: the planner may run where the data is not (it is read at run time): it warns,
    naming the file; the shipped paper configs say so too (data/deepscaler.jsonl is not shipped)."""
    res = plan_cli(preset_job(tmp_path, "nowhere.jsonl"), tmp_path / "plan.json")
    assert res.returncode == 0 and "WARNING" in res.stderr and str(tmp_path / "nowhere.jsonl") in res.stderr
    paper = ROOT / "tools" / "configs" / "paper_1.5b_h800.json"
    res = plan_cli(paper, tmp_path / "paper_plan.json")
    assert res.returncode == 0 and "WARNING" in res.stderr and "deepscaler.jsonl" in res.stderr, res.stderr


def test_run_umask_follows_share_run_dir(tmp_path):
    """Item 10 (the run itself: test_a_run_with_a_bad_prompt_trains_on_the_others)."""
    from hexrl.runtime.files import set_run_umask
    old = os.umask(0o022)
    try:
        for share, dmode, fmode in ((False, 0o700, 0o600), (True, 0o755, 0o644)):
            set_run_umask(share)
            d = tmp_path / f"run-{share}"
            d.mkdir()
            (d / "metrics.jsonl").write_text("{}\n")
            assert (d.stat().st_mode & 0o777, (d / "metrics.jsonl").stat().st_mode & 0o777) == (dmode, fmode)
    finally:
        os.umask(old)
    assert load_job(json.loads(preset_job(tmp_path, "x.jsonl").read_text()) | {"share_run_dir": True},
                    check_paths=False).share_run_dir


# ----------------------------------------------------------------------------- reliability, round 5


def test_an_environment_module_that_exits_on_import_stops_the_planner_with_its_name(tmp_path):
    """An env module calling sys.exit(0) on import: exit 2 naming env.name, no plan (not exit 0, silent)."""
    (tmp_path / "quits.py").write_text("import sys\nsys.exit(0)\n")
    job = {"model": {"preset": "tiny"}, "data": {"synthetic": {"task": "arithmetic", "n": 10}},
           "env": {"name": "quits:Env"}, "cluster": {"nodes": [{"gpu_type": "cpu", "gpus": 2}]}}
    (tmp_path / "job.json").write_text(json.dumps(job))
    cmd = [sys.executable, "-m", "hexrl.plan", str(tmp_path / "job.json"), "-o", str(tmp_path / "p.json")]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"})
    assert res.returncode == 2 and "env.name: cannot import 'quits:Env': SystemExit: 0" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "p.json").exists()


def test_calculator_with_a_tokenizer_that_cannot_write_its_tags_is_refused(tmp_path):
    """The char tokenizer's default alphabet has no < or >: the model could never close a <calc> call."""
    job = json.loads(job_with_data(tmp_path, GOOD).read_text())
    job["env"] = {"name": "calculator"}
    assert [p for p in check_inputs(load_job(job)).problems if p.startswith("env")] == [
        "env (calculator): the tokenizer cannot write '<>' of the stop string '</calc>': "
        "the model could never end a turn there"]
    job["env"] = {"name": "retry"}  # no stop strings: nothing to write
    assert check_inputs(load_job(job)).problems == []
