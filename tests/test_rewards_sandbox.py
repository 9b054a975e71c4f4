"""Hostile completions: every trick must score 0, leave no process running and write nothing.

Each attack is a `solve(a, b)` that does not compute a*b + 7, run against the three kinds of
test the code reward knows: a plain `assert solve(...) == value` (values compared by the
reward process), an assert the judge sandbox runs, and a stdin/stdout test. `-s` prints the
seconds each attack cost (measured, never asserted).
"""

import ctypes
import json
import os
import secrets
import socket
import subprocess
import sys
import time

import pytest

from hexrl.data.code_data import load_code_tasks
from hexrl.data.datasets import load_jsonl
from hexrl.rewards import code_reward
from hexrl.rewards.code import validate_tests
from hexrl.rewards.sandbox import Limits, python_argv, run_program

NONCE = secrets.token_hex(6)
HOST_FILE = f"/tmp/hexrl_pwned_{NONCE}"  # what an escape would write
PROJECT_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), f"pwned_{NONCE}")
TESTS = {
    "plain": ["assert solve(3, 4) == 19", "assert solve(10, -2) == -13"],
    "judged": ["assert abs(solve(3, 4) - 19) < 1e-9", "assert solve(10, -2) in (-13,)"],
    "stdio": [{"input": "3 4\n", "output": "19\n"}, {"input": "10 -2\n", "output": "-13\n"}],
}
TEMPLATE = """\
import os, sys, time
{top}
def solve(a, b):
{body}
if __name__ == "__main__":
    a, b = map(int, input().split())
    print(solve(a, b))
"""
ATTACKS = {
    # the old nonce trick: read our own files and print whatever looks like a pass
    "nonce_read": ("", "    for f in os.listdir('/in'):\n        print(open('/in/' + f).read())\n    return 0"),
    "atexit_after_systemexit": ("import atexit\natexit.register(lambda: print('PASS'))",
                                "    raise SystemExit(0)"),
    "always_equal": ("class Any:\n    def __eq__(self, o): return True\n    def __ne__(self, o): return False\n"
                     "    def __sub__(self, o): return 0\n    def __abs__(self): return 0\n    def __str__(self): return 'PASS'",
                     "    return Any()"),
    "settrace_skip": ("def tr(frame, event, arg):\n    if event == 'line':\n        try:\n"
                      "            frame.f_lineno = frame.f_lineno + 1\n        except Exception:\n            pass\n"
                      "    return tr\nsys.settrace(tr)", "    return None"),
    "read_dataset_file": ("", "    import glob, gzip\n    for p in glob.glob(sys.prefix + '/**/HumanEval*', recursive=True) + glob.glob('/in/*') + [DATASET]:\n"
                              "        try:\n            print(open(p).read())\n        except OSError:\n            pass\n"
                              "    return -1"),
    "proc_parent_mem": ("", "    for pid in [os.getppid(), HOST_PID, 1]:\n        try:\n"
                            "            open(f'/proc/{pid}/mem', 'rb').read(10)\n            return 19\n"
                            "        except OSError:\n            pass\n    return -2"),
    "read_host_secrets": ("import glob", "    leaks = [p for p in ['/etc/shadow', '/etc/passwd', '/root/.bash_history'] if os.path.exists(p)]\n"
                          "    leaks += [k for k in os.environ if k.startswith('HEXRL_TEST_SECRET')]\n"
                          "    for p in glob.glob('/proc/*/environ'):\n        try:\n"
                          "            leaks += ['environ'] if b'HEXRL_TEST_SECRET' in open(p, 'rb').read() else []\n"
                          "        except OSError:\n            pass\n"
                          "    return a * b + 7 if leaks else -11"),  # a leak would score: the test would fail
    "setsid_double_fork": ("", "    if os.fork() == 0:\n        os.setsid()\n        if os.fork() == 0:\n"
                               "            time.sleep(60)\n            open(HOST_FILE, 'w').write('x')\n        os._exit(0)\n    return -3"),
    "sleeping_child": ("", "    if os.fork() == 0:\n        time.sleep(60)\n        os._exit(0)\n    return -4"),
    "fork_bomb": ("", "    while True:\n        try:\n            os.fork()\n        except OSError:\n            pass"),
    "memory_bomb": ("", "    hog = []\n    while True:\n        hog.append(bytearray(1 << 24))"),
    "output_flood": ("", "    while True:\n        sys.stdout.write('PASS\\n' * 10000)"),
    "write_outside": ("", "    for p in (HOST_FILE, PROJECT_FILE, '/usr/pwned', '/in/pwned', '/pwned'):\n        try:\n"
                          "            open(p, 'w').write('x')\n        except OSError:\n            pass\n    return -5"),
    "network_connect": ("import socket", "    try:\n        socket.create_connection(('127.0.0.1', PORT), timeout=1).send(b'x')\n"
                                         "    except OSError:\n        pass\n    return -6"),
    "kill_parent": ("import signal", "    for pid in (os.getppid(), HOST_PID, SENTINEL_PID, -1):\n        try:\n"
                                     "            os.kill(pid, signal.SIGKILL)\n        except OSError:\n            pass\n    return -7"),
    "patch_builtins": ("import builtins, json\nbuiltins.type = lambda *a: int\nbuiltins.isinstance = lambda *a: True\n"
                       "json.dumps = lambda *a, **k: '{\"ok\": true}'\n"
                       "main = sys.modules.get('__main__')\nif main and hasattr(main, 'encode'):\n"
                       "    main.encode = lambda *a, **k: True", "    return -8"),
    "exit_zero_after_wrong_output": ("", "    print(-9)\n    sys.stdout.flush()\n    os._exit(0)"),
    "nested_namespace_remount": ("import subprocess", "    subprocess.run(['unshare', '-rm', 'sh', '-c', "
                                 "'mount -o remount,rw / ; echo x > /pwned; echo x > ' + HOST_FILE], capture_output=True)\n"
                                 "    return -10"),
}
TIMES: dict[str, float] = {}


