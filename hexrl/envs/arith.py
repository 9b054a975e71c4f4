"""A safe arithmetic evaluator for the calculator environment: numbers, + - * / // % **,
parentheses, unary minus. Never `eval`: the expression is parsed with `ast` and only these
nodes are walked; sizes and powers are bounded, so no input can take long or use much memory."""
from __future__ import annotations

import ast
import math
import operator
from fractions import Fraction

MAX_CHARS = 200  # longer expressions are refused before parsing
MAX_DIGITS = 60  # operands and results beyond this many digits are refused
MAX_EXPONENT = 64

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


class ArithError(ValueError):
    """The expression is not plain bounded arithmetic."""


def evaluate(expr: str) -> Fraction:
    """The exact value of `expr`; raises ArithError for anything else (names, calls, huge numbers)."""
    if not isinstance(expr, str) or len(expr) > MAX_CHARS:
        raise ArithError(f"an expression of at most {MAX_CHARS} characters is needed")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ArithError(f"not an arithmetic expression: {type(e).__name__}") from None
    return _walk(tree.body)


def _bounded(x: Fraction) -> Fraction:
    if max(abs(x.numerator), x.denominator).bit_length() > MAX_DIGITS * 3.33:
        raise ArithError(f"a number beyond {MAX_DIGITS} digits")
    return x


def _walk(node) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if not math.isfinite(node.value):  # 1e309 is parsed as inf
            raise ArithError("a number beyond a float's range")
        return _bounded(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _walk(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _walk(node.left), _walk(node.right)
        if isinstance(node.op, ast.Pow) and (b.denominator != 1 or abs(b) > MAX_EXPONENT):
            raise ArithError(f"powers need an integer exponent of at most {MAX_EXPONENT}")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and b == 0:
            raise ArithError("division by zero")
        if isinstance(node.op, ast.Pow) and a == 0 and b < 0:
            raise ArithError("division by zero")
        return _bounded(Fraction(_BINARY[type(node.op)](a, b)))
    raise ArithError(f"{type(node).__name__} is not allowed")


def format_number(x: Fraction) -> str:
    """An integer as digits; anything else as a decimal rounded to 6 places."""
    if x.denominator == 1:
        return str(x.numerator)
    return f"{float(x):.6f}".rstrip("0").rstrip(".")
