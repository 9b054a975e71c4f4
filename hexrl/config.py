"""Job and plan schema: dataclasses, loading, validation that reports every problem at once.

A job (job.json) names the model, data, reward, RL settings, the workload the planner
should assume, the cluster, prices and budget, and optionally a fixed layout. A plan
(plan.json) is the job plus a role for every global rank, the trainer's layout, the
rollout replicas and the planner's predictions. See docs/job_schema.md.
"""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from hexrl.data import load_dataset
from hexrl.plan.catalogue import CATALOGUE, canonical_name


class ConfigError(ValueError):
    """An invalid job or plan; `problems` lists every problem, each naming its field."""

    def __init__(self, problems: list[str], header: str = "invalid job"):
        self.problems = list(problems)
        lines = [f"{header}: {len(self.problems)} problem(s)"] + [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


# ----------------------------------------------------------------------------- reading

class _Reader:
    """Reads typed fields from nested dicts, collecting problems instead of raising."""

    def __init__(self):
        self.problems: list[str] = []

    def bad(self, where: str, msg: str):
        self.problems.append(f"{where}: {msg}")

    def section(self, d, where: str, known: set[str], required: bool = False) -> dict:
        if d is None:
            if required:
                self.bad(where, "missing (required section)")
            return {}
        if not isinstance(d, dict):
            self.bad(where, f"must be an object, got {type(d).__name__}")
            return {}
        for k in d:
            if k not in known:
                self.bad(f"{where}.{k}", f"unknown field (known: {', '.join(sorted(known))})")
        return d

    def num(self, d: dict, key: str, where: str, default=None, *, integer=False, lo=None,
            hi=None, lo_open=False, none_ok=False, required=False):
        name = f"{where}.{key}"
        if key not in d:
            if required:
                self.bad(name, "missing (required)")
            return default
        v = d[key]
        if v is None and none_ok:
            return None
        ok_int = isinstance(v, int) and not isinstance(v, bool)
        ok = ok_int if integer else (ok_int or isinstance(v, float))
        if isinstance(v, float) and integer and v.is_integer():
            v, ok = int(v), True
        if not ok or (isinstance(v, float) and not math.isfinite(v)):
            self.bad(name, f"must be {'an integer' if integer else 'a number'}, got {v!r}")
            return default
        if lo is not None and (v <= lo if lo_open else v < lo):
            self.bad(name, f"must be {'>' if lo_open else '>='} {lo}, got {v}")
            return default
        if hi is not None and v > hi:
            self.bad(name, f"must be <= {hi}, got {v}")
            return default
        return v

    def boolean(self, d: dict, key: str, where: str, default: bool) -> bool:
        v = d.get(key, default)
        if not isinstance(v, bool):
            self.bad(f"{where}.{key}", f"must be true or false, got {v!r}")
            return default
        return v

    def choice(self, d: dict, key: str, where: str, options, default=None, required=False):
        if key not in d:
            if required:
                self.bad(f"{where}.{key}", f"missing (one of: {', '.join(options)})")
            return default
        v = d[key]
        if v not in options:
            self.bad(f"{where}.{key}", f"must be one of {', '.join(options)}, got {v!r}")
            return default
        return v

    def text(self, d: dict, key: str, where: str, default=None, required=False):
        if key not in d:
            if required:
                self.bad(f"{where}.{key}", "missing (required)")
            return default
        v = d[key]
        if not isinstance(v, str) or not v:
            self.bad(f"{where}.{key}", f"must be a non-empty string, got {v!r}")
            return default
        return v


# ----------------------------------------------------------------------------- model

def _qwen2(h, inter, layers, heads, kv, vocab, tie, rope=10000.0, eps=1e-6, max_pos=131072):
    return {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu",
        "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
        "tie_word_embeddings": tie, "rope_theta": rope, "rms_norm_eps": eps,
        "max_position_embeddings": max_pos, "torch_dtype": "bfloat16",
    }


PRESETS = {
    "qwen2.5-1.5b": _qwen2(1536, 8960, 28, 12, 2, 151936, True, rope=1e6, max_pos=32768),
    "r1-distill-qwen-1.5b": _qwen2(1536, 8960, 28, 12, 2, 151936, False),
    "r1-distill-qwen-7b": _qwen2(3584, 18944, 28, 28, 4, 152064, False),
    "r1-distill-qwen-14b": _qwen2(5120, 13824, 48, 40, 8, 152064, False, eps=1e-5),
    # the CPU demo's shape (tools/make_tiny_model.py): a character vocabulary
    "tiny": {**_qwen2(64, 128, 4, 4, 2, 64, True, max_pos=4096), "bos_token_id": 1, "eos_token_id": 2},
}

_MODEL_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "vocab_size")


@dataclass
class ModelSpec:
    """Model shape (from a checkpoint's config.json, an inline config, or a preset)."""

    config: dict  # the Hugging Face config fields, complete enough to build the model
    path: str | None = None
    preset: str | None = None

    @property
    def hidden_size(self) -> int:
        return self.config["hidden_size"]

    @property
    def intermediate_size(self) -> int:
        return self.config["intermediate_size"]

    @property
    def num_layers(self) -> int:
        return self.config["num_hidden_layers"]

    @property
    def num_heads(self) -> int:
        return self.config["num_attention_heads"]

    @property
    def num_kv_heads(self) -> int:
        return self.config.get("num_key_value_heads") or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.config.get("head_dim") or self.hidden_size // self.num_heads

    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]

    @property
    def tied(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))

    def layer_params(self) -> int:
        """Parameters of one decoder layer: attention, SwiGLU MLP, 2 norms; biases as the family
        has them (Qwen2: q/k/v; Llama: `attention_bias` on q/k/v/o, `mlp_bias`)."""
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * d, self.num_kv_heads * d
        n = 2 * h * q + 2 * h * kv + 3 * h * i + 2 * h
        if self.config.get("model_type", "qwen2") == "qwen2":
            return n + q + 2 * kv
        if self.config.get("attention_bias", False):
            n += q + 2 * kv + h
        if self.config.get("mlp_bias", False):
            n += 2 * i + h
        return n

    def embed_params(self) -> int:
        """Input embedding plus (if untied) the output head, plus the final norm."""
        return self.vocab_size * self.hidden_size * (1 if self.tied else 2) + self.hidden_size

    def n_params(self) -> int:
        return self.num_layers * self.layer_params() + self.embed_params()

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V cache bytes for one token over all layers (whole model, not per TP rank)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def to_dict(self) -> dict:
        if self.path:
            return {"path": self.path}
        if self.preset:
            return {"preset": self.preset}
        return {"config": self.config}


