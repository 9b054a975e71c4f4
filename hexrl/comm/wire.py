"""The wire format between the controller and the rollout replicas: msgpack messages, validated.

A message is a dict with `"v": SCHEMA_VERSION`, `"type"` and the fields that `SCHEMAS[type]`
names. Arrays (numpy or torch) travel as a tagged map of raw bytes; pickle is never used. torch is
imported only by a process that uses it (the controller's own process never does).
`decode` validates every received message and raises `MessageError` with a short reason tag,
which a channel (hexrl.comm.channel) counts and skips, so a receive loop never sees an
exception from foreign or corrupted input.
"""
from __future__ import annotations

import math
import sys

import msgpack
import numpy as np

from hexrl.trajectory import ID_DTYPE, LOGPROB_DTYPE, MASK_DTYPE, VERSION_DTYPE, Trajectory

SCHEMA_VERSION = 2  # 2: a trajectory's token fields are typed arrays
MAX_MESSAGE_BYTES = 64 << 20  # a 32k-token trajectory is well under 1 MiB


# Field specs: "int", "float", "str", "bool", "dict", "list", "list[int]", "list[float]", "None", or
# "<dtype>[]" (a 1-D numpy array of exactly that dtype, e.g. "int32[]"), joined by "|"; a leading "?"
# marks an optional field. list[...] also accepts a 1-D array.
_IDS, _LOGPROBS, _VERSIONS, _MASK = (f"{d.name}[]" for d in (ID_DTYPE, LOGPROB_DTYPE, VERSION_DTYPE, MASK_DTYPE))
SCHEMAS: dict[str, dict[str, str]] = {
    "prompt": {"group_id": "int", "problem_id": "int|str", "prompt_ids": "list[int]", "n": "int",
               "sampling": "dict", "version": "int",
               # what the rollout side's reward needs: rewards run next to generation
               "answer": "?str", "tests": "?list",
               # a group moved from another replica: a `withdrawn` message's fields but v, type, group_id
               "resume": "?dict"},
    # the token fields as packed arrays: checked per field by dtype and length, not per element
    "trajectory": {"group_id": "int", "prompt_ids": _IDS, "completion_ids": _IDS, "logprobs": _LOGPROBS,
                   "versions": _VERSIONS, "start_version": "int", "reward": "float",
                   "finish_reason": "str", "problem_id": "?int|str|None", "meta": "?dict",
                   "rank": "?int", "mask": f"?{_MASK}|None"},
    "heartbeat": {"rank": "int", "time": "float"},
    "stats": {"rank": "int", "time": "float", "values": "dict"},
    "weights": {"version": "int", "report": "?bool"},  # trainer published `version`: join the weight broadcast
    # moving a group that outgrew its prediction (docs/long-tail.md): at a weight update asked to
    # `report`, a replica sends its running groups' progress, one row per sample (tokens so far,
    # finished or not); the controller may `withdraw` some, and the replica hands each back as it
    # stands: per sample its tokens so far (concatenated), "" for a sample still running
    "progress": {"rank": "int", "version": "int", "group_ids": "list[int]", "generated": "list[int]",
                 "finished": "list[int]"},
    "withdraw": {"group_ids": "list[int]"},
    "withdrawn": {"group_id": "int", "start_version": "int", "completion_ids": _IDS, "logprobs": _LOGPROBS,
                  "versions": _VERSIONS, "lengths": "list[int]", "finish_reasons": "list", "rank": "?int"},
    "stop": {"reason": "str"},
    "error": {"rank": "int", "cause": "str"},
    # between the trainer and the controller's own process (hexrl/control/controller_process.py)
    "call": {"method": "str", "args": "dict"},
    "reply": {"method": "str", "value": "?dict|list|int|float|str|bool|None", "error": "?str", "detail": "?str"},
    "group": {"group_id": "int", "n": "int", "problem_id": "?int|str|None", "seq": "int", "prompt_ids": _IDS,
              "trajectories": "list"},  # each a trajectory message's fields but v, type and prompt_ids
}
# what a moved group's `prompt` carries as its "resume": the `withdrawn` message's fields but its ids
RESUME_FIELDS = ("start_version", "completion_ids", "logprobs", "versions", "lengths", "finish_reasons")

