"""Reward for reasoning-gym problems: the task's own scorer (`pip install -e .[gym]`).

It runs where every reward runs, in the reward pool's worker processes (a per-call timeout; a
worker that crashes or hangs is replaced). Some tasks' scorers evaluate the model's text: countdown
and puzzle24 hand it to sympy's `parse_expr` (which calls `eval`), so do the integration and
polynomial tasks, and four tasks give partial credit for a Python list through a bare `eval`. Such a
task has a gate (GATES): the answer is parsed with `ast`, never evaluated, and reaches the scorer only
if it is made of what that task's answers are made of; anything else scores 0.
"""
from __future__ import annotations

import ast
import json
import math
import re
from functools import lru_cache

from hexrl.rewards.synthetic import first_line

INSTALL = "reasoning-gym is not installed: pip install -e .[gym]"

MAX_NODES = 500  # syntax-tree nodes of a gated answer (its scorer's time grows with them)
MAX_NUMBER = 10**30  # literals in an algebra answer
MAX_POWER = 1000  # an algebra answer's largest total exponent: sympy would compute 2**(10**9) in full
# what sympy may call in an algebra answer: every other name is a symbol, never called
FUNCTIONS = frozenset({"sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "acot", "sinh", "cosh",
                       "tanh", "asinh", "acosh", "atanh", "exp", "log", "ln", "sqrt", "cbrt", "Abs", "abs"})
# not Integral: reasoning-gym writes an integral sympy cannot do as Integral(f, x), and its scorer takes
# `Integral(f, x) + C`, the question written back, as right: the model would learn to echo questions
_ARITHMETIC_TEXT = re.compile(r"[0-9+\-*/() \t\n]*")
_ARITHMETIC_NODES = (ast.Expression, ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.UnaryOp, ast.USub)
_LITERAL_NODES = (ast.Expression, ast.Constant, ast.Name, ast.Load, ast.List, ast.Tuple, ast.UnaryOp, ast.USub,
                  ast.UAdd)
_SUMS = (ast.Add, ast.Sub)


def import_gym():
    """The reasoning_gym module, or ImportError saying how to install it."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(f"{INSTALL} ({e})") from None
    return reasoning_gym


@lru_cache(maxsize=None)
def scorer(task: str, config: str):
    """The task's `score_answer(answer, entry)`, of a dataset built with the problem's config (JSON)."""
    return import_gym().create_dataset(task, size=1, seed=0, **json.loads(config)).score_answer


def extract(completion: str) -> str:
    """The completion's answer: inside its last <answer>...</answer> (reasoning-gym's own format) when
    it has one, else its first line (a short model's bare answer)."""
    if "<answer>" in completion:
        from reasoning_gym.utils import extract_answer

        found = extract_answer(completion)
        if found is not None:
            return found
    return first_line(completion)


def _parse(text: str, max_chars: int) -> ast.Expression | None:
    """`text` as a Python expression of at most `max_chars` characters and MAX_NODES nodes, else None."""
    if len(text) > max_chars:
        return None
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    return tree if sum(1 for _ in ast.walk(tree)) <= MAX_NODES else None


def arithmetic(text: str) -> bool:
    """Integers, + - * /, unary minus and parentheses (countdown's and puzzle24's answers); no powers."""
    tree = _parse(text, 200) if _ARITHMETIC_TEXT.fullmatch(text) else None
    return tree is not None and all(isinstance(n, _ARITHMETIC_NODES) or (
        isinstance(n, ast.Constant) and type(n.value) is int) for n in ast.walk(tree))


def algebra(text: str) -> bool:
    """A sympy expression: numbers, symbols, + - * / **, calls of FUNCTIONS; its powers bounded."""
    tree = _parse(text, 2000) if text.isascii() else None
    try:
        return tree is not None and _algebra(tree.body, 1.0)
    except RecursionError:
        return False


def _algebra(node: ast.AST, scale: float) -> bool:
    """Whether `node` is allowed in an algebra answer inside powers that multiply to `scale`."""
    if isinstance(node, ast.Constant):
        return _small(node.value)
    if isinstance(node, ast.Name):
        return not node.id.startswith("_")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _algebra(node.operand, scale)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        power = scale * max(1.0, _magnitude(node.right))
        return power <= MAX_POWER and _algebra(node.left, power) and _algebra(node.right, 1.0)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (*_SUMS, ast.Mult, ast.Div)):
        return _algebra(node.left, scale) and _algebra(node.right, scale)
    if isinstance(node, ast.Call):
        return (isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS and not node.keywords
                and all(_algebra(a, scale) for a in node.args))
    return False


def _small(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and abs(value) <= MAX_NUMBER


def _magnitude(node: ast.AST) -> float:
    """A bound on |node| for symbols of size up to 2, so on any number sympy folds it to
    (x - x + 99 is 99 for every x); inf for powers and calls."""
    if isinstance(node, ast.Constant) and _small(node.value):
        return abs(node.value)
    if isinstance(node, ast.Name):
        return 2.0
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _magnitude(node.operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, _SUMS):
        return _magnitude(node.left) + _magnitude(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return _magnitude(node.left) * _magnitude(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant) \
            and _small(node.right.value) and node.right.value:
        return _magnitude(node.left) / abs(node.right.value)
    return math.inf


def literal(text: str) -> bool:
    """Not Python at all (a matrix, a board), or a literal: numbers, strings, names, lists, tuples.
    The scorer's `eval` parses exactly this text after dropping leading spaces and tabs."""
    try:
        tree = ast.parse(text.lstrip(" \t"), mode="eval")
    except SyntaxError:
        return True  # eval refuses it before running anything
    except (ValueError, MemoryError, RecursionError):
        return False
    return all(isinstance(n, _LITERAL_NODES) for n in ast.walk(tree))


# the tasks whose scorers evaluate the answer, and what an answer may be made of to reach it
GATES = {"countdown": arithmetic, "puzzle24": arithmetic, "polynomial_multiplication": algebra,
         "simple_integration": algebra, "intermediate_integration": algebra, "binary_matrix": literal,
         "n_queens": literal, "spiral_matrix": literal, "string_insertion": literal}


def gym_reward(completion: str, answer: str) -> float:
    """The task's score (0..1; some tasks give partial credit) of `completion`; `answer` is the problem's
    reasoning-gym entry as JSON (hexrl.data.gym_problems), naming its task and config. 0 for an answer its
    task's gate refuses."""
    if not isinstance(completion, str) or not isinstance(answer, str):
        return 0.0
    entry = json.loads(answer)
    text = extract(completion)
    gate = GATES.get(entry["task"])
    if gate is not None and not gate(text):
        return 0.0
    score = scorer(entry["task"], json.dumps(entry["config"], sort_keys=True))
    return float(score(answer=text, entry=entry))
