"""The rollout room of the cost model: decode and prefill operating points of a replica
configuration (gpu type, TP, batch), the waves in which an idle rollout generates a step's groups
(with the next step's joining mid-wave), and the generation time the staleness gate leaves a step.
rollout_milp.py assigns replicas with these points."""

import collections
import functools
import math
from dataclasses import dataclass

import numpy as np

from hexrl.gpus import GPU
from hexrl.plan.cost_inputs import (
    Memory,
    Params,
    Workload,
    active_replicas,
    class_workload,
    replicas_in,
    tp_degrees,
)
from hexrl.plan.lengths import LengthDist, expected_max_wait, output_lengths
from hexrl.plan.wave import Lengths, WaveSteps, bin_width, wave_steps
from hexrl.schema import Job

ALLREDUCE_LATENCY_S = 8e-6  # one small NVLink all-reduce (decode-time TP)
MAX_DECODE_BATCH = 1024  # engine cap on running sequences per replica
WAVE_BATCHES = 16  # a wave's course is followed for its last 16 batches; the rest of its queue runs at full rate


@dataclass(frozen=True)
class DecodePoint:
    """One rollout replica configuration psi = (gpu type, tp) run at decode batch `batch`."""

    gpu_type: str
    tp: int
    batch: int
    step_s: float  # one decode step of the whole batch
    tokens_per_s: float  # generated tokens/s including prefills
    recompute_s: float  # KV recompute of the running batch after a weight update


@dataclass(frozen=True)
class TailSplit:
    """The job's long tail as two length classes, each priced as a rollout of its own: the longest
    `groups` of a step's groups (the long tail, on replicas of their own at a batch cap from `caps`)
    and the rest. Each class's lengths are the distribution's top `groups / B` of mass and the rest
    (LengthDist.split): their conditional means, not P90 and P50, so that the two classes' tokens add
    up to the step's and a plan is priced for the tokens it generates."""

    regular: "RolloutCost"
    long: "RolloutCost"
    groups: int  # long-tail groups per step: round(alpha * B), at least 1, at most B - 1
    caps: tuple[int, ...]  # batch caps a long-tail replica may take

    @property
    def long_token_share(self) -> float:
        """The long tail's share of a step's generated tokens."""
        long, regular = self.long.w.gen_tokens, self.regular.w.gen_tokens
        return long / (long + regular)

    def prompt_share(self, long: bool) -> float:
        """The share of a step's groups in the class."""
        g = self.long.w.samples / (self.long.w.samples + self.regular.w.samples)
        return g if long else 1 - g

    def of(self, long: bool) -> "RolloutCost":
        return self.long if long else self.regular


def tail_split(job: Job, w: Workload, gpus: dict[str, GPU], memory: Memory, params: Params) -> TailSplit | None:
    """The job's two length classes, None where its long_tail is off (or a batch has one group)."""
    spec, batch = job.long_tail, job.rl.batch_size
    if not spec.on or batch < 2:
        return None
    groups = min(batch - 1, max(1, round(spec.alpha * batch)))
    long, rest = output_lengths(job.workload.output_len).split(groups / batch)
    return TailSplit(RolloutCost(job, class_workload(w, rest, batch - groups), gpus, memory, params, rest),
                     RolloutCost(job, class_workload(w, long, groups), gpus, memory, params, long),
                     groups, spec.caps)


def replica_kinds(replicas) -> collections.Counter:
    """Replicas (objects with gpu_type, tp, batch, share, or ReplicaKinds) counted by kind: plans repeat them."""
    kinds = collections.Counter()
    for r in replicas:
        kinds[r.gpu_type, r.tp, r.batch, r.share] += replicas_in(r)
    return kinds


def gate_fixed_point(gen_at, at_least: float) -> float:
    """The generation time g = gen_at(g), at least `at_least` (gen_at falls as g grows: the gate lets
    more run over a longer step), by bisection; at_least where gen_at(at_least) <= at_least (not binding)."""
    lo = at_least
    if lo <= 0 or gen_at(lo) <= lo:
        return at_least
    hi = 2 * lo
    while gen_at(hi) > hi:
        hi *= 2
    while hi - lo > 1e-4 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gen_at(mid) > mid else (lo, mid)
    return hi


