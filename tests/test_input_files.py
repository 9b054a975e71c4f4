"""Files that are not what they claim: one guard, hexrl.input_files, for every
input file: FIFOs and other non-regular files, truncated gzip, deep nesting, NaN."""
import gzip
import json
import os
import subprocess
import sys

import pytest
from runtime_utils import ROOT

from hexrl.data.datasets import load_dataset, load_jsonl
from hexrl.data.tokenizer import load_tokenizer
from hexrl.input_files import InputFileError, loads_json, read_json
from hexrl.model.config import ModelConfig
from hexrl.model.safetensors_header import weight_file_problems
from hexrl.model.tiny import make_tiny_model

DEEP = "[" * 100_000 + "]" * 100_000


def plan(job: dict, tmp_path) -> subprocess.CompletedProcess:
    """`python -m hexrl.plan` on `job`, bounded: a FIFO used to block it forever."""
    (tmp_path / "job.json").write_text(json.dumps(job))
    return subprocess.run([sys.executable, "-m", "hexrl.plan", str(tmp_path / "job.json"), "-o",
                           str(tmp_path / "plan.json")], cwd=ROOT, capture_output=True, text=True, timeout=60)


def tiny_job(model, data) -> dict:
    return {"name": "t", "model": {"path": str(model)}, "data": {"path": str(data)},
            "reward": {"name": "exact"}, "rl": {"batch_size": 2, "group_size": 2, "max_new_tokens": 3, "steps": 1},
            "cluster": {"nodes": [{"name": "local", "gpu_type": "cpu", "gpus": 3}]},
            "layout": {"train_gpus": 2, "dp": 2}}


@pytest.mark.parametrize("fifo", ["model/model.safetensors", "data.jsonl", "model/config.json"])
def test_a_fifo_named_like_an_input_is_refused_not_waited_on(tmp_path, fifo):
    model = make_tiny_model(tmp_path / "model", tokenizer="char")
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    os.remove(tmp_path / fifo)
    os.mkfifo(tmp_path / fifo)
    res = plan(tiny_job(model, tmp_path / "data.jsonl"), tmp_path)
    assert res.returncode == 2 and f"{tmp_path / fifo}: is a FIFO" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_the_guard_refuses_every_kind_of_non_file(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "dir").mkdir()
    for name, kind in (("pipe", "a FIFO"), ("dir", "a directory")):
        with pytest.raises(InputFileError, match=f"is {kind}"):
            read_json(tmp_path / name)
    with pytest.raises(InputFileError, match="is a device"):
        read_json("/dev/zero")
    (tmp_path / "dir.safetensors").mkdir()
    assert weight_file_problems(tmp_path) == [f"{tmp_path / 'dir.safetensors'}: is a directory, not a regular "
                                              "safetensors file"]


def test_a_truncated_or_corrupt_gz_dataset_is_named(tmp_path):
    record = {"task_id": "T/0", "prompt": "def f(x):\n", "entry_point": "f", "canonical_solution": "",
              "test": "def check(candidate):\n    assert candidate(1) == 2\n"}
    whole = gzip.compress((json.dumps(record) + "\n").encode() * 50)
    for name, data in (("cut.jsonl.gz", whole[:len(whole) // 2]), ("junk.jsonl.gz", b"\x1f\x8b" + b"x" * 40),
                       ("empty.jsonl.gz", b"")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=f"{tmp_path / name}: (truncated or corrupt gzip|holds no records)"):
            load_dataset(path=str(tmp_path / name), kind="code")
    (tmp_path / "ok.jsonl.gz").write_bytes(whole)
    assert len(load_dataset(path=str(tmp_path / "ok.jsonl.gz"), kind="code")[0]) == 50


def test_deep_nesting_is_named_in_every_json_input(tmp_path):
    model = make_tiny_model(tmp_path / "model", tokenizer="char")
    (tmp_path / "model" / "config.json").write_text(DEEP)
    with pytest.raises(ValueError, match="config.json: nested too deeply"):
        ModelConfig.from_dir(model)
    (tmp_path / "data.jsonl").write_text(DEEP + "\n" + json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(ValueError, match="line 1: nested too deeply"):
        load_jsonl(tmp_path / "data.jsonl")
    (tmp_path / "he.jsonl").write_text('{"entry_point": "f", "test": ' + DEEP + "}\n")
    with pytest.raises(ValueError, match="line 1: nested too deeply"):
        load_dataset(path=str(tmp_path / "he.jsonl"), kind="code")
    (tmp_path / "model" / "hexrl_tokenizer.json").write_text(DEEP)
    with pytest.raises(ValueError, match="nested too deeply"):
        load_tokenizer(model)
    res = plan(tiny_job(model, tmp_path / "data.jsonl"), tmp_path)
    assert res.returncode == 2 and "config.json: nested too deeply" in res.stderr and "Traceback" not in res.stderr


def test_a_data_line_nested_thousands_deep_refuses_the_file(tmp_path):
    """A line among good ones, nested 5,000 deep: the file is refused, naming it and the line (a line
    with a mere typo is still skipped with a warning)."""
    model = make_tiny_model(tmp_path / "model", tokenizer="char")
    good = [json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) for a in range(4)]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(good[:2] + ['{"prompt": "1+1=", "answer": "2", "x": ' + "[" * 5000 + "]" * 5000 + "}"]
                              + good[2:]) + "\n")
    res = plan(tiny_job(model, data), tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"dataset file {data}: line 3: nested too deeply to be a dataset line (more than 100 levels)" in res.stderr
    data.write_text("\n".join(good[:2] + ['{"prompt": "1+1=", "answer": '] + good[2:]) + "\n")
    with pytest.warns(UserWarning, match="skipped 1 malformed line.*line 3: invalid JSON"):
        assert len(load_jsonl(data).problems) == 4


def test_nan_and_infinity_are_not_json_numbers_here():
    for text in ('{"x": NaN}', '[Infinity]', '{"x": -Infinity}'):
        with pytest.raises(InputFileError, match="is not a number hexrl accepts"):
            loads_json(text, "f")
    assert loads_json('{"x": "NaN", "y": [1e308]}', "f") == {"x": "NaN", "y": [1e308]}


def test_a_lone_surrogate_escape_is_not_text_and_its_line_is_named(tmp_path):
    """`"\\ud800"` parses to a str no encoder takes: a prompt with one was tokenized or sent to the
    controller process (msgpack: UnicodeEncodeError) long after the file was read."""
    with pytest.raises(InputFileError, match=r"job.json: a \\u escape names half a surrogate pair \('\\ud800'\)"):
        loads_json('{"name": "a\\ud800b"}', "job.json")
    assert loads_json('{"name": "\\ud83d\\ude00 \\\\ud800"}', "job.json") == {"name": "\U0001F600 \\ud800"}
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4\\udcff"}\n')
    with pytest.warns(UserWarning, match="skipped 1 malformed"):
        result = load_jsonl(data)
    assert [p.prompt for p in result.problems] == ["1+1="]
    assert "half a surrogate pair ('\\udcff')" in dict(result.skipped)[2]