def _read_model(r: _Reader, d, base: Path) -> ModelSpec | None:
    d = r.section(d, "model", {"path", "config", "preset"}, required=True)
    given = [k for k in ("path", "config", "preset") if k in d]
    if len(given) != 1:
        if d:
            r.bad("model", f"give exactly one of path, config, preset (got {given or 'none'})")
        return None
    if "preset" in d:
        name = str(d["preset"]).lower()
        if name not in PRESETS:
            r.bad("model.preset", f"unknown preset {d['preset']!r} (known: {', '.join(PRESETS)})")
            return None
        return ModelSpec(dict(PRESETS[name]), preset=name)
    if "path" in d:
        p = _resolve(base, d["path"])
        cfg_file = p / "config.json"
        if not cfg_file.is_file():
            r.bad("model.path", f"no config.json in {p}")
            return None
        try:
            cfg = json.loads(cfg_file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            r.bad("model.path", f"cannot read {cfg_file}: {e}")
            return None
        where, path = f"model.path ({cfg_file})", str(p)
    else:
        cfg, where, path = d["config"], "model.config", None
        if not isinstance(cfg, dict):
            r.bad("model.config", "must be an object of Hugging Face config fields")
            return None
    return _check_model_config(r, dict(cfg), where, path)


def _check_model_config(r: _Reader, cfg: dict, where: str, path) -> ModelSpec | None:
    n0 = len(r.problems)
    for k in _MODEL_REQUIRED:
        r.num(cfg, k, where, integer=True, lo=1, required=True)
    r.num(cfg, "num_key_value_heads", where, integer=True, lo=1)
    r.num(cfg, "head_dim", where, integer=True, lo=1)
    if len(r.problems) > n0:
        return None
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if heads % kv:
        r.bad(f"{where}.num_key_value_heads", f"{kv} does not divide num_attention_heads {heads}")
    if "head_dim" not in cfg and cfg["hidden_size"] % heads:
        r.bad(f"{where}.hidden_size", f"{cfg['hidden_size']} not divisible by num_attention_heads {heads}")
    if len(r.problems) > n0:
        return None
    return ModelSpec(cfg, path=path)


def _resolve(base: Path, p) -> Path:
    p = Path(str(p)).expanduser()
    return p if p.is_absolute() else (base / p).resolve()


# ----------------------------------------------------------------------------- data, reward, rl

@dataclass
class DataSpec:
    path: str | None = None  # JSONL, one prompt record per line
    kind: str = "math"  # math | code (ignored for synthetic data)
    synthetic: dict | None = None  # {"task": "arithmetic", "n": ..., "seed": ..., task options}

    def to_dict(self) -> dict:
        if self.synthetic is not None:
            return {"synthetic": dict(self.synthetic)}
        return {"path": self.path, "kind": self.kind}


def _read_data(r: _Reader, d, base: Path, check_paths: bool) -> DataSpec:
    d = r.section(d, "data", {"path", "kind", "synthetic"}, required=True)
    if "synthetic" in d and "path" in d:
        r.bad("data", "give either path or synthetic, not both")
    if "synthetic" in d:
        s = d["synthetic"]
        if not isinstance(s, dict):
            r.bad("data.synthetic", "must be an object like {\"task\": \"arithmetic\", \"n\": 1000}")
            return DataSpec(synthetic={"task": "arithmetic", "n": 1000, "seed": 0})
        task = r.choice(s, "task", "data.synthetic", ("arithmetic",), "arithmetic")
        n = r.num(s, "n", "data.synthetic", 1000, integer=True, lo=1)
        seed = r.num(s, "seed", "data.synthetic", 0, integer=True)
        r.num(s, "n_heldout", "data.synthetic", 0, integer=True, lo=0)
        spec = {**s, "task": task, "n": n, "seed": seed}
        try:  # generating is cheap and catches impossible requests before any process starts
            load_dataset(synthetic=spec)
        except (TypeError, ValueError) as e:
            r.bad("data.synthetic", str(e))
        return DataSpec(synthetic=spec)
    if "path" not in d:
        if d:
            r.bad("data", "give path (JSONL) or synthetic")
        return DataSpec(synthetic={"task": "arithmetic", "n": 1000, "seed": 0})
    kind = r.choice(d, "kind", "data", ("math", "code"), "math")
    p = _resolve(base, d["path"])
    if check_paths and not p.is_file():
        r.bad("data.path", f"file not found: {p}")
    return DataSpec(path=str(p), kind=kind)


@dataclass
class RewardSpec:
    name: str = "math"  # math | exact | code
    timeout_s: float = 5.0

    def to_dict(self) -> dict:
        return {"name": self.name, "timeout_s": self.timeout_s}


def _read_reward(r: _Reader, d, data: DataSpec) -> RewardSpec:
    d = r.section(d, "reward", {"name", "timeout_s"})
    default = "exact" if data.synthetic is not None else data.kind
    name = r.choice(d, "name", "reward", ("math", "exact", "code"), default)
    timeout = r.num(d, "timeout_s", "reward", 5.0, lo=0, lo_open=True)
    return RewardSpec(name, float(timeout))


@dataclass
class RLSpec:
    batch_size: int = 8  # prompts (groups) per training step
    group_size: int = 4  # samples per prompt
    eta: int | None = 4  # staleness bound; None = unbounded; 0 = synchronous
    max_running: int | None = None  # groups generating at once; _read_rl fills (eta+1)·B, or 8·B if eta is None
    # Optimizer steps per training step. The decoupled objective's clip is relative to the proximal
    # policy, so with 1 it never engages (see README "Learning"); default min(4, batch_size).
    ppo_minibatches: int = 4
    lr: float = 1e-6
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    clip_low: float = 0.2
    clip_high: float = 0.2
    decoupled: bool = True
    behav_cap: float = 5.0
    kl_coef: float = 0.0
    filter_equal_groups: bool = True
    steps: int = 10
    seed: int = 0
    checkpoint_every: int = 0  # 0 = only at the end
    eval_every: int = 0  # greedy held-out accuracy every K steps (and at 0 and the end); 0 = off

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _read_rl(r: _Reader, d) -> RLSpec:
    known = set(RLSpec.__dataclass_fields__)
    d = r.section(d, "rl", known)
    x, w = RLSpec(), "rl"
    x.batch_size = r.num(d, "batch_size", w, x.batch_size, integer=True, lo=1)
    x.group_size = r.num(d, "group_size", w, x.group_size, integer=True, lo=1)
    x.eta = r.num(d, "eta", w, x.eta, integer=True, lo=0, none_ok=True)
    default_running = (x.eta + 1 if x.eta is not None else 8) * x.batch_size  # eta bounded: never binds
    x.max_running = r.num(d, "max_running", w, default_running, integer=True, lo=1)
    x.ppo_minibatches = r.num(d, "ppo_minibatches", w, min(x.ppo_minibatches, x.batch_size), integer=True, lo=1)
    x.lr = float(r.num(d, "lr", w, x.lr, lo=0, lo_open=True))
    x.max_new_tokens = r.num(d, "max_new_tokens", w, x.max_new_tokens, integer=True, lo=1)
    x.temperature = float(r.num(d, "temperature", w, x.temperature, lo=0))
    x.top_p = float(r.num(d, "top_p", w, x.top_p, lo=0, lo_open=True, hi=1))
    top_k = r.num(d, "top_k", w, 0, integer=True, lo=-1)
    x.top_k = max(top_k, 0)  # -1 (vLLM spelling) also means off
    x.clip_low = float(r.num(d, "clip_low", w, x.clip_low, lo=0, hi=1))
    x.clip_high = float(r.num(d, "clip_high", w, x.clip_high, lo=0))
    x.decoupled = r.boolean(d, "decoupled", w, True)
    x.behav_cap = float(r.num(d, "behav_cap", w, x.behav_cap, lo=1))
    x.kl_coef = float(r.num(d, "kl_coef", w, x.kl_coef, lo=0))
    x.filter_equal_groups = r.boolean(d, "filter_equal_groups", w, True)
    x.steps = r.num(d, "steps", w, x.steps, integer=True, lo=1)
    x.seed = r.num(d, "seed", w, x.seed, integer=True)
    x.checkpoint_every = r.num(d, "checkpoint_every", w, 0, integer=True, lo=0)
    x.eval_every = r.num(d, "eval_every", w, 0, integer=True, lo=0)
    if x.ppo_minibatches > x.batch_size:
        r.bad("rl.ppo_minibatches", f"{x.ppo_minibatches} > batch_size {x.batch_size}")
    if x.group_size == 1 and x.filter_equal_groups:
        r.bad("rl.group_size", "1 sample per prompt makes every group 'all equal' and "
              "filter_equal_groups would drop all data; use group_size >= 2")
    return x


# ----------------------------------------------------------------------------- workload

@dataclass
class LengthDist:
    """A discrete distribution of rollout output lengths (tokens)."""

    lengths: list[float]
    probs: list[float]

    def mean(self) -> float:
        return sum(l * p for l, p in zip(self.lengths, self.probs))

    def max(self) -> float:
        return max(l for l, p in zip(self.lengths, self.probs) if p > 0)

    def second_moment(self) -> float:
        return sum(l * l * p for l, p in zip(self.lengths, self.probs))

    def expected_max(self, n: int) -> float:
        """E[max of n independent draws]."""
        order = sorted(zip(self.lengths, self.probs))
        out, cdf = 0.0, 0.0
        for l, p in order:
            prev, cdf = cdf, min(1.0, cdf + p)
            out += l * (cdf ** n - prev ** n)
        return out

    def sample(self, rng, n: int):
        """n lengths drawn with numpy Generator `rng` (integers >= 1)."""
        import numpy as np
        idx = rng.choice(len(self.lengths), size=n, p=np.asarray(self.probs) / sum(self.probs))
        return np.maximum(1, np.rint(np.asarray(self.lengths)[idx])).astype(int)



def long_tail(mean: float, maximum: float, buckets: int = 64) -> LengthDist:
    """A truncated-exponential distribution on [1, max] with the given mean (the RL long tail)."""
    edges = [1 + (maximum - 1) * i / buckets for i in range(buckets + 1)]
    mids = [(a + b) / 2 for a, b in zip(edges, edges[1:])]
    span = max(maximum - 1.0, 1.0)

    def dist(lam):
        w = [math.exp(-lam * (m - 1) / span) for m in mids]
        s = sum(w)
        return [x / s for x in w]

    lo, hi = -60.0, 60.0  # rate in units of 1/span; negative rates skew towards max
    for _ in range(100):
        mid = (lo + hi) / 2
        m = sum(a * b for a, b in zip(mids, dist(mid)))
        lo, hi = (mid, hi) if m > mean else (lo, mid)
    return LengthDist(mids, dist((lo + hi) / 2))


@dataclass
class WorkloadSpec:
    prompt_len: int = 256
    output: LengthDist | None = None  # None: filled from rl.max_new_tokens
    output_raw: dict = field(default_factory=dict)  # as given, echoed into the plan
    reward_s_per_sample: float | None = None  # None: the reward's default

    def to_dict(self) -> dict:
        d = {"prompt_len": self.prompt_len, "output_len": self.output_raw}
        if self.reward_s_per_sample is not None:
            d["reward_s_per_sample"] = self.reward_s_per_sample
        return d


_DIST_KEYS = {"samples", "histogram", "mean", "max"}


def _read_workload(r: _Reader, d, rl: RLSpec) -> WorkloadSpec:
    d = r.section(d, "workload", {"prompt_len", "output_len", "reward_s_per_sample"} | _DIST_KEYS)
    w = WorkloadSpec()
    w.prompt_len = r.num(d, "prompt_len", "workload", 256, integer=True, lo=1)
    w.reward_s_per_sample = r.num(d, "reward_s_per_sample", "workload", None, lo=0)
    flat = {k: d[k] for k in _DIST_KEYS if k in d}
    if flat and "output_len" in d:
        r.bad("workload", "give the output length distribution once: under output_len")
    raw = d.get("output_len", flat) or {"mean": rl.max_new_tokens / 2, "max": rl.max_new_tokens}
    where = "workload.output_len" if "output_len" in d else "workload"
    w.output_raw = raw
    w.output = _read_dist(r, raw, where, rl.max_new_tokens)
    return w


def _read_dist(r: _Reader, raw, where: str, max_new: int) -> LengthDist | None:
    if not isinstance(raw, dict):
        r.bad(where, "must be {samples: [...]}, {histogram: {edges, counts}} or {mean, max}")
        return None
    kinds = [k for k in ("samples", "histogram", "mean") if k in raw]
    if len(kinds) != 1:
        r.bad(where, f"give exactly one of samples, histogram, mean+max (got {kinds or 'none'})")
        return None
    n0 = len(r.problems)
    if kinds == ["samples"]:
        s = raw["samples"]
        if not isinstance(s, list) or not s or not all(isinstance(v, (int, float)) and v >= 1 for v in s):
            r.bad(f"{where}.samples", "must be a non-empty list of lengths >= 1")
            return None
        counts: dict[float, int] = {}
        for v in s:
            counts[float(v)] = counts.get(float(v), 0) + 1
        dist = LengthDist(list(counts), [c / len(s) for c in counts.values()])
    elif kinds == ["histogram"]:
        dist = _read_histogram(r, raw["histogram"], f"{where}.histogram")
    else:
        mean = r.num(raw, "mean", where, lo=1)
        mx = r.num(raw, "max", where, max_new, lo=1)
        if mean is not None and mx is not None and mean > mx:
            r.bad(f"{where}.mean", f"{mean} > max {mx}")
        if len(r.problems) > n0:
            return None
        dist = long_tail(float(mean), float(mx))
    if dist is not None and dist.max() > max_new + 1e-9:
        r.bad(where, f"longest output {dist.max():g} > rl.max_new_tokens {max_new}")
    return dist


def _read_histogram(r: _Reader, h, where: str) -> LengthDist | None:
    if not isinstance(h, dict) or not isinstance(h.get("edges"), list) or not isinstance(h.get("counts"), list):
        r.bad(where, "must be {edges: [e0, ..., ek], counts: [c1, ..., ck]}")
        return None
    e, c = h["edges"], h["counts"]
    if len(e) != len(c) + 1 or not c:
        r.bad(where, f"needs len(edges) == len(counts) + 1, got {len(e)} and {len(c)}")
        return None
    if any(not isinstance(v, (int, float)) for v in e + c) or any(v < 0 for v in c) or sum(c) <= 0:
        r.bad(where, "edges and counts must be numbers, counts >= 0 with a positive sum")
        return None
    if any(b <= a for a, b in zip(e, e[1:])) or e[0] < 0:
        r.bad(f"{where}.edges", "must be increasing and >= 0")
        return None
    mids = [max(1.0, (a + b) / 2) for a, b in zip(e, e[1:])]
    total = float(sum(c))
    return LengthDist(mids, [v / total for v in c])


# ----------------------------------------------------------------------------- cluster

@dataclass
class NodeSpec:
    name: str
    gpu_type: str
    gpus: int
    address: str = "127.0.0.1"


@dataclass
class ClusterSpec:
    nodes: list[NodeSpec]
    inter_node_GBps: float = 12.5  # one 100 Gb/s NIC per node
    cross_type_GBps: float | dict | None = None  # None: same as inter_node
    intra_node_GBps: float | None = None  # None: the GPU's NVLink/PCIe figure

    @property
    def gpus_per_node(self) -> int:
        return self.nodes[0].gpus if self.nodes else 0

    @property
    def world_size(self) -> int:
        return sum(n.gpus for n in self.nodes)

    def types(self) -> list[str]:
        """GPU types in first-appearance order."""
        return list(dict.fromkeys(n.gpu_type for n in self.nodes))

    def count(self, gpu_type: str) -> int:
        return sum(n.gpus for n in self.nodes if n.gpu_type == gpu_type)

    def rank_of(self, node: int, local_rank: int) -> int:
        return node * self.gpus_per_node + local_rank

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def cross_GBps(self, a: str, b: str) -> float:
        """Bandwidth between two nodes of different types a and b."""
        c = self.cross_type_GBps
        if isinstance(c, dict):
            v = c.get(f"{a}/{b}", c.get(f"{b}/{a}"))
            return float(v) if v is not None else self.inter_node_GBps
        return float(c) if c is not None else self.inter_node_GBps

    def intra_GBps(self, gpu_type: str) -> float:
        if self.intra_node_GBps is not None:
            return self.intra_node_GBps
        return CATALOGUE[gpu_type].nvlink_GBps

    def link_GBps(self, node_a: int, node_b: int) -> float:
        """Bandwidth between a GPU on node_a and one on node_b (GB/s, one direction)."""
        ta, tb = self.nodes[node_a].gpu_type, self.nodes[node_b].gpu_type
        if node_a == node_b:
            return self.intra_GBps(ta)
        if ta == tb:
            return self.inter_node_GBps
        return self.cross_GBps(ta, tb)

    def to_dict(self) -> dict:
        d = {"nodes": [dict(n.__dict__) for n in self.nodes], "inter_node_GBps": self.inter_node_GBps}
        if self.cross_type_GBps is not None:
            d["cross_type_GBps"] = self.cross_type_GBps
        if self.intra_node_GBps is not None:
            d["intra_node_GBps"] = self.intra_node_GBps
        return d


def _known_types() -> str:
    return ", ".join(CATALOGUE)


def _read_cluster(r: _Reader, d) -> ClusterSpec:
    d = r.section(d, "cluster", {"nodes", "inter_node_GBps", "cross_type_GBps", "intra_node_GBps"},
                  required=True)
    nodes = []
    raw = d.get("nodes")
    if not isinstance(raw, list) or not raw:
        if d:
            r.bad("cluster.nodes", "must be a non-empty list of {name, gpu_type, gpus}")
        raw = []
    for i, n in enumerate(raw):
        node = _read_node(r, n, i)
        if node:
            nodes.append(node)
    names = [n.name for n in nodes]
    for name in sorted({x for x in names if names.count(x) > 1}):
        r.bad("cluster.nodes", f"node name {name!r} used more than once")
    counts = [(i, n.get("gpus")) for i, n in enumerate(raw) if isinstance(n, dict)
              and isinstance(n.get("gpus"), int) and n.get("gpus") > 0]
    if len({g for _, g in counts}) > 1:
        r.bad("cluster.nodes", f"all nodes must have the same number of GPUs (torchrun uses one "
              f"--nproc_per_node), got {', '.join(f'nodes[{i}]={g}' for i, g in counts)}")
    c = ClusterSpec(nodes)
    c.inter_node_GBps = float(r.num(d, "inter_node_GBps", "cluster", 12.5, lo=0, lo_open=True))
    c.intra_node_GBps = r.num(d, "intra_node_GBps", "cluster", None, lo=0, lo_open=True)
    c.cross_type_GBps = _read_cross(r, d.get("cross_type_GBps"))
    return c


def _read_node(r: _Reader, n, i: int) -> NodeSpec | None:
    where = f"cluster.nodes[{i}]"
    n = r.section(n, where, {"name", "gpu_type", "gpus", "address"})
    if not n:
        return None
    name = r.text(n, "name", where, f"node{i}")
    raw_type = r.text(n, "gpu_type", where, required=True)
    gpu_type = canonical_name(raw_type) if raw_type else None
    if raw_type and gpu_type is None:
        r.bad(f"{where}.gpu_type", f"unknown GPU type {raw_type!r} (known: {_known_types()})")
    gpus = r.num(n, "gpus", where, integer=True, lo=1, required=True)
    address = r.text(n, "address", where, "127.0.0.1")
    if gpu_type is None or gpus is None:
        return None
    return NodeSpec(name, gpu_type, gpus, address)


def _read_cross(r: _Reader, c):
    if c is None:
        return None
    if isinstance(c, dict):
        out = {}
        for k, v in c.items():
            where = f"cluster.cross_type_GBps[{k!r}]"
            parts = k.split("/") if isinstance(k, str) else []
            names = [canonical_name(p) for p in parts]
            if len(parts) != 2 or None in names:
                r.bad(where, f"key must be 'TYPE/TYPE' with known types (known: {_known_types()})")
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                r.bad(where, f"must be a number > 0, got {v!r}")
                continue
            out[f"{names[0]}/{names[1]}"] = float(v)
        return out
    if isinstance(c, bool) or not isinstance(c, (int, float)) or c <= 0:
        r.bad("cluster.cross_type_GBps", f"must be a number > 0 or a {{'A/B': GBps}} object, got {c!r}")
        return None
    return float(c)


def _read_prices(r: _Reader, d, cluster: ClusterSpec) -> dict[str, float]:
    if d is not None and not isinstance(d, dict):
        r.bad("prices", "must be an object {gpu_type: dollars per hour}")
        d = None
    out = {}
    for k, v in (d or {}).items():
        name = canonical_name(k)
        if name is None:
            r.bad(f"prices.{k}", f"unknown GPU type (known: {_known_types()})")
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            r.bad(f"prices.{k}", f"must be a number >= 0 ($/h per GPU), got {v!r}")
        else:
            out[name] = float(v)
    for t in cluster.types():
        out.setdefault(t, CATALOGUE[t].price)
    return out


# ----------------------------------------------------------------------------- layout

_LAYOUT_KEYS = {"train_ranks", "train_gpus", "train_gpu_type", "dp", "tp", "pp", "rollout_tp",
                "trainer", "rollout_replicas"}


def _read_layout(r: _Reader, d) -> dict | None:
    """Checks field types only; placement against the cluster is checked by the planner."""
    if d is None:
        return None
    d = r.section(d, "layout", _LAYOUT_KEYS)
    for k in ("train_gpus", "dp", "tp", "pp", "rollout_tp"):
        r.num(d, k, "layout", integer=True, lo=1)
    if "train_gpu_type" in d and canonical_name(d["train_gpu_type"]) is None:
        r.bad("layout.train_gpu_type", f"unknown GPU type {d['train_gpu_type']!r} (known: {_known_types()})")
    tr = d.get("train_ranks")
    if tr is not None and (not isinstance(tr, list) or not tr or
                           not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in tr)):
        r.bad("layout.train_ranks", "must be a non-empty list of global ranks (integers >= 0)")
    if "trainer" in d and not isinstance(d["trainer"], dict):
        r.bad("layout.trainer", "must be {dp, stages: [{gpu_type, tp, layers: [start, end]}]}")
    if "rollout_replicas" in d and not isinstance(d["rollout_replicas"], list):
        r.bad("layout.rollout_replicas", "must be a list of {tp, ranks}")
    return dict(d)