# dtype name -> numpy dtype of the raw bytes (bfloat16 travels as its uint16 bit pattern)
_ARRAY_DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2"),
                 "int64": np.dtype("<i8"), "int32": np.dtype("<i4"), "uint8": np.dtype("u1"), "bool": np.dtype("?")}


class MessageError(ValueError):
    """A message that cannot be sent or was rejected on receipt; `reason` is a short tag."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# ---------------------------------------------------------------- arrays


def _encode_array(obj) -> dict:
    """numpy array or torch tensor -> tagged map of raw bytes (a view, not a copy, when contiguous)."""
    if _is_tensor(obj):
        import torch

        t = obj.detach().cpu().contiguous()
        name = str(t.dtype).removeprefix("torch.")
        if name not in _ARRAY_DTYPES:
            raise MessageError("bad_array", f"tensor dtype {name} not allowed; use one of {sorted(_ARRAY_DTYPES)}")
        arr = (t.view(torch.uint16) if name == "bfloat16" else t).numpy()
        kind = "torch"
    else:
        arr = np.ascontiguousarray(obj)
        name = arr.dtype.name
        if name not in _ARRAY_DTYPES:
            raise MessageError("bad_array", f"array dtype {name} not allowed; use one of {sorted(_ARRAY_DTYPES)}")
        kind = "numpy"
    arr = arr.astype(_ARRAY_DTYPES[name], copy=False)  # a no-op on little-endian hosts
    return {"__nd__": True, "dtype": name, "shape": list(arr.shape), "kind": kind,
            "data": memoryview(arr.reshape(-1)).cast("B")}


def _decode_array(d: dict):
    """Tagged map -> numpy array (read-only view of the message bytes) or torch tensor."""
    name, shape, data = d.get("dtype"), d.get("shape"), d.get("data")
    if name not in _ARRAY_DTYPES:
        raise MessageError("bad_array", f"dtype {name!r} not allowed")
    if not (isinstance(shape, list) and len(shape) <= 32 and all(type(s) is int and s >= 0 for s in shape)):
        raise MessageError("bad_array", f"shape {shape!r} is not a list of at most 32 non-negative ints")
    if not isinstance(data, bytes):
        raise MessageError("bad_array", "data is not bytes")
    raw = _ARRAY_DTYPES[name]
    if math.prod(shape) * raw.itemsize != len(data):
        raise MessageError("bad_array", f"{len(data)} bytes do not hold shape {shape} of {name}")
    arr = np.frombuffer(data, dtype=raw).reshape(shape)
    if d.get("kind") != "torch" and name != "bfloat16":
        return arr
    import torch  # a tensor was sent: the receiver wants torch (a torch-free process pays the import once)

    t = torch.from_numpy(arr.copy())  # torch wants a writable buffer
    return t.view(torch.bfloat16) if name == "bfloat16" else t


def _default(obj):
    """msgpack hook for what it cannot pack natively."""
    if _is_array(obj):
        return _encode_array(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__} "
                    "(msgpack only: dict, list, str, int, float, bool, None, bytes, arrays)")


def _object_hook(d: dict):
    return _decode_array(d) if d.get("__nd__") is True else d


# ---------------------------------------------------------------- schema


def _is_tensor(v) -> bool:
    """A torch tensor? Asked of sys.modules: a process that never imported torch holds none."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(v, torch.Tensor)


def _is_array(v) -> bool:
    return isinstance(v, np.ndarray) or _is_tensor(v)


def _array_elem(v) -> str:
    """"int", "float" or "other": what a 1-D array may stand in for (bool is neither)."""
    if _is_tensor(v):
        import torch  # already imported: v is a tensor

        return "other" if v.dtype == torch.bool else "float" if v.is_floating_point() else "int"
    return {"f": "float", "i": "int", "u": "int"}.get(v.dtype.kind, "other")