def _all_pids() -> list[str]:
    return [p for p in os.listdir("/proc") if p.isdigit()]


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _descendants(root: int) -> set[str]:
    """Pids below `root` (orphans come back to it: the subreaper fixture below)."""
    children: dict[str, list[str]] = {}
    for pid in _all_pids():
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = f.read().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            continue
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), [str(root)]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _sandbox_processes() -> list[str]:
    """Command lines of live processes this test run started from a sandbox's /in (ours are all
    under /in); another job's sandboxes on the same machine are not ours to count."""
    return [f"{pid}: {cmd}" for pid in sorted(_descendants(os.getpid()))
            if "/in/harness.py" in (cmd := _cmdline(pid)) or "/in/main.py" in cmd]


def _adopt_orphans(on: bool) -> None:
    """prctl(PR_SET_CHILD_SUBREAPER): this process adopts its orphaned descendants."""
    ctypes.CDLL(None, use_errno=True).prctl(36, int(on), 0, 0, 0)


@pytest.fixture(scope="module", autouse=True)
def subreaper():
    """While these tests run, a sandbox process that outlived its launcher is still found below
    this process (and nothing else is)."""
    _adopt_orphans(True)
    yield
    _adopt_orphans(False)


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """A dataset file with the answers, a listening port and a sentinel process to attack."""
    dataset = tmp_path_factory.mktemp("data") / "train.jsonl"
    dataset.write_text('{"prompt": "solve", "tests": ["assert solve(3, 4) == 19"]}\n')
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    sentinel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    os.environ["HEXRL_TEST_SECRET"] = NONCE  # what the reward process's environment could leak
    yield {"DATASET": str(dataset), "PORT": listener.getsockname()[1], "SENTINEL_PID": sentinel.pid,
           "HOST_PID": os.getpid(), "HOST_FILE": HOST_FILE, "PROJECT_FILE": PROJECT_FILE}, listener, sentinel
    sentinel.kill()
    sentinel.wait()
    del os.environ["HEXRL_TEST_SECRET"]
    listener.close()
    if TIMES:
        print("\nseconds per attack (3 test kinds each):",
              ", ".join(f"{k} {v:.2f}" for k, v in TIMES.items()))


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_attack_scores_zero_and_leaves_nothing(attack, host):
    constants, listener, sentinel = host
    top, body = ATTACKS[attack]
    program = "".join(f"{k} = {v!r}\n" for k, v in constants.items()) + TEMPLATE.format(top=top, body=body)
    completion = f"```python\n{program}```"
    start = time.perf_counter()
    scores = {kind: code_reward(completion, tests, timeout_s=3.0, memory_mb=256) for kind, tests in TESTS.items()}
    TIMES[attack] = time.perf_counter() - start
    assert scores == {"plain": 0.0, "judged": 0.0, "stdio": 0.0}
    assert _sandbox_processes() == []
    assert not os.path.exists(HOST_FILE) and not os.path.exists(PROJECT_FILE)
    with pytest.raises(BlockingIOError):
        listener.accept()  # nobody connected
    assert sentinel.poll() is None  # the sentinel process survived


