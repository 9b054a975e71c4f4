"""Problems from reasoning-gym (`pip install -e .[gym]`): procedural reasoning tasks with their own scorers.

    data: {"reasoning_gym": {"tasks": "chain_sum", "size": 2000, "n_heldout": 200, "seed": 0}}

`tasks` is a task name, a list of names, or {name: the task's config options} (e.g.
{"chain_sum": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}); `size` training problems and
`n_heldout` held-out problems per task. The held-out problems come from another seed and skip every
question the training set holds, so the held-out accuracy is measured on problems never trained on.
`prompt` formats each problem's prompt from its question and metadata (default "{question}"; for a
tiny character-level model, e.g. "{expression} =" for chain_sum). Only plain field names are
formatted (no position, attribute or index lookup) with widths and precisions of at most
MAX_FIELD_WIDTH; `template_problems` checks that when the job is read, `gym_problems` checks each
task's config and the prompt's fields against a real problem of each task at plan time.

Each problem's answer is its reasoning-gym entry as JSON (question, answer, metadata, and the task
and config that rebuild its scorer): what the task's own scorer reads (`hexrl.rewards.gym.gym_reward`,
run in the reward pool's workers).
"""
from __future__ import annotations

import json
import re
from string import Formatter

from hexrl.data.problems import Problem
from hexrl.rewards.gym import import_gym

HELDOUT_SEED_OFFSET = 1_000_003  # the held-out set's seed: another stream of the same generator
MISSES = 10_000  # held-out draws in a row with no new question: the task has none left to give
MAX_FIELD_WIDTH = 1000  # a prompt field's width or precision: a wider one is a typo, not a prompt


def task_configs(tasks) -> dict[str, dict]:
    """{task name: its config options} from the `tasks` field's three forms."""
    if isinstance(tasks, str):
        return {tasks: {}}
    if isinstance(tasks, list):
        return {name: {} for name in tasks}
    return {name: dict(cfg or {}) for name, cfg in tasks.items()}


def entries(task: str, config: dict, size: int, seed: int) -> list[dict]:
    """`size` entries of `task` (question, answer, metadata), as reasoning-gym generates them for `seed`;
    ValueError naming the task and its options when the task refuses them."""
    return list(draws(task, config, size, seed))


def draws(task: str, config: dict, size: int, seed: int):
    """The entries of `entries`, one at a time: reasoning-gym makes each on demand."""
    gym = import_gym()
    try:
        ds = gym.create_dataset(task, size=size, seed=seed, **config)
        for e in ds:
            # the task and its config too: the scorer is the dataset's own, built with the same options
            yield {"question": e["question"], "answer": str(e["answer"]), "metadata": e.get("metadata", {}),
                   "task": task, "config": config}
    except Exception as e:  # the task's own checks are asserts; its generator may raise anything on odd options
        options = f" (options: {', '.join(f'{k}={v!r}' for k, v in config.items())})" if config else ""
        raise ValueError(f"{task}: {str(e) or type(e).__name__}{options}"[:500]) from None


def template_problems(template: str) -> list[str]:
    """What is wrong with a prompt template (no task needed): each field must be a plain name, with a
    width and precision of at most MAX_FIELD_WIDTH and no field nested in its format spec."""
    try:
        parts = list(Formatter().parse(template))
    except ValueError as e:  # an unmatched brace
        return [f"not a format string: {e}"]
    out = []
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        field = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
        if not name.isidentifier():
            out.append(f"{field[:80]}: name a field, like {{question}} (no position, attribute or index)")
        elif conversion not in (None, "r", "s", "a"):
            out.append(f"{field[:80]}: conversion must be !r, !s or !a")
        elif "{" in spec:
            out.append(f"{field[:80]}: no field inside a format spec")
        elif any(int(n) > MAX_FIELD_WIDTH for n in re.findall(r"\d+", spec)):
            out.append(f"{field[:80]}: width and precision must be at most {MAX_FIELD_WIDTH}")
    return out


def format_prompt(template: str, fields: dict) -> str:
    """`template` filled from `fields` by name alone (never an attribute or index lookup); ValueError
    naming the field that is wrong, missing, or cannot take its format spec."""
    if problems := template_problems(template):
        raise ValueError(problems[0])
    out = []
    for literal, name, spec, conversion in Formatter().parse(template):
        out.append(literal)
        if name is None:
            continue
        if name not in fields:
            raise ValueError(f"{{{name}}} is not a field of its problems (fields: {', '.join(sorted(fields))})")
        try:
            out.append(format(Formatter().convert_field(fields[name], conversion), spec))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{{{name}:{spec}}}: {e}") from None
    return "".join(out)


def prompt_fields(entry: dict) -> dict:
    """The fields a prompt template may name: the entry's metadata and its question. The question
    wins over a metadata key of that name: it is the problem as the task poses it (needle_haystack's
    metadata `question` is the last line alone, without the statements that answer it)."""
    return {**entry["metadata"], "question": entry["question"]}


def to_problem(entry: dict, id: str, prompt: str) -> Problem:
    """A Problem whose answer is the entry as JSON, for the task's scorer."""
    text = format_prompt(prompt, prompt_fields(entry))
    return Problem(text, json.dumps(entry, sort_keys=True, default=str), id=id, kind="gym")


def gym_problems(spec: dict) -> list[str]:
    """Every problem of a `data.reasoning_gym` section that needs reasoning-gym to see, each naming its
    field: a task that refuses its options, a prompt that does not fit a task's problems (checked on one
    generated problem of each task)."""
    prompt = spec.get("prompt", "{question}")
    out = [f"data.reasoning_gym.prompt: {p}" for p in template_problems(prompt)]
    check_prompt = not out  # a template that is wrong as written is named once, not once per task
    for task, config in task_configs(spec["tasks"]).items():
        try:
            first = entries(task, config, 1, spec.get("seed", 0))
        except ValueError as e:
            out.append(f"data.reasoning_gym.tasks: {e}")
            continue
        try:
            if first and check_prompt:
                format_prompt(prompt, prompt_fields(first[0]))
        except ValueError as e:
            out.append(f"data.reasoning_gym.prompt: {task}: {e}")
    return out


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
