"""The GRPO trainer: one slot of a DP x PP x TP grid running the decoupled PPO objective.

A step's plan (group advantages and filtering over the whole batch, PPO mini-batches, each
DP rank's share and its micro-batches, the global loss-token count of each mini-batch) comes
from rewards and lengths only (hexrl/train/packing.py). `step()` takes either the full batch
(the same list on every trainer rank: each rank plans, then packs only its own share) or this
rank's `RankShare`, which `hexrl.train.handoff` delivers from the controller rank; either way
the ranks of a pipeline agree on the micro-batches without exchanging metadata. One step:
  1. proximal log-probs (and reference log-probs for the KL) in a forward-only pipeline pass,
     with the weights before any update;
  2. per mini-batch: 1F1B forward/backward, DP all-reduce overlapping the last backward,
     tied-embedding gradient sum, global-norm clipping, AdamW;
  3. metrics reduced over all trainer ranks; `version` += 1.
"""
from __future__ import annotations

import math
import os
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from hexrl.model.attention import CausalAttention
from hexrl.model.config import ModelConfig
from hexrl.model.hf_checkpoint import load_pretrained, save_state_dict
from hexrl.runtime.dist_rules import warm_up
from hexrl.schema.job import PROXIMAL
from hexrl.schema.layout import TrainerLayout
from hexrl.trajectory import Trajectory

from . import checkpoint as ckpt
from .data_parallel import GradBuckets
from .grid import Grid, build_grid
from .importance import (
    MISMATCH_EDGES,
    NUM_BINS,
    NUM_MISMATCH_BINS,
    bin_counts,
    log_w_counts,
    mismatch_quantile,
    w_quantile,
    w_std,
)
from .linear_logprobs import CHUNK_ROWS, linear_logprobs
from .loss import lag_weights, ppo_terms
from .optim import AdamW, clip_divisor, global_grad_norm
from .packing import BatchSummary, MicroBatch, RankShare, StepPlan, check_trajectories, plan_batch
from .phases import PhaseTimer
from .pipeline import PipeComm, forward_only, train_1f1b

# No float16: its gradients underflow without a loss scaler, and bf16 needs none.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Token-level sums reduced over all trainer ranks each step, in this order; then the counts of
# log w per bin (hexrl/train/importance.py).
SUMS = ("loss", "tokens", "clipped", "capped", "w", "kl", "entropy", "w2", "lag0", "lag0_mismatch")


