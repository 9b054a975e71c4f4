"""Discrete-event simulation of a plan: the asynchronous pipeline over many RL steps.

Rollout replicas decode sequences of sampled lengths with continuous batching; a decode step
of b sequences with total context S takes a_b + c * S seconds (the planner's cost model), so
between two events (a sequence finishing, a weight update) a replica's steps are summed in
closed form. The control side is the runtime's own code, imported, not re-implemented: the
StalenessGate (hexrl/control/gate.py) decides when a prompt group may be handed out, the
Dispatcher (control/dispatch.py) picks its replica (least in flight per share), and the
ReplayBuffer (control/buffer.py) hands the trainer B groups oldest first and drops groups
more than eta versions old. A finished group goes to its replica's reward workers, which
score groups one after another while the replica decodes on (as hexrl/rollout/rollout_rank.py
does), then enters the buffer. A share `workload.equal_reward_fraction` of the groups (drawn at
random) get equal rewards, and the buffer filters them as the runtime does. The trainer takes B groups per
step (time: the plan's C_T scaled by the batch's tokens), then publishes weights: every
replica stops at its next step boundary, joins the broadcast (C_sync), recomputes the KV of
its running sequences, and decodes on. The controller thread handles arriving groups one after
another, at the host costs' service time (hexrl.gpus.Host: per trajectory, per generated token and
per group, on its share of a core; publishing a version takes it per replica), so a burst of finished
groups reaches the buffer, and their replacements reach the replicas, spread out. It is a process
of its own: with a core to itself (share 1) it costs the trainer nothing; with a share below 1 it
shares trainer rank 0's cores, and what it handles while the trainer trains makes that step longer.
Each training step starts with the batch's hand-off to the trainer ranks (per token). With rl.eta
"auto" the runtime's own AutoEta (hexrl/control/auto_eta.py) chooses the bound after every step from the
trainer's wait and a w_std that the simulation assumes grows by `w_spread` per version of lag.
Episodes (a job env, workload.turns > 1): a sampled output length is split into turns; between
two turns the episode leaves the batch (it holds no decode slot) for an environment latency
drawn from workload.env_latency_s, then rejoins the queue and prefills only its observation
(workload.obs_len tokens), or its whole context if the weights changed meanwhile.
A drifting workload (workload.output_len_growth) scales every sampled length by the growth at the
step its group is handed out in (capped at the longest output the job allows).
Long groups (`long_share` > 0): of every B groups handed out, round(long_share * B) at random are long,
their samples drawn from the longest long_share of the length distribution's mass, the others' from
the rest (LengthDist.split: the lengths are the same in all, but a prompt's difficulty now sets its
group's lengths). A plan with long-tail replicas (the job's long_tail) gets the groups predicted long
on them, by their shares, through a Dispatcher of their own, the rest through another; the
prediction finds `recall` of the long groups (the others it marks in their place are regular).
"""

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from hexrl.control.auto_eta import AutoEta
from hexrl.control.buffer import ReplayBuffer
from hexrl.control.dispatch import Dispatcher
from hexrl.control.gate import StalenessGate
from hexrl.plan.cost import CostModel
from hexrl.plan.lengths import draw_latency
from hexrl.plan.planner import plan_candidate
from hexrl.schema import Plan
from hexrl.trajectory import Trajectory