class RolloutCost:
    """Rollout costs of one job on the cluster's GPU types."""

    def __init__(self, job: Job, w: Workload, gpus: dict[str, GPU], memory: Memory, params: Params,
                 lengths: LengthDist | None = None):
        self.m, self.cluster = job.model.config, job.cluster
        self.w, self.gpus, self.memory, self.params = w, gpus, memory, params
        self.gpn = self.cluster.gpus_per_node
        # the output lengths (the job's, or one length class's: TailSplit)
        self.lengths = lengths or output_lengths(job.workload.output_len)
        self.decode_batch_cap = job.runtime.get("rollout", {}).get("max_running", MAX_DECODE_BATCH)
        self._decode_cache: dict = {}
        self._wave_cache: dict = {}
        self._env_waits: dict = {}

    def kv_bytes_per_token(self, tp: int) -> float:
        """KV bytes per token on one GPU of a TP group (KV heads are replicated past tp > kv_heads)."""
        return self.m.kv_bytes_per_token() / min(tp, self.m.num_key_value_heads)

    def max_decode_batch(self, gpu_type: str, tp: int) -> int:
        """Sequences of average length that fit in KV memory; 0 if not even one longest sequence fits."""
        weights = 2 * self.m.num_params / tp
        room = self.memory.usable_bytes(gpu_type, "rollout") - weights
        kv = self.kv_bytes_per_token(tp)
        if room < kv * self.w.max_seq:
            return 0
        return int(min(self.decode_batch_cap, room // (kv * self.w.ctx_decode)))

    def decode_point(self, gpu_type: str, tp: int, batch: int) -> DecodePoint:
        """Config (type, tp) run at decode batch `batch` (memoised: the searches ask again and again)."""
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
        n = self.params.matmul
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
        per_token = 2 * self.params.matmul + self.attn_flops_per_pos() * context
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
        if episodes not in self._env_waits:  # memoised: the search asks for every candidate
            self._env_waits[episodes] = expected_max_wait(self.w.env_latency, round(self.w.turns - 1), episodes)
        return self._env_waits[episodes]

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

    def capped_points(self, gpu_type: str, tp: int, cap: int) -> list[DecodePoint]:
        """Config (type, tp) at batch cap `cap`, if its memory holds that many (else none)."""
        return [self.decode_point(gpu_type, tp, cap)] if cap <= self.max_decode_batch(gpu_type, tp) else []

    def decode_points(self, gpu_type: str, tp: int, all_batches: bool) -> list[DecodePoint]:
        """Operating points of config (type, tp): bmax/8..bmax, or every power of two up to bmax."""
        bmax = self.max_decode_batch(gpu_type, tp)
        if bmax < 1:
            return []
        sizes = sorted({max(1, bmax >> i) for i in range(4)})  # smaller batches recompute less KV
        if all_batches:
            sizes = sorted({1 << i for i in range(int(math.log2(bmax)) + 1)} | {bmax})
        return [self.decode_point(gpu_type, tp, b) for b in sizes]

    @functools.cached_property
    def step_lengths(self) -> Lengths:
        """The output lengths as the simulator samples them (rounded, at least 1), on the step clock."""
        d = self.lengths
        L = np.maximum(1, np.rint(d.lengths)).astype(int)
        pmf = np.bincount(L, weights=np.asarray(d.probs, dtype=float) / sum(d.probs), minlength=L.max() + 1)
        return Lengths(pmf, self.w.prompt_len)

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
        joined = wave_steps(self.step_lengths, batch, own, max(1.0, n_all / n), k, n, steps.width)
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
            lengths = self.step_lengths
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

    def idle_wave_s(self, replicas) -> float:
        """Seconds an idle rollout needs to generate one step's B groups dealt out by share to
        replicas (objects with gpu_type, tp, batch, share; one with a `count` stands for as many).
        Filtered groups (equal rewards) are generated again once they are found, late in a wave (a
        group ends with its longest sample): at eta = 0, where nothing else runs meanwhile, a wave
        for each round of them while a round holds a whole group; with eta >= 1 one wave of them
        all (the gate lets the rounds overlap)."""
        active = active_replicas(replicas)
        if self.w.eta != 0:
            return self._one_wave(active, self.w.gen_samples)
        wave, part = 0.0, 1.0
        while part == 1.0 or self.w.samples * part >= self.w.group:
            wave += self._one_wave(active, self.w.samples * part)
            part *= self.w.equal_fraction
        return wave

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
        m = sum(replicas_in(r) for r in active)
        if m == 1:
            return wave
        # the slowest of m replicas, not the average one: E[max of m] ~ mean + sd sqrt(2 ln m)
        sd = max(self._wave_sd(*kind, samples, join_s, pause_s, waves[kind]) for kind in kinds)
        return wave + sd * math.sqrt(2 * math.log(m))

    def _wave_sd(self, gpu_type: str, tp: int, batch: int, n: float, n_all: float,
                 join_s: float | None, pause_s: float, wave: float) -> float:
        """Standard deviation of one replica's wave time over its draws of n lengths: its queue's
        tokens (sqrt(n - b) sd(L) / rate) and its attention work (c sqrt(n) sd(prompt L + L^2 / 2)).
        Where the next step joins (`wave`: that joined wave), a replica behind at the join runs
        more of its tail in full batches: the sd grows as the tail after the join does."""
        sd_len, sd_work = self._length_sd
        queue = math.sqrt(max(0.0, n - batch)) * sd_len / self.decode_point(gpu_type, tp, batch).tokens_per_s
        attention = self.decode_coeffs(gpu_type, tp, 1)[1] * math.sqrt(n) * sd_work
        sd = math.hypot(queue, attention)
        if join_s is not None:
            alone = self.wave_s(gpu_type, tp, batch, n, n_all)
            if alone > join_s:
                sd *= max(1.0, (wave - join_s - pause_s) / (alone - join_s))
        return sd

    @functools.cached_property
    def _length_sd(self) -> tuple[float, float]:
        """(sd of L, sd of prompt L + L^2 / 2: the context positions a sequence's steps read)."""
        d = self.lengths
        L, p = np.asarray(d.lengths, dtype=float), np.asarray(d.probs, dtype=float) / sum(d.probs)
        work = self.w.prompt_len * L + L * L / 2
        return (math.sqrt(max(0.0, d.second_moment() - d.mean() ** 2)),
                math.sqrt(max(0.0, (p * work * work).sum() - (p * work).sum() ** 2)))

    def joined_wave(self, replicas, join_s: float, pause_s: float) -> float:
        """One step's groups generated from idle while the next step's join after join_s seconds
        (a weight update of pause_s with them): how a wave runs when the gate alternates (eta >= 1)."""
        return self._one_wave(active_replicas(replicas), self.w.gen_samples, join_s, pause_s)

    def gated_gen_s(self, replicas, train_s: float, sync_s: float, at_least: float) -> float:
        """A step's generation time, at least `at_least`, when the staleness gate, not the GPUs, caps
        the sequences in flight (1 <= eta < inf): what filtered groups make binding, as the B accepted
        groups per step then take B / (1 - f) generated ones. Of the (eta + 1) B groups the gate
        admits, the accepted and untrained ones average B (C / T + 1/2) over a step of T (the batch in
        training is held for C = train + sync, acceptances arrive evenly), the rest run (gate_running);
        a running group decodes G mean(L) / E[max of G L] sequences on average, since it holds its slot
        until its longest ends. Replicas get running groups by share (control/dispatch.py) and decode
        at that batch (running_rate). The generation time g these rates give falls as g grows:
        bisection finds the fixed point (gate_fixed_point)."""
        active = [r for r in replicas if r.share > 0]
        if self.w.eta in (0, None) or not active:
            return at_least
        kinds = replica_kinds(active)
        return gate_fixed_point(
            lambda gen: self.w.gen_tokens / self.running_rate(kinds, self.gate_running(gen, train_s, sync_s)), at_least)

    def gate_running(self, gen: float, train_s: float, sync_s: float) -> float:
        """Groups running on average over a step of `gen` s of generation (gated_gen_s)."""
        w = self.w
        return w.samples / w.group * (w.eta + 0.5 - min(1.0, (train_s + sync_s) / (gen + sync_s)))

    def running_rate(self, kinds: collections.Counter, groups: float) -> float:
        """Generated tokens/s of replicas (replica_kinds) while `groups` groups run, dealt by share: each
        decodes at that batch, at most its own."""
        per_group = self._decoding_per_group
        return sum(self.decode_point(t, tp, max(1, min(b, round(groups * per_group * share)))).tokens_per_s * n
                   for (t, tp, b, share), n in kinds.items())

    @functools.cached_property
    def _decoding_per_group(self) -> float:
        """Sequences a running group decodes on average, G mean(L) / E[max of G L] (memoised: the
        search asks for every candidate, and a length distribution given as samples is long)."""
        d, g = self.lengths, self.w.group
        return g * d.mean() / d.expected_max(g)

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

    def decode_rate_bound(self, gpu_type: str) -> float:
        """An upper bound on one GPU's generated tokens/s (best TP, largest batch, no recompute)."""
        rates = [pt.tokens_per_s / tp for tp in tp_degrees(self.gpn, self.m.num_attention_heads)
                 for pt in self.decode_points(gpu_type, tp, False)]
        return max(rates, default=0.0)