# ----------------------------------------------------------------------------- job

_JOB_KEYS = {"name", "model", "data", "reward", "rl", "workload", "cluster", "prices", "budget",
             "layout", "out_dir", "extra"}
_PLAN_KEYS = {"ranks", "trainer", "rollout", "predicted"}


@dataclass
class Job:
    name: str
    model: ModelSpec
    data: DataSpec
    reward: RewardSpec
    rl: RLSpec
    workload: WorkloadSpec
    cluster: ClusterSpec
    prices: dict[str, float]
    budget: float | None = None
    layout: dict | None = None
    out_dir: str = "runs/hexrl"
    extra: dict = field(default_factory=dict)  # free-form, passed through untouched

    def price_per_hour(self) -> float:
        return sum(self.prices[n.gpu_type] * n.gpus for n in self.cluster.nodes)

    def to_dict(self) -> dict:
        """The job with every default filled in (what a plan file starts with)."""
        d = {
            "name": self.name, "model": self.model.to_dict(), "data": self.data.to_dict(),
            "reward": self.reward.to_dict(), "rl": self.rl.to_dict(),
            "workload": self.workload.to_dict(), "cluster": self.cluster.to_dict(),
            "prices": dict(self.prices), "budget": self.budget, "out_dir": self.out_dir,
        }
        if self.layout is not None:
            d["layout"] = self.layout
        if self.extra:
            d["extra"] = self.extra
        return d


