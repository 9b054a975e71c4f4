"""`python -m hexrl.generate` end to end on a tiny checkpoint with a char tokenizer."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hexrl.data.tokenizer import CharTokenizer
from hexrl.model.tiny import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]

transformers = pytest.importorskip("transformers")


def cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "hexrl.generate", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_generate_json_matches_transformers_greedy(tmp_path):
    path = make_tiny_model(tmp_path / "m", vocab=64, tokenizer="char", arch="llama")
    prompts = ["12+7=", "(3*4)-5=", "x"]
    run = cli(str(path), *[a for p in prompts for a in ("--prompt", p)], "--max-new-tokens", "6",
              "--temperature", "0", "--page-size", "4", "--max-pages", "32", "--json")
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert [x["prompt"] for x in lines] == prompts
    tok = CharTokenizer()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for p, x in zip(prompts, lines):
        ids = tok.encode(p)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_id,
                          pad_token_id=0)[0, len(ids):].tolist()
        assert x["token_ids"] == ref
        assert x["text"] == tok.decode(ref) and len(x["logprobs"]) == len(ref)
        assert x["finish_reason"] == ("eos" if ref[-1] == tok.eos_id else "length")


def test_generate_readable_output_and_clear_errors(tmp_path, capsys):
    from hexrl.generate import main  # in-process: same code path as the CLI, without a second interpreter

    path = make_tiny_model(tmp_path / "m", vocab=64, tokenizer="char")
    assert main([str(path), "--prompt", "1+1=", "--max-new-tokens", "3", "--seed", "5", "--max-pages", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("--- prompt: '1+1='") and "\n1+1=" in out
    assert main([str(path), "--prompt", "ABC", "--max-new-tokens", "3"]) == 2
    assert "cannot encode characters ['A', 'B', 'C']" in capsys.readouterr().err
    assert main([str(tmp_path / "nope"), "--prompt", "1"]) == 2
    assert "does not exist" in capsys.readouterr().err
