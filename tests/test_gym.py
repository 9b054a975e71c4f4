"""reasoning-gym as a data source (hexrl/data/gym_problems.py) with the task's own scorer as the reward
(hexrl/rewards/gym.py), run in the reward pool: the job section checked, the held-out split apart from
training, and the task's scorer agreeing with ours where both apply."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hexrl.plan.planner import plan_job
from hexrl.rewards import RewardPool, exact_match_reward
from hexrl.schema import ConfigError, load_job

rg = pytest.importorskip("reasoning_gym")  # the [gym] extra (also in [dev])

from hexrl.data.datasets import dataset_problems, load_dataset  # noqa: E402
from hexrl.data.gym_problems import format_prompt, gym_answer  # noqa: E402
from hexrl.rewards.gym import gym_reward  # noqa: E402

CHAIN = {"tasks": {"chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}},
         "size": 200, "n_heldout": 50, "seed": 3, "prompt": "{expression} ="}


def job(data: dict, **reward) -> dict:
    return {"model": {"preset": "tiny"}, "data": data, "reward": reward,
            "cluster": {"nodes": [{"name": "a", "gpu_type": "cpu", "gpus": 2}]}}


def test_the_job_section_is_checked_naming_each_field(tmp_path):
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job({"reasoning_gym": CHAIN})))
    spec = load_job(path)
    assert spec.data.reasoning_gym["size"] == 200 and spec.reward.name == "gym"  # the task's scorer by default
    assert plan_job(spec).predicted["step_time_s"] > 0  # the planner prices the gym scorer too
    path.write_text(json.dumps(job({"reasoning_gym": {"tasks": 7, "size": 0, "sead": 1}, "path": "x.jsonl"})))
    with pytest.raises(ConfigError) as e:
        load_job(path)
    text = str(e.value)
    for field in ("data: give one of", "data.reasoning_gym.tasks", "data.reasoning_gym.size",
                  "data.reasoning_gym.sead"):
        assert field in text, text
    path.write_text(json.dumps(job({"synthetic": {"task": "arithmetic", "n": 10}}, name="gym")))
    with pytest.raises(ConfigError, match="reward.name"):  # the gym scorer needs gym problems
        load_job(path)
    assert dataset_problems(None, {**CHAIN, "tasks": "nosuch"}) == [  # before launch, where the package is
        "data.reasoning_gym.tasks: nosuch: Dataset 'nosuch' not registered"]


def test_held_out_problems_are_drawn_apart_from_training():
    train, heldout = load_dataset(gym=CHAIN)
    assert len(train) == 200 and len(heldout) == 50
    assert not {p.prompt for p in heldout} & {p.prompt for p in train}
    assert len({p.prompt for p in heldout}) == 50
    assert train[0].prompt.endswith(" =") and all(p.kind == "gym" for p in train + heldout)
    again, _ = load_dataset(gym=CHAIN)  # the same seed: the same problems
    assert [p.answer for p in again] == [p.answer for p in train]
    entry = json.loads(train[0].answer)
    assert entry["task"] == "chain_sum" and entry["answer"] == gym_answer(train[0])
    assert train[0].prompt == entry["metadata"]["expression"] + " ="  # the prompt format


def test_the_tasks_scorer_and_ours_agree_where_both_apply():
    """chain_sum's scorer (compute_decimal_reward) and our exact match: the same verdict on right answers,
    answers with surrounding space or an eos marker, and wrong answers that do not contain the right one.
    Where they differ it is by the task's design, partial credit, not ours to change."""
    train, _ = load_dataset(gym={**CHAIN, "size": 40, "n_heldout": 0})
    cases = 0
    for p in train:
        answer = gym_answer(p)
        wrong = str(int(answer) + 7)
        for completion in (answer, f" {answer} ", f"{answer}<eos>", f"{answer}\nmore text", wrong, "", "abc"):
            if answer in completion or completion == wrong and answer not in wrong:
                assert gym_reward(completion, p.answer) == exact_match_reward(completion, answer), completion
                cases += 1
    assert cases >= 4 * 40
    p = train[0]
    assert gym_reward(f"<answer>{gym_answer(p)}</answer>", p.answer) == 1.0  # reasoning-gym's own format
    assert 0 < gym_reward(gym_answer(p) + "0", p.answer) < 1 == exact_match_reward(gym_answer(p), gym_answer(p))


def test_the_reward_pool_runs_the_tasks_scorer():
    train, _ = load_dataset(gym={**CHAIN, "size": 6, "n_heldout": 0})
    items = [(gym_answer(p) if i % 2 else "wrong", p.answer) for i, p in enumerate(train)]
    with RewardPool("gym", workers=1, timeout_s=30) as pool:
        assert pool.score(items) == [float(i % 2) for i in range(6)]
        assert pool.stats.ok == 6