_ELEM_TYPES = {"int": {int}, "float": {int, float}}  # exact types: a bool is not a number here
_TYPED_ARRAYS = {f"{name}[]": raw for name, raw in _ARRAY_DTYPES.items() if name != "bfloat16"}


def _check_one(value, kind: str) -> bool:
    """Does `value` match one alternative of a field spec (bool never counts as a number)?"""
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "None":
        return value is None
    if kind in _TYPED_ARRAYS:  # a packed array: its dtype and shape say everything about its elements
        return isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype == _TYPED_ARRAYS[kind]
    if kind in ("list[int]", "list[float]"):
        elem = kind[5:-1]
        if _is_array(value):
            return value.ndim == 1 and _array_elem(value) == elem
        return isinstance(value, list) and set(map(type, value)) <= _ELEM_TYPES[elem]  # C-speed scan
    return isinstance(value, {"str": str, "bool": bool, "dict": dict, "list": list}[kind])


def _matches(value, kinds: tuple[str, ...]) -> bool:
    for kind in kinds:  # a loop, not any(<generator>): every received message runs this per field
        if _check_one(value, kind):
            return True
    return False


def _parse(spec: str) -> tuple[bool, str, tuple[str, ...]]:
    """(optional, the spec without its "?", its alternatives) of a field spec."""
    body = spec.lstrip("?")
    return spec.startswith("?"), body, tuple(body.split("|"))


# the schemas parsed once: validate runs on every message received
_PARSED = {kind: [(field, *_parse(spec)) for field, spec in schema.items()] for kind, schema in SCHEMAS.items()}


def _describe(value) -> str:
    """What a field holds, for a problem message: its type, or an array's shape and dtype."""
    if isinstance(value, np.ndarray):
        return f"{value.ndim}-D {value.dtype.name} array"
    return type(value).__name__


def _semantic_problems(msg: dict) -> list[str]:
    """Checks across fields (only run once every field has the right type)."""
    kind = msg["type"]
    if kind == "prompt" and msg["n"] < 1:
        return [f"n must be >= 1, got {msg['n']}"]
    if kind == "progress":
        lens = {f: len(msg[f]) for f in ("group_ids", "generated", "finished")}
        if len(set(lens.values())) != 1:
            return [f"group_ids, generated and finished differ in length: {lens}"]
        return []
    if kind == "withdrawn":
        return _handback_problems(msg)
    if kind == "trajectory":  # the token fields are 1-D arrays here: no per-element work but the mask's
        mask = msg.get("mask")
        if mask is None:
            lens = {f: len(msg[f]) for f in ("completion_ids", "logprobs", "versions")}
            if len(set(lens.values())) != 1:
                return [f"completion_ids, logprobs and versions differ in length: {lens}"]
            return []
        if len(mask) != len(msg["completion_ids"]):
            return [f"mask has {len(mask)} values for {len(msg['completion_ids'])} completion tokens"]
        if len(mask) and mask.max() > 1:
            return ["mask values must be 0 (environment) or 1 (model)"]
        lens = {"mask == 1": int(np.count_nonzero(mask)), **{f: len(msg[f]) for f in ("logprobs", "versions")}}
        if len(set(lens.values())) != 1:
            return [f"generated tokens, logprobs and versions differ in length: {lens}"]
    return []


def _handback_problems(msg: dict) -> list[str]:
    """A `withdrawn` group: one length and finish reason per sample, the lengths adding up to the tokens."""
    lengths, reasons = msg["lengths"], msg["finish_reasons"]
    p = []
    if len(lengths) != len(reasons):
        p.append(f"{len(lengths)} lengths for {len(reasons)} finish_reasons: one of each per sample")
    if any(not isinstance(r, str) for r in reasons):
        p.append("finish_reasons must be strings (\"\" for a sample still running)")
    if any(n < 0 for n in lengths) or sum(lengths) != len(msg["completion_ids"]):
        p.append(f"lengths must be >= 0 and add up to the {len(msg['completion_ids'])} completion_ids")
    if not len(msg["completion_ids"]) == len(msg["logprobs"]) == len(msg["versions"]):
        p.append("completion_ids, logprobs and versions differ in length")
    return p