class Replica:
    """One rollout replica: running sequences as arrays, a queue, and the decode step in flight."""

    def __init__(self, idx: int, gpu_type: str, tp: int, max_batch: int, share: float, cm: CostModel,
                 stretch: float = 1.0):
        self.idx, self.gpu_type, self.tp, self.max_batch, self.share, self.cm = idx, gpu_type, tp, max_batch, share, cm
        self.stretch = stretch  # > 1 where it shares its GPU with the trainer (hexrl/plan/shared_gpu.py)
        self.host_s = cm.gpus[gpu_type].host_s_per_sample  # leader's host work per finished sample
        self.rem = np.zeros(0, dtype=np.int64)  # tokens still to generate
        self.context = np.zeros(0, dtype=np.int64)  # prompt + generated so far
        self.ver = np.zeros(0, dtype=np.int64)  # weight version of the oldest token
        self.grp = np.zeros(0, dtype=np.int64)
        self.after = np.zeros(0, dtype=np.int64)  # an episode's tokens in its turns after this one
        self.per = np.zeros(0, dtype=np.int64)  # an episode's tokens per turn
        # (group, length) of a new sequence, or an episode's next turn:
        # (group, turn tokens, tokens after it, tokens per turn, context with the observation, version, live)
        self.queue: deque = deque()
        self.reward_free = 0.0  # when the reward workers finish the groups handed to them so far
        self.chunk = None  # (compute_start, k steps, a, c, S0, b)
        self.chunk_id = 0
        self.busy = 0.0  # seconds decoding, prefilling, recomputing or handing off finished samples
        self.steps = self.seq_steps = 0  # decode steps taken, and sequences decoded over them
        self.paused = False
        self._coeffs: dict[int, tuple[float, float]] = {}

    def coeffs(self, b: int) -> tuple[float, float]:
        if b not in self._coeffs:
            a, c = self.cm.decode_coeffs(self.gpu_type, self.tp, b)
            self._coeffs[b] = (a * self.stretch, c * self.stretch)
        return self._coeffs[b]

    def prefill_s(self, tokens: float, context: float) -> float:
        return self.cm.prefill_s(self.gpu_type, self.tp, tokens, context) * self.stretch

    @staticmethod
    def elapsed(j, a, c, s0, b):
        """Seconds of j decode steps starting from total context s0."""
        return j * a + c * (j * s0 + b * j * (j - 1) / 2)


@dataclass
class SimResult:
    steps: int
    window_s: float  # simulated time over the measured steps (after warm-up)
    step_time_s: float
    tokens_per_s: float  # trained tokens (prompt + output) per second
    gen_tokens_per_s: float
    trainer_busy: float  # fraction of the window training
    sync_fraction: float  # fraction of the window in weight broadcasts
    rollout_busy: float  # GPU-weighted fraction of the window the rollout GPUs compute
    idle: dict  # GPU-weighted idle fraction per role
    staleness: dict  # staleness (versions) -> trajectories trained on
    violations: int  # trajectories trained although staler than eta (0: the buffer dropped them)
    dropped_stale: int  # trajectories the buffer dropped as more than eta versions old
    predicted_step_s: float
    mean_batch: float  # sequences per decode step, over the run (the engine's RUN_DIR/engine figure)
    tail_staleness: dict = field(default_factory=dict)  # as staleness, the long groups' tokens only (long_share > 0)
    tail_latency_s: float = 0.0  # mean seconds from a long group's hand-out to its last sample's end
    eta_by_step: list = field(default_factory=list)  # the bound in force after each step (rl.eta "auto" moves it)
    gantt: list = field(default_factory=list)  # (lane, kind, t0, t1) of the first steps


