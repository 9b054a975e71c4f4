"""Rewards: the math answer table, exact match, sandboxed code tests, and the reward pool."""

import os
import random
import time
from pathlib import Path

import pytest

from hexrl.rewards import RewardPool, code_reward, exact_match_reward, math_reward, reward_fn_by_name
from hexrl.rewards.code import extract_code
from hexrl.rewards.math import answers_match, find_boxed, normalize_answer
from hexrl.rewards.worker_pool import WorkerPool, worker_env

# ----------------------------------------------------------------------------- math

B = "\\boxed"
MATH_CASES = [
    # (completion, reference answer, expected reward)
    (f"The answer is {B}{{42}}.", "42", 1.0),
    (f"{B}{{ 42 }}", "42", 1.0),
    (f"so {B} 5$ done", "5", 1.0),  # \boxed without braces
    (f"{B}{{\\frac{{1}}{{2}}}}", "0.5", 1.0),
    (f"{B}{{\\dfrac{{1}}{{2}}}}", "\\frac{1}{2}", 1.0),
    (f"{B}{{\\tfrac12}}", "\\frac{1}{2}", 1.0),
    (f"{B}{{\\frac12}}", "1/2", 1.0),
    (f"{B}{{0.50}}", "\\frac{1}{2}", 1.0),
    (f"{B}{{.5}}", "1/2", 1.0),
    (f"{B}{{-3}}", "-3", 1.0),
    (f"{B}{{- 3}}", "-3", 1.0),
    (f"{B}{{+7}}", "7", 1.0),
    (f"{B}{{-\\frac{{1}}{{2}}}}", "-0.5", 1.0),
    (f"{B}{{\\frac{{-1}}{{2}}}}", "-1/2", 1.0),
    (f"{B}{{1,000}}", "1000", 1.0),
    (f"{B}{{1,234,567.5}}", "1234567.5", 1.0),
    (f"{B}{{1{{,}}000}}", "1000", 1.0),  # LaTeX thousands separator
    (f"{B}{{1\\,000}}", "1000", 1.0),
    (f"{B}{{50\\%}}", "50", 1.0),
    (f"{B}{{50%}}", "50", 1.0),
    (f"{B}{{x = 5}}", "5", 1.0),
    (f"{B}{{5\\text{{ cm}}}}", "5", 1.0),
    (f"{B}{{12\\mbox{{ cm}}^2}}", "12", 1.0),
    (f"{B}{{5 inches}}", "5", 1.0),
    (f"{B}{{90^\\circ}}", "90", 1.0),
    (f"{B}{{90^{{\\circ}}}}", "90", 1.0),
    (f"{B}{{\\$18.90}}", "18.9", 1.0),
    (f"{B}{{10.}}", "10", 1.0),  # trailing period
    ("$\\boxed{3.0}$", "3", 1.0),
    (f"{B}{{\\left(1, 2\\right)}}", "(1,2)", 1.0),
    (f"{B}{{(0.5, 2)}}", "(\\frac{1}{2}, 2)", 1.0),  # tuples compare element-wise
    (f"first {B}{{3}} then {B}{{4}}", "4", 0.0),  # two different boxes are a hedge
    (f"first {B}{{4}} then {B}{{4}}", "4", 1.0),  # the same box twice is one answer
    (f"{B}{{\\frac{{\\sqrt{{3}}}}{{2}}}}", "\\frac{\\sqrt3}{2}", 1.0),  # nested braces
    (f"{B}{{\\sqrt{{3}}/2}}", "\\frac{\\sqrt{3}}{2}", 1.0),
    (f"{B}{{2\\frac{{1}}{{2}}}}", "2.5", 1.0),  # mixed number
    (f"{B}{{0.3333333}}", "\\frac{1}{3}", 0.0),  # exact: no tolerance
    (f"{B}{{\\text{{(B)}}}}", "B", 1.0),
    (f"{B}{{\\infty}}", "\\infty", 1.0),
    ("\\fbox{12}", "12", 1.0),
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "72", 1.0),  # GSM8K form
    ("#### 1,000", "1000", 1.0),
    (f"{B}{{72}}", "She sold 24 clips.\n#### 72", 1.0),  # a GSM8K reference answer
    (f"{B}{{6}}", "so $\\boxed{6}$", 1.0),  # a boxed reference answer
    # --- wrong or missing answers
    (f"{B}{{41}}", "42", 0.0),
    ("The answer is 42", "42", 1.0),  # "the answer is" counts when there is no box or ####
    ("so it is 42", "42", 0.0),  # no marker at all
    ("", "42", 0.0),
    (f"{B}{{}}", "42", 0.0),
    (f"{B}{{4}} then {B}{{3}}", "4", 0.0),  # last box wins
    (f"{B}{{1,2}}", "12", 0.0),  # a tuple, not a thousands separator
    (f"{B}{{1,2}}", "1.2", 0.0),
    (f"{B}{{50\\%}}", "0.5", 0.0),  # documented: 50% equals 50, not 0.5
    (f"{B}{{0.33}}", "\\frac{1}{3}", 0.0),
    (f"{B}{{-3}}", "3", 0.0),
    (f"{B}{{3}}", "-3", 0.0),
    (f"{B}{{\\frac{{1}}{{2}}", "1/2", 0.0),  # unbalanced braces: no answer
    (f"{B}{{(1,2)}}", "(2,1)", 0.0),
    (f"{B}{{x+1}}", "x+2", 0.0),
    (f"{B}{{2\\sqrt{{2}}}}", "\\sqrt{2}", 0.0),
    (f"{B}{{10^{{5}}}}", "105", 0.0),
    (f"{B}{{1/0}}", "0", 0.0),  # division by zero must not crash
    (f"{B}{{5}}", "", 0.0),  # empty reference
    (f"{B}{{1000}}", "1,00", 0.0),  # not a thousands pattern
]


