"""The job schema: what job.json may say, loaded into dataclasses and checked all at once.

A job names the model, data, reward, RL settings, the workload the planner should assume,
the cluster, prices and budget, and optionally a fixed layout (docs/jobs.md, "The job file", lists every
field). Loading reports every problem in one ConfigError, each naming its field.
"""

from dataclasses import dataclass, field
from pathlib import Path

from hexrl.gpus import CATALOGUE, HOST_FIELDS, canonical_name
from hexrl.input_files import InputFileError, read_json
from hexrl.model.config import MAX_POSITIONS, ModelConfig, tiny_config
from hexrl.ranges import MAX_RANKS, MAX_SEED, number_problem, numbers_problem
from hexrl.schema.affinity import CpuAffinity, read_affinity
from hexrl.schema.colocate import Colocate, cluster_problems, read_colocate
from hexrl.schema.fields import ConfigError, Reader, resolve, unknown_field
from hexrl.schema.knobs import read_overrides
from hexrl.schema.long_tail_spec import LongTailSpec, read_long_tail
from hexrl.schema.replan_spec import ReplanSpec, read_replan

# sane ceilings of the numbers a job gives (hexrl.ranges bounds the rest by DEFAULT_MAX)
MAX_BATCH, MAX_GROUP, MAX_SAMPLES = 1 << 16, 1 << 12, 1 << 20  # prompts, samples per prompt, samples per step
MAX_GPUS_PER_NODE, MAX_NODES = 1024, 4096
MAX_GBPS, MAX_PRICE = 1e5, 1e4  # GB/s of a link; $/h of one GPU

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
    "tiny": tiny_config(),  # the CPU demo's model (tools/make_tiny_model.py): a character vocabulary
}

@dataclass
class ModelSpec:
    """The model: its shape (parsed by hexrl.model.config, the one HF config parser) and where it came from."""

    config: ModelConfig
    path: str | None = None  # a checkpoint directory
    preset: str | None = None  # a name in PRESETS

    def to_dict(self) -> dict:
        if self.path:
            return {"path": self.path}
        if self.preset:
            return {"preset": self.preset}
        return {"config": self.config.hf}


def _read_model(r: Reader, d, base: Path) -> ModelSpec | None:
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
        return ModelSpec(ModelConfig.from_hf(PRESETS[name]), preset=name)
    if "path" in d:
        p = resolve(base, d["path"])
        cfg_file = p / "config.json"
        if not cfg_file.exists():  # one that exists but is not a file is named by the guard below
            r.bad("model.path", f"no config.json in {p}")
            return None
        try:
            cfg = read_json(cfg_file, "config.json")
        except InputFileError as e:
            r.bad("model.path", str(e))
            return None
        where, path = f"model.path ({cfg_file})", str(p)
    else:
        cfg, where, path = d["config"], "model.config", None
    if not isinstance(cfg, dict):
        r.bad(where, "must be an object of Hugging Face config fields")
        return None
    problems = ModelConfig.problems(cfg)
    for problem in problems:
        r.bad(f"{where}.{problem.split(':')[0]}", problem.split(": ", 1)[1])
    return None if problems else ModelSpec(ModelConfig.from_hf(cfg), path=path)


# ----------------------------------------------------------------------------- data, reward, rl

@dataclass
class DataSpec:
    path: str | None = None  # JSONL, one prompt record per line
    kind: str = "math"  # math | code (ignored for synthetic data)
    synthetic: dict | None = None  # {"task": "arithmetic", "n": ..., "seed": ..., task options}
    reasoning_gym: dict | None = None  # {"tasks": ..., "size": ..., "n_heldout": ..., "seed": ..., "prompt": ...}

    def to_dict(self) -> dict:
        if self.synthetic is not None:
            return {"synthetic": dict(self.synthetic)}
        if self.reasoning_gym is not None:
            return {"reasoning_gym": dict(self.reasoning_gym)}
        return {"path": self.path, "kind": self.kind}


_SYNTHETIC_KEYS = {"task", "n", "seed", "n_heldout", "digits", "ops", "negatives", "budget"}
_BUDGET_KEYS = {"start", "end", "steps"}
_GYM_KEYS = {"tasks", "size", "n_heldout", "seed", "prompt"}


def _read_gym(r: Reader, g) -> DataSpec:
    """data.reasoning_gym (hexrl/data/gym_problems.py); the task names are checked where reasoning-gym is installed
    (hexrl.data.datasets.dataset_problems, at plan time and before launch)."""
    g = r.section(g, "data.reasoning_gym", _GYM_KEYS)
    tasks = g.get("tasks")
    ok = (isinstance(tasks, str) and tasks) or (isinstance(tasks, list) and tasks and all(
        isinstance(t, str) for t in tasks)) or (isinstance(tasks, dict) and tasks and all(
            isinstance(c, dict) for c in tasks.values()))
    if not ok:
        r.bad("data.reasoning_gym.tasks", "a task name, a list of names, or {name: {its config options}}, "
              f"got {tasks!r}")
    size = r.num(g, "size", "data.reasoning_gym", 1000, integer=True, lo=1)
    held = r.num(g, "n_heldout", "data.reasoning_gym", 0, integer=True, lo=0)
    seed = r.num(g, "seed", "data.reasoning_gym", 0, integer=True)
    prompt = g.get("prompt", "{question}")
    if not isinstance(prompt, str) or not prompt:
        r.bad("data.reasoning_gym.prompt", f"a format string like \"{{question}}\", got {prompt!r}")
    else:
        from hexrl.data.gym_problems import template_problems  # fields are checked against tasks there

        for p in template_problems(prompt):
            r.bad("data.reasoning_gym.prompt", p)
    return DataSpec(reasoning_gym={"tasks": tasks, "size": size, "n_heldout": held, "seed": seed, "prompt": prompt})