def split_turns(n: int, turns: float, rng: np.random.Generator) -> tuple[int, int, int]:
    """An episode of n generated tokens over `turns` turns (a fraction: drawn between its floor and
    ceiling): (first turn's tokens, tokens after it, tokens per turn)."""
    t = int(turns) + (turns > int(turns) and rng.random() < turns - int(turns))  # whole: no draw
    per = -(-n // max(1, min(t, n)))
    return min(per, n), n - min(per, n), per


class Simulation:
    def __init__(self, plan: Plan, seed: int = 0, use_profiles: bool = True, w_spread: float = 0.04,
                 start_step: int = 0, long_share: float | None = None, recall: float = 1.0):
        self.plan, self.job = plan, plan.job
        self.start_step = start_step  # the run's step this simulation starts at (lengths drift with it)
        self.cm = cm = CostModel(plan.job, use_profiles)
        self.cand = plan_candidate(cm, plan)
        self.rng = np.random.default_rng(seed)
        rl = self.job.rl
        self.B, self.G, self.eta = rl.batch_size, rl.group_size, rl.eta_bound
        # rl.eta "auto": w_spread = the importance weights' std per version of lag it assumes (0.04: the
        # study's lr 1e-4 -> 2.5e-5, eta=4's 0.168 at lag 3.95, docs/staleness.md)
        self.auto = AutoEta(rl.eta_max, rl.eta_w_std_target) if rl.eta == "auto" else None
        self.w_spread = w_spread
        self.free_since = 0.0  # when the trainer last became free to train (its wait starts)
        self.signal: tuple = ()  # the step in flight's (wait s, wait + training s, lag histogram)
        self.eta_by_step: list = []
        self.prompt = cm.w.prompt_len
        self.longest = self.job.rl.max_new_tokens * (self.job.env.max_turns if self.job.env else 1)
        self.turns, self.obs = cm.w.turns, int(round(cm.w.obs_len))
        self.latency = self.job.workload.env_latency_s
        self.reward_s = cm.group_reward_s()
        self.replicas = {}
        for r, rr in zip(plan.replicas, self.cand.rollout.replicas):
            self.replicas[r.id] = Replica(r.id, r.gpu_type, r.tp, rr.batch, r.share, cm, self.cand.stretch)
        host = cm.host.host  # the measured host costs (hexrl.gpus.Host)
        self.control_s = host.controller_us_per_traj * 1e-6  # per trajectory taken in
        self.control_token_s = host.controller_ns_per_token * 1e-9  # per generated token taken in
        self.group_s = host.controller_us_per_group * 1e-6  # handing out the group's prompt
        self.publish_s = host.publish_us_per_replica * 1e-6 * len(self.replicas)  # a version to every replica
        self.control_share = host.controller_core_share  # of one core: its work takes 1 / share as long
        self.handoff_token_s = (host.handoff_ns_per_token_rank0 + host.handoff_ns_per_token_other) * 1e-9
        self.control_debt = 0.0  # controller seconds taken from the training step in flight
        self.control_free = 0.0  # when the controller thread is done with the groups that arrived so far
        self.gate = StalenessGate(self.B, self.auto.eta if self.auto else self.eta, rl.max_concurrent_rollouts,
                                  max_lag=self.eta if self.auto else None)
        self.equal_fraction = self.job.workload.equal_reward_fraction
        self.buffer = ReplayBuffer(self.gate, filter_equal_rewards=self.equal_fraction > 0)
        self.equal: set[int] = set()  # groups whose rewards come out all equal (filtered)
        split = plan.job.long_tail.on  # as the controller: without the job's long tail the marks are ignored
        by_class = {long: {r.id: r.share for r in plan.replicas if r.share > 0 and (r.long_tail and split) == long}
                    for long in (False, True)}
        self.dispatchers = {long: Dispatcher(shares) for long, shares in by_class.items() if shares}
        self.classes = LongGroups(self, long_share, recall)
        self.tail_staleness: dict[int, int] = {}
        self.handed: dict[int, float] = {}  # a long group -> when it was handed out
        self.tail_latency: list[float] = []
        self.events: list = []
        self.order = 0
        self.trained = 0  # finished training steps = the gate's version
        self.live = 0  # weight version the replicas decode with
        self.issued = 0
        self.group_tokens: dict[int, int] = {}
        self.group_obs: dict[int, int] = {}  # observation tokens in a group's episodes (prefilled, not generated)
        self.step_obs: list[int] = []
        self.done: dict[int, list] = {}  # group -> trajectories finished so far
        self.training = False
        self.syncing = False
        self.step_ends: list[float] = []
        self.step_tokens: list[float] = []
        self.train_time = self.sync_time = 0.0
        self.staleness: dict[int, int] = {}
        self.violations = 0
        self.gantt: list = []
        self.gantt_until = math.inf

    # ------------------------------------------------------------------ bookkeeping
    def push(self, t: float, kind: str, *payload):
        heapq.heappush(self.events, (t, self.order, kind, payload))
        self.order += 1

    def mark(self, lane: str, kind: str, t0: float, t1: float):
        if t0 < self.gantt_until and t1 > t0:
            self.gantt.append((lane, kind, t0, t1))

    def growth(self, step: int) -> float:
        """workload.output_len_growth: how many times longer outputs are at `step` than at step 0."""
        g = self.job.workload.output_len_growth
        return 1.0 if g is None else 1.0 + (g["factor"] - 1.0) * min(step, g["steps"]) / g["steps"]

    # ------------------------------------------------------------------ controller
    def dispatch(self, t: float):
        """Hand out prompt groups while the gate allows, as the runtime controller does."""
        while self.gate.capacity(self.trained) > 0:
            gid = self.issued
            long, predicted = self.classes.peek()
            pool = bool(predicted)
            if pool not in self.dispatchers:  # as the controller: a class with no replica gives its groups to the other
                pool = not pool
            rid = self.dispatchers[pool].assign(gid)
            if rid is None:
                return
            self.classes.take(gid)
            self.gate.try_acquire(self.trained)
            self.buffer.expect(gid, self.G)
            self.issued += 1
            r = self.replicas[rid]
            self.group_tokens[gid] = self.group_obs[gid] = 0
            self.done[gid] = []
            if self.equal_fraction and self.rng.random() < self.equal_fraction:
                self.equal.add(gid)
            lengths = self.classes.lengths(long).sample(self.rng, self.G) * self.growth(self.start_step + self.trained)
            if long:
                self.handed[gid] = t
            r.queue.extend((gid, *split_turns(int(max(1, min(n, self.longest))), self.turns, self.rng))
                           for n in lengths)
            if r.chunk is None and not r.paused:
                self.start(r, t)

    def arrive(self, t: float, gid: int):
        """A scored group's trajectories reach the controller thread, which takes them in turn."""
        generated = self.group_tokens[gid] - self.G * self.prompt - self.group_obs[gid]
        work = self.G * self.control_s + generated * self.control_token_s + self.group_s
        start = max(t, self.control_free)
        self.control_free = start + work / self.control_share
        self.mark("controller", "control", start, self.control_free)
        if self.training and self.control_share < 1:  # it shares the trainer's cores
            self.control_debt += work
        self.push(self.control_free, "accept", gid)

    def accept(self, t: float, gid: int):
        """The controller has taken a group in: file its trajectories, maybe train."""
        self.equal.discard(gid)
        for traj in self.done.pop(gid):
            status = self.buffer.add(traj)
        if status != "pending":
            for d in self.dispatchers.values():
                d.done(gid)
        if status != "accepted":
            self.group_tokens.pop(gid, None)
            self.group_obs.pop(gid, None)
        self.try_train(t)
        self.dispatch(t)

    # ------------------------------------------------------------------ rollout
    def start(self, r: Replica, t: float):
        """Admit queued sequences (their prefill), then run decode steps until one finishes."""
        room = r.max_batch - len(r.rem)
        new = [r.queue.popleft() for _ in range(min(room, len(r.queue)))]
        pre = 0.0
        if new:
            fresh = [(g, n, after, per, self.prompt, self.live) for g, n, after, per in
                     (x for x in new if len(x) == 4)]
            back = [x[:6] for x in new if len(x) == 7]
            pre = r.prefill_s(len(fresh) * self.prompt, self.prompt / 2)
            for *_, context, _, live in (x for x in new if len(x) == 7):  # observation, or all after an update
                pre += (r.prefill_s(self.obs, context - self.obs / 2) if live == self.live
                        else r.prefill_s(context, context / 2))
            rows = fresh + back
            r.rem = np.concatenate([r.rem, [x[1] for x in rows]])
            r.after = np.concatenate([r.after, [x[2] for x in rows]])
            r.per = np.concatenate([r.per, [x[3] for x in rows]])
            r.context = np.concatenate([r.context, [x[4] for x in rows]])
            r.ver = np.concatenate([r.ver, [x[5] for x in rows]])
            r.grp = np.concatenate([r.grp, [x[0] for x in rows]])
        self.mark(f"R{r.idx}", "prefill", t, t + pre)
        b = len(r.rem)
        if b == 0:
            r.chunk = None
            return
        k = int(r.rem.min())
        a, c = r.coeffs(b)
        s0 = float(r.context.sum())
        dur = Replica.elapsed(k, a, c, s0, b)
        r.chunk = (t + pre, k, a, c, s0, b)
        r.chunk_id += 1
        r.busy += pre
        self.push(t + pre + dur, "chunk", r, r.chunk_id)

    def advance(self, r: Replica, t_end: float, j: int) -> float:
        """Apply j decode steps of the chunk in flight, ending at t_end; handle finished sequences.
        Returns the host seconds their hand-off takes before the replica's next step."""
        cs = r.chunk[0]
        r.busy += t_end - cs
        self.mark(f"R{r.idx}", "decode", cs, t_end)
        r.steps += j
        r.seq_steps += j * len(r.rem)
        r.rem = r.rem - j
        r.context = r.context + j
        r.chunk = None
        done = r.rem <= 0
        host = r.host_s * int(done.sum())
        if host:
            self.mark(f"R{r.idx}", "host", t_end, t_end + host)
            r.busy += host
        if done.any():
            turn = done & (r.after > 0)  # an episode's turn ended: to its environment, then back in line
            back: dict[float, list] = {}  # answers due at one moment rejoin together
            for g, n, v, after, per in zip(r.grp[turn], r.context[turn], r.ver[turn], r.after[turn], r.per[turn]):
                nxt = int(min(per, after))
                back.setdefault(t_end + host + draw_latency(self.latency, self.rng), []).append(
                    (int(g), nxt, int(after) - nxt, int(per), int(n) + self.obs, int(v)))
            for when, items in back.items():
                self.push(when, "observed", r, items)
            for g, n, v in zip(r.grp[done & ~turn], r.context[done & ~turn], r.ver[done & ~turn]):
                g = int(g)
                self.group_tokens[g] += int(n)
                reward = float(g not in self.equal and not self.done[g])  # unequal: the first scores 1
                self.done[g].append(Trajectory(g, [], [0], [0.0], [int(v)], reward))  # oldest token's version
                if len(self.done[g]) == self.G:  # to the reward workers; sent once scored
                    if g in self.handed:
                        self.tail_latency.append(t_end - self.handed.pop(g))
                    t0 = max(t_end + host, r.reward_free)  # handed over (and later sent) by the host work
                    r.reward_free = t0 + self.reward_s
                    self.mark(f"R{r.idx} reward", "reward", t0, r.reward_free)
                    self.push(r.reward_free, "arrive", g)
            keep = ~done
            r.rem, r.context, r.ver, r.grp = r.rem[keep], r.context[keep], r.ver[keep], r.grp[keep]
            r.after, r.per = r.after[keep], r.per[keep]
        return host

    def on_observed(self, t: float, r: Replica, items: list[tuple]):
        """Episodes' environments answered: their next turns queue (noting the weights they cached)."""
        for item in items:
            self.group_obs[item[0]] += self.obs
            r.queue.append((*item, self.live))
        if r.chunk is None and not r.paused:
            self.start(r, t)

    def on_chunk(self, t: float, r: Replica, chunk_id: int):
        if chunk_id != r.chunk_id or r.chunk is None:
            return  # cut short by a weight update
        t += self.advance(r, t, r.chunk[1])
        if r.chunk is None and not r.paused:
            self.start(r, t)

    def interrupt(self, r: Replica, t: float) -> float:
        """Stop at the first step boundary at or after t; returns that time."""
        if r.chunk is None:
            return t
        cs, k, a, c, s0, b = r.chunk
        if t <= cs:  # still prefilling: that completes, no decode step is taken
            return cs + self.advance(r, cs, 0)
        # smallest j with elapsed(j) >= t - cs: the root of c*b/2 j^2 + (a + c*s0 - c*b/2) j = t - cs
        qa, qb = c * b / 2, a + c * s0 - c * b / 2
        x = t - cs
        j = x / qb if qa == 0 else (-qb + math.sqrt(qb * qb + 4 * qa * x)) / (2 * qa)
        j = min(k, max(1, math.ceil(j - 1e-9)))
        end = cs + Replica.elapsed(j, a, c, s0, b)
        r.chunk_id += 1
        return end + self.advance(r, end, j)

    # ------------------------------------------------------------------ trainer
    def try_train(self, t: float):
        if self.training or self.syncing:
            return
        self.buffer.drop_stale(self.trained)  # as Controller.next_batch does, then oldest first
        batch = self.buffer.pop_batch(self.B)
        if batch is None:
            self.dispatch(t)  # dropped groups gave their slots back
            return
        tokens, obs, lags = 0, 0, {}
        for g in batch:
            tokens += self.group_tokens.pop(g.group_id)
            obs += self.group_obs.pop(g.group_id)
            for traj in g.trajectories:
                s = self.trained - traj.oldest_version
                self.staleness[s] = self.staleness.get(s, 0) + 1
                if g.group_id in self.classes.long:
                    self.tail_staleness[s] = self.tail_staleness.get(s, 0) + 1
                lags[s] = lags.get(s, 0) + 1
                self.violations += self.eta is not None and s > self.eta
            self.classes.long.discard(g.group_id)
        handoff = tokens * self.handoff_token_s  # the batch handed to every trainer rank first
        dur = (self.cand.C_T - self.cand.C_handoff) * self.cand.stretch * tokens / self.cm.w.tokens
        self.signal = (t - self.free_since, t - self.free_since + handoff + dur, lags)
        self.training = True
        self.train_time += handoff + dur
        self.step_tokens.append(tokens)
        self.step_obs.append(obs)
        self.mark("trainer", "handoff", t, t + handoff)
        self.mark("trainer", "train", t + handoff, t + handoff + dur)
        self.push(t + handoff + dur, "trained")

    def on_trained(self, t: float):
        if self.control_debt > 0:  # the step ends later by the controller's share of the core
            debt, self.control_debt = self.control_debt, 0.0
            self.train_time += debt
            self.mark("trainer", "control", t, t + debt)
            self.push(t + debt, "trained")
            return
        self.training = False
        self.trained += 1
        self.step_ends.append(t)
        if self.auto:  # as the runtime does before it publishes the version (Controller.choose_eta)
            wait, busy, lags = self.signal
            rms = (sum(k * k * n for k, n in lags.items()) / max(1, sum(lags.values()))) ** 0.5
            self.gate.eta = self.auto.update(wait, busy, self.w_spread * rms, lags)
        self.eta_by_step.append(self.gate.eta)
        start = max(t, self.control_free)  # the controller sends the new version to every replica
        self.control_free = start + self.publish_s / self.control_share
        self.mark("controller", "publish", start, self.control_free)
        self.syncing = True
        start = t
        for r in self.replicas.values():
            r.paused = True
            start = max(start, self.interrupt(r, t))
        end = start + self.cand.C_sync
        self.sync_time += end - t
        self.mark("trainer", "sync", t, end)
        for r in self.replicas.values():
            self.mark(f"R{r.idx}", "sync", start, end)
        self.push(end, "synced")
        self.dispatch(t)  # the controller opens the gate as soon as the version is published

    def on_synced(self, t: float):
        self.syncing = False
        self.free_since = t
        self.live = self.trained
        for r in self.replicas.values():  # paused until its recompute is done
            resume = t
            if len(r.rem):  # KV recompute of every running sequence with the new weights
                context = float(r.context.sum())
                rec = r.prefill_s(context, context / len(r.rem) / 2)
                r.busy += rec
                self.mark(f"R{r.idx}", "recompute", t, t + rec)
                resume = t + rec
            self.push(resume, "resume", r)
        self.try_train(t)

    def on_resume(self, t: float, r: Replica):
        r.paused = False
        if r.chunk is None:
            self.start(r, t)

    # ------------------------------------------------------------------ loop
    def run(self, steps: int = 12, warmup: int = 2, gantt_steps: int = 3) -> SimResult:
        handlers = {
            "chunk": self.on_chunk,
            "arrive": self.arrive,
            "accept": self.accept,
            "trained": self.on_trained,
            "synced": self.on_synced,
            "resume": self.on_resume,
            "observed": self.on_observed,
        }
        self.dispatch(0.0)
        while self.events and len(self.step_ends) < steps:
            t, _, kind, payload = heapq.heappop(self.events)
            handlers[kind](t, *payload)
            if len(self.step_ends) == gantt_steps and self.gantt_until == math.inf:
                self.gantt_until = t
        return self.result(warmup)

    def result(self, warmup: int) -> SimResult:
        n = len(self.step_ends)
        if n <= warmup:
            raise RuntimeError(f"simulation finished only {n} steps; nothing left after {warmup} warm-up steps")
        t0, t1 = self.step_ends[warmup - 1] if warmup else 0.0, self.step_ends[-1]
        window = t1 - t0
        tokens = sum(self.step_tokens[warmup:n])
        gen = tokens - (n - warmup) * self.B * self.G * self.prompt - sum(self.step_obs[warmup:n])
        # busy time is accumulated over the whole run: scale by the window's share of it
        span = t1
        roll_gpus = sum(r.tp for r in self.replicas.values())
        roll_busy = sum(r.busy * r.tp for r in self.replicas.values()) / roll_gpus / span
        train_busy = self.train_time / span
        sync = self.sync_time / span
        return SimResult(
            steps=n, window_s=window, step_time_s=window / (n - warmup), tokens_per_s=tokens / window,
            gen_tokens_per_s=gen / window, trainer_busy=train_busy, sync_fraction=sync,
            rollout_busy=roll_busy,
            idle={"train": max(0.0, 1 - train_busy - sync), "rollout": max(0.0, 1 - roll_busy - sync)},
            staleness=dict(sorted(self.staleness.items())), violations=self.violations,
            dropped_stale=self.buffer.dropped.get("stale", 0),
            predicted_step_s=self.cand.step_s, gantt=self.gantt,
            mean_batch=(sum(r.seq_steps for r in self.replicas.values())
                        / max(1, sum(r.steps for r in self.replicas.values()))),
            eta_by_step=self.eta_by_step, tail_staleness=dict(sorted(self.tail_staleness.items())),
            tail_latency_s=float(np.mean(self.tail_latency)) if self.tail_latency else 0.0,
        )


def simulate(plan: Plan, steps: int = 12, warmup: int = 2, seed: int = 0, gantt_steps: int = 3,
             use_profiles: bool = True, w_spread: float = 0.04, start_step: int = 0,
             long_share: float | None = None, recall: float = 1.0) -> SimResult:
    """Run the plan for `steps` RL steps from the run's step `start_step`; measure after `warmup`
    steps (w_spread, long_share, recall: see Simulation)."""
    return Simulation(plan, seed, use_profiles, w_spread, start_step, long_share, recall).run(steps, warmup,
                                                                                               gantt_steps)


class LongGroups:
    """Which groups are long, and which the prediction marks long (see the module's docstring).
    long_share None: the plan's long tail where it has long-tail replicas, else 0 (every group's
    lengths drawn from the whole distribution, as without a long tail)."""

    def __init__(self, sim: "Simulation", long_share: float | None, recall: float):
        tail = sim.cm.tail
        if long_share is None:
            long_share = tail.prompt_share(True) if tail and any(r.long_tail for r in sim.plan.replicas) else 0.0
        self.sim, self.recall = sim, recall
        self.per_batch = min(sim.B - 1, max(1, round(long_share * sim.B))) if long_share > 0 else 0
        whole = sim.cm.lengths
        self.dists = ((whole, whole) if not self.per_batch
                      else whole.split(self.per_batch / sim.B)[::-1])  # (regular, long)
        self.block: deque = deque()  # (long, predicted long) of the groups still to hand out in this block
        self.long: set[int] = set()  # long groups handed out and not yet trained on or dropped

    def lengths(self, long: bool):
        return self.dists[long]

    def peek(self) -> tuple[bool, bool]:
        """(long, predicted long) of the next group handed out."""
        if not self.block:
            self.block.extend(self._draw_block())
        return self.block[0]

    def take(self, gid: int) -> None:
        long, _ = self.block.popleft()
        if long:
            self.long.add(gid)

    def _draw_block(self) -> list[tuple[bool, bool]]:
        """B groups in random order, per_batch of them long; the prediction marks per_batch long,
        round(recall * per_batch) of them rightly."""
        B, n = self.sim.B, self.per_batch
        if n == 0:
            return [(False, False)] * B
        rng = self.sim.rng
        hits = round(self.recall * n)
        flags = ([(True, True)] * hits + [(True, False)] * (n - hits) + [(False, True)] * (n - hits)
                 + [(False, False)] * (B - 2 * n + hits))
        return [flags[i] for i in rng.permutation(B)]
