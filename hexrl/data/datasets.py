"""Problems: loading JSONL datasets, generating synthetic arithmetic, train/held-out splits.

Accepted JSONL record shapes (one JSON object per line):
- `{"prompt": ..., "answer": ...}`               plain (answer may be a JSON number)
- `{"question": ..., "answer": "... #### 72"}`   GSM8K: the answer is what follows the last ####
- `{"problem": ..., "solution": "... \\boxed{x}"}` MATH: the answer is the last \\boxed{} (an
  "answer" field, when present, wins)
- code tasks add `"tests": [{"input": ..., "output": ...} | "assert ..."]`; the answer is optional.
Optional fields: `"id"` (int or str; default the line number), `"kind"` (overrides the
`kind` argument of `load_jsonl`) and `"length_hint"` (the problem's expected output length in tokens,
a non-negative number: the length predictor's prior, docs/long-tail.md).
"""

from __future__ import annotations

import json
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from hexrl.data.code_data import load_code_tasks
from hexrl.data.problems import KINDS, Problem, length_hint
from hexrl.input_files import TooDeepError, loads_json, open_input
from hexrl.rewards.code import validate_tests
from hexrl.rewards.math import find_boxed

_SHOW = 5  # how many bad lines an error or warning message lists


@dataclass
class LoadResult:
    """Problems read from a file, and the lines skipped as (line number, reason)."""

    problems: list[Problem]
    skipped: list[tuple[int, str]] = field(default_factory=list)


# ----------------------------------------------------------------------------- JSONL


def _answer_of(rec: dict, kind: str) -> str:
    if "answer" in rec:
        a = rec["answer"]
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            return str(a)
        if not isinstance(a, str):
            raise ValueError(f"'answer' must be a string or number, got {type(a).__name__}")
        if "####" in a:
            a = a.rsplit("####", 1)[1]
        if not a.strip():
            raise ValueError("'answer' is empty")
        return a.strip()
    if "solution" in rec:
        if not isinstance(rec["solution"], str):
            raise ValueError(f"'solution' must be a string, got {type(rec['solution']).__name__}")
        boxed = find_boxed(rec["solution"])
        if boxed is None or not boxed.strip():
            raise ValueError("'solution' has no \\boxed{...} answer")
        return boxed.strip()
    if kind == "code":
        return ""
    raise ValueError("no 'answer' (or 'solution') field")


def parse_record(rec, line_no: int, kind: str = "math") -> Problem:
    """A Problem from one decoded JSON record; ValueError says what is wrong with it."""
    if not isinstance(rec, dict):
        raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
    kind = rec.get("kind", kind)
    if kind not in KINDS:
        raise ValueError(f"'kind' must be one of {KINDS}, got {kind!r}")
    key = next((k for k in ("prompt", "question", "problem") if k in rec), None)
    if key is None:
        raise ValueError("no 'prompt' (or 'question' / 'problem') field")
    prompt = rec[key]
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"'{key}' must be a non-empty string")
    answer = _answer_of(rec, kind)
    tests = rec.get("tests")
    if kind == "code" or tests is not None:
        tests = validate_tests(tests)
    pid = rec.get("id", line_no)
    if isinstance(pid, bool) or not isinstance(pid, (int, str)):
        raise ValueError(f"'id' must be an int or string, got {type(pid).__name__}")
    return Problem(prompt=prompt, answer=answer, id=pid, tests=tests, kind=kind, length_hint=length_hint(rec))


def _summary(skipped: list[tuple[int, str]]) -> str:
    shown = "; ".join(f"line {n}: {why}" for n, why in skipped[:_SHOW])
    more = f"; and {len(skipped) - _SHOW} more" if len(skipped) > _SHOW else ""
    return shown + more