def _read_budget(r: Reader, data: DataSpec, max_new_tokens: int) -> None:
    """data.synthetic.budget: {"start": 8, "end": 32, "steps": 100}, each sample's token budget drifting
    with the trainer step (hexrl.data.datasets.token_budget), each end within rl.max_new_tokens."""
    b = (data.synthetic or {}).get("budget")
    if b is None:
        return
    where = "data.synthetic.budget"
    if not isinstance(b, dict):
        r.bad(where, 'must be an object like {"start": 8, "end": 32, "steps": 100}')
        return
    r.section(b, where, _BUDGET_KEYS)
    ends = {k: r.num(b, k, where, integer=True, lo=1, required=True) for k in ("start", "end")}
    for k, v in ends.items():
        if v is not None and v > max_new_tokens:
            r.bad(f"{where}.{k}", f"{v} tokens > rl.max_new_tokens {max_new_tokens}: no sample may generate more")
    steps = r.num(b, "steps", where, integer=True, lo=1, required=True)
    if None not in ends.values() and steps is not None:
        data.synthetic["budget"] = {**ends, "steps": steps}


def _read_data(r: Reader, d, base: Path, check_paths: bool) -> DataSpec:
    d = r.section(d, "data", {"path", "kind", "synthetic", "reasoning_gym"}, required=True)
    if len({"synthetic", "path", "reasoning_gym"} & set(d)) > 1:
        r.bad("data", "give one of path, synthetic or reasoning_gym")
    if "reasoning_gym" in d:
        return _read_gym(r, d["reasoning_gym"])
    if "synthetic" in d:
        s = d["synthetic"]
        if not isinstance(s, dict):
            r.bad("data.synthetic", "must be an object like {\"task\": \"arithmetic\", \"n\": 1000}")
            return DataSpec(synthetic={"task": "arithmetic", "n": 1000, "seed": 0})
        task = r.choice(s, "task", "data.synthetic", ("arithmetic",), "arithmetic")
        n = r.num(s, "n", "data.synthetic", 1000, integer=True, lo=1)
        seed = r.num(s, "seed", "data.synthetic", 0, integer=True, hi=MAX_SEED)
        r.num(s, "n_heldout", "data.synthetic", 0, integer=True, lo=0)
        for k in sorted(set(s) - _SYNTHETIC_KEYS):
            r.bad(f"data.synthetic.{k}", unknown_field(k, _SYNTHETIC_KEYS))
        # whether the task can produce n distinct problems is hexrl.data.datasets.dataset_problems' call
        return DataSpec(synthetic={**s, "task": task, "n": n, "seed": seed})
    if "path" not in d:
        if d:
            r.bad("data", "give path (JSONL) or synthetic")
        return DataSpec(synthetic={"task": "arithmetic", "n": 1000, "seed": 0})
    kind = r.choice(d, "kind", "data", ("math", "code"), "math")
    p = resolve(base, d["path"])
    if check_paths and not p.is_file():
        r.bad("data.path", f"file not found: {p}")
    return DataSpec(path=str(p), kind=kind)


@dataclass
class RewardSpec:
    name: str = "math"  # math | exact | code | gym
    timeout_s: float = 5.0

    def to_dict(self) -> dict:
        return {"name": self.name, "timeout_s": self.timeout_s}


def _read_reward(r: Reader, d, data: DataSpec) -> RewardSpec:
    d = r.section(d, "reward", {"name", "timeout_s"})
    default = "exact" if data.synthetic is not None else "gym" if data.reasoning_gym is not None else data.kind
    name = r.choice(d, "name", "reward", ("math", "exact", "code", "gym"), default)
    if (name == "gym") != (data.reasoning_gym is not None):
        r.bad("reward.name", "\"gym\" (the reasoning-gym task's own scorer) goes with data.reasoning_gym, "
              f"and only with it; got {name!r}")
    timeout = r.num(d, "timeout_s", "reward", 5.0, lo=0, lo_open=True)
    return RewardSpec(name, float(timeout))


@dataclass
class EnvSpec:
    """A multi-turn environment (hexrl/envs/): its name, the episode limits, and its own options."""

    name: str
    max_turns: int = 4  # model turns per episode; an episode still running after them ends with reward 0
    timeout_s: float = 10.0  # per environment call
    max_obs_tokens: int = 256  # a longer observation ends the episode with reward 0
    workers: int = 2  # environment worker processes per rollout replica
    options: dict = field(default_factory=dict)  # the environment's own (Environment.options)

    def to_dict(self) -> dict:
        return {"name": self.name, "max_turns": self.max_turns, "timeout_s": self.timeout_s,
                "max_obs_tokens": self.max_obs_tokens, "workers": self.workers, **self.options}


