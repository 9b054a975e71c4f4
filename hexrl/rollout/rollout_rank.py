"""The rollout rank's loop: prompts in over ZeroMQ, trajectories (with rewards) out.

A finished group goes to the reward workers and decoding goes on; the group is sent once its
rewards are back, so a slow reward (math-verify, the code sandbox) never stalls the engine.
With a job `env`, each sample is an episode (hexrl/rollout/episodes.py): its turns go to the
environment's workers in the same way, and the environment gives the reward.

A group that outgrows its length prediction moves (docs/long-tail.md): at a weight update the
controller asks for a `report`, the leader sends each running group's progress, and a group the
controller withdraws goes back as it stands (`handback_message`); the long-tail replica that gets
it resumes its samples from their prefixes (`resumed_group`).

The replica leader (TP rank 0) talks to the controller; the other TP ranks of the replica
mirror its engine steps in `Engine.follow`. Every rank of the replica joins the weight
broadcast when the controller announces a new version (between decode steps: the engine
then drops its KV pages and recomputes every unfinished sequence).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from hexrl.comm.channel import DealerChannel
from hexrl.comm.store import lookup_endpoint
from hexrl.comm.weights import ShardLayout, SyncLink, current_values, load_into, receive_shards, receive_stage_ipc
from hexrl.comm.wire import message, trajectory_to_msg, validate
from hexrl.envs.base import Problem
from hexrl.envs.pool import EnvPool
from hexrl.model.parallel import TPGroup
from hexrl.rewards import RewardPool
from hexrl.runtime import effective
from hexrl.runtime.context import RankContext
from hexrl.runtime.files import write_json_atomic
from hexrl.runtime.watchdog import describe_exception
from hexrl.trajectory import ID_DTYPE, LOGPROB_DTYPE, VERSION_DTYPE, Trajectory, to_array

from .engine import Engine, EngineStats
from .episodes import Episode, EpisodeDriver
from .sequence import Finished, Prefix, Request

HEARTBEAT_S = 1.0
MAX_MESSAGES_PER_POLL = 256
TRACE_S = 2.0  # how often the leader appends where its time went to RUN/engine/replica<ID>.jsonl


@dataclass
class SyncGroup:
    """One pipeline stage's weight sync as this rollout rank takes part in it: its sources (CUDA IPC:
    the one source and its group) and how the trainer splits the stage among them."""

    links: list[SyncLink]
    layout: ShardLayout


@dataclass
class LeaderTime:
    """Where the leader's wall time went, cumulative seconds per part of its loop (the engine's
    own steps are `EngineStats.seconds`); `sent` counts trajectories sent, which lines the trace up
    with the controller's `trajectories_produced`."""

    poll_s: float = 0.0  # receiving prompts and weights (and waiting for them when idle)
    engine_s: float = 0.0  # engine.step(), as the leader sees it
    collect_s: float = 0.0  # filing finished samples, handing groups to the reward workers
    send_s: float = 0.0  # collecting rewards (waiting for them when idle), sending trajectories
    sent: int = 0


@dataclass
class PendingGroup:
    msg: dict
    outputs: dict[int, Finished | Episode] = field(default_factory=dict)
    start_version: int = 0  # the engine's weights when the group started: the version of a sample with no tokens


def weight_receiver(sync: list[SyncGroup], dtype: torch.dtype, device, ipc: bool = False,
                    replica: TPGroup | None = None, delta: bool | str = False):
    """`on_update(version)` for the engine: take each stage's pieces from its sources (shared with the
    replica's other TP ranks) and load them (or, on a GPU shared with the trainer, copy out of its
    export buffer through CUDA IPC). With `delta`, a piece may patch the weights this rank holds."""
    mapped: dict[bytes, torch.Tensor] = {}  # the trainer's buffers, mapped once

    def receive(version: int):
        def load(model):
            for s in sync:
                if ipc:
                    receive_stage_ipc(s.layout.specs, s.links[0].src, s.links[0].group, dtype, device,
                                      lambda part: load_into(model, part), mapped)
                else:
                    previous = current_values(model) if delta else None
                    receive_shards(s.layout, s.links, replica, dtype, device, lambda part: load_into(model, part),
                                   previous)
        return load
    return receive


