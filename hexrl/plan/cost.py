"""Cost models of one asynchronous RL step: training time per layout, rollout throughput per
replica configuration, weight-sync time, reward time.

Everything is seconds for one RL step (B prompts x G samples). The numbers come from the GPU
catalogue (peak FLOP/s, HBM, NVLink) and the cluster's link bandwidths; nothing is fitted
here, so a measured profile (profiles/<gpu>.json) is the way to make predictions sharper.
"""

import collections
import math
from dataclasses import dataclass

import numpy as np

from hexrl.gpus import GPU, gpu
from hexrl.plan.lengths import expected_max_wait, output_lengths
from hexrl.plan.sync_cost import NCCL_EFFICIENCY, StageSync, stage_links, sync_stage_s  # noqa: F401 (re-exported)
from hexrl.plan.wave import Lengths, WaveSteps, bin_width, wave_steps
from hexrl.schema import Job

BYTES_PER_PARAM_TRAIN = 18  # bf16 weights 2 + fp32 grads 4 + fp32 master 4 + Adam m, v 8
WORKSPACE_BYTES = 1.5e9  # allocator slack, kernels' scratch, CUDA context
ALLREDUCE_LATENCY_S = 8e-6  # one small NVLink all-reduce (decode-time TP)
MAX_DECODE_BATCH = 1024  # engine cap on running sequences per replica
# short sequences are packed up to this (the trainer's default): tiny micro-batches pay per-op overhead
MIN_MICRO_TOKENS = 4096
# gym: as exact (chain_sum's scorer took 8 us of CPU a call); other tasks vary: workload.reward_s_per_sample
REWARD_S_PER_SAMPLE = {"math": 5e-3, "exact": 2e-4, "code": 0.5, "gym": 2e-4}
# The rollout leader hands a finished group to its RewardPool (hexrl/rollout/rollout_rank.py, default
# reward_workers=2) and decodes on: scoring overlaps decoding; only the step's last group, and any
# backlog when scoring is slower than decoding, comes after it.
REWARD_WORKERS = 2
WAVE_BATCHES = 16  # a wave's course is followed for its last 16 batches; the rest of its queue runs at full rate


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
    def obs_tokens(self) -> float:
        """Observation tokens of one episode: (turns - 1) observations."""
        return (self.turns - 1) * self.obs_len

    @property
    def gen_samples(self) -> float:
        """Rollouts generated per step: B * G, and again for every filtered group."""
        return self.samples / (1 - self.equal_fraction)

    @property
    def gen_tokens(self) -> float:
        return self.gen_samples * self.mean_out


def workload_of(job: Job) -> Workload:
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
        ctx_decode=wl.prompt_len + (wl.turns - 1) * wl.obs_len / 2 + second / (2 * mean),
        ctx_attn=seq_second / (2 * seq_mean),
        tokens=rl.batch_size * rl.group_size * seq_mean, eta=rl.eta_bound, minibatches=rl.ppo_minibatches,
        extra_fwd=int(rl.decoupled) + int(rl.kl_coef > 0), reward_s=reward_s,
        turns=wl.turns, obs_len=wl.obs_len, env_s=wl.env_latency_mean, env_latency=wl.env_latency_s,
    )


@dataclass(frozen=True)
class StageCoeffs:
    """Stage time = per_layer * layers + fixed (seconds per RL step); memory caps the layers."""

    per_layer: float
    fixed: float
    max_layers: int


@dataclass(frozen=True)
class DecodePoint:
    """One rollout replica configuration psi = (gpu type, tp) run at decode batch `batch`."""

    gpu_type: str
    tp: int
    batch: int
    step_s: float  # one decode step of the whole batch
    tokens_per_s: float  # generated tokens/s including prefills
    recompute_s: float  # KV recompute of the running batch after a weight update


