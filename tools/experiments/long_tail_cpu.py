"""Dispatch by length class on the CPU with the real engine: rollout throughput and the staleness of
the long tail's tokens, length-blind vs by class, side by side in one window; and what moving a
group that outgrew its prediction costs.

    python -m tools.experiments.long_tail_cpu                 # both arms, then the move costs
    python -m tools.experiments.long_tail_cpu --steps 8 --regular 2 --tail 2 --tail-cap 8
    python -m tools.experiments.long_tail_cpu --move-only     # only what a move costs: recompute vs decode,
                                                              # and a group handed from one engine to another

The task: `--problems` problems, a quarter of them long (`--long` tokens a sample, the rest
`--short`; each sample +-20%), every problem's length_hint its class's length. Each arm is the real
Controller (gate, replay buffer, length predictor, dispatch by class) over virtual replicas, each a
real Engine on one random Qwen2-shaped model (fp32), its max_running the plan's batch cap. The
replicas share this process and its cores, so each keeps its own clock, advanced by the measured
wall time of each of its steps (the replica whose next event is earliest steps next): the arm's
time is what that many machines stepping in parallel would take. The trainer consumes a batch the
moment B groups are ready (training takes no time: the rollout is what is measured) and publishes
the next version; each replica interrupts at it as a real one does (the engine's weight update: KV
dropped, unfinished sequences recomputed). The arms alternate step by step (the one with less wall
time spent goes next), so the machine's background load falls on both alike.

Arms: length-blind (alpha 0: every replica regular, by share) and by class (alpha = the long share;
the --tail replicas marked long_tail with max_running --tail-cap). Both have the same replicas and
caps; only dispatch differs. Printed per arm: rollout tokens/s (tokens generated / time to the last
step's batch), steps/min, the version lag of the trained tokens (trainer version when trained
minus the version that sampled it) for the long problems' tokens (the tail) and the short ones',
and each group's age when trained (seconds from its dispatch: its first tokens' staleness in time).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from hexrl.comm.wire import RESUME_FIELDS, decode, encode, message, trajectory_to_msg
from hexrl.control.controller import Controller, ReplicaInfo
from hexrl.control.dataset import DatasetCursor
from hexrl.data.problems import Problem
from hexrl.model.config import ModelConfig
from hexrl.model.decoder import Decoder
from hexrl.rollout import Engine, EngineConfig, Request
from hexrl.rollout.rollout_rank import PendingGroup, handback_message, resumed_group, sample_request
from hexrl.trajectory import Trajectory

SHAPE = dict(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=4096)
PROMPT_LEN = 16
LONG_SHARE = 0.25


def random_model(seed: int = 0) -> Decoder:
    cfg = ModelConfig.from_hf({"architectures": ["Qwen2ForCausalLM"], "rms_norm_eps": 1e-6, **SHAPE})
    torch.manual_seed(seed)
    model = Decoder(cfg)
    model.init_weights(seed=seed)
    return model.eval()


def bimodal_problems(n: int, short: int, long: int, seed: int) -> list[Problem]:
    """`n` problems, a quarter of them long; each one's hint is its class's length."""
    rng = random.Random(seed)
    longs = set(rng.sample(range(n), round(LONG_SHARE * n)))
    return [Problem(f"p{i}", "0", id=i, kind="synthetic", length_hint=float(long if i in longs else short))
            for i in range(n)]


def sample_length(problem: Problem, group_id: int, sample: int) -> int:
    """The task's answer length for one sample: its problem's class length, +-20%."""
    jitter = random.Random(group_id * 1_000_003 + sample).uniform(0.8, 1.2)
    return max(1, round(problem.length_hint * jitter))


@dataclass
class VirtualReplica:
    """A real engine with its own clock; what is sent to it waits in `inbox` until its clock reaches it."""

    id: int
    engine: Engine
    clock: float = 0.0
    inbox: list = field(default_factory=list)  # (time, Request | version), in time order

    def next_event(self) -> float:
        """When it acts next: now if it has work, else when its first message arrives (inf: never)."""
        if self.engine.has_work():
            return self.clock
        return max(self.clock, self.inbox[0][0]) if self.inbox else float("inf")

    def receive(self) -> None:
        """Take in every message that has arrived by its clock."""
        while self.inbox and self.inbox[0][0] <= self.clock:
            _, item = self.inbox.pop(0)
            if isinstance(item, Request):
                self.engine.add(item)
            else:  # a weight version: the interruption a real update makes (KV dropped, recompute)
                self.engine.update_weights(lambda model: None, item)


class LocalRouter:
    """The controller's RouterChannel, delivering into the arm's virtual replicas at the arm's time."""

    def __init__(self, arm: "Arm"):
        self.arm, self.rejected = arm, Counter()
        self.peers = {f"replica-{r.id}" for r in arm.replicas}

    def send(self, msg: dict, to: str, timeout_s: float = 5.0) -> bool:
        self.arm.deliver(int(to.removeprefix("replica-")), msg)
        return True

    def broadcast(self, msg: dict, to: list[str], timeout_s: float = 30.0) -> list[str]:
        for name in to:
            self.send(msg, name)
        return []