class RolloutLeader:
    """Drives one replica's engine from controller messages; sends finished groups back."""

    episodes: EpisodeDriver | None = None  # a job env's episodes; None: single-turn samples

    def __init__(self, engine: Engine, replica_id: int, rank: int, store, secret: bytes, receive_weights,
                 reward: str, reward_timeout_s: float, tokenizer, reward_workers: int = 2,
                 trace: Path | None = None, env=None):
        self.engine, self.rank, self.receive_weights, self.tokenizer = engine, rank, receive_weights, tokenizer
        self.channel = DealerChannel(f"replica-{replica_id}", secret)
        self.channel.connect(lookup_endpoint(store, "controller", timeout_s=300))
        self.reward_name = reward
        self.rewards = None  # an environment gives episodes their rewards
        if env is None:
            self.rewards = RewardPool(reward, workers=reward_workers, timeout_s=reward_timeout_s)
        else:
            pool = EnvPool(env.name, env.options, workers=env.workers, timeout_s=env.timeout_s)
            self.episodes = EpisodeDriver(engine, tokenizer, env, pool)
        self.groups: dict[int, PendingGroup] = {}
        self.scoring: dict[int, PendingGroup] = {}  # reward ticket -> finished group being scored
        self._last_beat = 0.0
        self.time, self.trace, self._last_trace = LeaderTime(), trace, 0.0
        if trace is not None:
            trace.parent.mkdir(parents=True, exist_ok=True)

    def run(self) -> None:
        t, clock = self.time, time.perf_counter
        try:
            while True:
                t0 = clock()
                if not self._poll():
                    break
                t1 = clock()
                finished = self.engine.step() if self.engine.has_work() else []
                t2 = clock()
                self._collect(finished)
                t3 = clock()
                # nothing to decode: wait on the reward (or environment) workers instead of spinning
                self._send_scored(0.0 if self.engine.has_work() else 0.02)
                t4 = clock()
                t.poll_s, t.engine_s, t.collect_s, t.send_s = (
                    t.poll_s + t1 - t0, t.engine_s + t2 - t1, t.collect_s + t3 - t2, t.send_s + t4 - t3)
                self._heartbeat()
                self._write_trace()
            self._write_trace(final=True)
        except Exception as e:  # tell the controller why before the socket closes
            self.report_error(describe_exception(e))
            raise
        finally:
            self.engine.shutdown()
            (self.rewards or self.episodes.pool).close()
            self.channel.close()

    def report_error(self, cause: str) -> None:
        self.channel.send(message("error", rank=self.rank, cause=cause), timeout_s=2)

    def _poll(self) -> bool:
        """Handle waiting messages (at most MAX_MESSAGES_PER_POLL, so a flood of prompts cannot
        starve decoding and heartbeats); False once told to stop."""
        for i in range(MAX_MESSAGES_PER_POLL):
            idle = i == 0 and not self.engine.has_work() and not self.scoring and not (
                self.episodes and self.episodes.episodes)
            msg = self.channel.recv(0.05 if idle else 0)
            if msg is None:
                break
            kind = msg["type"]
            if kind == "stop":
                return False
            if kind == "prompt":
                self._add_group(msg)
            elif kind == "weights":
                if msg.get("report") and not self.episodes:  # before the update: the controller decides meanwhile
                    self._send([self._progress(msg["version"])])
                self.engine.update_weights(self.receive_weights(msg["version"]), msg["version"])
            elif kind == "withdraw" and not self.episodes:
                self._hand_back(msg["group_ids"])
        return True

    def _add_group(self, msg: dict) -> None:
        if msg.get("resume") is not None:
            group, requests = resumed_group(msg)
            self.groups[msg["group_id"]] = group
            for r in requests:
                self.engine.add(r)
            if len(group.outputs) == msg["n"]:  # every sample had finished: nothing to generate
                self._score(self.groups.pop(msg["group_id"]))
            return
        self.groups[msg["group_id"]] = PendingGroup(msg, start_version=self.engine.version)
        problem = Problem(self.tokenizer.decode(msg["prompt_ids"]), msg.get("answer"), msg["problem_id"],
                          msg.get("tests")) if self.episodes else None
        for i in range(msg["n"]):
            request = sample_request(msg, i)
            if self.episodes:
                self.episodes.start(request, problem)
            else:
                self.engine.add(request)

    def _progress(self, version: int) -> dict:
        """One row per sample of each group still generating: its tokens so far, finished or not."""
        running, rows = self.engine.progress(), []
        for gid, group in self.groups.items():
            for i in range(group.msg["n"]):
                out = group.outputs.get(i)
                rows.append((gid, len(out.token_ids) if out else running.get(f"{gid}:{i}", 0), int(out is not None)))
        gids, generated, finished = (list(c) for c in zip(*rows)) if rows else ([], [], [])
        return message("progress", rank=self.rank, version=version, group_ids=gids, generated=generated,
                       finished=finished)

    def _hand_back(self, group_ids: list[int]) -> None:
        """Take the groups the controller withdraws out of the engine and send each back as it stands
        (a group already complete is being scored: it is sent as trajectories as usual)."""
        for gid in map(int, group_ids):
            group = self.groups.get(gid)
            if group is None:
                continue
            taken = self.engine.withdraw([f"{gid}:{i}" for i in range(group.msg["n"]) if i not in group.outputs])
            self._send([handback_message(self.groups.pop(gid), taken, self.rank)])

    def _collect(self, finished: list[Finished]) -> None:
        for out in finished:
            if self.episodes:
                self.episodes.on_turn(out)
            elif self._file(out.id, out):
                self._score(self.groups.pop(int(out.id.split(":")[0])))

    def _file(self, id: str, out: Finished | Episode) -> bool:
        """File a finished sample; True when that completes its group."""
        gid, i = map(int, id.split(":"))
        group = self.groups[gid]
        group.outputs[i] = out
        return len(group.outputs) == group.msg["n"]

    def _score(self, group: PendingGroup) -> None:
        """Hand a finished group's completions to the reward workers (no waiting)."""
        self.scoring[self.rewards.submit(reward_inputs(group, self.reward_name, self.tokenizer))] = group

    def _send_scored(self, wait_s: float) -> None:
        """Send every group whose rewards are all back (or whose episodes all ended), as trajectories."""
        if self.episodes:
            for ep in self.episodes.poll(wait_s if self.episodes.waiting else 0.0):
                if self._file(ep.id, ep):
                    self._send(episode_messages(self.groups.pop(int(ep.id.split(":")[0])), self.rank))
            return
        for ticket, rewards in self.rewards.finished(wait_s).items():
            self._send(trajectory_messages(self.scoring.pop(ticket), rewards, self.rank))

    def _send(self, msgs: list[dict]) -> None:
        for msg in msgs:
            if not self.channel.send(msg, timeout_s=60):
                raise RuntimeError("the controller stopped accepting trajectories for 60 s")
            self.time.sent += 1

    def _write_trace(self, final: bool = False) -> None:
        """Every TRACE_S, one line of cumulative counters: the leader's time split, the engine's
        stats and the process's CPU seconds (tools/experiments/learning_study.py compares them with the
        simulator window by window)."""
        now = time.time()
        if self.trace is None or (now - self._last_trace < TRACE_S and not final):
            return
        self._last_trace = now
        e = self.engine.stats
        line = {"time": now, "cpu_s": time.process_time(), **asdict(self.time), "steps": e.steps,
                "engine_step_s": e.seconds, "mixed_steps": e.mixed_steps, "generated_tokens": e.generated_tokens,
                "prefill_tokens": e.prefill_tokens}
        with open(self.trace, "a") as f:
            f.write(json.dumps(line) + "\n")

    def _heartbeat(self) -> None:
        now = time.time()
        if now - self._last_beat >= HEARTBEAT_S:
            self.channel.send(message("heartbeat", rank=self.rank, time=now), timeout_s=1)
            self._last_beat = now


