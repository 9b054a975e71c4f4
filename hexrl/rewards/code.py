"""Code reward: run a completion's program in the sandbox; the reward process decides pass/fail.

A test is one of:
- `"assert f(args) == value"` where args and value are constants: the sandboxed harness calls
  `f(*args)` and returns the result as a plain value; the expected value never enters the
  sandbox, and the comparison is type-strict (`True != 1`, `1 != 1.0`, `[1] != (1,)`);
- any other assert string (`assert abs(f(x) - 1.5) < 1e-6`), or a HumanEval-style
  `{"check": test code, "entry_point": name, "setup": prompt code}`: the trusted test code runs
  in a second sandbox (the judge), where the solution's functions are proxies returning plain
  values relayed by this process; the solution never sees the test code (see `_under_test` for
  which names are the solution's); a test string must be one assert, else ValueError;
- `{"input": stdin, "output": expected stdout}`: this process compares the output;
- `{"all": [assert strings]}`: one test that passes when every assert in it passes.
A `{"check"}` or `{"all"}` test may carry `"setup"` (the prompt's code) and `"entry_point"`: a
completion that does not define the entry point is taken as the body continuing the prompt.
Nothing the program prints, patches, or exits with decides the score: a value either equals
the expected one or the test fails. See docs/rewards.md for what remains possible.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import re
import sys
from pathlib import Path

from hexrl.rewards.harness import CodecError, decode, encode, strict_equal
from hexrl.rewards.sandbox import Limits, Sandbox, check_isolation, python_argv, run_program

_HARNESS = Path(__file__).with_name("harness.py").read_text()
_FAIL = object()  # a call that raised, crashed, timed out or returned a non-plain value
_MAX_CONST = 10_000  # size cap when folding constant expressions in tests (3 * 19, 'a' + 'b')
_MAX_LINE = 1 << 20  # a player's reply line longer than this is not an answer


def extract_code(completion: str) -> str:
    """The last ```python (or ```py) fenced block; else the last ``` block; else the whole text.

    An unterminated fence (a truncated completion) counts up to the end of the text.
    """
    for lang in (r"(?:python3?|py)", r"[a-zA-Z0-9_+-]*"):
        blocks = re.findall(rf"```{lang}[ \t]*\n(.*?)(?:```|\Z)", completion, flags=re.DOTALL)
        if blocks:
            return blocks[-1]
    return completion


def _is_stdio(t) -> bool:
    return isinstance(t, dict) and isinstance(t.get("input", ""), str) and isinstance(t.get("output"), str)


def _is_check(t) -> bool:
    return (isinstance(t, dict) and isinstance(t.get("check"), str) and isinstance(t.get("entry_point"), str)
            and isinstance(t.get("setup", ""), str))


def _is_group(t) -> bool:
    return (isinstance(t, dict) and isinstance(t.get("all"), list) and bool(t["all"])
            and all(isinstance(a, str) for a in t["all"]) and isinstance(t.get("setup", ""), str)
            and isinstance(t.get("entry_point", ""), str))


def _parse(code: str) -> ast.Module | None:
    try:
        return ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _always_true(node: ast.Assert) -> bool:
    """An assert that cannot fail: a non-empty literal container (`assert (f(1) == 2, "msg")`
    is a tuple) or a constant."""
    t = node.test
    if isinstance(t, (ast.Tuple, ast.List, ast.Set)):
        return bool(t.elts)
    if isinstance(t, ast.Dict):
        return bool(t.keys)
    return isinstance(t, (ast.Constant, ast.JoinedStr, ast.Lambda))


def _assert_problem(test: str) -> str | None:
    """Why an assert string cannot judge a solution: not one assert that parses, always true, or
    calling nothing (then no solution is tested)."""
    tree = _parse(test.strip())
    if tree is None or len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return ("a test string must be one assert statement that parses; a HumanEval-style test (a check "
                'function and its call) becomes {"check": test, "entry_point": name, "setup": prompt}: see '
                "hexrl.data.code_data.humaneval_tests")
    if _always_true(tree.body[0]):
        return "the assert is always true (a tuple, container or constant: drop the parentheses)"
    if not any(isinstance(n, ast.Call) for n in ast.walk(tree.body[0].test)):
        return "the assert calls no function, so it tests no solution"
    return None


def _check_problem(t: dict) -> str | None:
    """Why a `{"check"}` test cannot judge: no entry point to call, no `def check(candidate)` that
    parses, or an assert in it that is always true."""
    if not t["entry_point"].isidentifier():
        return f"entry_point {t['entry_point']!r} is not a function name (the check would call nothing)"
    tree = _parse(t["check"])
    if tree is None:
        return "the check code does not parse"
    check = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if not check or not (check[-1].args.args or check[-1].args.vararg):
        return "the check code defines no check(candidate) function"
    if any(isinstance(n, ast.Assert) and _always_true(n) and not isinstance(n.test, ast.Constant)
           for n in ast.walk(tree)):  # HumanEval's `assert True, "..."` lines are harmless no-ops
        return "an assert in check is always true (a tuple or container: drop the parentheses)"
    return None


def validate_tests(tests) -> list:
    """The tests as a list; ValueError naming every malformed entry (never a silent 0 later)."""
    if not isinstance(tests, (list, tuple)) or not tests:
        raise ValueError(f"code tests must be a non-empty list, got {type(tests).__name__}")
    bad = [i for i, t in enumerate(tests)
           if not (isinstance(t, str) or _is_stdio(t) or _is_check(t) or _is_group(t))]
    if bad:
        raise ValueError(f"code tests {bad} are neither an assert string, "
                         '{"input": str, "output": str}, {"check": str, "entry_point": str}, '
                         'nor {"all": [assert strings]}')
    problems = {}
    for i, t in enumerate(tests):
        if _is_check(t):
            why = _check_problem(t)
        elif _is_group(t) and t.get("entry_point") and not t["entry_point"].isidentifier():
            why = f"entry_point {t['entry_point']!r} is not a function name"
        else:
            why = next(filter(None, map(_assert_problem, t["all"] if _is_group(t) else [t] if isinstance(t, str)
                                        else [])), None)
        if why:
            problems.setdefault(why, []).append(i)
    if problems:
        raise ValueError("; ".join(f"code tests {bad}: {why}" for why, bad in problems.items()))
    return list(tests)


# ----------------------------------------------------------------------------- assert parsing


def _const(node: ast.AST):
    """The value of a constant expression (literals, containers, arithmetic); ValueError otherwise."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow,
                                                            ast.FloorDiv, ast.Mod)):
        a, b = _const(node.left), _const(node.right)
        numbers = all(type(v) in (int, float) for v in (a, b))
        if not (numbers or (type(a) is type(b) is str and isinstance(node.op, ast.Add))):
            raise ValueError("not a constant")
        if isinstance(node.op, ast.Pow) and abs(b) > 64:
            raise ValueError("exponent too large")
        value = {ast.Add: lambda: a + b, ast.Sub: lambda: a - b, ast.Mult: lambda: a * b, ast.Div: lambda: a / b,
                 ast.Pow: lambda: a ** b, ast.FloorDiv: lambda: a // b, ast.Mod: lambda: a % b}[type(node.op)]()
        if len(repr(value)) > _MAX_CONST:
            raise ValueError("constant too large")
        return value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _const(node.operand)
        if type(v) not in (int, float):
            raise ValueError("not a number")
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = [_const(e) for e in node.elts]
        return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_const(k): _const(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def plain_call(test: str) -> tuple[str, tuple, object] | None:
    """(function name, args, expected) for `assert f(args) == value` with constant args and value."""
    try:
        tree = ast.parse(test.strip())
    except (SyntaxError, ValueError, RecursionError):
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert) or tree.body[0].msg is not None:
        return None
    t = tree.body[0].test
    if not (isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq)):
        return None
    call, value = t.left, t.comparators[0]
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and not call.keywords):
        return None
    try:
        args = tuple(_const(a) for a in call.args)
        expected = _const(value)
        encode(args), encode(expected)  # the harness must be able to carry both
    except (ValueError, TypeError, SyntaxError, ArithmeticError, CodecError, RecursionError, MemoryError):
        return None
    return call.func.id, args, expected


def defined_names(code: str) -> set[str]:
    """Names the solution's module binds at its top level (def, class, assignment, import, ...),
    statements nested in if/try/with/for included, function and class bodies not."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return set()
    out, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in node.names)
            continue
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                out.add(child.id)
            elif isinstance(child, (ast.stmt, ast.expr, ast.excepthandler, ast.withitem, ast.comprehension)):
                todo.append(child)
    return out


def _under_test(test: str, defined: set[str]) -> tuple[list[str], list[str]]:
    """(the names the judge must take from the solution, stdlib modules the test uses unimported).

    The functions under test are the names the test calls that are not builtins. A test that calls
    only builtin names (the solution is named like one: `round`) tests the solution's own
    definitions of them, as in the solution's module; when it defines none of them, all of them
    (they then fail). A builtin wrapped around the function under test (`set(f(x))`,
    `abs(f(x) - y)`) stays the builtin: a solution cannot redefine it to choose the outcome.
    """
    called, modules = set(), set()
    for node in ast.walk(ast.parse(test)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            called.add(node.func.id)
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in sys.stdlib_module_names):
            modules.add(node.value.id)
    called -= modules
    mine = called - set(dir(builtins))
    if not mine:
        mine = (called & defined) or called
    return sorted(mine), sorted(modules)


# ----------------------------------------------------------------------------- running


def _player(code: str, limits: Limits, unsafe: bool) -> Sandbox:
    files = {"harness.py": _HARNESS, "solution.py": code}
    return Sandbox(python_argv("harness.py", "player", "/in/solution.py"), files, limits, unsafe=unsafe)


def _reply_value(line: bytes | None):
    """The plain value in a player's reply line, or _FAIL (also for a line or value too large:
    the sizes `decode` bounds keep the parent's work small whatever the player writes)."""
    if line is None or len(line) > _MAX_LINE:
        return _FAIL
    try:
        reply = json.loads(line)
        return decode(reply["ok"]) if type(reply) is dict and set(reply) == {"ok"} else _FAIL
    except (TypeError, ValueError, KeyError, RecursionError, OverflowError, MemoryError):
        return _FAIL


def _call(player: Sandbox, fn: str, args) -> object:
    if not player.send_line({"fn": fn, "args": args}):
        return _FAIL
    return _reply_value(player.read_line())


def run_calls(code: str, calls: list[tuple[str, tuple]], limits: Limits, unsafe: bool = False) -> list:
    """The solution's return value for each (function name, args), or _FAIL; one sandbox for all."""
    with _player(code, limits, unsafe) as player:
        results = []
        for fn, args in calls:
            results.append(_call(player, fn, encode(args)))
            if (results[-1] is _FAIL and player.ended) or player.expired:  # the rest would fail the same way
                break
    return results + [_FAIL] * (len(calls) - len(results))


def run_judged(code: str, spec: dict, limits: Limits, unsafe: bool = False) -> list[bool]:
    """Pass/fail of each test in `spec` (see harness._judge), relaying the judge's calls."""
    n = len(spec["tests"])
    files = {"harness.py": _HARNESS, "tests.json": json.dumps(spec)}
    verdicts: dict[int, bool] = {}
    with _player(code, limits, unsafe) as player, \
            Sandbox(python_argv("harness.py", "judge", "/in/tests.json"), files, limits, unsafe=unsafe) as judge:
        if _call(player, None, encode(())) is _FAIL:  # a solution that does not load fails every test
            return [False] * n
        while len(verdicts) < n and not player.expired and (line := judge.read_line()) is not None:
            msg = json.loads(line)  # the judge runs trusted code only
            if "test" in msg:
                verdicts[msg["test"]] = msg["passed"] is True
                continue
            value = _call(player, msg["call"], msg["args"])
            judge.send_line({"error": "the call failed"} if value is _FAIL else {"ok": encode(value)})
    return [verdicts.get(i, False) for i in range(n)]


def _same_output(got: str, expected: str) -> bool:
    """Judge-style comparison: ignore trailing spaces on lines and trailing blank lines."""
    def lines(s: str) -> list[str]:
        out = [line.rstrip() for line in s.strip("\n").split("\n")]
        while out and not out[-1]:
            out.pop()
        return out
    return lines(got) == lines(expected)


def _stdio_passes(code: str, test: dict, limits: Limits, unsafe: bool) -> bool:
    status, out = run_program(python_argv("main.py"), {"main.py": code}, test.get("input", ""), limits, unsafe)
    return status == {"status": "exited", "rc": 0} and out is not None and _same_output(
        out.decode(errors="replace"), test["output"])


def _with_setup(code: str, tests: list[dict]) -> str:
    """The prompt's code in scope of the solution. A completion continuing the prompt's signature
    (HumanEval's own format) gets the whole prompt before it; one that writes the whole function
    (what hexrl's prompt asks) gets the prompt's imports and helpers, everything but the entry
    point's own def, which the solution's definitions may then override."""
    for t in tests:
        setup, entry = t.get("setup"), t.get("entry_point")
        if setup and entry:
            if not re.search(rf"^def\s+{re.escape(entry)}\s*\(", code, re.M):
                return setup + code
            return prompt_context(setup, entry) + code
    return code


def prompt_context(setup: str, entry_point: str) -> str:
    """The prompt's top-level statements but the entry point's def (its imports, helpers and
    constants), as source text; empty when the prompt does not parse (even with a body added)."""
    tree = _parse(setup) or _parse(setup + "    pass\n")  # a prompt may end in a bare signature
    lines = setup.splitlines(keepends=True)
    if tree is None:
        return ""
    keep = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == entry_point:
            continue
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        keep.append("".join(lines[first - 1:node.end_lineno]))
    return "\n".join(keep) + "\n" if keep else ""


def outcomes(code: str, tests: list, limits: Limits, unsafe: bool = False) -> list[bool]:
    """Pass/fail of every test, in order (a group passes when all its asserts do)."""
    code = _with_setup(code, [t for t in tests if _is_group(t) or _is_check(t)])
    flat = [a for t in tests for a in (t["all"] if _is_group(t) else [t])]
    flat_passed, out, k = _flat_outcomes(code, flat, limits, unsafe), [], 0
    for t in tests:
        n = len(t["all"]) if _is_group(t) else 1
        out.append(all(flat_passed[k:k + n]))
        k += n
    return out


def _flat_outcomes(code: str, tests: list, limits: Limits, unsafe: bool) -> list[bool]:
    """Pass/fail of tests that are asserts, checks or stdin/stdout (no groups): one sandbox per kind."""
    plain = {i: p for i, t in enumerate(tests) if isinstance(t, str) and (p := plain_call(t))}
    judged = [i for i, t in enumerate(tests) if isinstance(t, str) and i not in plain]
    checks = [i for i, t in enumerate(tests) if _is_check(t)]
    passed = [False] * len(tests)
    if plain:
        results = run_calls(code, [(fn, args) for fn, args, _ in plain.values()], limits, unsafe)
        for (i, (_, _, expected)), got in zip(plain.items(), results):
            passed[i] = got is not _FAIL and strict_equal(got, expected)
    if judged:
        defined = defined_names(code)
        names = [_under_test(tests[i], defined) for i in judged]
        modules = sorted({m for _, ms in names for m in ms})
        spec = {"setup": "".join(f"import {m}\n" for m in modules), "tests": [tests[i] for i in judged],
                "proxies": [proxies for proxies, _ in names]}
        for i, ok in zip(judged, run_judged(code, spec, limits, unsafe)):
            passed[i] = ok
    for i in checks:
        t = tests[i]
        spec = {"setup": t.get("setup", ""), "tests": [t["check"]], "proxies": [[t["entry_point"]]],
                "entry_point": t["entry_point"]}
        passed[i] = run_judged(code, spec, limits, unsafe)[0]
    for i, t in enumerate(tests):
        if _is_stdio(t):
            passed[i] = _stdio_passes(code, t, limits, unsafe)
    return passed


def unsafe_default() -> bool:
    """The opt-out for trusted code, HEXRL_CODE_REWARD_UNSAFE=1 (never for model output)."""
    return os.environ.get("HEXRL_CODE_REWARD_UNSAFE") == "1"


def code_reward(completion: str, tests, *, timeout_s: float = 5.0, memory_mb: int = 512,
                all_or_nothing: bool = False, unsafe: bool | None = None) -> float:
    """Fraction of `tests` the completion's program passes (or 1/0 with `all_or_nothing`).

    `timeout_s` bounds each sandboxed run (one per group of tests). Raises ValueError for
    malformed `tests` (a dataset bug, not a model failure) and SandboxUnavailable when this
    machine cannot isolate the program. `unsafe=True` (default: `unsafe_default()`) skips
    the isolation: for trusted code only.
    """
    tests = validate_tests(tests)
    unsafe = unsafe_default() if unsafe is None else unsafe
    check_isolation(unsafe)
    code = extract_code(completion) if isinstance(completion, str) else ""
    if not code.strip():
        return 0.0
    passed = outcomes(code, tests, Limits(timeout_s=timeout_s, memory_mb=memory_mb), unsafe)
    if all_or_nothing:
        return float(all(passed))
    return sum(passed) / len(passed)
