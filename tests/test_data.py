"""Datasets: JSONL loading (three record shapes, bad lines), synthetic arithmetic, splits."""

import json

import pytest

from hexrl.data.datasets import (
    load_dataset,
    load_jsonl,
    make_arithmetic,
    make_arithmetic_split,
    split_heldout,
    token_budget,
    write_jsonl,
)
from hexrl.data.problems import Problem
from hexrl.data.tokenizer import CharTokenizer


def _write_lines(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


# ----------------------------------------------------------------------------- JSONL


def test_three_record_shapes(tmp_path):
    path = _write_lines(tmp_path / "d.jsonl", [
        {"prompt": "1+1?", "answer": "2"},
        {"question": "Natalia sold 48 clips...", "answer": "She sold 48/2 = 24.\n#### 72"},
        {"problem": "Simplify.", "solution": "So it is $\\boxed{\\frac{1}{\\sqrt{2}}}$."},
        {"problem": "MATH-500 style", "solution": "\\boxed{9}", "answer": "3"},  # explicit answer wins
        {"prompt": "numeric answer", "answer": 12, "id": "q5"},
    ])
    result = load_jsonl(path)
    assert result.skipped == []
    assert [p.answer for p in result.problems] == ["2", "72", "\\frac{1}{\\sqrt{2}}", "3", "12"]
    assert [p.id for p in result.problems] == [1, 2, 3, 4, "q5"]  # default id: the line number
    assert result.problems[1].prompt == "Natalia sold 48 clips..."
    assert all(p.kind == "math" for p in result.problems)


def test_bad_lines_are_skipped_with_line_numbers(tmp_path):
    path = _write_lines(tmp_path / "d.jsonl", [
        {"prompt": "ok", "answer": "1"},
        "{not json",
        {"prompt": "no answer"},
        "",  # blank lines are not records, and not errors
        {"prompt": ["wrong", "type"], "answer": "1"},
        {"problem": "p", "solution": "no box here"},
        [1, 2],
        {"prompt": "ok again", "answer": "2", "id": 1},  # clashes with line 1's default id
        {"prompt": "fine", "answer": "3"},
    ])
    with pytest.warns(UserWarning, match="skipped 6 malformed"):
        result = load_jsonl(path)
    assert [p.answer for p in result.problems] == ["1", "3"]
    assert [n for n, _ in result.skipped] == [2, 3, 5, 6, 7, 8]
    reasons = dict(result.skipped)
    assert "invalid JSON" in reasons[2]
    assert "answer" in reasons[3]
    assert "'prompt' must be a non-empty string" in reasons[5]
    assert "boxed" in reasons[6]
    assert "JSON object" in reasons[7]
    assert "duplicate id 1" in reasons[8]


def test_all_bad_empty_and_missing_files(tmp_path):
    bad = _write_lines(tmp_path / "bad.jsonl", ["{", {"answer": "1"}, "[]"])
    with pytest.raises(ValueError, match=r"no usable line \(3 bad\): line 1: invalid JSON.*line 2.*line 3"):
        load_jsonl(bad)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="empty"):
        load_jsonl(tmp_path / "empty.jsonl")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_jsonl(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="kind"):
        load_jsonl(bad, kind="poetry")


def test_a_length_hint_is_read_and_a_bad_one_skips_its_line_naming_the_field(tmp_path):
    path = _write_lines(tmp_path / "d.jsonl", [
        {"prompt": "prove it", "answer": "1", "length_hint": 4000},  # a hard problem: expect long answers
        {"prompt": "1+1?", "answer": "2"},  # no hint: the predictor starts it at the running median
        {"prompt": "x", "answer": "3", "length_hint": "long"},
        {"prompt": "y", "answer": "4", "length_hint": -5},
        {"prompt": "z", "answer": "5", "length_hint": 12.5},
        {"prompt": "w", "answer": "6", "length_hint": 10**400},  # beyond a float: no length (was OverflowError)
    ])
    with pytest.warns(UserWarning, match="skipped 3 malformed"):
        result = load_jsonl(path)
    assert [p.length_hint for p in result.problems] == [4000.0, None, 12.5]
    assert dict(result.skipped) == {3: "'length_hint' must be a non-negative number of tokens, got 'long'",
                                    4: "'length_hint' must be a non-negative number of tokens, got -5",
                                    6: "'length_hint' must be a non-negative number of tokens, got "
                                       + "1" + "0" * 17 + "..." + "0" * 19}
    again = load_jsonl(write_jsonl(result.problems, tmp_path / "out.jsonl"))
    assert again.problems == result.problems  # written back with its hint