def sample_request(msg: dict, i: int, prefix: Prefix | None = None) -> Request:
    """The engine request of sample `i` of the `prompt` message `msg` (its seed fixed by the group's)."""
    s = msg["sampling"]
    return Request(id=f"{msg['group_id']}:{i}", prompt_ids=list(msg["prompt_ids"]),
                   max_new_tokens=int(s["max_new_tokens"]), temperature=float(s["temperature"]),
                   top_p=float(s["top_p"]), top_k=int(s["top_k"]), seed=(int(s["seed"]) * 64 + i) % (1 << 62),
                   prefix=prefix)


def handback_message(group: PendingGroup, taken: dict, rank: int) -> dict:
    """The `withdrawn` message of a group taken out of the engine (`taken`: Engine.withdraw's answer):
    per sample its tokens, log-probs and versions so far, and its finish reason ("" if running)."""
    ids, logprobs, versions, lengths, reasons = [], [], [], [], []
    for i in range(group.msg["n"]):
        out = group.outputs.get(i) or taken[f"{group.msg['group_id']}:{i}"]
        ids += out.token_ids
        logprobs += out.logprobs
        versions += out.versions
        lengths.append(len(out.token_ids))
        reasons.append(out.finish_reason if isinstance(out, Finished) else "")
    return message("withdrawn", group_id=group.msg["group_id"], start_version=group.start_version,
                   completion_ids=to_array(ids, ID_DTYPE, "completion_ids"),
                   logprobs=to_array(logprobs, LOGPROB_DTYPE, "logprobs"),
                   versions=to_array(versions, VERSION_DTYPE, "versions"), lengths=lengths, finish_reasons=reasons,
                   rank=rank)