@pytest.mark.parametrize("completion,answer,expected", MATH_CASES)
def test_math_reward_table(completion, answer, expected):
    assert math_reward(completion, answer) == expected


def test_math_table_is_big_and_balanced():
    assert len(MATH_CASES) >= 40
    assert sum(e == 1.0 for *_, e in MATH_CASES) >= 20 and sum(e == 0.0 for *_, e in MATH_CASES) >= 15


@pytest.mark.parametrize("bad", [None, 42, "\\boxed{" * 20000, "\\boxed{" + "9" * 5000 + "}",
                                 "\\boxed{" + "\\frac{" * 20000 + "}", "#### " + "1," * 3000,
                                 "\\boxed{\\frac{}{}}", "\\boxed{1e999999}"],
                         ids=["none", "int", "unclosed_boxes", "long_number", "unclosed_fracs", "long_hash",
                              "empty_frac", "huge_exponent"])
def test_math_reward_never_raises(bad):
    assert math_reward(bad, "1") == 0.0
    assert math_reward("\\boxed{1}", bad) in (0.0, 1.0)


def test_find_boxed_and_normalize():
    assert find_boxed("a \\boxed{\\frac{1}{\\sqrt{2}}} b \\boxed{x^{2}}") == "x^{2}"
    assert find_boxed("\\boxed{1} and a truncated \\boxed{2") == "1"  # last well-formed box
    assert find_boxed("no box") is None
    assert normalize_answer("\\dfrac12") == "\\frac{1}{2}"
    assert normalize_answer(" $1,000$ ") == "1000"


def test_answers_match_is_symmetric_and_reflexive_on_random_latex():
    rng = random.Random(0)
    pieces = list("0123456789{}()[],.-+/ =%$^\\x") + ["\\frac", "\\dfrac", "\\text{", "\\sqrt", "\\left",
                                                     "\\circ", " cm", "e5", "\\!", "{,}"]
    for _ in range(200):  # every non-numeric pair costs a math-verify call
        p, g = ("".join(rng.choice(pieces) for _ in range(rng.randint(0, 15))) for _ in range(2))
        assert answers_match(p, g) == answers_match(g, p), (p, g)
        assert answers_match(p, p) == bool(normalize_answer(p)), p