def load_jsonl(path: str | Path, kind: str = "math") -> LoadResult:
    """Read problems from a JSONL file, skipping (and warning about) malformed lines.

    Raises FileNotFoundError for a missing file, and ValueError when no line is usable or a line nests
    deeper than the input guard allows (hexrl/input_files.py).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    problems, skipped, first_line_of = [], [], {}
    with open_input(path, "dataset file") as f:  # a FIFO or directory is refused, never waited on
        for line_no, raw in enumerate(f, start=1):
            try:
                if not raw.strip():
                    continue  # blank lines are not records
                problem = parse_record(loads_json(raw, "", "dataset line"), line_no, kind)
                if problem.id in first_line_of:
                    raise ValueError(f"duplicate id {problem.id!r} (first on line {first_line_of[problem.id]})")
            except TooDeepError as e:  # a file built to break parsers: refused, not skipped line by line
                raise TooDeepError(f"dataset file {path}: line {line_no}{e}") from None
            except ValueError as e:  # not UTF-8, bad JSON, NaN, a bad record
                skipped.append((line_no, str(e).removeprefix(": ")))
                continue
            first_line_of[problem.id] = line_no
            problems.append(problem)
    if not problems:
        if not skipped:
            raise ValueError(f"dataset file {path} is empty (no JSON lines)")
        raise ValueError(f"dataset file {path} has no usable line ({len(skipped)} bad): {_summary(skipped)}")
    if skipped:
        warnings.warn(f"{path}: skipped {len(skipped)} malformed line(s): {_summary(skipped)}", stacklevel=2)
    return LoadResult(problems, skipped)


def write_jsonl(problems: Iterable[Problem], path: str | Path) -> Path:
    """Write problems as JSONL (readable back by `load_jsonl`); parent directories are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for p in problems:
            f.write(json.dumps(p.to_dict(), ensure_ascii=False) + "\n")
    return path


# ----------------------------------------------------------------------------- synthetic

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _operand_count(lo: int, hi: int) -> int:
    """How many integers have between lo and hi digits (0 counts as one digit)."""
    return 10 ** hi - (10 ** (lo - 1) if lo > 1 else 0)


def _check_arithmetic_args(n, digits, ops) -> None:
    problems = []
    if not isinstance(n, int) or n < 1:
        problems.append(f"n must be an int >= 1, got {n!r}")
    if not (isinstance(digits, (tuple, list)) and len(digits) == 2 and all(isinstance(d, int) for d in digits)
            and 1 <= digits[0] <= digits[1] <= 9):
        problems.append(f"digits must be (min, max) with 1 <= min <= max <= 9, got {digits!r}")
    if not ops or not set(ops) <= set(_OPS) or len(set(ops)) != len(ops):
        problems.append(f"ops must be distinct characters from {''.join(_OPS)!r}, got {ops!r}")
    if problems:
        raise ValueError("make_arithmetic: " + "; ".join(problems))


