"""Environments: the safe calculator, the retry environment, the job's `env` section, and the
worker pool that keeps a raising, hanging, dying or garbage-returning environment from
stopping anything (each such call ends its episode with a named reason and reward 0)."""
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
from env_fixtures import Hostile

import hexrl
from hexrl.data.tokenizer import DEFAULT_ALPHABET, CharTokenizer
from hexrl.envs import Calculator, Problem, Retry, Step, environment_class, stop_string_problems
from hexrl.envs.arith import ArithError, evaluate, format_number
from hexrl.envs.pool import MAX_OBSERVATION_CHARS, EnvPool
from hexrl.schema import ConfigError
from hexrl.schema.job import load_job


@pytest.mark.parametrize("expr, value", [("123*456", 56088), ("1+2+3+4", 10), ("-(7-10)", 3), ("2**10", 1024),
                                         ("7/2", Fraction(7, 2)), ("7//2", 3), ("7%4", 3), (" 12 ", 12)])
def test_calculator_evaluates_plain_arithmetic(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os').system('true')", "x+1", "len('ab')", "(1).real", "[1, 2]",
                                  "9**9**9", "10**61", "2**0.5", "1/0", "1%0", "0**-1", "1+", "'a'*3", "1" * 300,
                                  "(" * 150 + "1" + ")" * 150, "True+1", ""])
def test_calculator_refuses_everything_else(expr):
    with pytest.raises(ArithError):
        evaluate(expr)


@pytest.mark.parametrize("expr", ["1e309", "-1e309", "1e999-1e999"])
def test_a_number_beyond_a_float_is_an_error_observation(expr):
    with pytest.raises(ArithError):
        evaluate(expr)
    assert Calculator().step(Problem("q", "1"), [f"<calc>{expr}</calc>"]) == Step(observation="=error")


def test_numbers_print_as_integers_or_short_decimals():
    assert format_number(Fraction(56088)) == "56088"
    assert format_number(Fraction(7, 2)) == "3.5"
    assert format_number(Fraction(1, 3)) == "0.333333"


def test_calculator_turns():
    env, p = Calculator(), Problem("12*34=", "408")
    assert env.step(p, ["<calc>12*34</calc>"]) == Step(observation="=408")
    assert env.step(p, ["<calc>12*x</calc>"]) == Step(observation="=error")
    assert env.step(p, ["<calc>1</calc>", "408\n"]) == Step(done=True, reward=1.0, reason="answer")
    assert env.step(p, ["407"]).reward == 0.0
    assert env.step(p, ["<calc>12*3"]) == Step(done=True, reason="unclosed_call")
    assert env.step(p, ["12</calc>"]) == Step(done=True, reason="unopened_call")
    assert Calculator.stop_strings == ("</calc>",)


def test_retry_says_wrong_and_discounts_later_answers():
    env, p = Retry(discount=0.5), Problem("2+2=", "4")
    assert not env.step(p, ["5"]).done and env.step(p, ["5"]).observation
    assert env.step(p, ["5", "4"]) == Step(done=True, reward=0.5, reason="answer")
    assert Retry().step(p, ["4"]).reward == 1.0
    with pytest.raises(ValueError, match="unknown options"):
        Retry(nope=1)


# ----------------------------------------------------------------------------- hostile environments


def test_a_hostile_environment_ends_only_its_episode_with_a_named_reason():
    p = Problem("q", "a")
    with EnvPool("env_fixtures:Hostile", {}, workers=2, timeout_s=2.0) as pool:
        tickets = {pool.submit([("step", p, [t])]): t
                   for t in ("raise", "hang", "die", "huge", "bytes", "none", "nan", "exit", "ok")}
        got = {}
        while len(got) < len(tickets):
            got.update({tickets[k]: v[0] for k, v in pool.finished(wait_s=0.5).items()})
        reasons = {t: s.reason for t, s in got.items() if s.done}
        assert reasons == {"raise": "env_error", "hang": "env_timeout", "die": "env_error",
                           "huge": "observation_too_long", "bytes": "bad_observation", "none": "bad_observation",
                           "nan": "bad_reward", "exit": "env_error"}
        assert all(got[t].reward == 0.0 for t in reasons)
        assert got["ok"] == Step(observation="=ok")
        assert pool.stats.restarts == 2  # the hung worker and the dead one
        assert pool.run_step(p, ["fine"]) == Step(observation="=fine")  # still serving
    assert MAX_OBSERVATION_CHARS < 1 << 20