def _read_source(path_or_dict, what: str) -> tuple[dict, Path]:
    if isinstance(path_or_dict, dict):
        return path_or_dict, Path.cwd()
    p = Path(path_or_dict)
    try:
        d = json.loads(p.read_text())
    except OSError as e:
        raise ConfigError([f"{p}: cannot read: {e.strerror or e}"], f"invalid {what}") from None
    except json.JSONDecodeError as e:
        raise ConfigError([f"{p}: not valid JSON: {e}"], f"invalid {what}") from None
    if not isinstance(d, dict):
        raise ConfigError([f"{p}: must hold a JSON object"], f"invalid {what}")
    return d, p.resolve().parent


def _parse_job(r: _Reader, d: dict, base: Path, check_paths: bool, extra_keys=frozenset()) -> Job | None:
    for k in d:
        if k not in _JOB_KEYS | extra_keys:
            r.bad(k, f"unknown top-level field (known: {', '.join(sorted(_JOB_KEYS))})")
    name = r.text(d, "name", "job", "hexrl-job")
    model = _read_model(r, d.get("model"), base)
    data = _read_data(r, d.get("data"), base, check_paths)
    reward = _read_reward(r, d.get("reward"), data)
    rl = _read_rl(r, d.get("rl"))
    workload = _read_workload(r, d.get("workload"), rl)
    cluster = _read_cluster(r, d.get("cluster"))
    prices = _read_prices(r, d.get("prices"), cluster)
    budget = r.num(d, "budget", "job", None, lo=0, lo_open=True, none_ok=True)
    layout = _read_layout(r, d.get("layout"))
    out_dir = r.text(d, "out_dir", "job", f"runs/{name}")
    extra = d.get("extra", {})
    if not isinstance(extra, dict):
        r.bad("extra", "must be an object")
        extra = {}
    if model and model.config.get("max_position_embeddings", 1 << 30) < workload.prompt_len + rl.max_new_tokens:
        r.bad("rl.max_new_tokens", f"prompt_len {workload.prompt_len} + max_new_tokens {rl.max_new_tokens} "
              f"exceeds the model's max_position_embeddings {model.config['max_position_embeddings']}")
    if r.problems:
        return None
    return Job(name, model, data, reward, rl, workload, cluster, prices, budget, layout, out_dir, extra)


