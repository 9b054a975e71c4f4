"""Problems from reasoning-gym (`pip install -e .[gym]`): procedural reasoning tasks with their own scorers.

    data: {"reasoning_gym": {"tasks": "chain_sum", "size": 2000, "n_heldout": 200, "seed": 0}}

`tasks` is a task name, a list of names, or {name: the task's config options} (e.g.
{"chain_sum": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}); `size` training problems and
`n_heldout` held-out problems per task. The held-out problems come from another seed and skip every
question the training set holds, so the held-out accuracy is measured on problems never trained on.
`prompt` formats each problem's prompt from its question and metadata (default "{question}"; for a
tiny character-level model, e.g. "{expression} =" for chain_sum).

Each problem's answer is its reasoning-gym entry as JSON (question, answer, metadata, and the task
and config that rebuild its scorer): what the task's own scorer reads (`hexrl.rewards.gym.gym_reward`,
run in the reward pool's workers).
"""
from __future__ import annotations

import json

from hexrl.data.problems import Problem
from hexrl.rewards.gym import import_gym

HELDOUT_SEED_OFFSET = 1_000_003  # the held-out set's seed: another stream of the same generator
MISSES = 10_000  # held-out draws in a row with no new question: the task has none left to give


def task_configs(tasks) -> dict[str, dict]:
    """{task name: its config options} from the `tasks` field's three forms."""
    if isinstance(tasks, str):
        return {tasks: {}}
    if isinstance(tasks, list):
        return {name: {} for name in tasks}
    return {name: dict(cfg or {}) for name, cfg in tasks.items()}


def entries(task: str, config: dict, size: int, seed: int) -> list[dict]:
    """`size` entries of `task` (question, answer, metadata), as reasoning-gym generates them for `seed`."""
    return list(draws(task, config, size, seed))


def draws(task: str, config: dict, size: int, seed: int):
    """The entries of `entries`, one at a time: reasoning-gym makes each on demand."""
    ds = import_gym().create_dataset(task, size=size, seed=seed, **config)
    # the task and its config too: the scorer is the dataset's own, built with the same options
    for e in ds:
        yield {"question": e["question"], "answer": str(e["answer"]), "metadata": e.get("metadata", {}),
               "task": task, "config": config}


def to_problem(entry: dict, id: str, prompt: str) -> Problem:
    """A Problem whose answer is the entry as JSON, for the task's scorer."""
    text = prompt.format(question=entry["question"], **entry["metadata"])
    return Problem(text, json.dumps(entry, sort_keys=True, default=str), id=id, kind="gym")


def gym_answer(problem: Problem) -> str:
    """The task's reference answer of a reasoning-gym problem (what a supervised warm start trains on)."""
    return json.loads(problem.answer)["answer"]


def load_reasoning_gym(spec: dict) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out) problems of a job's `data.reasoning_gym` section (validated by hexrl.schema)."""
    size, held, seed = spec["size"], spec.get("n_heldout", 0), spec.get("seed", 0)
    prompt = spec.get("prompt", "{question}")
    train, heldout = [], []
    for task, config in task_configs(spec["tasks"]).items():
        mine = entries(task, config, size, seed)
        train += [to_problem(e, f"{task}/{i}", prompt) for i, e in enumerate(mine)]
        if held:
            heldout += [to_problem(e, f"{task}/heldout{i}", prompt)
                        for i, e in enumerate(apart(task, config, held, seed, {e["question"] for e in mine}))]
    return train, heldout


def apart(task: str, config: dict, n: int, seed: int, seen: set[str]) -> list[dict]:
    """n entries of `task` from the held-out seed whose questions are not in `seen` (nor repeated).
    The draws stop at 8 n + MISSES, or after MISSES in a row that bring no new question: a task's config
    may allow only a few hundred questions, and an n beyond them is refused at once, not searched for."""
    out, misses, drawn = [], 0, 0
    for e in draws(task, config, 8 * n + MISSES, seed + HELDOUT_SEED_OFFSET):
        drawn += 1
        if e["question"] in seen:
            misses += 1
            if misses == MISSES:
                break
            continue
        seen.add(e["question"])
        out.append(e)
        misses = 0
        if len(out) == n:
            return out
    raise ValueError(f"n_heldout {n}: {task} gave {len(out)} questions apart from the training ones in "
                     f"{drawn:,} draws (the last {misses:,} brought none new); the task's config allows too few "
                     "distinct problems: lower size or n_heldout")