def test_honest_solution_passes_every_kind():
    """The control: the same harness gives full marks to a correct program."""
    program = TEMPLATE.format(top="", body="    return a * b + 7")
    for kind, tests in TESTS.items():
        assert code_reward(f"```python\n{program}```", tests) == 1.0, kind


def test_type_strict_values():
    tests = ["assert f() == 1", "assert f() == [1, 2]", "assert f() == True", "assert f() == {1: 'a'}"]
    assert code_reward("def f():\n    return 1", tests[:1]) == 1.0
    for wrong in ("1.0", "True", "'1'", "(1, 2)", "1 == 1"):
        assert code_reward(f"def f():\n    return {wrong}", [tests[0]]) == 0.0, wrong
    assert code_reward("def f():\n    return (1, 2)", [tests[1]]) == 0.0
    assert code_reward("def f():\n    return 1", [tests[2]]) == 0.0
    assert code_reward("def f():\n    return {1: 'a'}", [tests[3]]) == 1.0
    assert code_reward("class I(int):\n    pass\ndef f():\n    return I(1)", [tests[0]]) == 0.0  # a subclass


def test_program_writes_only_its_private_tmp():
    probe = ("import os\nopen('/tmp/f.txt', 'w').write('x')\n"
             "def f():\n    return [os.getcwd(), os.path.exists('/tmp/f.txt'), os.getuid(), sorted(os.listdir('/in'))]")
    assert code_reward(probe, ["assert f() == ['/tmp', True, 65534, ['harness.py', 'solution.py']]"]) == 1.0
    pids = "import os\nprint([p for p in os.listdir('/proc') if p.isdigit()])"
    status, out = run_program(python_argv("p.py"), {"p.py": pids})
    assert status == {"status": "exited", "rc": 0} and out == b"['1']\n"  # it sees itself only
    nested = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
              "print(libc.unshare(0x10000000), ctypes.get_errno())")  # CLONE_NEWUSER
    status, out = run_program(python_argv("p.py"), {"p.py": nested})
    assert out == b"-1 28\n"  # ENOSPC: user.max_user_namespaces is 0 inside, no nested namespace


def test_timeouts_kill_the_whole_namespace():
    start = time.perf_counter()
    status, out = run_program(python_argv("p.py"), {"p.py": "import time\ntime.sleep(30)"}, limits=Limits(timeout_s=1))
    assert status == {"status": "timeout"} and out is None
    assert time.perf_counter() - start < 25  # the 30 s sleep did not run out (a bound, not a timing claim)
    assert _sandbox_processes() == []


def test_unavailable_isolation_says_what_is_missing():
    """With user namespaces switched off (inside a namespace of our own), the reward refuses."""
    probe = ("from hexrl.rewards import code_reward\n"
             "code_reward('def f():\\n    return 1', ['assert f() == 1'])")
    script = f"echo 0 > /proc/sys/user/max_user_namespaces && exec {sys.executable} -c \"{probe}\""
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c", script], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert proc.returncode != 0
    assert "SandboxUnavailable" in proc.stderr and "unshare" in proc.stderr and "unsafe=True" in proc.stderr


def test_unsafe_mode_runs_without_isolation():
    """The documented opt-out for trusted code: same results, no namespaces."""
    program = TEMPLATE.format(top="", body="    return a * b + 7")
    for kind, tests in TESTS.items():
        assert code_reward(f"```python\n{program}```", tests, unsafe=True) == 1.0, kind
    status, out = run_program(python_argv("p.py"), {"p.py": "import os\nprint(os.getpid() > 1)"}, unsafe=True)
    assert out == b"True\n"  # not pid 1 of a namespace of its own


def test_pool_timeout_takes_the_sandbox_down_with_the_worker():
    """The pool kills a worker stuck past its timeout; the worker's sandboxes die with it."""
    from hexrl.rewards import RewardPool
    hang = TEMPLATE.format(top="", body="    if os.fork() == 0:\n        os.setsid()\n    time.sleep(60)")
    with RewardPool("code", workers=1, timeout_s=4.0) as pool:  # room for the honest one on a busy machine
        assert pool.score([(hang, TESTS["plain"]), (TEMPLATE.format(top="", body="    return a * b + 7"),
                                                    TESTS["plain"])]) == [0.0, 1.0]
        assert pool.stats.timeout == 1
    for _ in range(50):  # the parent-death signals travel down the tree asynchronously
        if not _sandbox_processes():
            break
        time.sleep(0.2)
    assert _sandbox_processes() == []


def test_the_secrets_attack_is_real_without_the_sandbox(host):
    """Control: unsandboxed (the `unsafe` opt-out), the same attack finds secrets and scores."""
    top, body = ATTACKS["read_host_secrets"]
    program = TEMPLATE.format(top=top, body=body)
    assert code_reward(program, TESTS["plain"], unsafe=True) == 1.0
    assert code_reward(program, TESTS["plain"]) == 0.0


