"""Planning a colocated job: the trainer and one rollout replica share the job's one GPU.

Memory: the device is split between the two processes' allocators (hexrl/schema/colocate.py).
Each process keeps one workspace (CUDA context, kernel scratch) outside its share; the rollout's
share holds its weights, its scratch and the KV pool (`kv_fraction`); the trainer takes the rest.
Unless the job fixes `kv_fraction`, the planner tries KV_GRID and keeps the fastest predicted
step (the smallest KV pool among equals: more room for training).

Time (the shared-device model, docs/planner.md "One GPU"): the two processes' kernels time-share
the device (no MPS), while each one's host work (the engine's per-step scheduling and sampling,
per-sample hand-off) leaves the device free. Training, priced by FLOPs, keeps the device busy;
decoding keeps it busy a fraction u of its time (device seconds / all seconds at its decode
point). Asynchronous steps overlap both roles, so a step lasts at least the device work of both:
    step = max(train, gen + reward, train + u * gen) + sync   (eta >= 1; eta = 0 runs them in turn)
Each role gets the share of the device the other leaves: both are stretched by
k = max(train, gen + reward, train + u * gen) / max(train, gen + reward), which the simulator applies to the
trainer's steps and the replica's decode and prefill. Weight sync stays on the device: the
trainer's export buffer is mapped by the rollout process (CUDA IPC), two device copies of the
weights (hexrl/comm/cuda_ipc.py); on the CPU stand-in it is a gloo broadcast over loopback.
"""

from dataclasses import dataclass, replace

from hexrl.plan.candidate import Candidate, step_times
from hexrl.plan.candidate_knobs import ENGINE_BATCH_TOKENS
from hexrl.plan.cost import CostModel
from hexrl.plan.cost_sync import NCCL_EFFICIENCY
from hexrl.plan.fixed import _rollout_plan, _train_plan
from hexrl.schema import ConfigError, Job
from hexrl.schema.colocate import Colocate

KV_GRID = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6)
ENGINE_WORKSPACE_BYTES = 1e9  # FlashInfer's workspaces (128 MB each) and CUDA graph pools, with room
IPC_HANDSHAKE_S = 2e-3  # a sync's two host round trips over the sync group (ready, done)
_ALLOWED_LAYOUT = {"train_gpus": 1, "dp": 1, "tp": 1, "pp": 1, "rollout_tp": 1}


@dataclass(frozen=True)
class Split:
    """The device's memory, as fractions of it: the three `colocate` fields."""

    kv_fraction: float
    train_fraction: float
    rollout_fraction: float

    def colocate(self) -> Colocate:
        return Colocate(round(self.kv_fraction, 6), round(self.train_fraction, 6), round(self.rollout_fraction, 6))


def job_problems(job: Job) -> list[str]:
    """A colocated job's layout, if it has one, may only say what colocation implies (one of each), and its
    KV pool must be sized (the planner sizes it unless the job fixes one)."""
    lay = job.layout or {}
    p = [f"layout.{k}: {lay[k]} on one shared GPU, more ranks than the device holds (one trainer rank and "
         f"one rollout replica of TP 1); use {k}: {v} or drop it"
         for k, v in _ALLOWED_LAYOUT.items() if k in lay and lay[k] != v]
    p += [f"layout.{k}: not used with colocate (the planner places both roles on the one GPU)"
          for k in ("train_ranks", "trainer", "rollout_replicas", "train_gpu_type") if k in lay]
    if "kv_pages" in job.runtime.get("rollout", {}) and job.runtime["rollout"]["kv_pages"] is None:
        p.append("runtime.rollout.kv_pages: null sizes the KV pool from free memory, which the trainer shares; "
                 "give a number or leave it to the planner (colocate.kv_fraction)")
    return p


def rollout_scratch_bytes(cm: CostModel, gpu_type: str) -> float:
    """The engine's working memory beside weights and KV: one forward pass of ENGINE_BATCH_TOKENS
    tokens (a layer's activations) and the logits of every running sequence (float32), at least
    ENGINE_WORKSPACE_BYTES (attention kernels' workspaces, CUDA graph pools), 5% of the CPU stand-in."""
    m, g = cm.m, cm.gpus[gpu_type]
    floor = min(ENGINE_WORKSPACE_BYTES, 0.05 * g.hbm_bytes)
    return max(floor, ENGINE_BATCH_TOKENS * m.hidden_size * 2 * 16 + cm.rollout.decode_batch_cap * m.vocab_size * 4)


def split_memory(cm: CostModel, gpu_type: str, kv: float, col: Colocate) -> Split | None:
    """The fractions for a KV pool of `kv` (the job's own fractions win); None if they do not fit."""
    g = cm.gpus[gpu_type]
    hbm = g.hbm_bytes
    weights = (4 if gpu_type == "cpu" else 2) * cm.m.num_params
    total = g.hbm_bytes * g.mem_util - 2 * cm.workspace_bytes(gpu_type)  # a workspace per process
    rollout = col.rollout_fraction or kv + (weights + rollout_scratch_bytes(cm, gpu_type)) / hbm
    train = col.train_fraction or total / hbm - rollout
    if train <= 0 or kv >= rollout or train + rollout > 1 + 1e-9:
        return None
    return Split(kv, train, rollout)


def apply_split(cm: CostModel, split: Split) -> None:
    """Give the cost model each role's bytes (before it caches anything memory-bound)."""
    hbm = cm.gpus[cm.cluster.nodes[0].gpu_type].hbm_bytes
    cm.share_memory({"train": split.train_fraction * hbm, "rollout": split.kv_fraction * hbm + 2 * cm.m.num_params})