@pytest.mark.parametrize("completion,answer,expected", [
    (f"{B}{{1}} or {B}{{2}}", "2", 0.0),  # a hedge earns nothing
    (f"It is {B}{{3}}, {B}{{5}}, {B}{{7}}, or {B}{{2}}", "2", 0.0),
    (f"{B}{{2}} or maybe {B}{{1}}", "2", 0.0),
    (f"first {B}{{2}}, so again {B}{{2}}", "2", 1.0),  # one answer repeated still scores
    (f"{B}{{\\frac{{1}}{{2}}}}, that is {B}{{0.5}}", "1/2", 1.0),  # equivalent forms are one answer
    (f"{B}{{1}} or {B}{{1}} or {B}{{3}}", "3", 0.0),
    (f"{B}{{72}}\n#### 73", "72", 0.0),  # a box and a `####` line are both stated answers
    ("#### 73\nor rather\n#### 72", "72", 0.0),  # the last `####` alone used to count
    (f"#### 72\nso {B}{{72}}", "72", 1.0),
    ("#### 72\n#### 72.0", "72", 1.0),
    (f"#### Step 1: add\n3 + 4 = 7\n#### Step 2\n{B}{{7}}", "7", 1.0),  # markdown headings state no answer
    ("#### Step 1: add\n3 + 4 = 7\n#### 7", "7", 1.0),
])
def test_boxed_answers_must_agree(completion, answer, expected):
    assert math_reward(completion, answer) == expected


def test_last_number_fallback_is_opt_in():
    assert math_reward("so it is 42.", "42") == 0.0
    assert math_reward("so it is 42.", "42", last_number_fallback=True) == 1.0
    assert math_reward("from 3 we get -1,000", "-1000", last_number_fallback=True) == 1.0


# ----------------------------------------------------------------------------- exact match


@pytest.mark.parametrize("completion,answer,expected", [
    ("19", "19", 1.0), (" 19 \n12+3=15", "19", 1.0), ("19<eos>junk", "19", 1.0), ("19\n", " 19 ", 1.0),
    ("191", "19", 0.0), ("\n19", "19", 0.0), ("", "19", 0.0), ("1 9", "19", 0.0), (None, "19", 0.0),
])
def test_exact_match(completion, answer, expected):
    assert exact_match_reward(completion, answer) == expected


# ----------------------------------------------------------------------------- code

ADD = "```python\ndef add(a, b):\n    return a + b\n```"
STDIN_SUM = "Here:\n```python\nprint(sum(map(int, input().split())))\n```\nDone."


def test_code_pass_fail_partial():
    assert code_reward(ADD, ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]) == 1.0
    assert code_reward(ADD, ["assert add(1, 2) == 4"]) == 0.0
    assert code_reward(ADD, ["assert add(1, 2) == 3", "assert add(1, 2) == 4"]) == 0.5
    assert code_reward(ADD, ["assert add(1, 2) == 3", "assert add(1, 2) == 4"], all_or_nothing=True) == 0.0


def test_code_stdin_tests():
    tests = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5", "output": "10  \n\n"},
             {"input": "2 2", "output": "5"}]
    assert code_reward(STDIN_SUM, tests) == pytest.approx(2 / 3)
    assert code_reward("print(1/0)", [{"input": "", "output": ""}]) == 0.0  # runtime error fails


def test_code_early_exit_cannot_fake_an_assert():
    assert code_reward("import sys\nsys.exit(0)", ["assert f() != 1"]) == 0.0
    assert code_reward("import os\nos._exit(0)", ["assert f() != 1"]) == 0.0


def test_code_timeout_and_memory_limits():
    ok = ["assert f() is None"]  # true for `def f(): pass`, defined after each program's hog
    assert code_reward("def f(): pass", ok, timeout_s=10.0) == 1.0
    assert code_reward("while True:\n    pass\ndef f(): pass", ok, timeout_s=1.0) == 0.0
    hog = "a = []\nwhile True:\n    a.append(bytearray(10**7))\ndef f(): pass"
    assert code_reward(hog, ok, timeout_s=10.0, memory_mb=256) == 0.0
    assert code_reward("x = bytearray(2 * 10**9)\ndef f(): pass", ok, memory_mb=256) == 0.0


def test_extract_code_and_bad_tests():
    assert extract_code("```py\nA\n```\n```python\nB\n```") == "B\n"
    assert extract_code("```\nC\n```") == "C\n"
    assert extract_code("```python\ntruncated") == "truncated"
    assert extract_code("x = 1") == "x = 1"
    with pytest.raises(ValueError, match=r"\[1\]"):
        code_reward(ADD, ["assert 1", {"input": 3}])
    with pytest.raises(ValueError, match="non-empty"):
        code_reward(ADD, [])


# ----------------------------------------------------------------------------- pool