def load_job(path_or_dict, check_paths: bool = True) -> Job:
    """Read and validate a job (a path to job.json or a dict); raises ConfigError listing every problem.

    check_paths=False skips checking that the data file exists (the planner does not read it).
    """
    d, base = _read_source(path_or_dict, "job")
    r = _Reader()
    job = _parse_job(r, d, base, check_paths)
    if r.problems:
        raise ConfigError(r.problems, "invalid job")
    return job


# ----------------------------------------------------------------------------- plan

ROLES = ("train", "rollout")


@dataclass
class RankInfo:
    rank: int
    node: int
    local_rank: int
    gpu_type: str
    role: str  # train | rollout
    dp: int | None = None
    pp: int | None = None
    tp: int | None = None
    replica: int | None = None

    def to_dict(self) -> dict:
        keys = ("dp", "pp", "tp") if self.role == "train" else ("replica", "tp")
        d = {k: getattr(self, k) for k in ("rank", "node", "local_rank", "gpu_type", "role")}
        d.update({k: getattr(self, k) for k in keys})
        return d


@dataclass
class Stage:
    gpu_type: str
    tp: int
    layers: tuple[int, int]  # [start, end) decoder layers

    def to_dict(self) -> dict:
        return {"gpu_type": self.gpu_type, "tp": self.tp, "layers": list(self.layers)}