_ENV_KEYS = {"name", "max_turns", "timeout_s", "max_obs_tokens", "workers"}


def _read_env(r: Reader, d) -> EnvSpec | None:
    """The job's `env` section, or None (single-turn, no environment)."""
    if d is None:
        return None
    from hexrl.envs import class_problems, environment_class, setup_problems

    if not isinstance(d, dict):
        r.bad("env", f"must be an object like {{\"name\": \"calculator\"}}, got {type(d).__name__}")
        return None
    name, cls = r.text(d, "name", "env", required=True), None
    if name is not None:
        try:
            cls = environment_class(name)
        except ValueError as e:
            r.bad("env.name", str(e))
    found = class_problems(cls) if cls is not None else []
    for p in found:
        r.bad(f"env.name ({name})", p)
    x = EnvSpec(name or "?")
    x.max_turns = r.num(d, "max_turns", "env", x.max_turns, integer=True, lo=1, hi=1000)
    x.timeout_s = float(r.num(d, "timeout_s", "env", x.timeout_s, lo=0, lo_open=True))
    x.max_obs_tokens = r.num(d, "max_obs_tokens", "env", x.max_obs_tokens, integer=True, lo=1)
    x.workers = r.num(d, "workers", "env", x.workers, integer=True, lo=1, hi=64)
    known = _ENV_KEYS | set(cls.options if cls is not None and isinstance(cls.options, dict) else ())
    for k in sorted(set(d) - known):
        r.bad(f"env.{k}", unknown_field(k, known))
    if cls is None or found:
        return None
    x.options = {k: r.num(d, k, "env", default) for k, default in cls.options.items()}
    for p in setup_problems(cls, x.options):
        r.bad(f"env ({name})", p)
    return x


PROXIMAL = ("step", "minibatch")  # rl.proximal; hexrl/train/trainer.py checks TrainConfig.proximal against it


@dataclass
class RLSpec:
    batch_size: int = 8  # prompts (groups) per training step
    group_size: int = 4  # samples per prompt
    eta: int | str | None = 4  # staleness bound; None = unbounded; 0 = synchronous; "auto": chosen per step
    eta_max: int = 4  # eta "auto": the largest bound it may choose (hexrl/control/auto_eta.py)
    eta_w_std_target: float = 0.1  # eta "auto": the importance weights' std the stale tokens may reach
    # prompt groups generating at once (was `max_running`); _read_rl fills (eta+1)·B, or 8·B if eta is None
    max_concurrent_rollouts: int | None = None
    # Optimizer steps per training step. The decoupled objective's clip is relative to the proximal
    # policy, so with 1 it never engages (see docs/learning.md); default min(4, batch_size).
    ppo_minibatches: int = 4
    lr: float = 1e-6
    grad_clip: float | None = 1.0  # max global gradient norm; None = off
    warmup_steps: int = 0  # linear lr warm-up, in optimizer steps (ppo_minibatches per step)
    lr_decay_steps: int = 0  # after warm-up, linear lr decay over this many optimizer steps; 0 = constant lr
    lr_final_frac: float = 0.0  # the decay's end (and floor after it), as a fraction of lr
    weight_decay: float = 0.0  # AdamW, on matrices only
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    clip_low: float = 0.2
    clip_high: float = 0.2
    decoupled: bool = True
    # which weights give the proximal log-probs: the step's (AReaL's) or each mini-batch's own (an ablation)
    proximal: str = "step"
    behav_cap: float = 5.0
    # a token k versions old gets a step 1 / (1 + lr_lag_scale * k) times as large; 0 = off (docs/staleness.md)
    lr_lag_scale: float = 0.0
    kl_coef: float = 0.0
    filter_equal_groups: bool = True
    # a reward beyond +-reward_bound is clipped to it as its trajectory arrives, before any arithmetic
    reward_bound: float = 1e6
    steps: int = 10
    seed: int = 0
    checkpoint_every: int = 0  # 0 = only at the end
    eval_every: int = 0  # greedy held-out accuracy every K steps (and at 0 and the end); 0 = off
    # KL(pi_v || pi_v+1) after each step on this many held-out problems (hexrl/train/probe.py); 0 = off
    policy_kl_probe: int = 0

    @property
    def eta_bound(self) -> int | None:
        """The most lag the run may admit: eta, or eta_max when eta is "auto" (what the planner sizes for)."""
        return self.eta_max if self.eta == "auto" else self.eta

    def to_dict(self) -> dict:
        return dict(self.__dict__)


# old name -> new name: a job file with an old name is refused, naming the new one
RL_RENAMED = {"max_running": "max_concurrent_rollouts"}  # groups, unlike the engine's max_running (sequences)