def test_an_environment_that_cannot_start_is_reported_with_its_own_error():
    with pytest.raises(RuntimeError, match="EnvPool worker could not start: ValueError: Broken needs an API key"):
        EnvPool("env_fixtures:Broken", {}, workers=1)


LAUNCHER = """
import torch  # the launcher's heavy import, as hexrl.main's
from hexrl.envs import EnvPool, Problem

if __name__ == "__main__":
    with EnvPool("env_fixtures:Introspect", {}, workers=1, timeout_s=1.0) as pool:
        p = Problem("q")
        seen = [pool.run_step(p, [turn]) for turn in ("torch", "hang", "torch", "secret")]
        print(*[s.observation or s.reason for s in seen], pool.stats.restarts)
"""


def test_a_replaced_worker_neither_imports_the_launcher_nor_sees_the_secret(tmp_path):
    """A launcher that imported torch, with HEXRL_SECRET set: its workers, first and replaced, have neither."""
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    hexrl_root, tests = Path(hexrl.__file__).parents[1], Path(__file__).parent  # this hexrl, and env_fixtures
    env = {**os.environ, "HEXRL_SECRET": "s" * 40, "PYTHONPATH": os.pathsep.join(map(str, (hexrl_root, tests)))}
    out = subprocess.run([sys.executable, str(tmp_path / "launcher.py")], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.stdout.split() == ["False", "env_timeout", "False", "unset", "1"], out.stderr[-2000:]


def test_environment_names_resolve_to_classes():
    assert environment_class("calculator") is Calculator
    assert environment_class("env_fixtures:Hostile") is Hostile
    for bad, why in [("nope", "must be one of"), ("no.such.module:X", "cannot import"), ("os:path", "not a subclass")]:
        with pytest.raises(ValueError, match=why):
            environment_class(bad)


# ----------------------------------------------------------------------------- the job's env section


def job(**extra) -> dict:
    return {"model": {"preset": "tiny"}, "data": {"synthetic": {"task": "arithmetic", "n": 10}},
            "cluster": {"nodes": [{"gpu_type": "cpu", "gpus": 2}]}, **extra}


def test_without_env_a_job_is_single_turn():
    j = load_job(job())
    assert j.env is None and "env" not in j.to_dict()


def test_env_section_is_read_with_defaults_and_options():
    j = load_job(job(env={"name": "retry", "max_turns": 3, "discount": 0.9}))
    assert (j.env.name, j.env.max_turns, j.env.timeout_s, j.env.options) == ("retry", 3, 10.0, {"discount": 0.9})
    assert load_job(j.to_dict()).env == j.env  # a plan carries it unchanged


def test_every_env_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as e:
        load_job(job(env={"name": "retry", "max_turns": 0, "timeout_s": -1, "discount": 2, "colour": "red",
                          "workers": 0}))
    text = str(e.value)
    for field in ("env.max_turns", "env.timeout_s", "env.colour", "discount must be in (0, 1]", "env.workers"):
        assert field in text
    with pytest.raises(ConfigError, match="env.name"):
        load_job(job(env={"name": "chess"}))
    with pytest.raises(ConfigError, match="env.name"):
        load_job(job(env={"max_turns": 2}))
    with pytest.raises(ConfigError, match="env: must be an object"):
        load_job(job(env="calculator"))


@pytest.mark.parametrize("name, why", [
    ("hexrl.envs:Environment", "abstract: it must define step (and every abstract method)"),
    ("env_fixtures:Abstract", "abstract: it must define step (and every abstract method)"),
    ("env_fixtures:BrokenInit", "BrokenInit(**options) raised RuntimeError: no licence server"),
    ("env_fixtures:ListOptions", "options must be a dict {name: default number}, got list"),
    ("env_fixtures:RaisingChecks", "option_problems raised KeyError: 'penalty '"),
    ("env_fixtures:NoStops", "stop_strings must be a tuple of strings, got None"),
    ("env_fixtures:EmptyStop", "must not hold an empty string (every turn would end after one token)"),
    ("env_fixtures:BareStop", "stop_strings must be a tuple of strings, got '</calc>'"),
    ("env_fixtures:LongStop", "is longer than 64 characters"),
])
def test_an_environment_that_cannot_run_is_named_when_the_job_is_read(name, why):
    """Before any worker starts: the class as written, then its options and __init__ as a worker runs them."""
    with pytest.raises(ConfigError) as e:
        load_job(job(env={"name": name, "max_turns": 0}))
    named = [p for p in e.value.problems if p.endswith(why)]
    assert len(named) == 1 and named[0].startswith((f"env.name ({name}): ", f"env ({name}): ")), e.value.problems
    assert "env.max_turns" in str(e.value)  # with the section's other problems


@pytest.mark.parametrize("exit_line", ["import sys; sys.exit(0)", "raise KeyboardInterrupt",
                                       "class Stop(BaseException): pass\nraise Stop('bye')"])
def test_an_environment_module_that_exits_on_import_is_named(tmp_path, monkeypatch, exit_line):
    (tmp_path / "quits.py").write_text(exit_line + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    why = r"env.name: cannot import 'quits:Env': (SystemExit: 0|KeyboardInterrupt|Stop: bye)"
    with pytest.raises(ConfigError, match=why):
        load_job(job(env={"name": "quits:Env"}))


def test_stop_strings_the_tokenizer_cannot_write_are_named():
    """The char tokenizer's default alphabet has no < or >: the calculator's </calc> could never be written."""
    assert stop_string_problems(Calculator, CharTokenizer()) == [
        "the tokenizer cannot write '<>' of the stop string '</calc>': the model could never end a turn there"]
    assert stop_string_problems(Calculator, CharTokenizer(DEFAULT_ALPHABET + "<>")) == []


def test_the_documented_example_environment_runs_as_written(tmp_path, monkeypatch):
    """docs/agentic.md's complete environment (< 60 lines), imported by name like a user's own."""
    import sys
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "agentic.md").read_text()
    code = doc.split("```python\n", 1)[1].split("```", 1)[0]
    assert len(code.splitlines()) < 60
    (tmp_path / "my_envs.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_envs", None)
    j = load_job(job(env={"name": "my_envs:HigherLower", "max_turns": 3, "penalty": 0.2}))
    assert j.env.options == {"penalty": 0.2}
    with pytest.raises(ConfigError, match=r"penalty must be in \[0, 1\)"):
        load_job(job(env={"name": "my_envs:HigherLower", "penalty": 1.5}))
    p = Problem("6+1=", "7")
    with EnvPool("my_envs:HigherLower", j.env.options, workers=1, timeout_s=30) as pool:
        assert pool.run([("start", p, [])]) == [Step()]
        assert pool.run_step(p, ["5\n"]) == Step(observation=" higher\n")
        assert pool.run_step(p, ["5\n", "9\n"]) == Step(observation=" lower\n")
        assert pool.run_step(p, ["5\n", "9\n", "7\n"]) == Step(done=True, reward=pytest.approx(0.6), reason="answer")
        assert pool.run_step(p, ["seven\n"]) == Step(done=True, reason="not_a_number")