def validate(msg) -> None:
    """Raise MessageError naming every problem of `msg` against its schema."""
    if not isinstance(msg, dict):
        raise MessageError("not_a_map", f"message is a {type(msg).__name__}, not a map")
    v, kind = msg.get("v"), msg.get("type")
    if type(v) is not int or v != SCHEMA_VERSION:
        raise MessageError("bad_version", f"schema version {v!r}, expected {SCHEMA_VERSION}")
    fields = _PARSED.get(kind) if isinstance(kind, str) else None
    if fields is None:
        raise MessageError("unknown_type", f"type {kind!r}; known: {sorted(SCHEMAS)}")
    problems = []
    for field, optional, spec, kinds in fields:
        if field not in msg:
            if not optional:
                problems.append(f"missing field {field!r}")
        elif not _matches(msg[field], kinds):
            problems.append(f"field {field!r} should be {spec}, got {_describe(msg[field])}")
    problems = problems or _semantic_problems(msg)
    if problems:
        raise MessageError("bad_fields", f"{msg['type']}: " + "; ".join(problems))


def message(type: str, **fields) -> dict:
    """A message of `type` with the schema version set, e.g. message("stop", reason="done")."""
    return {"v": SCHEMA_VERSION, "type": type, **fields}


def encode(msg: dict, max_bytes: int = MAX_MESSAGE_BYTES) -> bytes:
    """Validate and pack; raises MessageError (sending a bad message is the sender's bug)."""
    validate(msg)
    try:
        data = msgpack.packb(msg, default=_default, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise MessageError("unencodable", str(e)) from None
    if len(data) > max_bytes:
        raise MessageError("oversize", f"{len(data)} bytes > limit {max_bytes}")
    return data


def decode(data, max_bytes: int = MAX_MESSAGE_BYTES) -> dict:
    """Unpack and validate bytes from the wire; raises MessageError with a reason tag."""
    size = memoryview(data).nbytes
    if size > max_bytes:
        raise MessageError("oversize", f"{size} bytes > limit {max_bytes}")
    try:
        msg = msgpack.unpackb(data, raw=False, object_hook=_object_hook, strict_map_key=True)
    except MessageError:
        raise
    except Exception as e:  # msgpack raises many types on garbage (ExtraData, ValueError, StackError, ...)
        raise MessageError("not_msgpack", f"{type(e).__name__}: {e}"[:200]) from None
    validate(msg)
    return msg


# ---------------------------------------------------------------- trajectories


def trajectory_to_msg(traj: Trajectory, rank: int | None = None) -> dict:
    """A `trajectory` message holding every field of `traj`, its token fields as typed arrays (rank:
    the sending replica, optional); MessageError if a token value does not fit its array's dtype."""
    try:
        traj = traj.as_arrays()
    except ValueError as e:
        raise MessageError("bad_fields", f"trajectory: {e}") from None
    msg = message("trajectory", group_id=traj.group_id, prompt_ids=traj.prompt_ids,
                  completion_ids=traj.completion_ids, logprobs=traj.logprobs, versions=traj.versions,
                  start_version=traj.start_version, reward=traj.reward, finish_reason=traj.finish_reason,
                  problem_id=traj.problem_id, meta=traj.meta, mask=traj.mask)
    if rank is not None:
        msg["rank"] = rank
    return msg


def msg_to_trajectory(msg: dict) -> Trajectory:
    """The Trajectory of a validated `trajectory` message; its token fields stay the message's arrays
    (read-only views of the received bytes: nothing is converted or copied per token)."""
    if msg.get("type") != "trajectory":
        raise MessageError("bad_fields", f"expected a trajectory message, got type {msg.get('type')!r}")
    return Trajectory(group_id=msg["group_id"], prompt_ids=msg["prompt_ids"], completion_ids=msg["completion_ids"],
                      logprobs=msg["logprobs"], versions=msg["versions"], start_version=msg["start_version"],
                      reward=float(msg["reward"]), finish_reason=msg["finish_reason"],
                      problem_id=msg.get("problem_id"), meta=dict(msg.get("meta") or {}), mask=msg.get("mask"))