def _read_rl(r: Reader, d) -> RLSpec:
    known = set(RLSpec.__dataclass_fields__)
    d = r.section(d, "rl", known, renamed=RL_RENAMED)
    x, w = RLSpec(), "rl"
    x.batch_size = r.num(d, "batch_size", w, x.batch_size, integer=True, lo=1, hi=MAX_BATCH)
    x.group_size = r.num(d, "group_size", w, x.group_size, integer=True, lo=1, hi=MAX_GROUP)
    if x.batch_size * x.group_size > MAX_SAMPLES:  # before the planner simulates that many samples
        r.bad("rl.group_size", f"batch_size x group_size = {x.batch_size * x.group_size:,} samples per step; "
              f"at most {MAX_SAMPLES:,}")
    x.eta_max = r.num(d, "eta_max", w, x.eta_max, integer=True, lo=1)
    x.eta_w_std_target = float(r.num(d, "eta_w_std_target", w, x.eta_w_std_target, lo=0, lo_open=True))
    if d.get("eta") == "auto":
        x.eta = "auto"
    elif isinstance(d.get("eta"), str):
        r.bad("rl.eta", f"must be an integer >= 0, null or \"auto\", got {d['eta']!r}")
    else:
        x.eta = r.num(d, "eta", w, x.eta, integer=True, lo=0, none_ok=True)
    bound = x.eta_bound
    default_running = (bound + 1 if bound is not None else 8) * x.batch_size  # eta bounded: never binds
    x.max_concurrent_rollouts = r.num(d, "max_concurrent_rollouts", w, default_running, integer=True, lo=1)
    x.ppo_minibatches = r.num(d, "ppo_minibatches", w, min(x.ppo_minibatches, x.batch_size), integer=True, lo=1)
    x.lr = float(r.num(d, "lr", w, x.lr, lo=0, lo_open=True))
    clip = r.num(d, "grad_clip", w, x.grad_clip, lo=0, lo_open=True, none_ok=True)
    x.grad_clip = float(clip) if clip is not None else None
    x.warmup_steps = r.num(d, "warmup_steps", w, x.warmup_steps, integer=True, lo=0)
    x.lr_decay_steps = r.num(d, "lr_decay_steps", w, x.lr_decay_steps, integer=True, lo=0)
    x.lr_final_frac = float(r.num(d, "lr_final_frac", w, x.lr_final_frac, lo=0, hi=1))
    x.weight_decay = float(r.num(d, "weight_decay", w, x.weight_decay, lo=0))
    x.max_new_tokens = r.num(d, "max_new_tokens", w, x.max_new_tokens, integer=True, lo=1, hi=MAX_POSITIONS)
    x.temperature = float(r.num(d, "temperature", w, x.temperature, lo=0))
    x.top_p = float(r.num(d, "top_p", w, x.top_p, lo=0, lo_open=True, hi=1))
    top_k = r.num(d, "top_k", w, 0, integer=True, lo=-1, hi=1 << 22)
    x.top_k = max(top_k, 0)  # -1 (vLLM spelling) also means off
    x.clip_low = float(r.num(d, "clip_low", w, x.clip_low, lo=0, hi=1))
    x.clip_high = float(r.num(d, "clip_high", w, x.clip_high, lo=0))
    x.decoupled = r.boolean(d, "decoupled", w, True)
    x.proximal = r.choice(d, "proximal", w, PROXIMAL, x.proximal)
    x.behav_cap = float(r.num(d, "behav_cap", w, x.behav_cap, lo=1))
    x.lr_lag_scale = float(r.num(d, "lr_lag_scale", w, x.lr_lag_scale, lo=0))
    x.kl_coef = float(r.num(d, "kl_coef", w, x.kl_coef, lo=0))
    x.filter_equal_groups = r.boolean(d, "filter_equal_groups", w, True)
    x.reward_bound = float(r.num(d, "reward_bound", w, x.reward_bound, lo=0, lo_open=True))
    x.steps = r.num(d, "steps", w, x.steps, integer=True, lo=1)
    x.seed = r.num(d, "seed", w, x.seed, integer=True, hi=MAX_SEED)
    x.checkpoint_every = r.num(d, "checkpoint_every", w, 0, integer=True, lo=0)
    x.eval_every = r.num(d, "eval_every", w, 0, integer=True, lo=0)
    x.policy_kl_probe = r.num(d, "policy_kl_probe", w, 0, integer=True, lo=0)
    if x.ppo_minibatches > x.batch_size:
        r.bad("rl.ppo_minibatches", f"{x.ppo_minibatches} > batch_size {x.batch_size}")
    if x.group_size == 1 and x.filter_equal_groups:
        r.bad("rl.group_size", "1 sample per prompt makes every group 'all equal' and "
              "filter_equal_groups would drop all data; use group_size >= 2")
    return x


# ----------------------------------------------------------------------------- workload

