"""What every room of the cost model reads: the step's workload (derived from the job), the
model's parameter counts and TP degrees, and the bytes a process may fill on each GPU type."""

import math
from dataclasses import dataclass, field, replace

from hexrl.gpus import GPU
from hexrl.plan.lengths import LengthDist, output_lengths
from hexrl.schema import Job

WORKSPACE_BYTES = 1.5e9  # allocator slack, kernels' scratch, CUDA context
# short sequences are packed up to this (the trainer's default): tiny micro-batches pay per-op overhead
MIN_MICRO_TOKENS = 4096
# gym: as exact (chain_sum's scorer took 8 us of CPU a call); other tasks vary: workload.reward_s_per_sample
REWARD_S_PER_SAMPLE = {"math": 5e-3, "exact": 2e-4, "code": 0.5, "gym": 2e-4}


@dataclass(frozen=True)
class Workload:
    """The per-step numbers the cost models need, derived from a job."""

    samples: int  # rollouts trained per step: B * G
    equal_fraction: float  # share of generated groups filtered for equal rewards (generated again)
    group: int
    prompt_len: int
    mean_out: float
    max_out: float
    max_seq: int  # prompt + max_new_tokens: a micro-batch holds at least one whole sequence
    micro_tokens: int  # tokens per training micro-batch: max(max_seq, MIN_MICRO_TOKENS) unless the runtime knobs say
    ctx_decode: float  # time-averaged context length of a decoding sequence
    ctx_attn: float  # average causal attention context of a trained token
    tokens: float  # tokens trained per step (prompt + output)
    eta: int | None
    minibatches: int
    extra_fwd: int  # forward-only passes besides fwd+bwd: proximal log-probs, KL reference
    reward_s: float  # reward time of one sample on one worker
    turns: float = 1.0  # model turns per episode (1: single-turn)
    obs_len: float = 0.0  # tokens of each observation between two turns (prefilled, not generated)
    env_s: float = 0.0  # mean environment latency per call
    env_latency: dict | None = None  # its distribution (workload.env_latency_s)

    @property
    def gen_samples(self) -> float:
        """Rollouts generated per step: B * G, and again for every filtered group."""
        return self.samples / (1 - self.equal_fraction)

    @property
    def gen_tokens(self) -> float:
        return self.gen_samples * self.mean_out


def workload_of(job: Job) -> Workload:
    """The job's step as the cost models see it: sample counts, lengths and contexts, passes."""
    rl, wl = job.rl, job.workload
    d = output_lengths(wl.output_len)
    mean, second = d.mean(), d.second_moment()
    context = wl.prompt_len + (wl.turns - 1) * wl.obs_len  # an episode's observations are context, like the prompt
    seq_mean = context + mean
    seq_second = context ** 2 + 2 * context * mean + second
    reward_s = wl.reward_s_per_sample
    if reward_s is None:
        reward_s = REWARD_S_PER_SAMPLE[job.reward.name]
    return Workload(
        samples=rl.batch_size * rl.group_size, equal_fraction=wl.equal_reward_fraction,
        group=rl.group_size, prompt_len=wl.prompt_len,
        mean_out=mean, max_out=d.max(), max_seq=math.ceil(context + max(rl.max_new_tokens, d.max())),
        micro_tokens=job.runtime.get("trainer", {}).get("micro_batch_tokens",
                                                        max(MIN_MICRO_TOKENS, wl.prompt_len + rl.max_new_tokens)),
        ctx_decode=decode_context(wl.prompt_len, wl.turns, wl.obs_len, d),
        ctx_attn=seq_second / (2 * seq_mean),
        tokens=rl.batch_size * rl.group_size * seq_mean, eta=rl.eta_bound, minibatches=rl.ppo_minibatches,
        extra_fwd=int(rl.decoupled) + int(rl.kl_coef > 0), reward_s=reward_s,
        turns=wl.turns, obs_len=wl.obs_len, env_s=wl.env_latency_mean, env_latency=wl.env_latency_s,
    )


def decode_context(prompt_len: int, turns: float, obs_len: float, d: LengthDist) -> float:
    """Time-averaged context of a decoding sequence whose output lengths follow d."""
    return prompt_len + (turns - 1) * obs_len / 2 + d.second_moment() / (2 * d.mean())


def class_workload(w: Workload, d: LengthDist, groups: int) -> Workload:
    """The rollout side of a step restricted to `groups` of its groups, whose lengths follow d
    (one length class of the long tail: hexrl/plan/cost_rollout.py, TailSplit)."""
    return replace(w, samples=groups * w.group, mean_out=d.mean(), max_out=d.max(),
                   ctx_decode=decode_context(w.prompt_len, w.turns, w.obs_len, d))


@dataclass(frozen=True)
class Params:
    """Parameter counts the costs multiply through (computed once: hot in the searches)."""

    layer: int  # one decoder layer
    head: int  # the output head, vocab x hidden (the embedding lookup is as large)
    layers: int
    tied: bool  # embedding and head share one matrix (hexrl/model/decoder.py)

    @classmethod
    def of(cls, m) -> "Params":
        """The counts of model config `m`."""
        return cls(m.layer_params(), m.vocab_size * m.hidden_size, m.num_hidden_layers, m.tie_word_embeddings)

    @property
    def matmul(self) -> int:
        """Parameters a token multiplies through: decoder layers and the output head (not the lookup)."""
        return self.layers * self.layer + self.head

    def edge(self, index: int, pp: int) -> int:
        """Embedding and output-head parameters stage `index` of `pp` holds: a tied model on one
        stage holds one matrix for both."""
        head = self.head if index == pp - 1 else 0
        tied_here = self.tied and pp == 1
        return head + (self.head if index == 0 and not tied_here else 0)


def tp_degrees(gpus_per_node: int, heads: int) -> list[int]:
    """TP degrees: powers of two that divide GPUs per node and attention heads."""
    out, t = [], 1
    while t <= gpus_per_node:
        if gpus_per_node % t == 0 and heads % t == 0:
            out.append(t)
        t *= 2
    return out


@dataclass
class Memory:
    """Bytes one process may fill on each GPU type; where training and rollout share one GPU
    (hexrl/plan/shared_gpu.py), each role's share instead."""

    gpus: dict[str, GPU]
    role_bytes: dict[str, float] = field(default_factory=dict)

    def usable_bytes(self, gpu_type: str, role: str | None = None) -> float:
        """Bytes one process may fill on a GPU of this type; a role's share where the roles share it."""
        if role in self.role_bytes:
            return self.role_bytes[role]
        return self.gpus[gpu_type].hbm_bytes * self.gpus[gpu_type].mem_util - self.workspace_bytes(gpu_type)

    def workspace_bytes(self, gpu_type: str) -> float:
        """One process's allocator slack, kernel scratch and CUDA context."""
        return min(WORKSPACE_BYTES, 0.1 * self.gpus[gpu_type].hbm_bytes)


def replicas_in(r) -> int:
    """How many replicas r stands for: a ReplicaKind its count, a replica one."""
    return getattr(r, "count", 1)


def active_replicas(replicas) -> list:
    """The replicas a step's groups are dealt to: those with a share (all of them where none has)."""
    return [r for r in replicas if r.share > 0] or list(replicas)