def resumed_group(msg: dict) -> tuple[PendingGroup, list[Request]]:
    """A moved group (a `prompt` message with `resume`): its finished samples filed, and a request
    resuming each of the others from its prefix. The prefix keeps its tokens' log-probs and versions,
    and the group its start version: its trajectories are what they would have been unmoved."""
    resume = msg["resume"]
    validate(message("withdrawn", group_id=msg["group_id"], **resume))  # the controller checked it; so do we
    group, requests, at = PendingGroup(msg, start_version=resume["start_version"]), [], 0
    for i, (n, reason) in enumerate(zip(resume["lengths"], resume["finish_reasons"])):
        ids, lps, vs = (np.asarray(resume[f])[at:at + n].tolist() for f in ("completion_ids", "logprobs", "versions"))
        at += n
        if reason:
            group.outputs[i] = Finished(f"{msg['group_id']}:{i}", list(msg["prompt_ids"]), ids, lps, vs, reason)
        else:
            requests.append(sample_request(msg, i, Prefix(ids, lps, vs)))
    return group, requests


def reward_inputs(group: PendingGroup, reward: str, tokenizer) -> list[tuple[str, object]]:
    """(completion text, answer or tests) for each sample of a finished group."""
    msg = group.msg
    target = msg.get("tests") if reward == "code" else msg.get("answer")
    return [(tokenizer.decode(group.outputs[i].token_ids), target) for i in range(msg["n"])]


def trajectory_messages(group: PendingGroup, rewards: list[float], rank: int) -> list[dict]:
    """The `trajectory` messages of a scored group, one per sample."""
    msg, out = group.msg, []
    for i, reward in enumerate(rewards):
        o = group.outputs[i]
        traj = Trajectory(group_id=msg["group_id"], prompt_ids=list(o.prompt_ids), completion_ids=o.token_ids,
                          logprobs=o.logprobs, versions=o.versions, reward=float(reward),
                          finish_reason=o.finish_reason, problem_id=msg["problem_id"],
                          start_version=group.start_version)
        out.append(trajectory_to_msg(traj, rank=rank))
    return out


def episode_messages(group: PendingGroup, rank: int) -> list[dict]:
    """The `trajectory` messages of a group of ended episodes, one per episode."""
    msg, out = group.msg, []
    for i in range(msg["n"]):
        ep = group.outputs[i]
        traj = Trajectory(group_id=msg["group_id"], prompt_ids=list(msg["prompt_ids"]), completion_ids=ep.ids,
                          logprobs=ep.logprobs, versions=ep.versions, reward=float(ep.reward),
                          finish_reason=ep.reason, problem_id=msg["problem_id"], mask=ep.mask,
                          meta={"turns": len(ep.turns)}, start_version=group.start_version)
        out.append(trajectory_to_msg(traj, rank=rank))
    return out