def flaky_reward(completion, answer):
    """A misbehaving reward for the pool tests (module level, so spawned workers can import it)."""
    if completion == "hang":
        time.sleep(1000)
    if completion == "raise":
        raise RuntimeError("boom")
    if completion == "die":
        os._exit(3)
    if completion == "nan":
        return float("nan")
    if completion == "mark":  # leave the file named by `answer` behind
        Path(answer).touch()
        return 1.0
    if completion == "wait":  # until the file named by `answer` exists
        while not os.path.exists(answer):
            time.sleep(0.01)
        return 1.0
    return 1.0 if completion == answer else 0.0


def test_pool_matches_direct_calls():
    items = [(c, a) for c, a, _ in MATH_CASES[:12] + MATH_CASES[-6:]]
    with RewardPool("math", workers=2, timeout_s=30) as pool:
        assert pool.score(items) == [math_reward(c, a) for c, a in items]
        assert pool.score([]) == []
        assert pool.stats.ok == len(items) and pool.stats.error == pool.stats.timeout == 0


def test_pool_survives_hang_raise_and_death():
    with RewardPool(flaky_reward, workers=2, timeout_s=2.0) as pool:
        got = pool.score([("hang", ""), ("a", "a"), ("raise", ""), ("die", ""), ("nan", ""), ("b", "c")])
        assert got == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
        assert pool.stats.timeout == 1
        assert pool.stats.error == 3
        assert pool.stats.ok == 2
        assert pool.stats.restarts == 2  # the hung worker and the dead one were replaced
        assert any("boom" in e for e in pool.recent_errors)
        assert pool.score([("x", "x")] * 4) == [1.0] * 4  # still working afterwards
    with pytest.raises(RuntimeError, match="closed"):
        pool.score([("x", "x")])


def test_submit_returns_at_once_and_finished_hands_back_whole_batches(tmp_path):
    """The rollout leader's use: submit a finished group, decode on, collect it when scored."""
    go = tmp_path / "go"
    with RewardPool(flaky_reward, workers=2, timeout_s=30) as pool:
        slow = pool.submit([("wait", str(go))] * 3)  # both workers block until `go` exists
        fast = pool.submit([("a", "a"), ("b", "c")])  # queued behind them: first in, first out
        assert pool.finished(wait_s=0.2) == {} and pool.pending == 2
        go.touch()
        got = {}
        while len(got) < 2:
            got.update(pool.finished(wait_s=1.0))
        assert got == {slow: [1.0, 1.0, 1.0], fast: [1.0, 0.0]} and pool.pending == 0
        assert pool.submit([]) in pool.finished()  # an empty batch is done at once


def test_workers_score_a_whole_chunk_while_the_caller_does_not_poll(tmp_path):
    """The leader polls once per decode step: each worker must score many items per poll, not one."""
    marks = [tmp_path / f"m{i}" for i in range(12)]
    with RewardPool(flaky_reward, workers=2, timeout_s=30) as pool:
        ticket = pool.submit([("mark", str(m)) for m in marks])
        deadline = time.monotonic() + 30
        while not all(m.exists() for m in marks) and time.monotonic() < deadline:
            time.sleep(0.01)  # no finished() call: nothing new is dispatched meanwhile
        assert all(m.exists() for m in marks)
        assert pool.finished() == {ticket: [1.0] * len(marks)}


def test_an_unpicklable_item_fails_alone():
    with RewardPool(flaky_reward, workers=1, timeout_s=30) as pool:
        assert pool.score([("a", "a"), ("b", lambda: 0), ("c", "c")]) == [1.0, 0.0, 1.0]
        assert pool.stats.error == 1 and "cannot send" in pool.recent_errors[-1]


def test_pool_rejects_bad_arguments():
    with pytest.raises(ValueError, match="module-level"):
        RewardPool(lambda c, a: 1.0, workers=1)
    with pytest.raises(ValueError, match=r"workers.*timeout_s"):
        RewardPool(flaky_reward, workers=0, timeout_s=0)


def test_workers_start_without_the_jobs_variables(monkeypatch):
    """Model output reaches the workers: they see what Python needs, not the job's secret or keys."""
    monkeypatch.setenv("HEXRL_SECRET", "s" * 40)
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    with WorkerPool(os.getenv, workers=1) as pool:
        assert pool.run([("HEXRL_SECRET",), ("WANDB_API_KEY",), ("PATH",)]) == [None, None, os.environ["PATH"]]
    kept = {"PATH": "/bin", "HOME": "/h", "PYTHONPATH": "/src", "LC_ALL": "C", "OMP_NUM_THREADS": "1",
            "HEXRL_CODE_REWARD_UNSAFE": "1"}
    assert worker_env({**kept, "HEXRL_SECRET": "s", "AWS_SECRET_ACCESS_KEY": "k", "HF_TOKEN": "t"}) == kept