@dataclass
class TrainerLayout:
    dp: int
    stages: list[Stage]

    @property
    def pp(self) -> int:
        return len(self.stages)

    def n_gpus(self) -> int:
        return self.dp * sum(s.tp for s in self.stages)

    def to_dict(self) -> dict:
        return {"dp": self.dp, "stages": [s.to_dict() for s in self.stages]}


@dataclass
class Replica:
    id: int
    gpu_type: str
    tp: int
    ranks: list[int]  # ranks[i] holds TP shard i; ranks[0] leads
    share: float  # fraction of prompts this replica should receive
    max_batch: int | None = None  # running sequences the planner assumed (a hint for the engine)

    def to_dict(self) -> dict:
        d = {"id": self.id, "gpu_type": self.gpu_type, "tp": self.tp, "ranks": list(self.ranks),
             "share": self.share}
        if self.max_batch is not None:
            d["max_batch"] = self.max_batch
        return d


@dataclass
class Plan:
    job: Job
    ranks: list[RankInfo]
    trainer: TrainerLayout
    replicas: list[Replica]
    predicted: dict = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def gpus_per_node(self) -> int:
        return self.job.cluster.gpus_per_node

    def train_ranks(self) -> list[int]:
        return [x.rank for x in self.ranks if x.role == "train"]

    def rollout_ranks(self) -> list[int]:
        return [x.rank for x in self.ranks if x.role == "rollout"]

    def trainer_rank(self, dp: int, pp: int, tp: int) -> int:
        """The global rank at grid position (dp, pp, tp)."""
        for x in self.ranks:
            if x.role == "train" and (x.dp, x.pp, x.tp) == (dp, pp, tp):
                return x.rank
        raise KeyError(f"no trainer rank at dp={dp} pp={pp} tp={tp}")

    def to_dict(self) -> dict:
        d = self.job.to_dict()
        d["ranks"] = [x.to_dict() for x in self.ranks]
        d["trainer"] = self.trainer.to_dict()
        d["rollout"] = {"replicas": [x.to_dict() for x in self.replicas]}
        d["predicted"] = self.predicted
        return d

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def _read_ranks(r: _Reader, raw) -> list[RankInfo]:
    if not isinstance(raw, list) or not raw:
        r.bad("ranks", "must be a non-empty list with one object per global rank")
        return []
    out, seen = [], {}
    for i, x in enumerate(raw):
        w = f"ranks[{i}]"
        x = r.section(x, w, {"rank", "node", "local_rank", "gpu_type", "role", "dp", "pp", "tp", "replica"})
        if not x:
            continue
        ints = {k: r.num(x, k, w, None, integer=True, lo=0, required=k in ("rank", "node", "local_rank", "tp"))
                for k in ("rank", "node", "local_rank", "dp", "pp", "tp", "replica")}
        if ints["rank"] in seen:
            r.bad(f"{w}.rank", f"rank {ints['rank']} listed twice (also ranks[{seen[ints['rank']]}])")
            continue
        seen.setdefault(ints["rank"], i)
        role = x.get("role")
        if role not in ROLES:
            r.bad(f"{w}.role", f"unknown role {role!r} (known: {', '.join(ROLES)})")
            continue
        need = ("dp", "pp") if role == "train" else ("replica",)
        for k in need:
            if ints[k] is None and k not in x:
                r.bad(f"{w}.{k}", f"missing (required for role {role!r})")
        gt = canonical_name(x.get("gpu_type"))
        if gt is None:
            r.bad(f"{w}.gpu_type", f"unknown GPU type {x.get('gpu_type')!r} (known: {_known_types()})")
        if None in (ints["rank"], ints["node"], ints["local_rank"], ints["tp"], gt) or \
                any(ints[k] is None for k in need):
            continue
        out.append(RankInfo(ints["rank"], ints["node"], ints["local_rank"], gt, role,
                            ints["dp"] if role == "train" else None, ints["pp"] if role == "train" else None,
                            ints["tp"], ints["replica"] if role == "rollout" else None))
    return out