@dataclass
class WorkloadSpec:
    """What the planner should assume about prompts and outputs (hexrl.plan.lengths reads output_len)."""

    prompt_len: int = 256
    output_len: dict = field(default_factory=dict)  # {samples} | {histogram: {edges, counts}} | {mean, max}
    reward_s_per_sample: float | None = None  # None: the reward's default
    # share of generated groups whose rewards are all equal, filtered (rl.filter_equal_groups)
    # and generated again: generation does 1 / (1 - f) of a step's groups
    equal_reward_fraction: float = 0.0
    # episodes (a job env): model turns per episode, tokens per observation between turns, and the
    # environment's latency per call {"dist": "fixed"|"exponential"|"lognormal", "mean": s, "sigma"}
    turns: float = 1.0
    obs_len: float = 0.0
    env_latency_s: dict | None = None
    # the simulator's drifting workload: output lengths scale linearly from 1x at step 0 to `factor`
    # at step `steps`, then hold ({"factor": 2, "steps": 1000}); None: lengths do not drift
    output_len_growth: dict | None = None
    host: dict | None = None  # measured host costs in place of the defaults: hexrl.gpus.Host's fields

    def to_dict(self) -> dict:
        d = {"prompt_len": self.prompt_len, "output_len": self.output_len}
        if self.output_len_growth:
            d["output_len_growth"] = dict(self.output_len_growth)
        if self.host:
            d["host"] = dict(self.host)
        if self.reward_s_per_sample is not None:
            d["reward_s_per_sample"] = self.reward_s_per_sample
        if self.equal_reward_fraction:
            d["equal_reward_fraction"] = self.equal_reward_fraction
        if self.turns != 1 or self.obs_len or self.env_latency_s:
            d.update(turns=self.turns, obs_len=self.obs_len)
            if self.env_latency_s:
                d["env_latency_s"] = dict(self.env_latency_s)
        return d

    @property
    def env_latency_mean(self) -> float:
        return float(self.env_latency_s["mean"]) if self.env_latency_s else 0.0


_DIST_KEYS = {"samples", "histogram", "mean", "max"}


LATENCY_DISTS = ("fixed", "exponential", "lognormal")


def _read_workload(r: Reader, d, rl: RLSpec, env: EnvSpec | None = None) -> WorkloadSpec:
    d = r.section(d, "workload", {"prompt_len", "output_len", "reward_s_per_sample", "equal_reward_fraction",
                                  "turns", "obs_len", "env_latency_s", "output_len_growth", "host"} | _DIST_KEYS)
    w = WorkloadSpec()
    w.prompt_len = r.num(d, "prompt_len", "workload", 256, integer=True, lo=1, hi=MAX_POSITIONS)
    w.reward_s_per_sample = r.num(d, "reward_s_per_sample", "workload", None, lo=0)
    w.equal_reward_fraction = r.num(d, "equal_reward_fraction", "workload", 0.0, lo=0, hi=0.99)
    if w.equal_reward_fraction and not rl.filter_equal_groups:
        r.bad("workload.equal_reward_fraction", "rl.filter_equal_groups is false: no group is filtered")
    flat = {k: d[k] for k in _DIST_KEYS if k in d}
    if flat and "output_len" in d:
        r.bad("workload", "give the output length distribution once: under output_len")
    _read_turns(r, d, w, env)
    w.host = _read_host(r, d.get("host"))
    # an episode's output is every turn's tokens: up to env.max_turns x rl.max_new_tokens
    max_out = rl.max_new_tokens * (env.max_turns if env else 1)
    raw = d.get("output_len", flat) or {"mean": max_out / 2, "max": max_out}
    where = "workload.output_len" if "output_len" in d else "workload"
    longest = _check_lengths(r, raw, where, max_out)
    if longest is not None and longest > max_out + 1e-9:
        r.bad(where, f"longest output {longest:g} > " + (f"env.max_turns x rl.max_new_tokens {max_out}" if env
                                                         else f"rl.max_new_tokens {max_out}"))
    w.output_len = {**raw, "max": raw.get("max", max_out)} if isinstance(raw, dict) and "mean" in raw else raw
    w.output_len_growth = _read_growth(r, d.get("output_len_growth"))
    return w


def _read_growth(r: Reader, g) -> dict | None:
    """workload.output_len_growth: {"factor": x, "steps": n}, the simulator's drifting lengths."""
    if g is None:
        return None
    where = "workload.output_len_growth"
    if not isinstance(g, dict):
        r.bad(where, 'must be an object like {"factor": 2, "steps": 1000}')
        return None
    r.section(g, where, {"factor", "steps"})
    factor = r.num(g, "factor", where, lo=0.01, hi=100, required=True)
    steps = r.num(g, "steps", where, integer=True, lo=1, required=True)
    return None if factor is None or steps is None else {"factor": float(factor), "steps": steps}


def _read_host(r: Reader, d) -> dict | None:
    """workload.host: host costs measured on the job's machines (hexrl.gpus.Host's fields), each
    >= 0, controller_core_share in (0, 1]; None where the job gives none."""
    if d is None:
        return None
    d = r.section(d, "workload.host", set(HOST_FIELDS))
    share = {"lo": 0, "lo_open": True, "hi": 1}
    vals = {k: r.num(d, k, "workload.host", **(share if k == "controller_core_share" else {"lo": 0}))
            for k in HOST_FIELDS if k in d}
    return {k: float(v) for k, v in vals.items() if v is not None}