def test_reward_fn_by_name():
    assert reward_fn_by_name("math") is math_reward
    assert reward_fn_by_name("exact") is exact_match_reward
    assert reward_fn_by_name("code") is code_reward
    with pytest.raises(ValueError, match="unknown reward 'poetry'"):
        reward_fn_by_name("poetry")


HEDGES_IN_ONE_BOX = [  # (completion, reference) pairs: a hedge inside one box scores 0
    (r"\boxed{2\text{ (or 3)}}", "2"), (r"\boxed{2\mbox{ or 3}}", "2"), (r"\boxed{2 \ \text{(maybe 3)}}", "2"),
    (r"\boxed{2 \text{ (3 also works)}}", "2"), (r"\boxed{2 \operatorname{or} 3}", "3"),  # text and mbox tails
    (r"\boxed{2 \lor 3}", "3"), (r"\boxed{2 \vee 3}", "3"), (r"\boxed{2 ∨ 3}", "3"),  # logical or
    (r"\boxed{2 \cap 3}", "3"), (r"\boxed{2 \mid 3}", "3"), (r"\boxed{2 | 3}", "3"),  # sets, divides
    (r"\boxed{2 \parallel 3}", "3"), (r"\boxed{2 \approx 3}", "2"), (r"\boxed{2 \sim 3}", "3"),
    (r"\boxed{2 \\ 3}", "3"), (r"\boxed{2 \to 3}", "3"), (r"\boxed{2 \Rightarrow 3}", "3"),  # line break, arrows
    (r"\boxed{2 \implies 3}", "3"), (r"\boxed{2 \mapsto 3}", "3"), (r"\boxed{2 \iff 3}", "3"),
    (r"\boxed{2 \leftrightarrow 3}", "3"), (r"\boxed{\begin{pmatrix} 2}", "2"),  # an unclosed matrix
    ("#### 2 or 3", "3"), (r"The answer is $2 \lor 3$.", "3"),  # the rule holds for every marker
]


@pytest.mark.parametrize("completion,answer", HEDGES_IN_ONE_BOX)
def test_a_hedge_inside_one_box_earns_nothing(completion, answer):
    assert math_reward(completion, answer) == 0.0


@pytest.mark.parametrize("completion,answer", [
    (r"\boxed{2 \text{ or } 3}", r"2 \text{ or } 3"),  # the reference is itself such a list
    (r"\boxed{(-\infty,2)\cup(3,\infty)}", r"(-\infty, 2) \cup (3, \infty)"),
    (r"\boxed{\begin{pmatrix}1\\2\end{pmatrix}}", r"\begin{pmatrix}1\\2\end{pmatrix}"),
    (r"\boxed{\text{(B)}}", "B"),  # a multiple-choice letter is not an aside
])
def test_a_list_against_a_list_still_scores(completion, answer):
    assert math_reward(completion, answer) == 1.0


@pytest.mark.parametrize("completion,answer", [  # correct answers as repeating decimals or wrapped in text with a unit
    (r"\boxed{0.\overline{3}}", r"\frac{1}{3}"), (r"\boxed{\frac{1}{3}}", r"0.\overline{3}"),
    (r"\boxed{0.1\overline{6}}", r"\frac16"), (r"\boxed{1.\overline{142857}}", r"\frac{8}{7}"),
    (r"\boxed{-0.\bar{3}}", "-1/3"), (r"\boxed{\text{5 dollars}}", "5"), (r"\boxed{\textbf{12 inches}}", "12"),
    (r"\boxed{\mbox{7 cm}}", "7"),
])
def test_repeating_decimals_and_text_wrapped_units_score(completion, answer):
    assert math_reward(completion, answer) == 1.0
    assert math_reward(completion.replace("3}", "4}").replace("5 ", "6 ").replace("12 ", "13 ")
                       .replace("7 ", "8 ").replace("6}", "5}").replace("142857", "142858"), answer) == 0.0
