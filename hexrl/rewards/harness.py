"""Code-test harness: the value codec shared by both sides, and the two programs run in sandboxes.

Stdlib only: the sandbox runs this file as a script (`python -I -S harness.py player|judge FILE`),
and the reward process imports it for the codec, so both sides speak one format.

- `player FILE`: runs the untrusted solution, then serves calls `{"fn", "args"}` -> `{"ok": value}`
  or `{"error": text}`, one JSON line each way (`"fn": null` asks whether the solution loaded).
  Only plain values cross: `encode` accepts the exact types None, bool, int, float, str, bytes,
  list, tuple, dict, set, frozenset (subclasses, e.g. an object whose `__eq__` is always True,
  are refused), so the decoded value has no code of its own.
- `judge FILE`: runs trusted test code (a HumanEval `check` or an assert the reward could not turn
  into a call) in its own sandbox; the solution's functions are proxies that send their arguments
  out and get plain values back through the reward process. It never sees the solution's code.
"""

import json
import math
import os
import sys

_MAX_DEPTH = 100  # deeper values are not test answers, and would risk a RecursionError
_MAX_VALUES = 100_000  # values in one decoded answer
_MAX_ENTRIES = 2_000  # set elements plus dict keys in one decoded answer (hashed: see decode)


class CodecError(ValueError):
    """A value that cannot cross the sandbox boundary."""


def encode(x, depth: int = 0):
    """A JSON-able tagged form of a plain value; CodecError for anything else."""
    if depth > _MAX_DEPTH:
        raise CodecError("value nested too deeply")
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if t is int:
        return {"int": str(x)}  # JSON numbers would blur int and float
    if t is float:
        return {"float": repr(x)}
    if t is bytes:
        return {"bytes": x.hex()}
    if t in (list, tuple, set, frozenset):
        items = sorted(x, key=repr) if t in (set, frozenset) else x
        return {t.__name__: [encode(v, depth + 1) for v in items]}
    if t is dict:
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in x.items()]}
    raise CodecError(f"unsupported type {t.__name__}")


def decode(x, depth: int = 0, budget: list[int] | None = None):
    """The value `encode` produced (type-exact); CodecError for anything malformed or too big.

    At most _MAX_VALUES values and _MAX_ENTRIES set elements plus dict keys: each entry is
    hashed, and a sender can make their hashes collide (a set of n costs n^2 then).
    """
    budget = [_MAX_VALUES, _MAX_ENTRIES] if budget is None else budget
    budget[0] -= 1
    if depth > _MAX_DEPTH or budget[0] < 0:
        raise CodecError("value nested too deeply or too large")
    if x is None or type(x) in (bool, str):
        return x
    if type(x) is not dict or len(x) != 1:
        raise CodecError(f"malformed value of type {type(x).__name__}")
    (tag, v), = x.items()
    if tag == "int" and type(v) is str:
        return int(v)
    if tag == "float" and type(v) is str:
        return float(v)
    if tag == "bytes" and type(v) is str:
        return bytes.fromhex(v)
    if tag in ("set", "frozenset", "dict") and type(v) is list:
        budget[1] -= len(v)
        if budget[1] < 0:
            raise CodecError(f"more than {_MAX_ENTRIES} set elements and dict keys")
    if tag in ("list", "tuple", "set", "frozenset") and type(v) is list:
        items = [decode(e, depth + 1, budget) for e in v]
        return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
    if tag == "dict" and type(v) is list and all(type(p) is list and len(p) == 2 for p in v):
        return {decode(k, depth + 1, budget): decode(e, depth + 1, budget) for k, e in v}
    raise CodecError(f"malformed value tagged {tag!r}")


def strict_key(x):
    """A key equal for two plain values exactly when they are equal with equal types all the way
    down (set elements and dict keys included); NaN equals NaN. Orderable, so sets and dicts
    compare as sorted keys, without hashing."""
    t = type(x)
    if t in (list, tuple):
        return (t.__name__, tuple(strict_key(v) for v in x))
    if t in (set, frozenset):
        return (t.__name__, tuple(sorted(strict_key(v) for v in x)))
    if t is dict:
        return ("dict", tuple(sorted((strict_key(k), strict_key(v)) for k, v in x.items())))
    if t is float:
        return ("float", "nan" if math.isnan(x) else repr(x + 0.0))  # -0.0 + 0.0 is 0.0: 0.0 == -0.0
    if x is None:
        return ("NoneType", 0)
    return (t.__name__, x)  # bool, int, str, bytes: one type per tag, so values compare among themselves


def strict_equal(a, b) -> bool:
    """Equality that also requires equal types all the way down (True != 1, 1 != 1.0, [] != (),
    {True} != {1}, {1.0: 'a'} != {1: 'a'})."""
    try:
        return strict_key(a) == strict_key(b)
    except (TypeError, RecursionError):  # not a plain value
        return False


# ----------------------------------------------------------------------------- sandbox side


def _channel():
    """The protocol's (reader, writer); fds 0/1/2 then point at /dev/null for the code we run."""
    proto_in, proto_out = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    return proto_in, proto_out


def _send(out, msg: dict) -> None:
    out.write(json.dumps(msg) + "\n")
    out.flush()


def _player(path: str) -> None:
    proto_in, proto_out = _channel()
    namespace = {"__name__": "__solution__", "__builtins__": __builtins__}
    load_error = None
    try:
        with open(path) as f:
            exec(compile(f.read(), "solution.py", "exec"), namespace)
    except BaseException as e:  # SystemExit included: a solution that exits has no functions
        load_error = f"loading the solution: {type(e).__name__}: {e}"
    for line in proto_in:
        req = json.loads(line)
        try:
            if load_error:
                raise RuntimeError(load_error)
            if req["fn"] is None:  # a ping: did the solution load?
                _send(proto_out, {"ok": None})
                continue
            fn = namespace.get(req["fn"])
            if not callable(fn):
                raise NameError(f"the solution defines no function {req['fn']!r}")
            _send(proto_out, {"ok": encode(fn(*decode(req["args"])))})
        except BaseException as e:
            _send(proto_out, {"error": f"{type(e).__name__}: {e}"[:300]})


class _Proxy:
    """Stands for one of the solution's functions inside the judge."""

    def __init__(self, name: str, proto):
        self.name, self.proto = name, proto

    def __call__(self, *args):
        proto_in, proto_out = self.proto
        _send(proto_out, {"call": self.name, "args": encode(args)})
        reply = json.loads(proto_in.readline() or '{"error": "no reply"}')
        if "ok" not in reply:
            raise RuntimeError(f"{self.name} raised: {reply.get('error')}")
        return decode(reply["ok"])


def _judge(path: str) -> None:
    proto = _channel()
    with open(path) as f:
        spec = json.load(f)  # {"setup": code, "tests": [code], "proxies": [[names] per test]}
    for i, test in enumerate(spec["tests"]):
        ns = {"__name__": "__judge__"}
        passed = False
        try:
            exec(spec.get("setup", ""), ns)
            ns.update({name: _Proxy(name, proto) for name in spec["proxies"][i]})  # shadow builtins too
            ns["candidate"] = ns.get(spec.get("entry_point") or "", ns.get("candidate"))
            exec(test, ns)
            if spec.get("entry_point"):
                ns["check"](ns["candidate"])
            passed = True
        except BaseException:
            pass
        _send(proto[1], {"test": i, "passed": passed})


if __name__ == "__main__":
    {"player": _player, "judge": _judge}[sys.argv[1]](sys.argv[2])