class CostModel:
    """Cost models for one job: model shape, workload, GPU catalogue entries, links."""

    def __init__(self, job: Job, use_profiles: bool = True):
        self.job, self.m, self.cluster = job, job.model.config, job.cluster
        self.w = workload_of(job)
        self.lengths = output_lengths(job.workload.output_len)  # the long tail (rollout_tail_s)
        self.gpus: dict[str, GPU] = {t: gpu(t, job.prices[t], use_profiles) for t in self.cluster.types()}
        self.gpn = self.cluster.gpus_per_node
        self._decode_cache: dict = {}
        self._stage_cache: dict = {}
        self._layer_cache: dict = {}
        self._send_cache: dict = {}
        self._bound_cache: dict = {}  # train_search._type_part
        self._wave_cache: dict = {}
        # colocated (hexrl/plan/shared_gpu.py): the bytes each role may use on the shared GPU
        self.role_bytes: dict[str, float] = {}
        knobs = job.runtime.get("trainer", {})
        # the trainer all-reduces its float32 gradient buckets (plan.trainer.grad_reduce_dtype)
        self.grad_reduce_bytes = 4.0 if knobs.get("grad_reduce_dtype", "float32") == "float32" else 2.0
        self.decode_batch_cap = job.runtime.get("rollout", {}).get("max_running", MAX_DECODE_BATCH)
        self.layer_params = self.m.layer_params()  # hot in the searches: compute once
        q_dim = self.m.num_attention_heads * self.m.head_dim
        self.layer_fwd_flops = 2 * self.layer_params + 4 * q_dim * self.w.ctx_attn

    # ------------------------------------------------------------------ shapes
    def tp_options(self, gpu_type: str) -> list[int]:
        """TP degrees: powers of two that divide GPUs per node and attention heads."""
        out, t = [], 1
        while t <= self.gpn:
            if self.gpn % t == 0 and self.m.num_attention_heads % t == 0:
                out.append(t)
            t *= 2
        return out

    def usable_bytes(self, gpu_type: str, role: str | None = None) -> float:
        """Bytes one process may fill on a GPU of this type; a role's share where the roles share it."""
        if role in self.role_bytes:
            return self.role_bytes[role]
        return self.gpus[gpu_type].hbm_bytes * self.gpus[gpu_type].mem_util - self.workspace_bytes(gpu_type)

    def workspace_bytes(self, gpu_type: str) -> float:
        """One process's allocator slack, kernel scratch and CUDA context."""
        return min(WORKSPACE_BYTES, 0.1 * self.gpus[gpu_type].hbm_bytes)

    def head_params(self) -> int:
        return self.m.vocab_size * self.m.hidden_size

    def edge_params(self, index: int, pp: int) -> int:
        """Embedding and output-head parameters stage `index` of `pp` holds: a tied model on one
        stage holds one matrix for both (hexrl/model/decoder.py shares it)."""
        head = self.head_params() if index == pp - 1 else 0
        tied_here = self.m.tie_word_embeddings and pp == 1
        return head + (self.head_params() if index == 0 and not tied_here else 0)

    def matmul_params(self) -> int:
        """Parameters a token multiplies through: decoder layers and the output head (not the lookup)."""
        return self.m.num_hidden_layers * self.layer_params + self.head_params()

    # ------------------------------------------------------------------ training
    def microbatches(self, dp: int) -> int:
        """Micro-batches per PPO minibatch per DP replica (each holds up to micro_tokens tokens)."""
        w = self.w
        return max(1, math.ceil(w.tokens / (w.minibatches * dp * w.micro_tokens)))

    def stage_coeffs(self, gpu_type: str, tp: int, dp: int, pp: int, index: int, dp_nodes: int,
                     send_GBps: float | None, recompute: bool) -> StageCoeffs:
        """Time and memory coefficients of pipeline stage `index` (of pp) for one RL step.

        dp_nodes: how many nodes the stage's dp*tp GPUs span (1: DP all-reduce on NVLink).
        send_GBps: link to the next stage (None for the last stage).
        """
        key = (gpu_type, tp, dp, pp, index, dp_nodes, send_GBps, recompute)
        if key not in self._stage_cache:
            self._stage_cache[key] = self._stage_coeffs(*key)
        return self._stage_cache[key]

    def per_layer_s(self, gpu_type: str, tp: int, dp: int, pp: int, dp_nodes: int, recompute: bool) -> float:
        """Seconds one layer adds to its stage per RL step (a stage's time is per_layer * layers + fixed):
        the same for every stage of one type and TP, whatever its index or link to the next."""
        key = (gpu_type, tp, dp, pp, dp_nodes, recompute)
        if key not in self._layer_cache:
            self._layer_cache[key] = self._per_layer(*key)
        return self._layer_cache[key]

    def _per_layer(self, gpu_type, tp, dp, pp, dp_nodes, recompute) -> float:
        g, m, w = self.gpus[gpu_type], self.m, self.w
        bubble = self._bubble(dp, pp)
        tok = w.tokens / dp  # tokens through one replica per step
        passes = self._passes(recompute)
        flops = g.flops * self.train_efficiency(gpu_type, dp * tp * pp) * tp
        compute = passes * self.layer_fwd_flops * tok / flops
        tp_comm = 0.0
        if tp > 1:  # 2 all-reduces of activations per forward-like pass, 4 per backward
            n_ar = 2 * (passes - 1)
            tp_comm = n_ar * tok * m.hidden_size * 2 * 2 * (tp - 1) / tp / (self.cluster.intra_GBps(gpu_type) * 1e9)
        per_param = self._dp_per_param(gpu_type, tp, dp, dp_nodes) + self._opt_per_param(gpu_type, tp)
        return bubble * (compute + tp_comm) + w.minibatches * per_param * self.layer_params

    def _bubble(self, dp: int, pp: int) -> float:
        """1F1B's time over its busy time: (micro-batches + pp - 1) / micro-batches."""
        mb = self.microbatches(dp)
        return (mb + pp - 1) / mb

    def _passes(self, recompute: bool) -> int:
        """Forward-sized passes over a layer per micro-batch: forward + backward (2), the proximal /
        reference forwards, and the recomputed forward."""
        return 3 + self.w.extra_fwd + int(recompute)

    def _dp_per_param(self, gpu_type: str, tp: int, dp: int, dp_nodes: int) -> float:
        """Seconds per parameter of a stage's gradient all-reduce across its dp replicas."""
        if dp == 1:
            return 0.0
        grad_bytes = self.grad_reduce_bytes / tp  # gradient bytes per parameter on one GPU
        out = 2 * (dp - 1) / dp * grad_bytes / (self.cluster.intra_GBps(gpu_type) * 1e9)
        if dp_nodes > 1:  # the node's NIC carries a whole copy of the stage's gradients
            out += 2 * (dp_nodes - 1) / dp_nodes * self.grad_reduce_bytes / (self.cluster.inter_node_GBps * 1e9)
        return out

    def _opt_per_param(self, gpu_type: str, tp: int) -> float:
        return 2 * 16 / tp / self.gpus[gpu_type].hbm_Bps  # read + write weights, grads, Adam state

    def _stage_coeffs(self, gpu_type, tp, dp, pp, index, dp_nodes, send_GBps, recompute) -> StageCoeffs:
        g, w = self.gpus[gpu_type], self.w
        k = w.minibatches
        mb = self.microbatches(dp)
        bubble = self._bubble(dp, pp)
        tok = w.tokens / dp  # tokens through one replica per step
        passes = self._passes(recompute)
        flops = g.flops * self.train_efficiency(gpu_type, dp * tp * pp) * tp
        per_layer = self.per_layer_s(gpu_type, tp, dp, pp, dp_nodes, recompute)
        # each micro-batch's fixed cost beside its FLOPs (measured train_overhead_s per fwd+bwd, and per
        # forward-only pass: proximal/reference log-probs, recompute), k * mb of them; 0 without a profile
        # that has them. Measured on a whole model: a pipeline stage holding fewer layers errs slow
        fixed = bubble * k * mb * (g.train_overhead_s + (w.extra_fwd + int(recompute)) * g.train_fwd_overhead_s)
        fixed += k * g.optimizer_overhead_s  # and each of the k optimizer steps' (measured, else 0)
        if index == pp - 1:  # output head (vocab-parallel) and its log-softmax
            fixed += bubble * passes * 2 * self.head_params() * tok / flops
        edge_params = self.edge_params(index, pp)
        fixed += k * (self._dp_per_param(gpu_type, tp, dp, dp_nodes) + self._opt_per_param(gpu_type, tp)) * edge_params
        if send_GBps is not None:
            fixed += self.send_s(dp, pp, dp_nodes, send_GBps)
        return StageCoeffs(per_layer, fixed, self._max_layers(gpu_type, tp, pp, index, mb, recompute, edge_params))

    def send_s(self, dp: int, pp: int, dp_nodes: int, send_GBps: float) -> float:
        """Seconds per RL step a stage spends sending activations forward and receiving gradients back
        (per replica, each of its dp_nodes nodes' links carrying its share)."""
        key = (dp, pp, dp_nodes, send_GBps)
        if key not in self._send_cache:
            tok = self.w.tokens / dp
            self._send_cache[key] = self._bubble(dp, pp) * (2 + self.w.extra_fwd) * tok * self.m.hidden_size * 2 * dp \
                / max(1, dp_nodes) / (send_GBps * 1e9)
        return self._send_cache[key]

    def train_efficiency(self, gpu_type: str, gpus: int) -> float:
        """Fraction of peak a trainer of `gpus` GPUs reaches on this type: train_mfu, less
        train_scale_loss per doubling past one node (the paper's Observation 2 for H20)."""
        g = self.gpus[gpu_type]
        doublings = max(0.0, math.log2(gpus / self.gpn)) if gpus > self.gpn else 0.0
        return g.train_mfu / (1 + g.train_scale_loss * doublings)

    def _max_layers(self, gpu_type, tp, pp, index, mb, recompute, edge_params) -> int:
        m, w = self.m, self.w
        h, tokens = m.hidden_size, w.micro_tokens
        inflight = min(mb, pp - index)  # 1F1B keeps pp - index micro-batches alive on stage index
        bpp = BYTES_PER_PARAM_TRAIN + (2 if self.job.rl.kl_coef > 0 else 0)
        full_act = tokens * h * (10 + 24 / tp)  # one layer's activations (flash attention)
        if recompute:
            act_per_layer, act_fixed = inflight * tokens * h * 2, full_act
        else:
            act_per_layer, act_fixed = inflight * full_act, 0.0
        fixed = edge_params * bpp / tp + act_fixed
        if index == pp - 1:
            fixed += tokens * m.vocab_size / tp * 4  # fp32 logits of one micro-batch
        room = self.usable_bytes(gpu_type, "train") - fixed
        per_layer = self.layer_params * bpp / tp + act_per_layer
        return max(0, int(room // per_layer))

    def train_flops(self) -> float:
        """FLOPs of one step's training without activation recompute (layers and output head)."""
        per_token = self.m.num_hidden_layers * self.layer_fwd_flops + 2 * self.head_params()
        return (3 + self.w.extra_fwd) * per_token * self.w.tokens

    def decode_rate_bound(self, gpu_type: str) -> float:
        """An upper bound on one GPU's generated tokens/s (best TP, largest batch, no recompute)."""
        rates = [pt.tokens_per_s / tp for tp in self.tp_options(gpu_type)
                 for pt in self.decode_points(gpu_type, tp, False)]
        return max(rates, default=0.0)

    def train_memory_floor(self) -> float:
        """Bytes the training set needs at the very least (weights, grads, Adam; no activations)."""
        return self.m.num_params * BYTES_PER_PARAM_TRAIN

    # ------------------------------------------------------------------ rollout
    def kv_bytes_per_token(self, tp: int) -> float:
        """KV bytes per token on one GPU of a TP group (KV heads are replicated past tp > kv_heads)."""
        return self.m.kv_bytes_per_token() / min(tp, self.m.num_key_value_heads)

    def max_decode_batch(self, gpu_type: str, tp: int) -> int:
        """Sequences of average length that fit in KV memory; 0 if not even one longest sequence fits."""
        weights = 2 * self.m.num_params / tp
        room = self.usable_bytes(gpu_type, "rollout") - weights
        kv = self.kv_bytes_per_token(tp)
        if room < kv * self.w.max_seq:
            return 0
        return int(min(self.decode_batch_cap, room // (kv * self.w.ctx_decode)))

    def decode_point(self, gpu_type: str, tp: int, batch: int) -> DecodePoint:
        key = (gpu_type, tp, batch)
        if key not in self._decode_cache:
            self._decode_cache[key] = self._decode_point(gpu_type, tp, batch)
        return self._decode_cache[key]

    def decode_coeffs(self, gpu_type: str, tp: int, b: int) -> tuple[float, float]:
        """(a, c): one decode step of b sequences with total context S takes a + c * S seconds.

        A roofline per kernel family: weight matmuls read the weights once for the whole batch,
        attention reads every sequence's KV; the two run one after the other.
        """
        g = self.gpus[gpu_type]
        bw, peak = g.hbm_Bps * g.hbm_efficiency, tp * g.flops * g.decode_mfu
        c = max(self.kv_bytes_per_token(tp) / bw, self.attn_flops_per_pos() / peak)
        return float(self.decode_fixed_s(gpu_type, tp, b)), c

    def decode_fixed_s(self, gpu_type: str, tp: int, b):
        """The context-free part `a` of a decode step at batch b (a number or a numpy array)."""
        g, m = self.gpus[gpu_type], self.m
        n = self.matmul_params()
        bw, peak = g.hbm_Bps * g.hbm_efficiency, tp * g.flops * g.decode_mfu
        a = g.decode_overhead_s + np.maximum(2 * n / tp / bw, 2 * n * np.asarray(b, dtype=float) / peak)
        if tp > 1:
            nvlink = self.cluster.intra_GBps(gpu_type) * 1e9
            a = a + 2 * m.num_hidden_layers * (ALLREDUCE_LATENCY_S + b * m.hidden_size * 2 * 2 * (tp - 1) / tp / nvlink)
        return a

    def attn_flops_per_pos(self) -> float:
        """Attention FLOPs of one token per context position, all layers (scores and values)."""
        return 4 * self.m.num_attention_heads * self.m.head_dim * self.m.num_hidden_layers

    def prefill_s(self, gpu_type: str, tp: int, tokens: float, context: float) -> float:
        """Prefill (or KV recompute) of `tokens` tokens whose average causal context is `context`."""
        g = self.gpus[gpu_type]
        per_token = 2 * self.matmul_params() + self.attn_flops_per_pos() * context
        return tokens * per_token / (tp * g.flops * g.prefill_mfu)

    def observation_prefill_s(self, gpu_type: str, tp: int) -> float:
        """An episode's observation prefills, one per turn after the first, at its average context
        (the rest of the conversation stays cached: hexrl/rollout/scheduler.py)."""
        w = self.w
        if w.turns <= 1 or not w.obs_len:
            return 0.0
        return (w.turns - 1) * self.prefill_s(gpu_type, tp, w.obs_len, w.ctx_decode)

    def env_wait_s(self, episodes: int) -> float:
        """The longest total environment wait among `episodes` episodes of (turns - 1) calls each."""
        waits = self.__dict__.setdefault("_env_waits", {})  # memoised: the search asks for every candidate
        if episodes not in waits:
            waits[episodes] = expected_max_wait(self.w.env_latency, round(self.w.turns - 1), episodes)
        return waits[episodes]

    def _decode_point(self, gpu_type: str, tp: int, b: int) -> DecodePoint:
        w = self.w
        a, c = self.decode_coeffs(gpu_type, tp, b)
        step = a + c * b * w.ctx_decode
        prefill = (self.prefill_s(gpu_type, tp, w.prompt_len, w.prompt_len / 2)
                   + self.observation_prefill_s(gpu_type, tp))
        # each step finishes b / mean_out sequences on average: their host work, their successors' prefill
        rate = b / (step + b / w.mean_out * (prefill + self.gpus[gpu_type].host_s_per_sample))
        recompute = self.prefill_s(gpu_type, tp, b * w.ctx_decode, w.ctx_decode / 2)
        return DecodePoint(gpu_type, tp, b, step, rate, recompute)

    def decode_points(self, gpu_type: str, tp: int, all_batches: bool) -> list[DecodePoint]:
        """Operating points of config (type, tp): bmax/8..bmax, or every power of two up to bmax."""
        bmax = self.max_decode_batch(gpu_type, tp)
        if bmax < 1:
            return []
        sizes = sorted({max(1, bmax >> i) for i in range(4)})  # smaller batches recompute less KV
        if all_batches:
            sizes = sorted({1 << i for i in range(int(math.log2(bmax)) + 1)} | {bmax})
        return [self.decode_point(gpu_type, tp, b) for b in sizes]

    def step_lengths(self) -> Lengths:
        """The output lengths as the simulator samples them (rounded, at least 1), on the step clock."""
        if not hasattr(self, "_step_lengths"):
            d = self.lengths
            L = np.maximum(1, np.rint(d.lengths)).astype(int)
            pmf = np.bincount(L, weights=np.asarray(d.probs, dtype=float) / sum(d.probs), minlength=L.max() + 1)
            self._step_lengths = Lengths(pmf, self.w.prompt_len)
        return self._step_lengths

    def wave_s(self, gpu_type: str, tp: int, batch: int, n: float, n_all: float = 0.0) -> float:
        """Seconds for one replica (at most `batch` running) to generate n sequences handed to it
        at once, nothing joining (hexrl/plan/wave.py); n_all: the sequences all replicas generate
        together, the step ending with the slowest replica."""
        if n <= 0:
            return 0.0
        queue, course = self._wave_course(gpu_type, tp, batch, n, n_all)
        return queue + float(course[1][-1])

    def joined_wave_s(self, gpu_type: str, tp: int, batch: int, n: float, n_all: float,
                      join_s: float, pause_s: float) -> float:
        """wave_s, where as many sequences again join after join_s seconds, with a weight update
        (pause_s, then the KV recompute of the running sequences) when they do."""
        if n <= 0:
            return 0.0
        queue, (steps, time_s) = self._wave_course(gpu_type, tp, batch, n, n_all)
        k = int(np.searchsorted(time_s, join_s - queue))
        if k >= len(time_s) - 1 or steps.alive[k] < 1e-3:
            return queue + float(time_s[-1])
        own = min(n, WAVE_BATCHES * batch)
        joined = wave_steps(self.step_lengths(), batch, own, max(1.0, n_all / n), k, n, steps.width)
        context = float(joined.context[k])  # the running sequences' KV to recompute
        recompute = self.prefill_s(gpu_type, tp, context, context / joined.batch[k] / 2)
        pause = joined.alive[k] * (pause_s + recompute)
        return float(queue + pause + self._course_s(gpu_type, tp, joined, min(own, batch))[-1])

    def _wave_course(self, gpu_type: str, tp: int, batch: int, n: float, n_all: float):
        """(seconds at full rate before the last WAVE_BATCHES batches, (WaveSteps, time by bin))."""
        key = (gpu_type, tp, batch, n, n_all)  # splits that share a type's replicas ask again: memoised
        if key not in self._wave_cache:
            own = min(n, WAVE_BATCHES * batch)
            queue = (n - own) * self.w.mean_out / self.decode_point(gpu_type, tp, batch).tokens_per_s
            lengths = self.step_lengths()
            steps = wave_steps(lengths, batch, own, max(1.0, n_all / n), width=bin_width(lengths, batch, 2 * own))
            self._wave_cache[key] = queue, (steps, self._course_s(gpu_type, tp, steps, min(own, batch)))
        return self._wave_cache[key]

    def _course_s(self, gpu_type: str, tp: int, steps: WaveSteps, first: float) -> np.ndarray:
        """Seconds from the wave's start to the end of each bin: the first batch's prefill, decode
        steps at their batch and context, each later start's prefill and hand-off."""
        c = self.decode_coeffs(gpu_type, tp, 1)[1]
        decode = steps.width * (self.decode_fixed_s(gpu_type, tp, steps.batch) + c * steps.context)
        starts = steps.starts.copy()
        starts[0] -= first  # prefilled together, below
        one = (self.prefill_s(gpu_type, tp, self.w.prompt_len, self.w.prompt_len / 2)
               + self.gpus[gpu_type].host_s_per_sample)
        first_s = self.prefill_s(gpu_type, tp, first * self.w.prompt_len, self.w.prompt_len / 2)
        return first_s + np.cumsum(steps.alive * (decode + starts * one))

    def rollout_wave(self, replicas) -> tuple[float, float]:
        """(wave_s, reward_s) for replicas (objects with gpu_type, tp, batch, share): the time an idle
        rollout needs to generate one step's B groups dealt out by share, and the reward work of
        the busiest replica over a step (its groups times group_reward_s), which its reward
        workers do while it decodes. Filtered groups (equal rewards) are generated again once
        they are found, late in a wave (a group ends with its longest sample): at eta = 0, where
        nothing else runs meanwhile, a wave for each round of them while a round holds a whole
        group; with eta >= 1 one wave of them all (the gate lets the rounds overlap)."""
        active = [r for r in replicas if r.share > 0] or list(replicas)
        reward = max(r.share for r in active) * self.w.gen_samples / self.w.group * self.group_reward_s()
        if self.w.eta != 0:
            return self._one_wave(active, self.w.gen_samples), reward
        wave, part = 0.0, 1.0
        while part == 1.0 or self.w.samples * part >= self.w.group:
            wave += self._one_wave(active, self.w.samples * part)
            part *= self.w.equal_fraction
        return wave, reward

    def _one_wave(self, active, samples: float, join_s: float | None = None, pause_s: float = 0.0) -> float:
        """Seconds for the slowest replica to generate `samples` sequences dealt out by share at
        once (join_s: as many again join then, see joined_wave_s)."""
        n = [math.ceil(r.share * samples / self.w.group - 1e-9) * self.w.group for r in active]  # whole groups
        kinds = {(r.gpu_type, r.tp, r.batch, k) for r, k in zip(active, n)}  # replicas repeat
        waves = {kind: self.wave_s(*kind, samples) if join_s is None else
                 self.joined_wave_s(*kind, samples, join_s, pause_s) for kind in kinds}
        # an episode waits for its environment (turns - 1) times, holding no decode slot meanwhile:
        # decoding goes on, but the wave ends with the episode that waited longest
        wave = max(waves.values()) + self.env_wait_s(max(n))
        if len(active) == 1:
            return wave
        # the slowest of m replicas, not the average one: E[max of m] ~ mean + sd sqrt(2 ln m)
        sd = max(self._wave_sd(*kind, samples, join_s, pause_s, waves[kind]) for kind in kinds)
        return wave + sd * math.sqrt(2 * math.log(len(active)))

    def _wave_sd(self, gpu_type: str, tp: int, batch: int, n: float, n_all: float,
                 join_s: float | None, pause_s: float, wave: float) -> float:
        """Standard deviation of one replica's wave time over its draws of n lengths: its queue's
        tokens (sqrt(n - b) sd(L) / rate) and its attention work (c sqrt(n) sd(prompt L + L^2 / 2)).
        Where the next step joins (`wave`: that joined wave), a replica behind at the join runs
        more of its tail in full batches: the sd grows as the tail after the join does."""
        sd_len, sd_work = self._length_sd()
        queue = math.sqrt(max(0.0, n - batch)) * sd_len / self.decode_point(gpu_type, tp, batch).tokens_per_s
        attention = self.decode_coeffs(gpu_type, tp, 1)[1] * math.sqrt(n) * sd_work
        sd = math.hypot(queue, attention)
        if join_s is not None:
            alone = self.wave_s(gpu_type, tp, batch, n, n_all)
            if alone > join_s:
                sd *= max(1.0, (wave - join_s - pause_s) / (alone - join_s))
        return sd

    def _length_sd(self) -> tuple[float, float]:
        """(sd of L, sd of prompt L + L^2 / 2: the context positions a sequence's steps read)."""
        if not hasattr(self, "_sds"):
            d = self.lengths
            L, p = np.asarray(d.lengths, dtype=float), np.asarray(d.probs, dtype=float) / sum(d.probs)
            work = self.w.prompt_len * L + L * L / 2
            self._sds = (math.sqrt(max(0.0, d.second_moment() - d.mean() ** 2)),
                         math.sqrt(max(0.0, (p * work * work).sum() - (p * work).sum() ** 2)))
        return self._sds

    def joined_wave(self, replicas, join_s: float, pause_s: float) -> float:
        """One step's groups generated from idle while the next step's join after join_s seconds
        (a weight update of pause_s with them): how a wave runs when the gate alternates (eta >= 1)."""
        active = [r for r in replicas if r.share > 0] or list(replicas)
        return self._one_wave(active, self.w.gen_samples, join_s, pause_s)

    def gated_gen_s(self, replicas, train_s: float, sync_s: float, at_least: float) -> float:
        """A step's generation time, at least `at_least`, when the staleness gate, not the GPUs, caps
        the sequences in flight (1 <= eta < inf): what filtered groups make binding, as the B accepted
        groups per step then take B / (1 - f) generated ones. Of the (eta + 1) B groups the gate
        admits, the accepted and untrained ones average B (C / T + 1/2) over a step of T (the batch in
        training is held for C = train + sync, acceptances arrive evenly), the rest run; a running
        group decodes G mean(L) / E[max of G L] sequences on average, since it holds its slot until its
        longest ends. Replicas get running groups by share (control/dispatch.py) and decode at that
        batch. The generation time g these rates give falls as g grows: bisection finds the fixed point."""
        w, eta = self.w, self.w.eta
        active = [r for r in replicas if r.share > 0]
        if eta in (0, None) or not active:
            return at_least
        groups, per_group = w.samples / w.group, self._decoding_per_group()
        kinds = collections.Counter((r.gpu_type, r.tp, r.batch, r.share) for r in active)  # replicas repeat

        def gen_at(gen: float) -> float:  # generation time at the concurrency a step of gen + sync leaves
            running = groups * (eta + 0.5 - min(1.0, (train_s + sync_s) / (gen + sync_s)))
            rate = sum(self.decode_point(t, tp, max(1, min(b, round(running * per_group * share)))).tokens_per_s * n
                       for (t, tp, b, share), n in kinds.items())
            return w.gen_tokens / rate

        lo = at_least
        if lo <= 0 or gen_at(lo) <= lo:
            return at_least  # the gate leaves enough running: not binding
        hi = 2 * lo
        while gen_at(hi) > hi:
            hi *= 2
        while hi - lo > 1e-4 * hi:
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if gen_at(mid) > mid else (lo, mid)
        return hi

    def _decoding_per_group(self) -> float:
        """Sequences a running group decodes on average, G mean(L) / E[max of G L] (memoised: the
        search asks for every candidate, and a length distribution given as samples is long)."""
        if not hasattr(self, "_per_group"):
            d, g = self.lengths, self.w.group
            self._per_group = g * d.mean() / d.expected_max(g)
        return self._per_group

    def gen_s(self, theta_s: float, wave_s: float, train_s: float, sync_s: float) -> float:
        """Generation time of a step as the staleness gate lets it overlap training (reward included).

        theta_s: the throughput makespan; wave_s: one step's groups generated from idle (eta = 0),
        or from idle with the next step's joining when training ends (joined_wave, eta >= 1).
        eta = 0 waits for the whole wave every step. With eta >= 1 the groups of step v + eta are
        handed out when step v's training ends, and must be done before step v + eta + 1 trains:
        (eta + 1) steps take train + sync + wave, so a step takes at least that / (eta + 1).
        """
        eta = self.w.eta
        if eta == 0:
            return wave_s
        if eta is None:
            return theta_s
        return max(theta_s, (train_s + sync_s + wave_s) / (eta + 1) - sync_s)

    # ------------------------------------------------------------------ sync, reward
    def sync_s(self, stage_bytes: list[tuple[int, float, int]], rollout_nodes: set[int], dp: int = 1,
               split: int = 1) -> float:
        """Weight sync (hexrl/plan/sync_cost.py): every trainer rank of a stage sends its part.

        stage_bytes: (leader node, bytes, tp) per stage; dp: the trainer's DP degree; split: the
        smallest rollout replica TP. A rollout rank takes the stages one after the other, so they add
        up; each ring runs at NCCL_EFFICIENCY of its slowest link and passes every rollout node.
        """
        sync = self.job.sync
        return sum(sync_stage_s(StageSync(nbytes, tp * dp, split, *stage_links(self.cluster, node, rollout_nodes),
                                          2, sync.delta, sync.changed_fraction))
                   for node, nbytes, tp in stage_bytes)

    def group_reward_s(self) -> float:
        """Seconds a replica's reward workers take to score one finished group (G samples on
        REWARD_WORKERS)."""
        return math.ceil(self.w.group / REWARD_WORKERS) * self.w.reward_s

    def step_s(self, train_s: float, gen_s: float, sync_s: float) -> float:
        """Step time: async overlaps generation and training; eta=0 runs them back to back."""
        if self.w.eta == 0:
            return train_s + gen_s + sync_s
        return max(train_s, gen_s) + sync_s
