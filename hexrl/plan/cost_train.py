"""The training room of the cost model: a pipeline stage's time per RL step (compute, TP
all-reduces, 1F1B's bubble, the DP gradient all-reduce, the optimizer, activation sends) and the
layers its memory holds. train_search.py lays stages out with these coefficients."""

import math
from dataclasses import dataclass

from hexrl.gpus import GPU
from hexrl.plan.cost_inputs import Memory, Params, Workload
from hexrl.schema import Job

BYTES_PER_PARAM_TRAIN = 18  # bf16 weights 2 + fp32 grads 4 + fp32 master 4 + Adam m, v 8


@dataclass(frozen=True)
class StageCoeffs:
    """Stage time = per_layer * layers + fixed (seconds per RL step); memory caps the layers."""

    per_layer: float
    fixed: float
    max_layers: int


class TrainCost:
    """Training costs of one job on the cluster's GPU types."""

    def __init__(self, job: Job, w: Workload, gpus: dict[str, GPU], memory: Memory, params: Params):
        self.job, self.m, self.cluster = job, job.model.config, job.cluster
        self.w, self.gpus, self.memory, self.params = w, gpus, memory, params
        self.gpn = self.cluster.gpus_per_node
        knobs = job.runtime.get("trainer", {})
        # the trainer all-reduces its float32 gradient buckets (plan.trainer.grad_reduce_dtype)
        self.grad_reduce_bytes = 4.0 if knobs.get("grad_reduce_dtype", "float32") == "float32" else 2.0
        q_dim = self.m.num_attention_heads * self.m.head_dim
        self.layer_fwd_flops = 2 * params.layer + 4 * q_dim * w.ctx_attn
        self._stage_cache: dict = {}
        self._layer_cache: dict = {}
        self._send_cache: dict = {}

    def clear_stage_cache(self) -> None:
        """Forget the stage coefficients priced so far (their layer caps depend on memory)."""
        self._stage_cache.clear()

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
        return bubble * (compute + tp_comm) + w.minibatches * per_param * self.params.layer

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
            fixed += bubble * passes * 2 * self.params.head * tok / flops
        edge_params = self.params.edge(index, pp)
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
        room = self.memory.usable_bytes(gpu_type, "train") - fixed
        per_layer = self.params.layer * bpp / tp + act_per_layer
        return max(0, int(room // per_layer))

    def train_flops(self) -> float:
        """FLOPs of one step's training without activation recompute (layers and output head)."""
        per_token = self.m.num_hidden_layers * self.layer_fwd_flops + 2 * self.params.head
        return (3 + self.w.extra_fwd) * per_token * self.w.tokens

    def train_memory_floor(self) -> float:
        """Bytes the training set needs at the very least (weights, grads, Adam; no activations)."""
        return self.m.num_params * BYTES_PER_PARAM_TRAIN
