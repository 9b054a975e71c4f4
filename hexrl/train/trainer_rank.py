"""The trainer rank's loop: batches in, GRPO steps, weights out.

Trainer slot (stage 0, dp 0, tp 0) also hosts the controller thread. Each step it takes B
complete prompt groups from the controller, plans the step and sends each DP replica only its
own share (hexrl/train/handoff.py); all ranks run the collective `Trainer.step`; then each stage's
(dp 0, tp 0) rank broadcasts the new weights to the rollout ranks, whom the controller has
told to join. Metrics go to `run_dir/metrics.jsonl`, checkpoints to `run_dir/checkpoints`.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import torch

from hexrl.comm.store import publish_endpoint
from hexrl.comm.weights import IpcSender, ShardSender, SyncLink, shard_layout, stage_specs
from hexrl.control.controller import ReplicaInfo
from hexrl.control.controller_process import ControllerProcess, ControllerSetup
from hexrl.control.metrics import (
    MetricsWriter,
    equal_reward_share,
    length_stats,
    replica_rates,
    staleness_histogram,
    truncate_after,
)
from hexrl.data.heldout import greedy_accuracy
from hexrl.data.prompts import Prompts
from hexrl.data.tokenizer import load_tokenizer, tokenizer_files
from hexrl.model.hf_checkpoint import load_pretrained
from hexrl.rewards import reward_fn_by_name
from hexrl.runtime import effective, elastic, errors
from hexrl.runtime.context import RankContext
from hexrl.runtime.nodes import bind_host
from hexrl.schema.knobs import TrainKnobs

from .checkpoint import full_param, shard_dims
from .export import write_model_files
from .handoff import Stop, share_batch
from .probe import PolicyProbe, probe_batch
from .replanning import Replanner, start_replanning
from .trainer import DTYPES, TrainConfig, Trainer


def train_config(rl, knobs: TrainKnobs) -> TrainConfig:
    """The trainer's settings: the job's RL hyper-parameters and the plan's trainer knobs."""
    return TrainConfig(lr=rl.lr, grad_clip=rl.grad_clip, warmup_steps=rl.warmup_steps, weight_decay=rl.weight_decay,
                       lr_decay_steps=rl.lr_decay_steps, lr_final_frac=rl.lr_final_frac,
                       clip_low=rl.clip_low, clip_high=rl.clip_high, behav_cap=rl.behav_cap,
                       decoupled=rl.decoupled, proximal=rl.proximal, kl_coef=rl.kl_coef, lr_lag_scale=rl.lr_lag_scale,
                       ppo_minibatches=rl.ppo_minibatches,
                       temperature=rl.temperature if rl.temperature > 0 else 1.0,
                       filter_equal_groups=rl.filter_equal_groups, micro_batch_tokens=knobs.micro_batch_tokens,
                       dtype=knobs.dtype, activation_checkpointing=knobs.activation_checkpointing)


def start_controller(ctx: RankContext, train: Prompts) -> ControllerProcess:
    """Start the controller in its own process (off this trainer's GIL), its socket bound on this node's
    address from the plan (never a wildcard: only that interface listens), and publish the endpoint
    through the store."""
    plan, job = ctx.plan, ctx.plan.job
    address = job.cluster.nodes[ctx.info.node].address
    replicas = [ReplicaInfo(r.id, r.share, r.long_tail) for r in plan.replicas]
    setup = ControllerSetup(job.rl, train.problems, train.ids, replicas, vocab_size=job.model.config.vocab_size,
                            secret=ctx.secret,  # never through the store
                            host=bind_host(address), advertise=address, env=job.env,
                            long_tail_alpha=job.long_tail.alpha, budget=(job.data.synthetic or {}).get("budget"))
    controller = ControllerProcess(setup)
    publish_endpoint(ctx.store, "controller", controller.endpoint)
    ctx.run_dir.mkdir(parents=True, exist_ok=True)
    (ctx.run_dir / "controller_endpoint").write_text(controller.endpoint + "\n")  # for operators' tools
    return controller