def test_code_records(tmp_path):
    path = _write_lines(tmp_path / "c.jsonl", [
        {"prompt": "read two ints, print the sum", "tests": [{"input": "1 2", "output": "3"}, "assert add(1, 2) == 3"]},
        {"prompt": "no tests"},
        {"prompt": "bad tests", "tests": [{"input": 1}]},
    ])
    with pytest.warns(UserWarning):
        result = load_jsonl(path, kind="code")
    assert len(result.problems) == 1
    p = result.problems[0]
    assert p.kind == "code" and p.answer == "" and len(p.tests) == 2
    assert [n for n, _ in result.skipped] == [2, 3]


def test_write_then_load_round_trip(tmp_path):
    problems = make_arithmetic(20, seed=3) + [Problem("q", "a", id="code-1", tests=["assert f(1) == 1"], kind="code")]
    path = write_jsonl(problems, tmp_path / "sub" / "out.jsonl")
    loaded = load_jsonl(path)  # each record carries its kind
    assert loaded.problems == problems


# ----------------------------------------------------------------------------- synthetic


def test_arithmetic_is_correct_and_learnable_by_char_model():
    problems = make_arithmetic(300, seed=0, digits=(1, 2), ops="+-*")
    tok = CharTokenizer()
    for p in problems:
        assert p.prompt.endswith("=") and p.kind == "synthetic"
        assert str(eval(p.prompt[:-1])) == p.answer  # independent reference: Python itself
        tok.encode(p.prompt + p.answer)  # every character is in the char alphabet
        a, b = (int(x) for x in p.prompt[:-1].replace("*", "+").replace("-", "+").split("+"))
        assert 0 <= a <= 99 and 0 <= b <= 99
    assert len({p.prompt for p in problems}) == 300
    assert all(int(p.answer) >= 0 for p in problems)  # no negatives by default
    assert {op for p in problems for op in '+-*' if op in p.prompt} == set('+-*')
    assert [p.id for p in problems] == list(range(300))


def test_arithmetic_is_deterministic_and_prefix_stable():
    a = make_arithmetic(50, seed=7)
    assert a == make_arithmetic(50, seed=7)
    assert a != make_arithmetic(50, seed=8)
    assert make_arithmetic(20, seed=7) == a[:20]


def test_arithmetic_digits_and_negatives():
    problems = make_arithmetic(200, seed=1, digits=(3, 3), ops="-", negatives=True)
    assert all(len(x) == 3 for p in problems for x in p.prompt[:-1].split("-"))
    assert any(p.answer.startswith("-") for p in problems)


def test_arithmetic_argument_errors():
    with pytest.raises(ValueError, match="only 100 distinct"):
        make_arithmetic(101, seed=0, digits=(1, 1), ops="+")
    assert len(make_arithmetic(100, seed=0, digits=(1, 1), ops="+")) == 100  # the whole space
    with pytest.raises(ValueError, match=r"n must be.*digits must be.*ops must be"):
        make_arithmetic(0, digits=(2, 1), ops="/")


def test_split_heldout_is_disjoint_and_complete():
    problems = make_arithmetic(100, seed=0)
    problems += [Problem(problems[0].prompt, problems[0].answer, id="dup", kind="synthetic")]
    train, held = split_heldout(problems, 0.2, seed=1)
    assert not {p.prompt for p in train} & {p.prompt for p in held}
    assert len(train) + len(held) == len(problems)
    assert len({p.prompt for p in held}) == 20
    assert (train, held) == split_heldout(problems, 0.2, seed=1)
    _, held_count = split_heldout(problems, 5, seed=1)
    assert len(held_count) in (5, 6)  # 6 when the duplicated prompt is held out (both copies)
    with pytest.raises(ValueError, match="no training prompts"):
        split_heldout(problems, 100)
    with pytest.raises(ValueError, match="fraction"):
        split_heldout(problems, 1.5)


def test_make_arithmetic_split():
    train, held = make_arithmetic_split(80, 20, seed=2, digits=(1, 2))
    assert len(train) == 80 and len(held) == 20
    assert not {p.prompt for p in train} & {p.prompt for p in held}


def test_a_token_budget_drifts_with_the_trainer_step_then_holds():
    grow, shrink = {"start": 8, "end": 32, "steps": 12}, {"start": 32, "end": 8, "steps": 12}
    assert [token_budget(grow, v) for v in (0, 3, 6, 12, 100)] == [8, 14, 20, 32, 32]
    assert [token_budget(shrink, v) for v in (0, 6, 12, 100)] == [32, 20, 8, 8]
    # the budget is the run's stop rule, not part of the problems: they are the task's without it
    synthetic = {"task": "arithmetic", "n": 20, "seed": 1, "digits": [1, 2]}
    assert load_dataset({**synthetic, "budget": grow}) == load_dataset(synthetic)
