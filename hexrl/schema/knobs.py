"""Runtime knobs the cost model assumes: the planner writes them into plan.json, the runtime reads them.

    plan["trainer"]: activation_checkpointing, micro_batch_tokens, dtype, grad_reduce_dtype
    plan["rollout"]["replicas"][i]: max_running, max_batch_tokens, kv_pages, page_size, dtype

A job may override any of them under `runtime: {"trainer": {...}, "rollout": {...}}` (the
rollout overrides apply to every replica); the planner costs the plan with the overrides and
writes the result, so plan.json always holds the values the run will use.
"""

from dataclasses import asdict, dataclass, fields

from hexrl.schema.fields import Reader

DTYPES = ("bfloat16", "float32")
# The trainer accumulates gradients in float32 buckets and all-reduces those buckets as they are.
GRAD_REDUCE_DTYPES = ("float32",)


@dataclass
class TrainKnobs:
    activation_checkpointing: bool = False  # recompute each layer's activations in the backward pass
    micro_batch_tokens: int = 4096  # tokens per micro-batch (at least one whole sequence)
    dtype: str = "bfloat16"  # compute dtype of weights and activations
    grad_reduce_dtype: str = "float32"  # dtype of the DP gradient all-reduce

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RolloutKnobs:
    max_running: int = 256  # sequences decoding at once
    max_batch_tokens: int = 8192  # tokens per forward pass (prefill chunks + decodes), >= max_running
    kv_pages: int | None = None  # KV pages per rank; None: the engine sizes the pool from free memory
    page_size: int = 16  # tokens per KV page
    dtype: str = "bfloat16"  # weights and KV cache

    def to_dict(self) -> dict:
        return asdict(self)


TRAIN_KEYS = frozenset(f.name for f in fields(TrainKnobs))
ROLLOUT_KEYS = frozenset(f.name for f in fields(RolloutKnobs))


def read_train_knobs(r: Reader, d: dict, where: str, base: TrainKnobs) -> TrainKnobs:
    """`base` with the knobs `d` gives (only TRAIN_KEYS of d are read; the caller checks unknown keys)."""
    return TrainKnobs(
        activation_checkpointing=r.boolean(d, "activation_checkpointing", where, base.activation_checkpointing),
        micro_batch_tokens=r.num(d, "micro_batch_tokens", where, base.micro_batch_tokens, integer=True, lo=1,
                                 hi=1 << 24),
        dtype=r.choice(d, "dtype", where, DTYPES, base.dtype),
        grad_reduce_dtype=r.choice(d, "grad_reduce_dtype", where, GRAD_REDUCE_DTYPES, base.grad_reduce_dtype))


def read_rollout_knobs(r: Reader, d: dict, where: str, base: RolloutKnobs, whole: bool = True) -> RolloutKnobs:
    """`base` with the knobs `d` gives; in a whole replica max_batch_tokens must cover max_running."""
    k = RolloutKnobs(
        max_running=r.num(d, "max_running", where, base.max_running, integer=True, lo=1),
        max_batch_tokens=r.num(d, "max_batch_tokens", where, base.max_batch_tokens, integer=True, lo=1, hi=1 << 24),
        kv_pages=r.num(d, "kv_pages", where, base.kv_pages, integer=True, lo=1, hi=1 << 26, none_ok=True),
        page_size=r.num(d, "page_size", where, base.page_size, integer=True, lo=1, hi=1 << 16),
        dtype=r.choice(d, "dtype", where, DTYPES, base.dtype))
    if whole and k.max_batch_tokens < k.max_running:  # else some running sequences would skip decode steps
        r.bad(f"{where}.max_batch_tokens", f"{k.max_batch_tokens} < max_running {k.max_running}")
    return k


def read_overrides(r: Reader, d) -> dict:
    """The job's `runtime` section: {"trainer": {...}, "rollout": {...}}, each knob checked."""
    d = r.section(d, "runtime", {"trainer", "rollout"})
    out = {}
    for part, keys in (("trainer", TRAIN_KEYS), ("rollout", ROLLOUT_KEYS)):
        given = r.section(d.get(part), f"runtime.{part}", set(keys))
        if given:
            w = f"runtime.{part}"
            knobs = read_train_knobs(r, given, w, TrainKnobs()) if part == "trainer" else \
                read_rollout_knobs(r, given, w, RolloutKnobs(), whole=False)
            full = knobs.to_dict()
            out[part] = {k: full[k] for k in given if k in keys}
    return out