class HeldoutEval:
    """Greedy held-out accuracy every `every` steps (and at 0 and the end), written to eval.jsonl.

    All trainer ranks export the model (collective); the controller rank scores it. Time spent
    here is kept out of `wall_s`, so runs with and without evaluation compare fairly.
    """

    def __init__(self, ctx: RankContext, heldout: list, tokenizer, every: int, steps: int, max_new_tokens: int):
        self.ctx, self.heldout, self.tokenizer = ctx, heldout, tokenizer
        self.every, self.steps, self.max_new_tokens = every, steps, max_new_tokens
        self.start, self.seconds = time.perf_counter(), 0.0

    def start_clock(self) -> None:
        """The run's clock starts now: set-up and the step-0 evaluation before it are not counted."""
        self.start, self.seconds = time.perf_counter(), 0.0

    def wall(self) -> float:
        """Seconds since the start of the run, evaluation excluded."""
        return time.perf_counter() - self.start - self.seconds

    def maybe(self, trainer: Trainer, step: int) -> float | None:
        if not (self.every and self.heldout and (step % self.every == 0 or step == self.steps)):
            return None
        t0 = time.perf_counter()
        path = self.ctx.run_dir / "eval_model"
        trainer.export_hf(path, extra_files=tokenizer_files(self.ctx.plan.job.model.path))
        acc = None
        if self.tokenizer is not None:
            acc, _ = greedy_accuracy(load_pretrained(path), self.tokenizer, self.heldout, self.max_new_tokens,
                                     reward_fn=reward_fn_by_name(self.ctx.plan.job.reward.name))  # the job's own
            with open(self.ctx.run_dir / "eval.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "version": trainer.version, "heldout_accuracy": acc,
                                    "wall_s": self.wall(), "n": len(self.heldout)}) + "\n")
        self.seconds += time.perf_counter() - t0
        return acc


def sync_weights(ctx: RankContext, trainer: Trainer, dtype: torch.dtype) -> float:
    """Send this rank's part of its stage's new weights to the rollout ranks; returns the seconds it took.
    Every trainer rank sends its own TP shard's pieces of its DP replica's buckets (hexrl/comm/weights.py);
    colocated on a GPU, the stage's (dp 0, tp 0) rank fills the CUDA IPC export buffer instead."""
    t0, g = time.perf_counter(), trainer.grid
    params = dict(trainer.model.named_parameters())
    if ctx.sync_ipc:  # the rollout shares this GPU: it maps our export buffer
        if g.dp_rank != 0:  # DP replica 0 holds the same weights
            return 0.0
        src, group = ctx.sync_groups[g.stage][0]
        dims = shard_dims(trainer.model)

        def full(name):  # gathered on the device, collective over the stage's TP group
            t = full_param(params[name], dims[name], g, dtype)
            return t if ctx.rank == src else None

        specs = stage_specs(trainer.model_cfg, g.layers)
        _IPC.setdefault(g.stage, IpcSender()).send(full, specs, src, group, dtype, ctx.device)
        return time.perf_counter() - t0
    if g.stage not in _SENDERS:
        layout = shard_layout(trainer.model_cfg, g.layers, g.layout.stages[g.stage].tp, g.layout.dp, dtype)
        _SENDERS[g.stage] = ShardSender(layout, g.tp_rank, g.dp_rank, ctx.plan.job.sync.delta)
    sender = _SENDERS[g.stage]
    sender.send(params.__getitem__, SyncLink(*ctx.sync_groups[g.stage][sender.t * g.layout.dp + sender.d]), dtype)
    return time.perf_counter() - t0


_IPC: dict[int, IpcSender] = {}  # per pipeline stage, kept for the run: the rollout maps it once
_SENDERS: dict[int, ShardSender] = {}  # per pipeline stage, kept for the run: a delta needs what was sent last