@pytest.mark.parametrize("prompt, why", [
    ("{}", "{}: name a field, like {question} (no position, attribute or index)"),
    ("Q: {0}", "{0}: name a field"),
    ("{question.foo}", "{question.foo}: name a field"),
    ("{question[999999]}", "{question[999999]}: name a field"),
    ("{question.__class__}", "{question.__class__}: name a field"),
    ("{question.__class__.__init__.__globals__}", "{question.__class__.__init__.__globals__}: name a field"),
    ("{question:>2000000000}", "{question:>2000000000}: width and precision must be at most 1000"),
    ("{question:.5000}", "{question:.5000}: width and precision must be at most 1000"),
    ("{question:{question}}", "no field inside a format spec"),
    ("{question!x}", "{question!x}: conversion must be !r, !s or !a"),
    ("{question", "not a format string"),
])
def test_a_prompt_template_names_plain_fields_only(tmp_path, prompt, why):
    """Refused when the job is read, naming the field: no traversal into the question's attributes or
    items, no width that builds a gigabyte prompt."""
    with pytest.raises(ConfigError) as e:
        load_job(job({"reasoning_gym": {**CHAIN, "prompt": prompt}}))
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith("data.reasoning_gym.prompt: "), e.value
    assert why in e.value.problems[0]
    with pytest.raises(ValueError):
        format_prompt(prompt, {"question": "2+2"})  # the formatter the problems are made with refuses it too


def test_the_prompt_is_formatted_from_its_own_fields():
    fields = {"question": "2+2", "expression": "2 + 2"}
    assert format_prompt("{expression} = ? ({question!r:>7})", fields) == "2 + 2 = ? (  '2+2')"
    with pytest.raises(ValueError, match=r"\{nope\} is not a field of its problems \(fields: expression, question\)"):
        format_prompt("{nope}", fields)


def test_prompt_fields_and_task_options_are_checked_against_each_task_at_once():
    """Each task's options by building it, the prompt on one real problem of each task: every problem
    in one list, naming the task, its option and the field (reasoning-gym's own checks are asserts)."""
    spec = {"tasks": {"chain_sum": {"min_terms": 0}, "basic_arithmetic": {"min_terms": 5, "max_terms": 2},
                      "needle_haystack": {}, "leg_counting": {"colour": 1}},
            "size": 10, "prompt": "{expression} ="}
    assert dataset_problems(None, spec) == [
        "data.reasoning_gym.tasks: chain_sum: min_terms must be positive (options: min_terms=0)",
        "data.reasoning_gym.tasks: basic_arithmetic: max_terms must be >= min_terms (options: min_terms=5, "
        "max_terms=2)",
        "data.reasoning_gym.prompt: needle_haystack: {expression} is not a field of its problems (fields: "
        "difficulty, num_statements, question, source_dataset, source_index)",
        "data.reasoning_gym.tasks: leg_counting: LegCountingConfig.__init__() got an unexpected keyword "
        "argument 'colour' (options: colour=1)"]
    assert dataset_problems(None, {**spec, "tasks": "chain_sum", "prompt": "{question:,}"}) == [
        "data.reasoning_gym.prompt: chain_sum: {question:,}: Cannot specify ',' with 's'."]


def test_the_plan_names_a_task_option_without_a_traceback(tmp_path):
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job({"reasoning_gym": {**CHAIN, "tasks": {"chain_sum": {"min_terms": 3,
                                                                                       "max_terms": 2}}}})))
    res = subprocess.run([sys.executable, "-m", "hexrl.plan", str(path), "-o", str(tmp_path / "plan.json")],
                         cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "data.reasoning_gym.tasks: chain_sum: max_terms must be >= min_terms" in res.stderr, res.stderr


def test_needle_haystack_takes_the_default_prompt():
    """Its metadata has a `question` too (the last line alone): the entry's question, the whole problem
    with the statements that answer it, is the one `{question}` means."""
    spec = {"tasks": "needle_haystack", "size": 4, "seed": 0}
    assert dataset_problems(None, spec) == []
    train, _ = load_dataset(gym=spec)
    entry = json.loads(train[0].answer)
    assert train[0].prompt == entry["question"] != entry["metadata"]["question"]
    assert train[0].prompt.endswith(entry["metadata"]["question"])


@pytest.mark.timeout(120)  # the search used to run on for minutes: fail, do not hang the suite
def test_more_held_out_problems_than_the_task_has_are_refused_at_once():
    """chain_sum with two one-digit terms has 200 distinct questions: asking for a million held-out ones
    stops once the draws bring no new question, naming the field and how many were found."""
    small = {"tasks": {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}},
             "size": 100, "seed": 0}
    train, _ = load_dataset(gym={**small, "n_heldout": 0})
    left = 200 - len({p.prompt for p in train})  # questions the training set does not hold
    assert 0 < left < 200
    for n in (10 ** 6, left + 1):
        found = dataset_problems(None, {**small, "n_heldout": n})
        assert len(found) == 1 and found[0].startswith(
            f"data.reasoning_gym: n_heldout {n}: chain_sum gave {left} questions apart from the training ones"), found
    _, heldout = load_dataset(gym={**small, "n_heldout": left})  # every one the task has left
    assert len({p.prompt for p in heldout}) == left
