"""Model output never runs code in a reasoning-gym scorer. Nine tasks' scorers evaluate the answer
(sympy's parse_expr, or eval for partial credit on a Python list); each has a gate
(hexrl.rewards.gym.GATES) that parses without evaluating, and right answers still score as the task's
own scorer scores them.

    gym_reward("<answer>__import__('os').system('touch pwned')</answer>", countdown_problem)  # 0.0, no file
"""
import json
import os
import subprocess
import sys

import pytest

rg = pytest.importorskip("reasoning_gym")  # the [gym] extra (also in [dev])

from hexrl.data.gym_problems import entries  # noqa: E402
from hexrl.rewards import RewardPool  # noqa: E402
from hexrl.rewards.gym import gym_reward, scorer  # noqa: E402

# the tasks whose scorers evaluate the model's text (test_no_scorer_runs_code_from_an_answer finds them)
EVALUATING = ["binary_matrix", "countdown", "intermediate_integration", "n_queens", "polynomial_multiplication",
              "puzzle24", "simple_integration", "spiral_matrix", "string_insertion"]

SWEEP = """
import contextlib, io, json, sys, warnings
from reasoning_gym.factory import DATASETS
from hexrl.data.gym_problems import entries
from hexrl.rewards.gym import gym_reward, scorer

def mentions(code):  # whether a code object (or one nested in it) names the canary
    return "hexrl_canary" in code.co_names or any(
        c == "hexrl_canary" or hasattr(c, "co_names") and mentions(c) for c in code.co_consts)

ran = []
sys.addaudithook(lambda event, args: event == "exec" and mentions(args[0]) and ran.append(event))
warnings.filterwarnings("ignore")
raw, gated, skipped = set(), set(), []
for task in sorted(set(DATASETS) - {"composite"}):  # composite scores with its parts' scorers
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            entry = entries(task, {}, 1, 0)[0]
    except Exception:
        skipped.append(task)
        continue
    for answer in ("hexrl_canary(1)", "[hexrl_canary(1)]", "1 + hexrl_canary(1)"):
        for hits, score in ((raw, lambda: scorer(task, "{}")(answer=answer, entry=entry)),
                            (gated, lambda: gym_reward(f"<answer>{answer}</answer>", json.dumps(entry, default=str)))):
            ran.clear()
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    score()
            except Exception:
                pass
            if ran:
                hits.add(task)
print(json.dumps({"raw": sorted(raw), "gated": sorted(gated), "skipped": skipped, "tasks": len(DATASETS)}))
"""


def test_no_scorer_runs_code_from_an_answer():
    """Every registered task, scored with answers that call a canary: an audit hook sees each code object
    run. The task's own scorer runs the canary's code in exactly EVALUATING; through gym_reward, none does."""
    out = subprocess.run([sys.executable, "-c", SWEEP], capture_output=True, text=True, timeout=600)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["tasks"] > 100 and found["skipped"] == []
    assert found["raw"] == EVALUATING
    assert found["gated"] == []


def attacks(out) -> list[str]:
    """A shell command and a secret-reading call, bare, in a list, and in reasoning-gym's tags."""
    shell = f"__import__('os').system('touch {out}/shell')"
    secret = f"open('{out}/secret', 'w').write(__import__('os').environ.get('HEXRL_SECRET', 'unset'))"
    bare = [shell, secret, f"[{shell}]", f"[{secret}]"]
    return bare + [f"<answer>{a}</answer>" for a in bare]


@pytest.fixture(scope="module")
def problems() -> dict[str, str]:
    """One real problem of each evaluating task, as the reward reads it (the entry as JSON)."""
    return {task: json.dumps(entries(task, {}, 1, 0)[0], sort_keys=True, default=str) for task in EVALUATING}


def test_shell_and_secret_payloads_run_nothing_directly_or_through_the_pool(problems, tmp_path, monkeypatch):
    monkeypatch.setenv("HEXRL_SECRET", "s" * 40)
    items = [(attack, answer) for answer in problems.values() for attack in attacks(tmp_path)]
    direct = [gym_reward(c, a) for c, a in items]
    assert os.listdir(tmp_path) == []  # no command ran, no secret written
    assert direct == [0.0] * len(items)
    with RewardPool("gym", workers=1, timeout_s=60) as pool:
        pooled = pool.score(items)
    assert os.listdir(tmp_path) == []
    assert pooled == [0.0] * len(items) and pool.stats.ok == len(items)