# ----------------------------------------------------------------------------- hostile solutions and tests (docs/reliability.md)


def test_a_solution_named_like_a_builtin_is_the_one_tested():
    """The judge calls the solution's `round`, not the builtin it shadows."""
    test = "assert round(2.675, 2) == 2.67 or round(2.675, 2) == 2.68"
    assert code_reward("def round(x, n=0):\n    return 'garbage'", [test]) == 0.0
    assert code_reward("def round(x, n=0):\n    return 2.68", [test]) == 1.0
    assert code_reward("x = 1", [test]) == 0.0  # defines no `round`: nothing under test passes
    # a builtin wrapped around the function under test stays the builtin: shadowing it gains nothing
    wrapped = ["assert set(f([1, 2, 2])) == {1, 2}", "assert abs(f([3]) - 3) < 1e-9"]
    honest = "def f(xs):\n    return xs[0] if len(xs) == 1 else list(xs)"
    assert code_reward(honest, wrapped) == 1.0
    cheat = "def set(*a):\n    return {1, 2}\ndef abs(*a):\n    return 0\ndef f(xs):\n    return 7"
    assert code_reward(cheat, wrapped) == 0.0


@pytest.mark.parametrize("got,expected", [("{True, 2}", "{1, 2}"), ("{True: 'a'}", "{1: 'a'}"), ("{1.0}", "{1}"),
                                          ("{(1, True)}", "{(1, 1)}"),
                                          ("{1: {False}}", "{1: {0}}"), ("[{0.0: 1}]", "[{0: 1}]")])
def test_type_strict_inside_set_elements_and_dict_keys(got, expected):
    """Type-strict all the way down: that includes set elements and dict keys."""
    assert code_reward(f"def f():\n    return {got}", [f"assert f() == {expected}"]) == 0.0
    assert code_reward(f"def f():\n    return {expected}", [f"assert f() == {expected}"]) == 1.0


def test_strict_equal_matches_sets_and_dicts_by_type_and_value():
    from hexrl.rewards.harness import strict_equal
    assert strict_equal({1, 2, (3, "a")}, {(3, "a"), 2, 1})
    assert strict_equal({float("nan"): [1]}, {float("nan"): [1]})  # NaN equals NaN, as a value does
    assert strict_equal({1: [2.0], "k": {None}}, {"k": {None}, 1: [2.0]})
    assert not strict_equal({1: [2.0]}, {1: [2]}) and not strict_equal({0.0}, {False})
    assert strict_equal([float("nan")], [float("nan")])  # as before: NaN equals NaN as a value


@pytest.mark.parametrize("test", [
    "def check(candidate):\n    assert candidate(1) == 2\n\ncheck(inc)",  # HumanEval's test + a call
    "assert inc(1) == 2\nassert inc(2) == 3",  # two statements
    "inc(1) == 2",  # an expression, not an assert
    "assert inc(1) == (2",  # does not parse
])
def test_a_test_string_that_is_not_one_assert_is_refused(test):
    """Never a silent 0 for a malformed test; the error points to the converter."""
    with pytest.raises(ValueError, match=r"hexrl\.data\.code_data\.humaneval_tests"):
        code_reward("def inc(x):\n    return x + 1", [test])


FLOOD = """\
import os
P = 2 ** 61 - 1  # every multiple of P hashes to 0: a set of them costs its builder quadratic time
LINE = ('{"ok":{"set":[' + ','.join('{"int":"%d"}' % (k * P) for k in range(1, 30000)) + ']}}\\n').encode()
def f(*a):
    for fd in range(3, 12):
        try:
            os.write(fd, LINE)
        except OSError:
            pass
    return 1
"""


def test_protocol_flood_is_bounded_by_the_timeout():
    """Hash-colliding integers written straight onto the protocol pipe cost the parent a bounded
    decode, and the call ends within timeout_s plus a few seconds."""
    flood = {}
    exec(FLOOD, flood)
    assert 1_000_000 < len(flood["LINE"]) < Limits().output_bytes  # one line as long as a reply may be
    start = time.perf_counter()
    assert code_reward(FLOOD, [f"assert f({i}) == 0" for i in range(30)], timeout_s=1.0) == 0.0
    assert time.perf_counter() - start < 1.0 + 4  # a bound (timeout + grace + start), not a timing claim