def _read_trainer(r: _Reader, raw) -> TrainerLayout | None:
    t = r.section(raw, "trainer", {"dp", "stages"}, required=True)
    dp = r.num(t, "dp", "trainer", None, integer=True, lo=1, required=bool(t))
    stages = []
    raw_stages = t.get("stages")
    if t and (not isinstance(raw_stages, list) or not raw_stages):
        r.bad("trainer.stages", "must be a non-empty list of {gpu_type, tp, layers}")
        raw_stages = []
    for i, s in enumerate(raw_stages or []):
        w = f"trainer.stages[{i}]"
        s = r.section(s, w, {"gpu_type", "tp", "layers"})
        gt = canonical_name(s.get("gpu_type"))
        if gt is None:
            r.bad(f"{w}.gpu_type", f"unknown GPU type {s.get('gpu_type')!r} (known: {_known_types()})")
        tp = r.num(s, "tp", w, None, integer=True, lo=1, required=True)
        lay = s.get("layers")
        if not (isinstance(lay, list) and len(lay) == 2 and all(isinstance(v, int) for v in lay)):
            r.bad(f"{w}.layers", f"must be [start, end] integers, got {lay!r}")
            lay = None
        if gt and tp and lay:
            stages.append(Stage(gt, tp, (lay[0], lay[1])))
    if dp is None or len(stages) != len(raw_stages or []):
        return None
    return TrainerLayout(dp, stages)


def _read_replicas(r: _Reader, raw) -> list[Replica]:
    roll = r.section(raw, "rollout", {"replicas"}, required=True)
    reps = roll.get("replicas")
    if roll and not isinstance(reps, list):
        r.bad("rollout.replicas", "must be a list of {id, gpu_type, tp, ranks, share}")
        return []
    out = []
    for i, x in enumerate(reps or []):
        w = f"rollout.replicas[{i}]"
        x = r.section(x, w, {"id", "gpu_type", "tp", "ranks", "share", "max_batch"})
        rid = r.num(x, "id", w, None, integer=True, lo=0, required=True)
        max_batch = r.num(x, "max_batch", w, None, integer=True, lo=1)
        tp = r.num(x, "tp", w, None, integer=True, lo=1, required=True)
        share = r.num(x, "share", w, None, lo=0, hi=1, required=True)
        gt = canonical_name(x.get("gpu_type"))
        if gt is None:
            r.bad(f"{w}.gpu_type", f"unknown GPU type {x.get('gpu_type')!r} (known: {_known_types()})")
        ranks = x.get("ranks")
        if not (isinstance(ranks, list) and ranks and all(isinstance(v, int) for v in ranks)):
            r.bad(f"{w}.ranks", f"must be a non-empty list of global ranks, got {ranks!r}")
            ranks = None
        if None not in (rid, tp, share, gt, ranks):
            out.append(Replica(rid, gt, tp, ranks, float(share), max_batch))
    return out


def check_plan(plan: Plan) -> list[str]:
    """Every inconsistency between a plan's ranks, trainer grid, replicas and cluster."""
    p: list[str] = []
    _check_rank_table(plan, p)
    _check_trainer(plan, p, plan.job.model.num_layers)
    _check_replicas(plan, p)
    if not plan.train_ranks():
        p.append("ranks: no rank has role 'train'")
    if not plan.rollout_ranks():
        p.append("ranks: no rank has role 'rollout'")
    return p


def _check_rank_table(plan: Plan, p: list[str]):
    c = plan.job.cluster
    n = c.world_size
    seen: dict[int, int] = {}  # duplicates were reported while reading the ranks
    for i, x in enumerate(plan.ranks):
        seen[x.rank] = i
        if not 0 <= x.rank < n:
            p.append(f"ranks[{i}].rank: {x.rank} outside 0..{n - 1} (cluster has {n} GPUs)")
            continue
        node, local = divmod(x.rank, c.gpus_per_node)
        if (x.node, x.local_rank) != (node, local):
            p.append(f"ranks[{i}]: rank {x.rank} must be node {node} local_rank {local} "
                     f"(rank = node * {c.gpus_per_node} + local_rank), got node {x.node} local_rank {x.local_rank}")
        elif x.gpu_type != c.nodes[node].gpu_type:
            p.append(f"ranks[{i}].gpu_type: {x.gpu_type} but node {c.nodes[node].name} has {c.nodes[node].gpu_type}")
    missing = sorted(set(range(n)) - set(seen))
    if missing:
        p.append(f"ranks: missing global ranks {_short(missing)} (cluster has {n} GPUs)")