def right_answers(task: str, entry: dict) -> list[str]:
    """The task's answer, and for a task that gives partial credit for a Python list, that list."""
    answer = entry["answer"]
    rows = [row.split() for row in answer.split("\n")]
    lists = {"string_insertion": lambda: list(answer), "spiral_matrix": lambda: [int(x) for x in answer.split()],
             "binary_matrix": lambda: [[int(x) for x in row] for row in rows], "n_queens": lambda: rows}
    return [answer] + ([str(lists[task]())] if task in lists else [])


@pytest.mark.parametrize("task", EVALUATING)
def test_right_answers_score_as_the_tasks_own_scorer(task):
    for entry in entries(task, {}, 8, 1):
        for right in right_answers(task, entry):
            own = scorer(task, "{}")(answer=right, entry=entry)
            assert own > 0, (task, right)
            if "Integral(" in right:  # an integral sympy could not do: the question echoed back, refused
                assert gym_reward(f"<answer>{right}</answer>", json.dumps(entry, default=str)) == 0.0
                continue
            assert gym_reward(f"<answer>{right}</answer>", json.dumps(entry, default=str)) == own, (task, right)


ARITHMETIC = {"6*(98 - 54) - 34 - 66": True, "-3 + 4/2": True, "(1)": True, "2**3": False, "9**9**9": False,
              "7//2": False, "7%2": False, "1.5*2": False, "x+1": False, "__import__('os')": False,
              "1+2 # note": False, "1" * 201: False, "": False, "1 +": False}
ALGEBRA = {"-5*X**9 - 2*X**6/3 + 4*X**3 + C": True, "-4*(-2*x - 8)**(3/2)/3 + C": True, "E**(2*x)": True,
           "exp(x)*sin(x) - log(x, 2)": True, "x**(n + 1)": True, "Integral(exp(x**2), x) + C": False,
           "__import__('os').system('true')": False, "x.__class__": False, "sin('x')": False,
           "sympify('1')": False, "Symbol('x')": False, "(lambda: 1)()": False, "sin(x=1)": False,
           "_x + 1": False, "[x]": False, "x[0]": False, "x if x else 1": False, "sin(*x)": False,
           "2**(x - x + 10**6)": False, "2**(99*99*99*99)": False, "((2 + x - x)**64)**64": False,
           "1e309": False, "1" * 40: False, "x" * 2001: False, "\uff45xp(x)": False}
LITERAL = {"1 2 3\n4 5 6": True, "_ Q _\nQ _ _": True, "['a', 'b']": True, "[[1, 2], [3, 4]]": True, "ABC": True,
           "-5": True, "(1, 2)": True, "[__import__('os').system('true')]": False, "'a' * 10**9": False,
           "[1] * 3": False, "x.y": False, "f(1)": False, " \t__import__('os')": False, "[i for i in x]": False,
           "{1: 2}": False}


def test_each_gate_lets_through_only_its_tasks_answers():
    from hexrl.rewards.gym import algebra, arithmetic, literal

    for gate, table in ((arithmetic, ARITHMETIC), (algebra, ALGEBRA), (literal, LITERAL)):
        assert {text: gate(text) for text in table} == table, gate.__name__


def test_an_integral_written_back_unevaluated_earns_nothing():
    """intermediate_integration's own scorer takes `Integral(f, x) + C` for f's integral: the question
    echoed back. An unevaluated integral is refused before the scorer, on every problem."""
    for entry in entries("intermediate_integration", {}, 8, 1):
        integrand = entry["metadata"]["integrand"]
        echo = f"Integral({integrand}, x) + C"
        assert scorer("intermediate_integration", "{}")(answer=echo, entry=entry) == 1.0  # the hole
        assert gym_reward(f"<answer>{echo}</answer>", json.dumps(entry, default=str)) == 0.0