def test_reply_decoding_bounds_sizes():
    from hexrl.rewards.code import _FAIL, _reply_value
    from hexrl.rewards.harness import encode
    big_set = json.dumps({"ok": encode(set(range(5000)))}).encode()
    assert _reply_value(big_set) is _FAIL  # more set/dict entries than an answer needs
    assert _reply_value(json.dumps({"ok": encode(list(range(1000)))}).encode()) == list(range(1000))
    assert _reply_value(b'{"ok": {"list": [' + b'null, ' * 150_000 + b'null]}}') is _FAIL  # too many values
    assert _reply_value(b'{"ok": "' + b"x" * (2 << 20) + b'"}') is _FAIL  # longer than a line may be


def test_the_leak_scan_ignores_other_jobs_sandboxes():
    """A sandbox of another job on the machine (not started by this test run) is not a leak."""
    script = "import time; time.sleep(60)"
    # double fork through a shell that exits: the stand-in is reparented away from this process
    _adopt_orphans(False)
    try:
        subprocess.run(["sh", "-c", f"setsid {sys.executable} -c '{script}' /in/harness.py player >/dev/null 2>&1 &"],
                       check=True)
    finally:
        _adopt_orphans(True)
    foreign = []
    try:
        for _ in range(100):
            foreign = [p for p in _all_pids() if "/in/harness.py" in _cmdline(p) and script in _cmdline(p)]
            if foreign:
                break
            time.sleep(0.05)
        assert foreign, "the stand-in for another job's sandbox did not start"
        assert _sandbox_processes() == []
    finally:
        for pid in foreign:
            os.kill(int(pid), 9)


CHECK = "def check(candidate):\n    assert candidate(1) == 2\n"
CANNOT_JUDGE = {  # tests that would score every completion 1.0 (or every solution 0)
    "empty entry point": {"check": CHECK, "entry_point": "", "setup": ""},
    "blank entry point": {"check": CHECK, "entry_point": " ", "setup": ""},
    "entry point not a name": {"check": CHECK, "entry_point": "inc(", "setup": ""},
    "no def check": {"check": "def test(candidate):\n    assert candidate(1) == 2\n", "entry_point": "inc"},
    "check takes nothing": {"check": "def check():\n    assert inc(1) == 2\n", "entry_point": "inc"},
    "check syntax error": {"check": "def check(candidate):\n    assert candidate(1) ==\n", "entry_point": "inc"},
    "tuple assert in check": {"check": "def check(c):\n    assert (c(1) == 999, 'msg')\n", "entry_point": "inc"},
    "tuple assert": 'assert (inc(1) == 999, "msg")',
    "list assert": "assert [inc(1) == 999]",
    "constant assert": "assert True",
    "assert calling nothing": "assert 1 == 1",
    "tuple assert in a group": {"all": ["assert inc(1) == 2", "assert (inc(2) == 999, 'x')"]},
    "group entry point not a name": {"all": ["assert inc(1) == 2"], "entry_point": "1inc", "setup": "x = 1"},
}


@pytest.mark.parametrize("name", CANNOT_JUDGE)
def test_a_code_test_that_cannot_judge_is_refused(name):
    with pytest.raises(ValueError, match=r"code tests \[1\]"):
        validate_tests(["assert inc(1) == 2", CANNOT_JUDGE[name]])
    with pytest.raises(ValueError):  # before: 1.0 for any completion, or 0 for every solution
        code_reward("def inc(x):\n    return 0", [CANNOT_JUDGE[name]])


def test_tests_that_can_judge_still_load():
    humaneval = {"check": 'def check(candidate):\n    assert True, "debug line"\n    assert candidate(1) == 2\n',
                 "entry_point": "inc", "setup": "def inc(x):\n    \"\"\"Add one.\"\"\"\n"}
    ok = ["assert inc(1) == 2", "assert abs(inc(1) - 2) < 1e-9", humaneval, {"all": ["assert inc(1) == 2"]}]
    assert validate_tests(ok) == ok


def test_a_dataset_line_with_a_test_that_cannot_judge_is_named(tmp_path):
    path = tmp_path / "code.jsonl"
    good = {"prompt": "inc", "tests": ["assert inc(1) == 2"]}
    bad = {"prompt": "inc", "tests": [{"check": CHECK, "entry_point": ""}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.warns(UserWarning, match=r"line 2: code tests \[0\]: entry_point '' is not a function name"):
        result = load_jsonl(path, kind="code")
    assert len(result.problems) == 1 and result.skipped[0][0] == 2
    record = {"task_id": "X/0", "prompt": "def inc(x):\n", "entry_point": "inc", "canonical_solution": "",
              "test": "def check(candidate):\n    assert (candidate(1) == 999, 'msg')\n"}
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=r"record 1: .*always true"):
        load_code_tasks(path)