def run_trainer(ctx: RankContext, grid) -> Stop | None:
    """A trainer rank's run: every step of the job, then the final model; or, when re-planning decides
    to switch plans, the steps up to that boundary and its checkpoint, returning the Stop."""
    job = ctx.plan.job
    if not job.model.path:
        raise ValueError("model.path: a run needs a checkpoint directory (a preset or inline config only plans)")
    trainer = Trainer(job.model.path, ctx.layout, train_config(job.rl, ctx.plan.train_knobs), grid=grid,
                      device=ctx.device)
    if ctx.rank == ctx.controller_rank:
        effective.publish(ctx, "train", effective.train_values(trainer))
    elif ctx.rank == 0:
        effective.write_for(ctx)
    is_controller = ctx.rank == ctx.controller_rank
    if is_controller:  # so that a checkpoint is a model directory's worth: `hexrl.generate RUN_DIR`
        write_model_files(ctx.run_dir / "checkpoints", job.model.path)
    controller = metrics = None
    tokenizer = load_tokenizer(job.model.path)
    train, heldout = ctx.train_prompts, ctx.heldout_prompts  # the same usable prompts on every trainer rank
    if is_controller and train.skipped:
        print(f"[hexrl] skipped {len(train.skipped)} training prompts: {train.summary()}", flush=True)
    heldout = heldout.problems
    tokenizer = tokenizer if is_controller else None
    start_step = 0
    if ctx.resume is not None:
        extra = trainer.load(ctx.resume)
        start_step = extra.get("step", trainer.version)
    if is_controller:
        controller = start_controller(ctx, train)
        if ctx.resume is not None:
            controller.load_state(extra["controller"])
            # queued before the controller starts, so replicas load the weights before any prompt
            controller.publish_version(trainer.version)
        metrics = MetricsWriter(ctx.run_dir, resume_step=start_step if ctx.resume is not None else None)
        if ctx.resume is not None and (ctx.run_dir / "eval.jsonl").exists():  # evaluations after it are redone
            truncate_after(ctx.run_dir / "eval.jsonl", start_step)
    evaluator = HeldoutEval(ctx, heldout, tokenizer, job.rl.eval_every, job.rl.steps, job.rl.max_new_tokens)
    probe = None
    if is_controller and job.rl.policy_kl_probe:  # the policy as it starts: the first step's KL is from it
        probe = PolicyProbe(probe_batch(heldout, tokenizer, job.rl.policy_kl_probe))
        probe.measure(trainer)
    if start_step == 0:
        evaluator.maybe(trainer, 0)
    replanner = None
    if is_controller:  # after the untimed evaluation: the rollout starts with the run's clock
        evaluator.start_clock()
        controller.start()
        replanner = start_replanning(ctx, metrics, start_step, extra if ctx.resume is not None else None)
    rollout_dtype = DTYPES[ctx.plan.replicas[0].knobs.dtype]  # one broadcast: every replica's dtype (checked)
    if ctx.resume is not None:  # rollout ranks still hold the initial weights
        if is_controller:
            controller.wait_delivered(trainer.version)
        sync_weights(ctx, trainer, rollout_dtype)
    stop = None
    try:
        for step in range(start_step, job.rl.steps):
            stop = run_step(ctx, trainer, controller, metrics, evaluator, step, rollout_dtype, probe, replanner)
            if stop is not None:
                switch_plans(ctx, trainer, controller, replanner, step, stop)
                break
        else:
            trainer.export_hf(ctx.run_dir / "final", extra_files=tokenizer_files(job.model.path))
    finally:
        if replanner is not None:
            replanner.close()
        if controller is not None:
            controller.stop("switching plans" if stop is not None else "done")
        if metrics is not None:
            metrics.close()
    return stop


def checkpoint_extra(step: int, controller: ControllerProcess | None, replanner: Replanner | None) -> dict:
    """What a checkpoint keeps beside the weights: the step, the controller's state, when the run last
    switched plans."""
    return {"step": step, "controller": controller.state() if controller else None,
            **({"replan": replanner.state()} if replanner else {})}


def switch_plans(ctx: RankContext, trainer: Trainer, controller: ControllerProcess | None, replanner: Replanner | None,
                 step: int, stop: Stop) -> Path | None:
    """Leave for another plan at the boundary after `step` trained steps: checkpoint (collective; every
    trained step kept) and, on the controller rank, record the plan as the run's next round; returns its
    path there. Every rank then exits for torchrun to restart it into that plan (hexrl/main.py)."""
    trainer.save(ctx.run_dir / "checkpoints", checkpoint_extra(step, controller, replanner))
    if replanner is None:
        return None
    plans = ctx.run_dir / "plans"
    path = elastic.record_plan(plans, replanner.switch_to, elastic.next_round(plans), stop.reason,
                               switched_at_s=replanner.switches.last_switch_s)
    errors.say(f"[hexrl] switching plans ({stop.reason}): step {step} checkpointed; torchrun restarts every "
               f"rank into {path}")
    return path