def check_kv_room(model, knobs, replica_id: int, device: torch.device) -> None:
    """The plan's KV pages must fit in the memory left after loading the weights (GPU only)."""
    if device.type != "cuda" or knobs.kv_pages is None:
        return
    from .pages import page_bytes

    cfg, tp = model.cfg, model.tp.size if model.tp else 1
    need = knobs.kv_pages * page_bytes(cfg.num_hidden_layers, knobs.page_size, max(1, cfg.num_key_value_heads // tp),
                                       cfg.head_dim, next(model.parameters()).dtype)
    free, _ = torch.cuda.mem_get_info(device)
    if need > free:
        raise MemoryError(f"rollout.replicas[{replica_id}].kv_pages: {knobs.kv_pages} pages need {need / 1e9:.2f} GB "
                          f"but {free / 1e9:.2f} GB are free after loading the weights; lower kv_pages "
                          "(job runtime.rollout) or the GPU's mem_util in its profile, and plan again")


def run_rollout(ctx: RankContext) -> None:
    """A rollout rank: load the model (this rank's TP shard), then lead or follow the replica."""
    from hexrl.comm.weights import shard_layout
    from hexrl.data.tokenizer import load_tokenizer
    from hexrl.model.hf_checkpoint import load_pretrained

    from .engine import EngineConfig

    job, plan = ctx.plan.job, ctx.plan
    replica = next(r for r in plan.replicas if r.id == ctx.info.replica)
    tp_rank = replica.ranks.index(ctx.rank)
    tp = TPGroup(ctx.replica_group, tp_rank, replica.tp) if replica.tp > 1 else None
    knobs = replica.knobs
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[knobs.dtype]
    model = load_pretrained(job.model.path, dtype=dtype, tp=tp, device=ctx.device, fused=True)  # fused on the host
    tokenizer = load_tokenizer(job.model.path)
    check_kv_room(model, knobs, replica.id, ctx.device)
    config = EngineConfig(page_size=knobs.page_size, max_pages=knobs.kv_pages, max_batch_tokens=knobs.max_batch_tokens,
                          max_running=knobs.max_running)
    engine = Engine(model, config, tokenizer=tokenizer, seed=job.rl.seed)
    if tp_rank == 0:
        effective.publish(ctx, f"replica/{replica.id}", effective.rollout_values(engine))
    elif ctx.rank == 0:
        effective.write_for(ctx)
    sync = [SyncGroup([SyncLink(*x) for x in links], shard_layout(model.cfg, tuple(st.layers), st.tp, plan.trainer.dp,
                                                                  dtype))
            for links, st in zip(ctx.sync_groups, plan.trainer.stages)]
    receive = weight_receiver(sync, dtype, ctx.device, ctx.sync_ipc, tp, job.sync.delta)
    if tp_rank != 0:
        engine.follow(on_update=receive)
        return
    trace = Path(ctx.run_dir) / "engine" / f"replica{replica.id}.jsonl"
    leader = RolloutLeader(engine, replica.id, ctx.rank, ctx.store, ctx.secret, receive, job.reward.name,
                           job.reward.timeout_s, tokenizer, trace=trace, env=job.env)
    leader.run()
    write_engine_stats(ctx.run_dir, replica.id, engine.stats)


def write_engine_stats(run_dir: Path, replica_id: int, stats: EngineStats) -> dict:
    """RUN_DIR/engine/replica<ID>.json: the engine's counters over the run; `mean_batch` (sequences
    per model step) tells how full the batches were, which sets the engine's efficiency."""
    out = {**asdict(stats), "mean_batch": stats.generated_tokens / max(1, stats.steps)}
    write_json_atomic(Path(run_dir) / "engine" / f"replica{replica_id}.json", out)
    return out