def weight_bytes(cm: CostModel) -> float:
    """The weights the sync moves, in the rollout's dtype (the tied head once)."""
    elem = 4 if cm.cluster.nodes[0].gpu_type == "cpu" else 2
    return elem * cm.m.num_params


def shared_sync_s(cm: CostModel) -> float:
    """Weight sync between two processes on one device: CUDA IPC is two device copies (into the
    export buffer, out of it: each reads and writes the weights); the CPU stand-in broadcasts
    over loopback gloo at the node's intra-node rate."""
    gpu_type = cm.cluster.nodes[0].gpu_type
    g, nbytes = cm.gpus[gpu_type], weight_bytes(cm)
    if gpu_type == "cpu":
        return nbytes / (cm.cluster.intra_GBps(gpu_type) * 1e9 * NCCL_EFFICIENCY)
    return 4 * nbytes / (g.hbm_Bps * g.hbm_efficiency) + IPC_HANDSHAKE_S


def decode_busy_fraction(cm: CostModel, gpu_type: str, batch: int) -> float:
    """u: the share of the replica's time its kernels hold the device, at decode batch `batch`
    (the per-step overhead and per-sample host work leave it free)."""
    g, w = cm.gpus[gpu_type], cm.w
    pt = cm.decode_point(gpu_type, 1, batch)
    per_step = batch / w.mean_out  # sequences finished per decode step
    prefill = cm.prefill_s(gpu_type, 1, w.prompt_len, w.prompt_len / 2)
    total = pt.step_s + per_step * (prefill + g.host_s_per_sample)
    host = g.decode_overhead_s + per_step * g.host_s_per_sample
    return max(0.0, min(1.0, 1 - host / total))


def shared_step(cm: CostModel, train_s: float, gen_s: float, reward_s: float, sync_s: float,
                u: float) -> tuple[float, float]:
    """(step seconds, stretch k) of the shared-device model in the module docstring; the step's
    last reward (reward_s, on the host) follows its generation and holds no device."""
    if cm.w.eta == 0:
        return train_s + gen_s + reward_s + sync_s, 1.0
    alone = max(train_s, gen_s + reward_s)
    shared = max(alone, train_s + u * gen_s)
    return shared + sync_s, shared / alone if alone > 0 else 1.0


def colocated_candidate(cm: CostModel, gpu_type: str, layers: list[int] | None = None) -> Candidate | None:
    """Both roles on the one GPU under cm's memory split; None if either does not fit."""
    p: list[str] = []
    train = _train_plan(cm, [(gpu_type, 1, [(0, 0)])], 1, layers, p)
    if cm.max_decode_batch(gpu_type, 1) < 1 or train is None:
        return None
    roll = _rollout_plan(cm, [(gpu_type, 1, [0], 1.0, None, False)], p)  # not a long-tail replica
    if roll is None:
        return None
    sync = shared_sync_s(cm)
    gen, reward, _ = step_times(cm, train.time_s, sync, roll)
    u = decode_busy_fraction(cm, gpu_type, roll.replicas[0].batch)
    step, k = shared_step(cm, train.time_s, gen, reward, sync, u)
    return Candidate((1,), train, roll, train.time_s, gen, reward, sync, step, stretch=k, device_busy=u)


def best_colocated(job: Job, use_profiles: bool = True) -> tuple[CostModel, Candidate, Job]:
    """The memory split with the fastest predicted step: its cost model, candidate, and the job with
    its colocate section filled in (hexrl/plan/planner.py turns them into the plan)."""
    p = job_problems(job)
    if p:
        raise ConfigError(p, "invalid colocated job")
    gpu_type = job.cluster.nodes[0].gpu_type
    col = job.colocate
    best = None
    for kv in ([col.kv_fraction] if col.kv_fraction is not None else KV_GRID):
        cm = CostModel(job, use_profiles)
        split = split_memory(cm, gpu_type, kv, col)
        if split is None:
            continue
        apply_split(cm, split)
        cand = colocated_candidate(cm, gpu_type)
        if cand is not None and (best is None or cand.step_s < best[2].step_s * (1 - 1e-6)):
            best = (cm, split, cand)
    if best is None:
        raise ConfigError([_no_fit(job, gpu_type)], "infeasible job")
    cm, split, cand = best
    return cm, cand, replace(job, colocate=split.colocate())


def _no_fit(job: Job, gpu_type: str) -> str:
    cm = CostModel(job)
    g = cm.gpus[gpu_type]
    given = ", ".join(f"{k} {v:g}" for k, v in job.colocate.to_dict().items()) or "the planner's choice"
    return (f"colocate: the {gpu_type} ({g.hbm_GB:g} GB) cannot hold training (at least "
            f"{cm.train_memory_floor() / 1e9:.2f} GB for weights, gradients and Adam, plus activations) beside a "
            f"rollout replica (weights plus the KV cache of one longest sequence) with {given}; use a smaller "
            "model, a GPU with more memory, or other fractions")


def recost(cm: CostModel, plan) -> Candidate:
    """The candidate a colocated plan describes (to simulate it): its split, its layers."""
    col = plan.job.colocate
    apply_split(cm, Split(col.kv_fraction, col.train_fraction, col.rollout_fraction))
    layers = [b - a for a, b in (st.layers for st in plan.trainer.stages)]
    cand = colocated_candidate(cm, plan.replicas[0].gpu_type, layers)
    if cand is None:
        raise ConfigError(["colocate: the plan's memory split holds no trainer or no replica"], "invalid plan")
    return cand