def _check_trainer(plan: Plan, p: list[str], L: int):
    t = plan.trainer
    pos = 0
    heads = plan.job.model.num_heads
    for s_i, s in enumerate(t.stages):
        a, b = s.layers
        if a != pos or b <= a:
            p.append(f"trainer.stages[{s_i}].layers: [{a}, {b}] must start at {pos} and be non-empty")
        pos = max(pos, b)
        if heads % s.tp:
            p.append(f"trainer.stages[{s_i}].tp: {s.tp} does not divide num_attention_heads {heads}")
    if t.stages and pos != L:
        p.append(f"trainer.stages: layers cover [0, {pos}) but the model has {L} layers")
    grid: dict[tuple, int] = {}
    for x in plan.ranks:
        if x.role != "train":
            continue
        key = (x.dp, x.pp, x.tp)
        if key in grid:
            p.append(f"ranks: ranks {grid[key]} and {x.rank} both at trainer dp={x.dp} pp={x.pp} tp={x.tp}")
        grid[key] = x.rank
        if not (x.pp < len(t.stages) and x.dp < t.dp and x.tp < t.stages[x.pp].tp):
            p.append(f"ranks: rank {x.rank} at dp={x.dp} pp={x.pp} tp={x.tp} is outside the trainer grid")
        elif x.gpu_type != t.stages[x.pp].gpu_type:
            p.append(f"ranks: rank {x.rank} is {x.gpu_type} but trainer stage {x.pp} is {t.stages[x.pp].gpu_type}")
    want = {(d, s_i, k) for s_i, s in enumerate(t.stages) for d in range(t.dp) for k in range(s.tp)}
    holes = sorted(want - set(grid))
    if holes:
        p.append(f"trainer: no rank at grid positions (dp, pp, tp) {_short(holes)}")


def _check_replicas(plan: Plan, p: list[str]):
    by_rank = {x.rank: x for x in plan.ranks}
    ids = [r.id for r in plan.replicas]
    for rid in sorted({i for i in ids if ids.count(i) > 1}):
        p.append(f"rollout.replicas: id {rid} used more than once")
    covered = set()
    for i, rep in enumerate(plan.replicas):
        w = f"rollout.replicas[{i}]"
        if len(rep.ranks) != rep.tp:
            p.append(f"{w}.ranks: {len(rep.ranks)} ranks for tp={rep.tp}")
        if plan.job.model.num_heads % rep.tp:
            p.append(f"{w}.tp: {rep.tp} does not divide num_attention_heads {plan.job.model.num_heads}")
        for k, rk in enumerate(rep.ranks):
            x = by_rank.get(rk)
            if rk in covered:
                p.append(f"{w}.ranks: rank {rk} belongs to two replicas")
            covered.add(rk)
            if x is None:
                p.append(f"{w}.ranks: rank {rk} not in ranks")
            elif (x.role, x.replica, x.tp, x.gpu_type) != ("rollout", rep.id, k, rep.gpu_type):
                p.append(f"{w}.ranks: rank {rk} must be role 'rollout', replica {rep.id}, tp {k}, "
                         f"{rep.gpu_type}; ranks says role {x.role!r}, replica {x.replica}, tp {x.tp}, {x.gpu_type}")
    orphans = sorted(x.rank for x in plan.ranks if x.role == "rollout" and x.rank not in covered)
    if orphans:
        p.append(f"ranks: rollout ranks {_short(orphans)} belong to no replica")
    total = sum(r.share for r in plan.replicas)
    if plan.replicas and abs(total - 1.0) > 1e-3:
        p.append(f"rollout.replicas: shares sum to {total:.4f}, must sum to 1")


def _short(xs: list, n: int = 8) -> str:
    return ", ".join(map(str, xs[:n])) + (f", ... ({len(xs)} in all)" if len(xs) > n else "")


def load_plan(path_or_dict, check_paths: bool = True, world: tuple[int, int] | None = None) -> Plan:
    """Read and validate a plan (job fields + ranks, trainer, rollout, predicted); ConfigError lists all problems.

    world: (WORLD_SIZE, LOCAL_WORLD_SIZE) of the torchrun job, checked in the same pass."""
    d, base = _read_source(path_or_dict, "plan")
    r = _Reader()
    job = _parse_job(r, {k: v for k, v in d.items() if k not in _PLAN_KEYS}, base, check_paths)
    ranks = _read_ranks(r, d.get("ranks"))
    trainer = _read_trainer(r, d.get("trainer"))
    replicas = _read_replicas(r, d.get("rollout"))
    predicted = d.get("predicted", {})
    if not isinstance(predicted, dict):
        r.bad("predicted", "must be an object")
        predicted = {}
    n_ranks = len(d["ranks"]) if isinstance(d.get("ranks"), list) else 0
    problems = list(r.problems)
    if world is not None and job is not None:
        problems += _world_problems(n_ranks, job.cluster, *world)
    if job is not None and trainer is not None:  # also with bad rank entries: report the rest too
        plan = Plan(job, ranks, trainer, replicas, predicted)
        problems += check_plan(plan)
    if problems or job is None or trainer is None:
        raise ConfigError(problems or ["trainer: missing"], "invalid plan")
    return plan


def _world_problems(n_ranks: int, c: "ClusterSpec", world_size: int, local_world_size: int) -> list[str]:
    p = []
    if world_size != n_ranks:
        p.append(f"WORLD_SIZE={world_size} but the plan has {n_ranks} ranks "
                 f"({len(c.nodes)} nodes x {c.gpus_per_node}); launch with "
                 f"torchrun --nnodes {len(c.nodes)} --nproc_per_node {c.gpus_per_node}")
    if local_world_size != c.gpus_per_node:
        p.append(f"LOCAL_WORLD_SIZE={local_world_size} but every plan node has {c.gpus_per_node} GPUs; "
                 f"launch with --nproc_per_node {c.gpus_per_node}")
    return p


def validate_plan_against_world(plan: Plan, world_size: int, local_world_size: int) -> None:
    """Check the plan fits the torchrun world this process lives in; ConfigError lists every problem."""
    p = check_plan(plan) + _world_problems(plan.world_size, plan.job.cluster, world_size, local_world_size)
    if p:
        raise ConfigError(p, "plan does not match this torchrun world")