@dataclass
class TrainConfig:
    """Optimisation and objective settings (the objective is defined in hexrl/train/loss.py)."""

    lr: float = 1e-6
    warmup_steps: int = 0  # linear warm-up, in optimizer steps (ppo_minibatches per train step)
    lr_decay_steps: int = 0  # then linear decay to lr_final_frac * lr over this many optimizer steps; 0 = off
    lr_final_frac: float = 0.0
    weight_decay: float = 0.0  # on matrices only
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    grad_clip: float | None = 1.0  # max global gradient norm; None = off
    clip_low: float = 0.2
    clip_high: float = 0.2
    behav_cap: float | None = 5.0  # mask tokens with exp(p − b) above this; None = off
    decoupled: bool = True  # False: naive PPO (p = b), no proximal forward pass
    # "step": proximal log-probs from the weights before the step (AReaL's); "minibatch": from the weights
    # before each mini-batch, so the ratio starts at 1 and the clip never engages (the staleness study's ablation)
    proximal: str = "step"
    kl_coef: float = 0.0  # > 0 loads a frozen reference copy of this stage
    lr_lag_scale: float = 0.0  # a token k versions old weighs 1 / (1 + lr_lag_scale * k) (loss.lag_weights)
    adv_eps: float = 1e-6
    filter_equal_groups: bool = True
    ppo_minibatches: int = 1
    micro_batch_tokens: int = 4096  # the planner's floor too (hexrl.plan.cost_inputs.MIN_MICRO_TOKENS)
    temperature: float = 1.0  # the sampling temperature the behaviour log-probs were taken at
    dtype: str = "auto"  # compute dtype: auto (bf16 on GPU, fp32 on CPU) | bfloat16 | float32
    activation_checkpointing: bool = False
    entropy_metric: bool = True  # the "entropy" metric costs one more float32 pass over the logits
    logprob_chunk_rows: int = CHUNK_ROWS  # lm_head + log-prob rows at a time: [rows, vocab/tp] float32 logits
    bucket_mb: float = 25.0
    keep_checkpoints: int = 2

    def problems(self) -> list[str]:
        p = []
        for k in ("lr", "micro_batch_tokens", "ppo_minibatches", "temperature", "bucket_mb", "logprob_chunk_rows"):
            if not getattr(self, k) > 0:
                p.append(f"train.{k}: must be > 0, got {getattr(self, k)!r}")
        for k in ("clip_low", "clip_high", "kl_coef", "warmup_steps", "lr_decay_steps", "weight_decay", "lr_lag_scale"):
            if not getattr(self, k) >= 0:
                p.append(f"train.{k}: must be >= 0, got {getattr(self, k)!r}")
        if not 0 <= self.lr_final_frac <= 1:
            p.append(f"train.lr_final_frac: must be in [0, 1], got {self.lr_final_frac!r}")
        if self.clip_low >= 1:
            p.append(f"train.clip_low: must be < 1, got {self.clip_low}")
        if self.proximal not in PROXIMAL:
            p.append(f"train.proximal: must be one of {PROXIMAL}, got {self.proximal!r}")
        if self.behav_cap is not None and not self.behav_cap > 0:
            p.append(f"train.behav_cap: must be > 0 or None, got {self.behav_cap!r}")
        if self.dtype == "float16":
            p.append("train.dtype: float16 training is not supported (no loss scaler); use bfloat16")
        elif self.dtype not in ("auto", *DTYPES):
            p.append(f"train.dtype: unknown {self.dtype!r} (known: auto, {', '.join(DTYPES)})")
        return p


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


@dataclass
class _StepState:
    """What one step's last-stage forwards accumulate."""

    sums: torch.Tensor  # SUMS, then the log-w bins, then the mismatch bins
    logprobs: dict = field(default_factory=dict)
    # whether this mini-batch's proximal (else θ) log-probs come from the weights of the step's start, the
    # version that generated the lag-0 tokens: then |behaviour - proximal| of those is the numeric mismatch
    pre_step: bool = True
    norms: list = field(default_factory=list)  # each optimizer step's gradient norm, on the device