def _read_turns(r: Reader, d: dict, w: WorkloadSpec, env: EnvSpec | None) -> None:
    """workload.turns, obs_len and env_latency_s: what the planner assumes of episodes."""
    w.turns = float(r.num(d, "turns", "workload", 1.0, lo=1, hi=env.max_turns if env else 1))
    w.obs_len = float(r.num(d, "obs_len", "workload", 0.0, lo=0, hi=env.max_obs_tokens if env else 0))
    lat = d.get("env_latency_s")
    if lat is None:
        return
    if env is None:
        r.bad("workload.env_latency_s", "only a job with an env has environment calls")
        return
    if not isinstance(lat, dict):
        r.bad("workload.env_latency_s", 'must be an object like {"dist": "lognormal", "mean": 0.2, "sigma": 1}')
        return
    r.section(lat, "workload.env_latency_s", {"dist", "mean", "sigma"})
    dist = r.choice(lat, "dist", "workload.env_latency_s", LATENCY_DISTS, "fixed")
    mean = r.num(lat, "mean", "workload.env_latency_s", lo=0, required=True)
    sigma = r.num(lat, "sigma", "workload.env_latency_s", 1.0, lo=0, hi=5)
    if mean is not None:
        w.env_latency_s = {"dist": dist, "mean": float(mean)}
        if dist == "lognormal":
            w.env_latency_s["sigma"] = float(sigma)


def _check_lengths(r: Reader, raw, where: str, max_new: int) -> float | None:
    """Check an output-length distribution's form; its longest output, or None if invalid."""
    if not isinstance(raw, dict):
        r.bad(where, "must be {samples: [...]}, {histogram: {edges, counts}} or {mean, max}")
        return None
    kinds = [k for k in ("samples", "histogram", "mean") if k in raw]
    if len(kinds) != 1:
        r.bad(where, f"give exactly one of samples, histogram, mean+max (got {kinds or 'none'})")
        return None
    if kinds == ["samples"]:
        s = raw["samples"]
        if why := numbers_problem(s, 1, MAX_POSITIONS):
            r.bad(f"{where}.samples", f"lengths {why}")
            return None
        return float(max(s))
    if kinds == ["histogram"]:
        return _check_histogram(r, raw["histogram"], f"{where}.histogram")
    n0 = len(r.problems)
    mean = r.num(raw, "mean", where, lo=1, hi=MAX_POSITIONS)
    mx = r.num(raw, "max", where, max_new, lo=1, hi=MAX_POSITIONS)
    if mean is not None and mx is not None and mean > mx:
        r.bad(f"{where}.mean", f"{mean} > max {mx}")
    return None if len(r.problems) > n0 else float(mx)


def _check_histogram(r: Reader, h, where: str) -> float | None:
    if not isinstance(h, dict) or not isinstance(h.get("edges"), list) or not isinstance(h.get("counts"), list):
        r.bad(where, "must be {edges: [e0, ..., ek], counts: [c1, ..., ck]}")
        return None
    e, c = h["edges"], h["counts"]
    if len(e) != len(c) + 1 or not c:
        r.bad(where, f"needs len(edges) == len(counts) + 1, got {len(e)} and {len(c)}")
        return None
    for name, values, hi in (("edges", e, MAX_POSITIONS), ("counts", c, 1e15)):
        if why := numbers_problem(values, 0, hi, max_len=100_000):
            r.bad(f"{where}.{name}", why)
            return None
    if sum(c) <= 0:
        r.bad(f"{where}.counts", "must have a positive sum")
        return None
    if any(b <= a for a, b in zip(e, e[1:])):
        r.bad(f"{where}.edges", "must be increasing and >= 0")
        return None
    return max(max(1.0, (a + b) / 2) for (a, b), n in zip(zip(e, e[1:]), c) if n > 0)


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


def known_types() -> str:
    return ", ".join(CATALOGUE)


def _read_cluster(r: Reader, d) -> ClusterSpec:
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
    c.inter_node_GBps = float(r.num(d, "inter_node_GBps", "cluster", 12.5, lo=0, lo_open=True, hi=MAX_GBPS))
    c.intra_node_GBps = r.num(d, "intra_node_GBps", "cluster", None, lo=0, lo_open=True, hi=MAX_GBPS)
    if len(nodes) > MAX_NODES or c.world_size > MAX_RANKS:
        r.bad("cluster.nodes", f"{len(nodes):,} nodes, {c.world_size:,} GPUs; at most {MAX_NODES:,} nodes and "
              f"{MAX_RANKS:,} GPUs")
    c.cross_type_GBps = _read_cross(r, d.get("cross_type_GBps"))
    return c


