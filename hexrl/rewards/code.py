"""Code reward: run a completion's Python program against test cases in a sandboxed process.

Each test runs in its own `python -I` process, in a fresh temporary directory, with limits on
address space, CPU time, file size and wall time; the whole process group is killed on timeout.
A test is either `{"input": stdin, "output": expected stdout}` or an assert statement (string).
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

# Limits are set by a tiny launcher inside the child rather than in `preexec_fn`, because
# preexec_fn is unsafe when the parent has threads (rollout workers do).
_LAUNCHER = """\
import resource, runpy, sys
mem, cpu, fsize = (int(x) for x in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
sys.argv = ["main.py"]
del resource, mem, cpu, fsize
runpy.run_path("main.py", run_name="__main__")
"""
_MAX_FILE_BYTES = 16 << 20
_MAX_OUTPUT_BYTES = 1 << 20  # more output than this is never a correct answer anyway


def extract_code(completion: str) -> str:
    """The last ```python (or ```py) fenced block; else the last ``` block; else the whole text.

    An unterminated fence (a truncated completion) counts up to the end of the text.
    """
    for lang in (r"(?:python3?|py)", r"[a-zA-Z0-9_+-]*"):
        blocks = re.findall(rf"```{lang}[ \t]*\n(.*?)(?:```|\Z)", completion, flags=re.DOTALL)
        if blocks:
            return blocks[-1]
    return completion


def validate_tests(tests) -> list:
    """The tests as a list; ValueError naming every malformed entry."""
    if not isinstance(tests, (list, tuple)) or not tests:
        raise ValueError(f"code tests must be a non-empty list, got {type(tests).__name__}")
    bad = [i for i, t in enumerate(tests) if not (
        isinstance(t, str) or (isinstance(t, dict) and isinstance(t.get("input", ""), str)
                               and isinstance(t.get("output"), str)))]
    if bad:
        raise ValueError(f"code tests {bad} are neither an assert string nor "
                         '{"input": str, "output": str}')
    return list(tests)


def _same_output(got: str, expected: str) -> bool:
    """Judge-style comparison: ignore trailing spaces on lines and trailing blank lines."""
    def lines(s: str) -> list[str]:
        out = [line.rstrip() for line in s.strip("\n").split("\n")]
        while out and not out[-1]:
            out.pop()
        return out
    return lines(got) == lines(expected)


def run_sandboxed(source: str, stdin: str, *, timeout_s: float, memory_mb: int) -> tuple[int | None, str]:
    """Run `source` as main.py in a temp dir; return (exit code, or None on timeout; stdout).

    stdin and stdout are files in the temp dir, so RLIMIT_FSIZE bounds a runaway print loop.
    """
    with tempfile.TemporaryDirectory(prefix="hexrl_code_") as tmp:
        Path(tmp, "main.py").write_text(source)
        Path(tmp, "stdin.txt").write_text(stdin)
        limits = [str(memory_mb << 20), str(int(timeout_s) + 1), str(_MAX_FILE_BYTES)]
        with open(Path(tmp, "stdin.txt"), "rb") as fin, open(Path(tmp, "stdout.txt"), "wb") as fout:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _LAUNCHER, *limits], cwd=tmp, stdin=fin, stdout=fout,
                stderr=subprocess.DEVNULL, start_new_session=True,
                env={"PATH": os.environ.get("PATH", ""), "HOME": tmp, "PYTHONHASHSEED": "0"})
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                rc = None
            _kill_group(proc)  # on timeout, and any grandchildren it left behind
            proc.wait()
        with open(Path(tmp, "stdout.txt"), "rb") as f:
            out = f.read(_MAX_OUTPUT_BYTES)
        return rc, ("" if rc is None else out.decode(errors="replace"))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _passes(code: str, test, timeout_s: float, memory_mb: int) -> bool:
    if isinstance(test, str):
        # The nonce printed after the assert proves the assert ran (an early exit() cannot fake it).
        nonce = secrets.token_hex(8)
        source = f"{code}\n\n{test}\nprint({nonce!r})\n"
        rc, out = run_sandboxed(source, "", timeout_s=timeout_s, memory_mb=memory_mb)
        return rc == 0 and out.rstrip("\n").rsplit("\n", 1)[-1] == nonce
    rc, out = run_sandboxed(code, test.get("input", ""), timeout_s=timeout_s, memory_mb=memory_mb)
    return rc == 0 and _same_output(out, test["output"])


def code_reward(completion: str, tests, *, timeout_s: float = 2.0, memory_mb: int = 256,
                all_or_nothing: bool = False) -> float:
    """Fraction of `tests` the completion's program passes (or 1/0 with `all_or_nothing`).

    Raises ValueError for malformed `tests` (a dataset bug, not a model failure).
    """
    tests = validate_tests(tests)
    code = extract_code(completion) if isinstance(completion, str) else ""
    if not code.strip():
        return 0.0
    passed = 0
    for test in tests:
        if _passes(code, test, timeout_s, memory_mb):
            passed += 1
        elif all_or_nothing:
            return 0.0
    return 1.0 if all_or_nothing else passed / len(tests)