class Trainer:
    """One trainer rank. See the module docstring for the step; `step()` is collective."""

    def __init__(self, model_path: str | os.PathLike, layout: TrainerLayout | dict, config: TrainConfig | None = None,
                 grid: Grid | None = None, device: str | torch.device | None = None):
        self.config = config or TrainConfig()
        self.model_cfg = ModelConfig.from_dir(model_path)
        if isinstance(layout, dict):
            layout = TrainerLayout.from_dict(layout, self.model_cfg.num_hidden_layers)
        problems = self.config.problems() + layout.problems(self.model_cfg.num_hidden_layers)
        if problems:
            raise ValueError("invalid trainer settings:\n  " + "\n  ".join(problems))
        self.grid = grid or build_grid(layout, tied_embeddings=self.model_cfg.tie_word_embeddings)
        if self.grid is None:
            raise ValueError("this process is not a slot of the trainer layout")
        self.device = torch.device(device) if device is not None else default_device()
        auto = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.dtype = auto if self.config.dtype == "auto" else DTYPES[self.config.dtype]
        self.model = self._load(model_path)
        self.params = list({id(p): p for p in self.model.parameters()}.values())
        masters = [p.detach().clone() for p in self.params] if self.dtype != torch.float32 else None
        for p in self.params:  # parameters only: RoPE buffers stay float32
            p.data = p.data.to(self.dtype)
        self.ref_model = None
        if self.config.kl_coef > 0:
            self.ref_model = self._load(model_path, self.dtype).requires_grad_(False)
        c = self.config
        self.grads = GradBuckets(self.params, self.grid.dp_group, c.bucket_mb, self.device)
        self.optimizer = AdamW(self.params, c.lr, c.warmup_steps, c.betas, c.adam_eps, c.weight_decay, masters,
                               c.lr_decay_steps, c.lr_final_frac)
        self.version = 0
        self.last_logprobs: dict[int, torch.Tensor] = {}  # batch index -> θ log-probs (last stage)
        self._norm_params = self._counted_params()
        self.phases: PhaseTimer | None = None  # per-phase timing, off unless a caller sets one
        warm_up(self.grid.groups.values(), self.device)  # NCCL communicators before the first p2p

    def _load(self, path, dtype=torch.float32):
        g = self.grid
        return load_pretrained(path, dtype=dtype, layers=g.layers, tp=g.tp, device=self.device)

    def _counted_params(self) -> list[torch.Tensor]:
        """Parameters this rank adds to the global gradient norm (each element once in the model)."""
        g, dims = self.grid, ckpt.shard_dims(self.model)
        if g.dp_rank != 0:
            return []
        tied_copy = self.model_cfg.tie_word_embeddings and g.is_last and not g.is_first
        seen, out = set(), []
        for name, p in self.model.named_parameters():
            if id(p) in seen or (tied_copy and name == "lm_head.weight"):
                continue
            seen.add(id(p))
            if dims[name] is not None or g.tp_rank == 0:
                out.append(p)
        return out

    # ------------------------------------------------------------------ the step

    def plan(self, trajectories: list[Trajectory]) -> StepPlan:
        """Check the full batch (one ValueError naming every problem) and plan the step: every DP
        rank's sequences and micro-batches, from rewards and lengths only."""
        c = self.config
        check_trajectories(trajectories, self.model_cfg.vocab_size)
        return plan_batch(trajectories, c.ppo_minibatches, self.grid.layout.dp, c.micro_batch_tokens, c.adv_eps,
                          c.filter_equal_groups)

    def step(self, batch: list[Trajectory] | RankShare) -> dict:
        """One training step (collective); returns metrics. `batch`: the full batch (the same list on
        every trainer rank) or this rank's share of it (hexrl.train.handoff)."""
        c, g = self.config, self.grid
        share = batch if isinstance(batch, RankShare) else self.plan(batch).share(batch, g.dp_rank)
        plans = [(mbs, n) for mbs, n in zip(share.micro_batches(), share.num_loss_tokens) if n > 0]
        mine = [[mb.to(self.device) for mb in mbs] for mbs, _ in plans]
        each = c.decoupled and c.proximal == "minibatch"
        with self._phase("proximal"):  # the forward-only passes: proximal and KL-reference log-probs
            none = [[None] * len(m) for m in mine]
            prox = self._forward_logprobs(self.model, mine) if c.decoupled and not each else none
            ref = self._forward_logprobs(self.ref_model, mine) if self.ref_model else none
        state = _StepState(torch.zeros(len(SUMS) + NUM_BINS + NUM_MISMATCH_BINS, dtype=torch.float64,
                                       device=self.device))
        lr = self.optimizer.lr_at(self.optimizer.steps)
        for i, ((_, num_tokens), mbs, p, r) in enumerate(zip(plans, mine, prox, ref)):
            state.pre_step = i == 0 or (c.decoupled and not each)
            if each:  # the weights as the step's earlier mini-batches left them
                with self._phase("proximal"):
                    p = self._forward_logprobs(self.model, [mbs])[0]
            lr = self._train_minibatch(mbs, p, r, num_tokens, state)
        self.version += 1
        sums, norms, self.last_logprobs = self._to_host(state)
        nonfinite = sum(not math.isfinite(n) for n in norms)
        self.optimizer.steps -= nonfinite  # skipped updates do not advance the warm-up
        return self._metrics(sums, share.summary, len(plans), norms, lr, nonfinite)

    def _to_host(self, state: _StepState) -> tuple[torch.Tensor, list[float], dict[int, torch.Tensor]]:
        """The step's metric sums (reduced over trainer ranks), gradient norms and θ log-probs in one
        device-to-host copy."""
        sums = state.sums
        if self.grid.trainer_group is not None:
            sums = sums * (self.grid.tp_rank == 0)  # TP ranks hold the same values: count one
            dist.all_reduce(sums, group=self.grid.trainer_group)
        seqs = list(state.logprobs)
        parts = [state.logprobs[i] for i in seqs]
        norms = [n.double().reshape(1) for n in state.norms]
        host = torch.cat([sums, *norms, *(lp.double() for lp in parts)]).cpu()
        n = len(sums)
        k = n + len(norms)
        lps = host[k:].float().split([len(lp) for lp in parts])
        return host[:n], host[n:k].tolist(), dict(zip(seqs, lps))

    def _forward_logprobs(self, model, mine: list[list[MicroBatch]]) -> list[list[torch.Tensor | None]]:
        """Log-probs of every micro-batch's targets under `model` (last stage; None elsewhere)."""
        flat = [mb for mbs in mine for mb in mbs]
        out = [None] * len(flat)

        def forward(i, x):
            h = self._run_stage(model, flat[i], x)
            if self.grid.is_last:
                out[i] = self._logprobs(model, h, flat[i], entropy=False)[0]
            return h

        forward_only(len(flat), forward, self._comm(flat))
        it = iter(out)
        return [[next(it) for _ in mbs] for mbs in mine]

    def _train_minibatch(self, mbs, prox, ref, num_tokens: int, state: _StepState) -> float:
        """Forward/backward every micro-batch of one PPO mini-batch, then one optimizer step (its
        gradient norm goes to `state`, unread); returns the lr used."""
        c, g = self.config, self.grid
        self.grads.zero()

        def forward(i, x):
            mb = mbs[i]
            with self._phase("forward"):
                h = self._run_stage(self.model, mb, x)
            if not g.is_last:
                return h
            with self._phase("logprob"):
                return self._loss(mb, h, prox[i], ref[i], num_tokens, state)

        def before_backward(j):
            self.grads.sync = j == len(mbs) - 1  # all-reduce only once all micro-batches accumulated

        train_1f1b(len(mbs), forward, self._comm(mbs), g.stage, g.layout.pp, before_backward, self._phase)
        with self._phase("optimizer"):
            self.grads.wait()
            self._sum_tied_grads()
            norm = global_grad_norm([p.main_grad for p in self._norm_params], g.trainer_group, self.device)
            state.norms.append(norm)  # a non-finite gradient skips the update (counted in the metrics)
            return self.optimizer.step(clip_divisor(norm, c.grad_clip), skip=~torch.isfinite(norm))

    def _phase(self, name: str):
        """Time a phase of the step when `self.phases` (a PhaseTimer, e.g. bench_train's) is set."""
        return self.phases(name) if self.phases is not None else nullcontext()

    def _loss(self, mb: MicroBatch, h: torch.Tensor, prox, ref, num_tokens: int, state: _StepState) -> torch.Tensor:
        """The micro-batch's share of the loss from last-stage hidden states; its metric sums and θ
        log-probs go to `state` on the device."""
        c = self.config
        logp, entropy = self._logprobs(self.model, h, mb, c.entropy_metric)
        adv = mb.adv * lag_weights(self.version - mb.versions, c.lr_lag_scale) if c.lr_lag_scale else mb.adv
        t = ppo_terms(logp, prox, mb.behav, adv, c.clip_low, c.clip_high, c.behav_cap, c.decoupled, ref, c.kl_coef)
        loss = t.loss.sum() / num_tokens
        with torch.no_grad():  # everything stays on the device: one copy at the end of the step
            ent = entropy.double().sum() if entropy is not None else loss.new_zeros((), dtype=torch.float64)
            n_loss = loss.new_full((), float(mb.num_loss_tokens), dtype=torch.float64)  # a fill, not a copy
            w = t.w.double()
            lag0 = ((mb.versions == self.version) & state.pre_step).double()  # self.version: not yet bumped
            gap = (mb.behav - (prox if prox is not None else logp.detach())).abs().double()
            state.sums[:len(SUMS)] += torch.stack([loss.double(), n_loss, *(x.double().sum() for x in (
                t.clipped, t.capped, t.w, t.kl)), ent, (w * w).sum(), lag0.sum(), (gap * lag0).sum()])
            state.sums[len(SUMS):len(SUMS) + NUM_BINS] += log_w_counts(w)
            state.sums[len(SUMS) + NUM_BINS:] += bin_counts(gap, MISMATCH_EDGES, lag0)
            for seq, lp in zip(mb.seqs, logp.detach().split(mb.completion_lens)):
                state.logprobs[seq] = lp
        return loss

    def _run_stage(self, model, mb: MicroBatch, x: torch.Tensor | None) -> torch.Tensor:
        """This stage's layers on a micro-batch (token ids on the first stage, else activations)."""
        attn = CausalAttention(mb.seq_lens)
        x = mb.input_ids if model.is_first else x
        if not (self.config.activation_checkpointing and torch.is_grad_enabled()):
            return model.stage(x, mb.positions, attn)
        model.reset_rotary()
        h = model.model.embed_tokens(x) if model.is_first else x  # Decoder.stage, layer by layer
        for layer in model.model.layers.values():
            h = activation_checkpoint(layer, h, mb.positions, attn, use_reentrant=False)
        return model.model.norm(h) if model.is_last else h

    def _logprobs(self, model, h: torch.Tensor, mb: MicroBatch, entropy: bool = True):
        """(log-probs, entropy or None) of the micro-batch's completion tokens from last-stage hidden
        states. Logits are float32 (bf16 GEMMs, fp32 accumulation) as on the rollout side, so importance
        ratios are not dominated by bf16 rounding of the logits; they exist one row chunk at a time."""
        c = self.config  # only rows that predict a completion token
        return linear_logprobs(h[mb.loss_index], model.lm_head.weight, mb.targets, self.grid.tp, c.temperature,
                               entropy, c.logprob_chunk_rows)

    def _comm(self, mbs: list[MicroBatch]) -> PipeComm:
        return PipeComm(self.grid, [mb.num_tokens for mb in mbs], self.model_cfg.hidden_size, self.dtype, self.device)

    def _sum_tied_grads(self) -> None:
        """Tied embeddings across stages: embed (first stage) and lm_head (last) get the sum of both
        gradients. With equal TP degrees each rank swaps its shard with its partner (same TP rank on
        the other stage); otherwise shards differ, so each rank adds its rows into a full-vocab buffer
        all-reduced over the tied group."""
        g = self.grid
        if g.tied_group is None:
            return
        p = self.model.model.embed_tokens.weight if g.is_first else self.model.lm_head.weight
        first, last = g.layout.stages[0], g.layout.stages[-1]
        if first.tp == last.tp:
            partner = g.layout.rank(g.layout.pp - 1 if g.is_first else 0, g.dp_rank, g.tp_rank)
            theirs = torch.empty_like(p.main_grad)
            ops = [dist.P2POp(dist.isend, p.main_grad, partner, g.tied_group),
                   dist.P2POp(dist.irecv, theirs, partner, g.tied_group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            p.main_grad.add_(theirs)
            return
        rows = p.shape[0]
        full = torch.zeros(self.model_cfg.vocab_size, p.shape[1], dtype=torch.float32, device=self.device)
        full[g.tp_rank * rows:(g.tp_rank + 1) * rows] = p.main_grad
        dist.all_reduce(full, group=g.tied_group)
        p.main_grad.copy_(full[g.tp_rank * rows:(g.tp_rank + 1) * rows])

    def _metrics(self, sums, summary: BatchSummary, optimizer_steps: int, norms, lr, nonfinite) -> dict:
        s, w_counts = dict(zip(SUMS, sums[:len(SUMS)].tolist())), sums[len(SUMS):len(SUMS) + NUM_BINS]
        n = max(s["tokens"], 1.0)
        return {
            # rollout vs trainer numerics: |behaviour - proximal| log-prob over tokens the step's starting
            # weights generated (lag 0), where the two policies are the same weights (~0 on CPU)
            "logprob_mismatch_mean": s["lag0_mismatch"] / s["lag0"] if s["lag0"] else None,
            "logprob_mismatch_p99": mismatch_quantile(sums[len(SUMS) + NUM_BINS:], 0.99),
            "logprob_mismatch_tokens": int(s["lag0"]),
            # the staleness of what was trained, per token: lag behind the weights before this step
            "token_staleness_hist": summary.token_staleness(self.version - 1),
            "w_std": w_std(s["tokens"], s["w"], s["w2"]), "w_p05": w_quantile(w_counts, 0.05),
            "w_p50": w_quantile(w_counts, 0.5), "w_p95": w_quantile(w_counts, 0.95),
            "version": self.version, "loss": s["loss"] / max(optimizer_steps, 1), "tokens": int(s["tokens"]),
            "clip_frac": s["clipped"] / n, "capped_frac": s["capped"] / n, "mean_w": s["w"] / n,
            "kl": s["kl"] / n, "entropy": s["entropy"] / n if self.config.entropy_metric else float("nan"),
            "grad_norm": sum(norms) / len(norms) if norms else 0.0, "lr": lr, "optimizer_steps": optimizer_steps,
            "nonfinite_steps": nonfinite, "sequences": summary.sequences, "groups": summary.groups,
            "groups_filtered": summary.groups_filtered,
            "max_staleness": self.version - 1 - summary.oldest_version if summary.oldest_version is not None else 0,
        }

    # ------------------------------------------------------------------ state

    def save(self, root: str | os.PathLike, extra: dict | None = None) -> Path:
        """Checkpoint the full training state under `root` (collective); `extra` (a JSON-able dict,
        e.g. the data position) comes back from load()."""
        shard = None
        if self.grid.dp_rank == 0:
            shard = {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}
        meta = {"config": asdict(self.config), "optimizer_steps": self.optimizer.steps}
        return ckpt.save(root, self.version, self.grid, shard, meta, extra, self.device, self.config.keep_checkpoints)

    def load(self, path: str | os.PathLike) -> dict:
        """Restore a checkpoint written by save() in any layout of this model (resharded when its stages
        or TP degrees differ); returns its `extra`."""
        shard, rng, meta, extra = ckpt.load(path, self.grid, self.model)  # on the CPU; copied into place here
        ckpt.check_shapes(shard["model"], self.model.state_dict(), f"{path}: model shard")
        self.model.load_state_dict(shard["model"])
        self.optimizer.load_state_dict(shard["optim"])
        if rng is not None:
            ckpt.set_rng_state(rng)
        self.version = meta["version"]
        return extra

    def export_hf(self, path: str | os.PathLike, dtype: torch.dtype | None = None,
                  extra_files: dict[str, str] | None = None) -> None:
        """Write the whole model as a Hugging Face checkpoint from the leader rank (collective);
        `extra_files` ({name: text}, e.g. the tokenizer's) go into the same directory."""
        full = ckpt.gather_model(self.model, self.grid, dtype)
        if full is not None:
            save_state_dict(full, self.model_cfg, path, extra_files=extra_files)
        if self.grid.trainer_group is not None:
            dist.barrier(group=self.grid.trainer_group)