def _read_node(r: Reader, n, i: int) -> NodeSpec | None:
    where = f"cluster.nodes[{i}]"
    n = r.section(n, where, {"name", "gpu_type", "gpus", "address"})
    if not n:
        return None
    name = r.text(n, "name", where, f"node{i}")
    raw_type = r.text(n, "gpu_type", where, required=True)
    gpu_type = canonical_name(raw_type) if raw_type else None
    if raw_type and gpu_type is None:
        r.bad(f"{where}.gpu_type", f"unknown GPU type {raw_type!r} (known: {known_types()})")
    gpus = r.num(n, "gpus", where, integer=True, lo=1, hi=MAX_GPUS_PER_NODE, required=True)
    address = r.text(n, "address", where, "127.0.0.1")
    if address in ("0.0.0.0", "*", "::", ""):  # peers connect to it, and the controller binds only it
        r.bad(f"{where}.address", f"must be the node's own address or hostname, not the wildcard {address!r}")
    if gpu_type is None or gpus is None:
        return None
    return NodeSpec(name, gpu_type, gpus, address)


def _read_cross(r: Reader, c):
    if c is None:
        return None
    if isinstance(c, dict):
        out = {}
        for k, v in c.items():
            where = f"cluster.cross_type_GBps[{k!r}]"
            parts = k.split("/") if isinstance(k, str) else []
            names = [canonical_name(p) for p in parts]
            if len(parts) != 2 or None in names:
                r.bad(where, f"key must be 'TYPE/TYPE' with known types (known: {known_types()})")
                continue
            if why := number_problem(v, 0, MAX_GBPS, lo_open=True):
                r.bad(where, why)
                continue
            out[f"{names[0]}/{names[1]}"] = float(v)
        return out
    if why := number_problem(c, 0, MAX_GBPS, lo_open=True):
        r.bad("cluster.cross_type_GBps", f"{why} (or a {{'A/B': GBps}} object)")
        return None
    return float(c)


def _read_prices(r: Reader, d, cluster: ClusterSpec) -> dict[str, float]:
    if d is not None and not isinstance(d, dict):
        r.bad("prices", "must be an object {gpu_type: dollars per hour}")
        d = None
    out = {}
    for k, v in (d or {}).items():
        name = canonical_name(k)
        if name is None:
            r.bad(f"prices.{k}", f"unknown GPU type (known: {known_types()})")
        elif number_problem(v, 0, MAX_PRICE):
            r.bad(f"prices.{k}", f"must be a number >= 0 and <= {MAX_PRICE:g} ($/h per GPU), got {v!r}")
        else:
            out[name] = float(v)
    for t in cluster.types():
        out.setdefault(t, CATALOGUE[t].price)
    return out


# ----------------------------------------------------------------------------- layout

_LAYOUT_KEYS = {"train_ranks", "train_gpus", "train_gpu_type", "dp", "tp", "pp", "rollout_tp",
                "trainer", "rollout_replicas"}


def _read_layout(r: Reader, d) -> dict | None:
    """Checks field types only; placement against the cluster is checked by the planner."""
    if d is None:
        return None
    d = r.section(d, "layout", _LAYOUT_KEYS)
    for k in ("train_gpus", "dp", "tp", "pp", "rollout_tp"):
        r.num(d, k, "layout", integer=True, lo=1, hi=MAX_RANKS)
    if "train_gpu_type" in d and canonical_name(d["train_gpu_type"]) is None:
        r.bad("layout.train_gpu_type", f"unknown GPU type {d['train_gpu_type']!r} (known: {known_types()})")
    tr = d.get("train_ranks")
    if tr is not None and numbers_problem(tr, 0, MAX_RANKS - 1, integer=True, max_len=MAX_RANKS):
        r.bad("layout.train_ranks", "must be a non-empty list of global ranks (integers >= 0)")
    if "trainer" in d and not isinstance(d["trainer"], dict):
        r.bad("layout.trainer", "must be {dp, stages: [{gpu_type, tp, layers: [start, end]}]}")
    if "rollout_replicas" in d and not isinstance(d["rollout_replicas"], list):
        r.bad("layout.rollout_replicas", "must be a list of {tp, ranks}")
    return dict(d)


@dataclass
class SyncSpec:
    """How the trainer sends new weights to the rollout (hexrl/comm/weights.py)."""

    delta: bool | str = False  # True: only changed elements; "auto": per bucket, when fewer changed; False: dense
    changed_fraction: float = 0.034  # share of elements expected to change per version (the planner's estimate)

    def to_dict(self) -> dict:
        return {"delta": self.delta, "changed_fraction": self.changed_fraction}


def _read_sync(r: Reader, d) -> SyncSpec:
    d = r.section(d, "sync", {"delta", "changed_fraction"})
    delta = d.get("delta", False)
    if not (isinstance(delta, bool) or delta == "auto"):
        r.bad("sync.delta", f"must be true, false or \"auto\", got {delta!r}")
        delta = False
    frac = r.num(d, "changed_fraction", "sync", 0.034, lo=0, hi=1)
    return SyncSpec(delta, float(frac))


# ----------------------------------------------------------------------------- job