class Arm:
    """One configuration: the real controller over virtual replicas, run a step at a time."""

    def __init__(self, name: str, model: Decoder, problems: list[Problem], args, alpha: float):
        self.name, self.problems, self.now, self.wall = name, {p.id: p for p in problems}, 0.0, 0.0
        caps = [args.cap] * args.regular + [args.tail_cap] * args.tail
        self.replicas = [VirtualReplica(i, Engine(model, EngineConfig(max_running=cap, overlap=False,
                                                                      cpu_kv_bytes=64 << 20), eos_ids=[]))
                         for i, cap in enumerate(caps)]
        rl = SimpleNamespace(batch_size=args.batch, group_size=args.group, eta=args.eta, max_concurrent_rollouts=None,
                             filter_equal_groups=False, temperature=1.0, top_p=1.0, top_k=0,
                             max_new_tokens=2 * args.long, seed=args.seed, reward_bound=1e6)
        infos = [ReplicaInfo(i, 1.0, i >= args.regular) for i in range(len(caps))]
        self.ctl = Controller(rl, DatasetCursor(problems, seed=args.seed), self.encode, infos, LocalRouter(self),
                              vocab_size=SHAPE["vocab_size"], long_tail_alpha=alpha)
        self.sent: dict[int, dict] = {}  # group id -> its prompt message
        self.lags: dict[bool, list[int]] = {True: [], False: []}  # long problem? -> trained tokens' lags
        self.ages: dict[bool, list[float]] = {True: [], False: []}  # long problem? -> seconds, dispatch to trained
        self.sent_at: dict[int, float] = {}  # group id -> when it was dispatched
        self.routed: Counter = Counter()  # (long problem?, to a long-tail replica?) -> groups
        self.regular, self.short = args.regular, min(p.length_hint for p in problems)
        self.steps_done, self.steps_s = 0, 0.0

    @staticmethod
    def encode(text: str) -> list[int]:
        rng = random.Random(text)
        return [rng.randrange(3, SHAPE["vocab_size"]) for _ in range(PROMPT_LEN)]

    def deliver(self, replica: int, msg: dict) -> None:
        r = self.replicas[replica]
        if msg["type"] == "weights":
            r.inbox.append((self.now, msg["version"]))
            return
        self.sent[msg["group_id"]], self.sent_at[msg["group_id"]] = msg, self.now
        problem = self.problems[msg["problem_id"]]
        self.routed[problem.length_hint > self.short, replica >= self.regular] += 1
        for i in range(msg["n"]):
            r.inbox.append((self.now, Request((msg["group_id"], i), list(msg["prompt_ids"]), ignore_eos=True,
                                              max_new_tokens=sample_length(problem, msg["group_id"], i),
                                              seed=msg["sampling"]["seed"] + i)))

    def step(self) -> None:
        """Dispatch what the gate allows, then one engine step of the replica whose next event is first."""
        self.ctl._flush_outbox()
        self.ctl._dispatch()
        r = min(self.replicas, key=VirtualReplica.next_event)
        r.clock = self.now = r.next_event()
        r.receive()
        if not r.engine.has_work():
            return
        t0 = time.perf_counter()
        finished = r.engine.step()
        dt = time.perf_counter() - t0
        r.clock, self.now, self.wall = r.clock + dt, r.clock + dt, self.wall + dt
        for out in finished:
            self.admit(r.id, out)
        self.train()

    def admit(self, replica: int, out) -> None:
        gid, i = out.id
        msg = self.sent[gid]
        traj = Trajectory(gid, list(msg["prompt_ids"]), out.token_ids, out.logprobs, out.versions, reward=float(i),
                          finish_reason=out.finish_reason, problem_id=msg["problem_id"],
                          start_version=out.versions[0] if out.versions else self.ctl.version)
        self.ctl._admit(replica, trajectory_to_msg(traj))

    def train(self) -> None:
        """Consume every batch that is ready: record its tokens' lags, publish the next version."""
        while True:
            try:
                batch = self.ctl.next_batch(timeout_s=0)
            except TimeoutError:
                return
            version = self.ctl.version
            for g in batch:
                long = self.problems[g.problem_id].length_hint > self.short
                self.ages[long].append(self.now - self.sent_at[g.group_id])
                for t in g.trajectories:
                    self.lags[long].extend((version - t.versions).tolist())
            self.steps_done, self.steps_s = self.steps_done + 1, self.now
            self.ctl.publish_version(version + 1)

    def share_to_tail(self, long: bool) -> float:
        """The share of the long (or short) problems' groups dispatched to long-tail replicas."""
        return self.routed[long, True] / max(1, self.routed[long, True] + self.routed[long, False])

    def report(self) -> dict:
        tokens = sum(r.engine.stats.generated_tokens for r in self.replicas)
        tail, rest = self.lags[True], self.lags[False]
        return {"arm": self.name, "time_s": self.steps_s, "tokens_per_s": tokens / self.now,
                "steps_per_min": 60 * self.steps_done / self.steps_s,
                "tail_lag": mean(tail),
                "tail_stale": mean([x >= 1 for x in tail]), "short_lag": mean(rest), "tail_tokens": len(tail),
                "tail_age_s": mean(self.ages[True]), "short_age_s": mean(self.ages[False]),
                "long_to_tail": self.share_to_tail(True), "short_to_tail": self.share_to_tail(False),
                "busy": [r.engine.stats.seconds / self.now for r in self.replicas],
                "batch": [r.engine.stats.generated_tokens / max(1, r.engine.stats.steps) for r in self.replicas]}