def run_step(ctx: RankContext, trainer: Trainer, controller: ControllerProcess | None, metrics, evaluator: HeldoutEval,
             step: int, dtype, probe: PolicyProbe | None = None, replanner: Replanner | None = None) -> Stop | None:
    """Train step `step` + 1 (every trainer rank; the controller rank also hands out the batch and writes
    the metrics), or, when the controller rank's re-planning decides to switch plans at this boundary,
    train nothing and return the Stop on every trainer rank."""
    job, t0 = ctx.plan.job, time.perf_counter()
    # the boundary: the previous step's evaluation is done, and a switch keeps it (eval.jsonl)
    stop = replanner.at_boundary(step, evaluator.seconds) if replanner else None
    before = controller.counters() if controller else None
    groups = controller.next_batch() if controller and stop is None else None
    # in group-id order, not completion order: which replica finished first must not change the
    # mini-batches (a run with eta=0 is then reproducible, on one node or several)
    batch = ([t for g in sorted(groups, key=lambda g: g.group_id) for t in g.trajectories]
             if groups is not None else None)
    t_batch = time.perf_counter()
    # this rank's part (the controller rank keeps the batch), or the stop every rank returns
    share = share_batch(stop if stop is not None else batch, trainer)
    if isinstance(share, Stop):
        return share
    version_before = trainer.version
    out = trainer.step(share)
    t_train = time.perf_counter()
    last = step + 1 == job.rl.steps
    # Untimed work (kept out of wall_s) runs before the rollout is told of the new version: at eta=0
    # it waits for that version, so it cannot generate the next batch in time the run does not count.
    t_probe = time.perf_counter()
    policy_kl = probe.measure(trainer) if probe else None
    evaluator.seconds += time.perf_counter() - t_probe
    accuracy = evaluator.maybe(trainer, step + 1)
    eta = (controller.choose_eta(t_batch - t0, t_train - t0, out["w_std"], out["token_staleness_hist"])
           if controller else None)
    sync_s = 0.0
    if not last:
        if controller:
            controller.publish_version(trainer.version)
            controller.wait_delivered(trainer.version)  # wakes, and raises, on a controller failure
        sync_s = sync_weights(ctx, trainer, dtype)
    if controller:
        c, lengths = controller.counters(), [t.num_generated for t in batch]
        elapsed = time.perf_counter() - t0
        metrics.log({
            "step": step + 1, "version": trainer.version,
            "reward_mean": sum(t.reward for t in batch) / len(batch),
            "trajectories_accepted": c["accepted"], "trajectories_filtered": sum(c["filtered"].values()),
            "trajectories_dropped": sum(c["dropped"].values()), "trajectories_trained": c["trained"],
            "trajectories_produced": c["produced"], "trajectories_pending": c["pending"],
            "filtered_reasons": dict(c["filtered"]), "dropped_reasons": dict(c["dropped"]),
            "max_staleness": max(version_before - t.oldest_version for t in batch),
            "staleness_hist": staleness_histogram([t.oldest_version for t in batch], version_before),
            "too_stale": c["too_stale"], "rewards_clipped": c["rewards_clipped"], "env_timeouts": c["env_timeouts"],
            "equal_groups_in_a_row": c["equal_groups_in_a_row"], "groups_moved": c["groups_moved"],
            "rejected_messages": c["rejected_messages"],
            "rejected_reasons": c["rejected_reasons"],
            "rollout_tokens_per_s": (c["completion_tokens"] - before["completion_tokens"]) / elapsed,
            "replica_tokens_per_s": replica_rates(before["replica_tokens"], c["replica_tokens"], elapsed),
            "train_tokens_per_s": sum(t.num_tokens for t in batch) / max(t_train - t_batch, 1e-9),
            "weight_sync_s": sync_s, "wait_s": t_batch - t0, "train_s": t_train - t_batch, "step_s": elapsed,
            "loss": out["loss"], "clip_frac": out["clip_frac"], "capped_frac": out["capped_frac"],
            "mean_w": out["mean_w"], "w_std": out["w_std"], "w_p05": out["w_p05"], "w_p50": out["w_p50"],
            "w_p95": out["w_p95"], "tokens_trained": out["tokens"], "token_staleness_hist": out["token_staleness_hist"],
            "logprob_mismatch_mean": out["logprob_mismatch_mean"], "logprob_mismatch_p99": out["logprob_mismatch_p99"],
            "logprob_mismatch_tokens": out["logprob_mismatch_tokens"],
            "policy_kl": policy_kl, "eta": eta,
            "equal_reward_share": equal_reward_share(before, c),
            "grad_norm": out["grad_norm"], "kl": out["kl"], "entropy": out["entropy"],
            "problem_ids": sorted({t.problem_id for t in batch}, key=str),
            # how the batch's samples ended (an episode: its environment's reason, or why it was cut)
            "finish_reasons": dict(Counter(t.finish_reason for t in batch)),
            "turns_mean": sum(t.meta.get("turns", 1) for t in batch) / len(batch),
            **length_stats(lengths),  # what re-planning measures the workload by
            "heldout_accuracy": accuracy, "wall_s": evaluator.wall(),
        })
        metrics.log_lengths(step + 1, [t.problem_id for t in batch], [t.group_id for t in batch], lengths)
    # The step's metrics row is written before its checkpoint: a kill between the two then redoes the
    # step on resume (its row is replaced), instead of resuming past a step whose row was never written.
    every = job.rl.checkpoint_every
    if last or (every and (step + 1) % every == 0):
        trainer.save(ctx.run_dir / "checkpoints", checkpoint_extra(step + 1, controller, replanner))
    return None