def make_arithmetic(n: int, seed: int = 0, digits: tuple[int, int] = (1, 2), ops: str = "+-",
                    negatives: bool = False) -> list[Problem]:
    """`n` distinct problems like `"12+7="` -> `"19"`, deterministic given `seed`.

    Each operand has a uniformly drawn number of digits in `digits` (so short operands are not
    swamped by long ones). Without `negatives`, `a-b` is written with a >= b. A smaller `n`
    with the same seed gives a prefix of a larger one.
    """
    _check_arithmetic_args(n, digits, ops)
    lo, hi = digits
    v = _operand_count(lo, hi)
    capacity = sum(v * (v + 1) // 2 if (op == "-" and not negatives) else v * v for op in ops)
    if n > capacity:
        raise ValueError(f"make_arithmetic: only {capacity} distinct problems exist for digits={digits}, "
                         f"ops={ops!r}; asked for {n}")
    rng = random.Random(seed)

    def operand() -> int:
        d = rng.randint(lo, hi)
        return rng.randint(0 if d == 1 else 10 ** (d - 1), 10 ** d - 1)

    seen: set[str] = set()
    problems: list[Problem] = []
    for _ in range(50 * n + 1000):  # rejection sampling; bounded so a near-full space cannot hang
        op, a, b = rng.choice(ops), operand(), operand()
        if op == "-" and not negatives and a < b:
            a, b = b, a
        prompt = f"{a}{op}{b}="
        if prompt in seen:
            continue
        seen.add(prompt)
        problems.append(Problem(prompt, str(_OPS[op](a, b)), id=len(problems), kind="synthetic"))
        if len(problems) == n:
            return problems
    raise ValueError(f"make_arithmetic: drew only {len(problems)} distinct problems of {n} "
                     f"(space has {capacity}); widen digits or ops")


def token_budget(budget: dict, version: int) -> int:
    """Tokens a sample of trainer version `version` may generate under a synthetic task's `budget`
    ({"start", "end", "steps"}): `start` at version 0, linearly to `end` at version `steps`, then `end`.
    A random model with a large vocabulary seldom samples its end-of-text id, so the budget sets its
    output length: a budget that grows plays a run whose answers lengthen as it learns, one that
    shrinks a run whose answers shorten."""
    done = min(version, budget["steps"]) / budget["steps"]
    return round(budget["start"] + (budget["end"] - budget["start"]) * done)


def split_heldout(problems: list[Problem], heldout: float | int, seed: int = 0) -> tuple[list[Problem], list[Problem]]:
    """Split into (train, held_out) so that no prompt appears in both.

    `heldout` is a fraction in (0, 1) or a count of distinct prompts; problems sharing a prompt
    stay together. Order within each side is preserved; the choice is deterministic in `seed`.
    """
    prompts = list(dict.fromkeys(p.prompt for p in problems))
    if isinstance(heldout, float) and 0 < heldout < 1:
        k = max(1, round(heldout * len(prompts)))
    elif isinstance(heldout, int) and not isinstance(heldout, bool) and heldout >= 1:
        k = heldout
    else:
        raise ValueError(f"heldout must be a fraction in (0, 1) or an int >= 1, got {heldout!r}")
    if k >= len(prompts):
        raise ValueError(f"heldout={heldout!r} leaves no training prompts ({len(prompts)} distinct prompts)")
    held = set(random.Random(seed).sample(prompts, k))
    return [p for p in problems if p.prompt not in held], [p for p in problems if p.prompt in held]


def make_arithmetic_split(n_train: int, n_heldout: int, seed: int = 0, **kwargs) -> tuple[list[Problem], list[Problem]]:
    """Disjoint train and held-out arithmetic sets (all prompts distinct); kwargs go to make_arithmetic."""
    problems = make_arithmetic(n_train + n_heldout, seed=seed, **kwargs)
    return problems[:n_train], problems[n_train:]


def load_dataset(synthetic: dict | None = None, path: str | None = None,
                 kind: str = "math", gym: dict | None = None) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out) problems of a job's `data` section.

    Synthetic: `{"task": "arithmetic", "n": N, "seed": S, "n_heldout": H, digits/ops/negatives}`
    gives N training and H disjoint held-out problems. JSONL: all lines train, none held out.
    gym: the `reasoning_gym` section (hexrl.data.gym_problems).
    """
    if gym is not None:
        from hexrl.data.gym_problems import load_reasoning_gym  # an optional dependency: only its jobs import it

        return load_reasoning_gym(gym)
    if synthetic is not None:
        opts = {k: v for k, v in synthetic.items() if k not in ("task", "n", "seed", "n_heldout", "budget")}
        if "digits" in opts:
            opts["digits"] = tuple(opts["digits"])
        n, seed, held = synthetic.get("n", 1000), synthetic.get("seed", 0), synthetic.get("n_heldout", 0)
        if held:
            return make_arithmetic_split(n, held, seed=seed, **opts)
        return make_arithmetic(n, seed=seed, **opts), []
    if kind == "code" and _is_code_benchmark(path):
        return load_code_tasks(path), []
    return load_jsonl(path, kind=kind).problems, []


def _is_code_benchmark(path: str) -> bool:
    """A HumanEval (.jsonl.gz, or records with a top-level `entry_point` and `test`) or MBPP
    (`test_list`) file rather than hexrl JSONL (whose tests may name an entry point too: the
    record's own fields decide, not the text of its first line)."""
    if str(path).endswith(".gz"):
        return True
    with open_input(path, "dataset file") as f:
        first = next((line for line in f if line.strip()), b"")
    try:
        rec = loads_json(first, str(path))
    except ValueError:
        return False  # load_jsonl names the bad line
    return isinstance(rec, dict) and (("entry_point" in rec and "test" in rec) or "test_list" in rec)


def dataset_problems(synthetic: dict | None, gym: dict | None = None) -> list[str]:
    """Why a job's synthetic or reasoning-gym data section cannot be generated (cheap: run before any
    process starts)."""
    if synthetic is None and gym is None:
        return []
    try:
        if gym is not None:
            from hexrl.data.gym_problems import gym_problems  # an optional dependency: only its jobs import it

            if found := gym_problems(gym):  # each task's options and the prompt, every problem at once
                return found
        load_dataset(synthetic=synthetic, gym=gym)
    except (TypeError, ValueError, KeyError, ImportError) as e:
        return [f"data.{'synthetic' if gym is None else 'reasoning_gym'}: {e}"]
    return []