_JOB_KEYS = {"name", "model", "data", "reward", "env", "rl", "workload", "cluster", "prices", "budget",
             "layout", "runtime", "out_dir", "extra", "cpu_affinity", "share_run_dir",
             "colocate", "sync", "replan", "long_tail"}


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
    runtime: dict = field(default_factory=dict)  # knob overrides (hexrl.schema.knobs): {"trainer", "rollout"}
    out_dir: str = "runs/hexrl"
    extra: dict = field(default_factory=dict)  # free-form, passed through untouched
    cpu_affinity: CpuAffinity | None = None  # cores per local rank (hexrl/schema/affinity.py); None: not pinned
    share_run_dir: bool = False  # False: the run directory is 0700 and its files 0600 (umask 077)
    colocate: Colocate | None = None  # trainer and rollout share the one GPU (hexrl/schema/colocate.py)
    env: EnvSpec | None = None  # multi-turn episodes in this environment; None: single-turn
    sync: SyncSpec = field(default_factory=SyncSpec)  # how weights go to the rollout
    replan: ReplanSpec = field(default_factory=ReplanSpec)  # re-planning on measurements (schema/replan_spec.py)
    long_tail: LongTailSpec = field(default_factory=LongTailSpec)  # two length classes (schema/long_tail_spec.py)

    @property
    def ranks_per_node(self) -> int:
        """Processes torchrun starts per node: one per GPU, two on a shared GPU."""
        return self.cluster.gpus_per_node * (2 if self.colocate is not None else 1)

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
        if self.runtime:
            d["runtime"] = self.runtime
        if self.extra:
            d["extra"] = self.extra
        if self.cpu_affinity is not None:
            d["cpu_affinity"] = self.cpu_affinity.to_dict()
        if self.share_run_dir:
            d["share_run_dir"] = True
        if self.colocate is not None:
            d["colocate"] = self.colocate.to_dict()
        if self.env is not None:
            d["env"] = self.env.to_dict()
        if self.sync != SyncSpec():
            d["sync"] = self.sync.to_dict()
        if self.replan != ReplanSpec():
            d["replan"] = self.replan.to_dict()
        if self.long_tail != LongTailSpec():
            d["long_tail"] = self.long_tail.to_dict()
        return d


def read_source(path_or_dict, what: str) -> tuple[dict, Path]:
    if isinstance(path_or_dict, dict):
        return path_or_dict, Path.cwd()
    p = Path(path_or_dict)
    try:
        d = read_json(p, f"{what} file")  # the guard: a regular file, UTF-8, bounded depth, no NaN
    except InputFileError as e:
        raise ConfigError([str(e)], f"invalid {what}") from None
    if not isinstance(d, dict):
        raise ConfigError([f"{p}: must hold a JSON object"], f"invalid {what}")
    return d, p.resolve().parent


def parse_job(r: Reader, d: dict, base: Path, check_paths: bool, extra_keys=frozenset()) -> Job | None:
    for k in d:
        if k not in _JOB_KEYS | extra_keys:
            r.bad(k, f"unknown top-level field (known: {', '.join(sorted(_JOB_KEYS))})")
    name = r.text(d, "name", "job", "hexrl-job")
    model = _read_model(r, d.get("model"), base)
    data = _read_data(r, d.get("data"), base, check_paths)
    reward = _read_reward(r, d.get("reward"), data)
    env = _read_env(r, d.get("env"))
    rl = _read_rl(r, d.get("rl"))
    _read_budget(r, data, rl.max_new_tokens)
    workload = _read_workload(r, d.get("workload"), rl, env)
    cluster = _read_cluster(r, d.get("cluster"))
    prices = _read_prices(r, d.get("prices"), cluster)
    budget = r.num(d, "budget", "job", None, lo=0, lo_open=True, hi=1e12, none_ok=True)
    layout = _read_layout(r, d.get("layout"))
    runtime = read_overrides(r, d.get("runtime"))
    out_dir = r.text(d, "out_dir", "job", f"runs/{name}")
    extra = d.get("extra", {})
    if not isinstance(extra, dict):
        r.bad("extra", "must be an object")
        extra = {}
    if model and model.config.max_position_embeddings < workload.prompt_len + rl.max_new_tokens:
        r.bad("rl.max_new_tokens", f"prompt_len {workload.prompt_len} + max_new_tokens {rl.max_new_tokens} "
              f"exceeds the model's max_position_embeddings {model.config.max_position_embeddings}")
    colocate = read_colocate(r, d.get("colocate"))
    if colocate is not None and cluster.nodes:
        r.problems += cluster_problems(colocate, cluster.nodes)
    affinity = read_affinity(r, d.get("cpu_affinity"), cluster.gpus_per_node * (2 if colocate is not None else 1))
    share = r.boolean(d, "share_run_dir", "job", False)
    sync = _read_sync(r, d.get("sync"))
    replan = read_replan(r, d.get("replan"))
    long_tail = read_long_tail(r, d.get("long_tail"))
    if r.problems:
        return None
    return Job(name, model, data, reward, rl, workload, cluster, prices, budget, layout, runtime, out_dir, extra,
               affinity, share, colocate, env, sync, replan, long_tail)


def load_job(path_or_dict, check_paths: bool = True) -> Job:
    """Read and validate a job (a path to job.json or a dict); raises ConfigError listing every problem.

    check_paths=False skips checking that the data file exists (the planner does not read it).
    """
    d, base = read_source(path_or_dict, "job")
    r = Reader()
    job = parse_job(r, d, base, check_paths)
    if r.problems:
        raise ConfigError(r.problems, "invalid job")
    return job