def mean(values: list) -> float:
    return statistics.fmean(values) if values else float("nan")


def run_arms(args) -> list[dict]:
    """Both arms on the same model and problems, stepped alternately until each trained `--steps` batches."""
    model = random_model(args.seed)
    problems = bimodal_problems(args.problems, args.short, args.long, args.seed)
    arms = [Arm("length-blind", model, problems, args, 0.0), Arm("by class", model, problems, args, LONG_SHARE)]
    while any(a.steps_done < args.steps for a in arms):
        min((a for a in arms if a.steps_done < args.steps), key=lambda a: a.wall).step()
    return [a.report() for a in arms]


def timed_step(engine: Engine) -> float:
    t0 = time.perf_counter()
    engine.step()
    return time.perf_counter() - t0


def decode_step_s(model: Decoder, batch: int, context: int, reps: int = 20) -> float:
    """Median seconds of one decode step of `batch` sequences `context` tokens long."""
    engine = Engine(model, EngineConfig(max_running=batch, overlap=False, cpu_kv_bytes=64 << 20), eos_ids=[])
    for i in range(batch):
        engine.add(Request(i, [5] * context, max_new_tokens=reps + 2, ignore_eos=True, temperature=0.0))
    engine.step()  # the prefill
    return statistics.median(timed_step(engine) for _ in range(reps))


def prefill_s(model: Decoder, tokens: int, reps: int = 5) -> float:
    """Median seconds to recompute one sequence of `tokens` tokens (prompt + generated) alone."""
    times = []
    for k in range(reps):
        engine = Engine(model, EngineConfig(max_running=1, overlap=False, cpu_kv_bytes=64 << 20), eos_ids=[])
        engine.add(Request(k, [5] * tokens, max_new_tokens=2, ignore_eos=True, temperature=0.0))
        times.append(timed_step(engine))
    return statistics.median(times)


def moved_group_s(model: Decoder, group: int, prompt: int, generated: int, reps: int = 3) -> tuple[float, float]:
    """Median seconds, per group of `group` samples that generated `generated` tokens each after a
    `prompt`-token prompt, of the hand-off at a weight update (withdraw from the source, the
    `withdrawn` message out and the resumed `prompt` in, through the wire, and the target's add) and
    of the target's first step (the group's recompute, which the source pays instead when unmoved)."""
    msg = message("prompt", group_id=0, problem_id=0, prompt_ids=[5] * prompt, n=group, version=0,
                  sampling={"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 2 * generated, "seed": 1})
    handoff, recompute = [], []
    for _ in range(reps):
        source, target = (Engine(model, EngineConfig(overlap=False, cpu_kv_bytes=64 << 20), eos_ids=[])
                          for _ in range(2))
        for i in range(group):
            source.add(sample_request(msg, i))
        for _ in range(generated):
            source.step()
        source.update_weights(lambda m: None, 1)  # the interruption (same weights)
        target.update_weights(lambda m: None, 1)
        t0 = time.perf_counter()
        taken = source.withdraw([f"0:{i}" for i in range(group)])
        back = decode(encode(handback_message(PendingGroup(msg), taken, rank=0)))
        _, requests = resumed_group(decode(encode({**msg, "resume": {k: back[k] for k in RESUME_FIELDS}})))
        for r in requests:
            target.add(r)
        handoff.append(time.perf_counter() - t0)
        recompute.append(timed_step(target))
    return statistics.median(handoff), statistics.median(recompute)


def move_costs(args) -> None:
    """A group that outgrew its prediction, moved at an interruption: its sequences are recomputed
    there (prompt + generated tokens) instead of on the source, which recomputes them at the same
    interruption anyway; what the move changes is the per-token latency of the tokens left."""
    model = random_model(args.seed)
    decode_step_s(model, 1, 64)  # warm-up: oneDNN packing, allocator
    print("\ndecode step (ms) by batch, context 256:")
    steps = {b: decode_step_s(model, b, 256) for b in (1, 8, 32, 64)}
    print("  " + "  ".join(f"batch {b}: {s * 1e3:.2f}" for b, s in steps.items()))
    print("recompute of prompt + generated tokens alone (ms):")
    recompute = {n: prefill_s(model, n) for n in (128, 512, 1024)}
    print("  " + "  ".join(f"{n}: {s * 1e3:.1f}" for n, s in recompute.items()))
    saved = steps[64] - steps[8]
    print(f"a token left decodes {saved * 1e3:.2f} ms sooner in a batch of 8 than of 64; at an interruption the "
          f"recompute is paid wherever the sequence goes; outside one, recomputing 1,024 tokens pays back after "
          f"{recompute[1024] / max(saved, 1e-9):.0f} tokens left")
    print(f"a group of {args.group} moved at a weight update (prompt {PROMPT_LEN}), ms: hand-off (withdraw, "
          "both messages through the wire, add) / the target's recompute of it:")
    for generated in (64, 256, 1024):
        handoff, recompute = moved_group_s(model, args.group, PROMPT_LEN, generated)
        print(f"  {generated} tokens generated each: {handoff * 1e3:.2f} / {recompute * 1e3:.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="trained batches per arm")
    p.add_argument("--batch", type=int, default=8, help="groups per batch (B)")
    p.add_argument("--group", type=int, default=4, help="samples per group")
    p.add_argument("--eta", type=int, default=1)
    p.add_argument("--problems", type=int, default=64)
    p.add_argument("--short", type=int, default=32, help="tokens of a short problem's sample")
    p.add_argument("--long", type=int, default=256, help="tokens of a long problem's sample")
    p.add_argument("--regular", type=int, default=2, help="regular replicas")
    p.add_argument("--tail", type=int, default=2, help="long-tail replicas (regular in the length-blind arm)")
    p.add_argument("--cap", type=int, default=64, help="max_running of a regular replica")
    p.add_argument("--tail-cap", type=int, default=8, help="max_running of a long-tail replica")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--move-only", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    if not args.move_only:
        t0 = time.perf_counter()
        rows = run_arms(args)
        print(f"{'arm':<14}{'time s':>8}{'tok/s':>9}{'steps/min':>10}{'tail lag':>9}{'tail >=1':>9}"
              f"{'short lag':>10}{'tail age s':>11}{'short age s':>12}{'long->tail':>11}{'short->tail':>12}"
              "  busy, mean batch per replica")
        for r in rows:
            print(f"{r['arm']:<14}{r['time_s']:>8.1f}{r['tokens_per_s']:>9.0f}{r['steps_per_min']:>10.1f}"
                  f"{r['tail_lag']:>9.2f}{r['tail_stale']:>9.0%}{r['short_lag']:>10.2f}{r['tail_age_s']:>11.2f}"
                  f"{r['short_age_s']:>12.2f}{r['long_to_tail']:>11.0%}{r['short_to_tail']:>12.0%}  "
                  + " ".join(f"{b:.0%} {n:.0f}" for b, n in zip(r["busy"], r["batch"])))
        print(f"(wall {time.perf_counter() - t0:.0f} s)")
    move_costs(args)


if __name__ == "__main__":
    main()
