"""Cost models and the search-phase solvers, each against an independent reference:
hand arithmetic, brute-force enumeration, or the full cost model (for the lower bounds)."""

import itertools
import json
import random
from dataclasses import replace

import pytest

from hexrl.gpus import PAPER_DECODE_FACTOR, SHIPPED_PROFILES, gpu, read_profile
from hexrl.plan import train_search
from hexrl.plan.candidate import Evaluator
from hexrl.plan.cost import CostModel
from hexrl.plan.cost_rollout import MAX_DECODE_BATCH
from hexrl.plan.cost_train import StageCoeffs
from hexrl.plan.partition import lower_bounds, split_grid
from hexrl.plan.placement import FreeClass, free_classes, train_per_node
from hexrl.plan.rollout_milp import _columns, _solve
from hexrl.plan.train_search import assign_layers
from hexrl.schema import PRESETS, Job, load_job
from hexrl.schema.job import SyncSpec


def job(nodes, model="r1-distill-qwen-1.5b", **rl):
    return load_job({
        "model": {"preset": model}, "data": {"synthetic": {}},
        "rl": {"batch_size": 64, "group_size": 8, "max_new_tokens": 4096, "eta": 2, **rl},
        "workload": {"prompt_len": 256, "output_len": {"mean": 1500, "max": 4096}},
        "cluster": {"nodes": nodes, "inter_node_GBps": 5, "cross_type_GBps": 1.5},
    })


def nodes(*spec, gpus=8):
    return [{"name": f"n{i}", "gpu_type": t, "gpus": gpus} for i, t in enumerate(spec)]


# ---------------------------------------------------------------- cost terms by hand
# Each cost term against arithmetic from the model's shape and the GPU's datasheet, never from the
# CostModel's own helpers. The types used (H20, H800) have no measured profile in the repository,
# and use_profiles=False keeps it so.

# r1-distill-qwen-1.5b (hexrl/schema/job.py): hidden 1536, MLP 8960, 28 layers, 12 heads of 128, 2 KV heads
LAYER = (2 * 1536 * 1536  # q and o projections (12 heads x 128 = 1536)
         + 2 * 1536 * 256  # k and v projections (2 KV heads x 128 = 256)
         + 3 * 1536 * 8960  # SwiGLU gate, up, down
         + 1536 + 2 * 256  # Qwen2's q, k, v biases
         + 2 * 1536)  # two RMSNorm weights
HEAD = 151_936 * 1536  # output head (untied); the input embedding is as large
MATMUL = 28 * LAYER + HEAD  # parameters a token multiplies through (the embedding is a lookup)
PARAMS = 28 * LAYER + 2 * HEAD + 1536  # all of them: layers, embedding, head, final norm
KV_BYTES = 2 * 28 * 2 * 128 * 2  # K and V, 28 layers, 2 KV heads of 128, bf16
ATTN = 4 * 12 * 128  # FLOPs per layer per context position: q.k and p.v, 2 FLOPs a multiply-add, 12 heads of 128

# H20 datasheet (hexrl/gpus.py): 148 TFLOP/s dense bf16, 4 TB/s HBM, 96 GB, 450 GB/s NVLink;
# the catalogue's efficiencies, scaled on the rollout side by the paper-fitted decode factor
F_H20 = PAPER_DECODE_FACTOR["H20"]
H20_BW = 4e12 * 0.75 * F_H20  # bytes/s decode reads at (hbm_efficiency 0.75)
H20_PEAK = 148e12 * 0.5 * F_H20  # FLOP/s of decode and prefill (decode_mfu = prefill_mfu = 0.5)
H20_STEP = 2e-3 / F_H20  # decode_overhead_s per step


def fixed_job(gpu: str, prompt: int, out: int, model: dict | None = None, **rl) -> Job:
    """One node of 8 `gpu`; every prompt `prompt` tokens, every output `out` tokens."""
    return load_job({
        "model": model or {"preset": "r1-distill-qwen-1.5b"}, "data": {"synthetic": {}},
        "rl": {"batch_size": 8, "group_size": 4, "max_new_tokens": out, "eta": 0, **rl},
        "workload": {"prompt_len": prompt, "output_len": {"samples": [out]}},
        "cluster": {"nodes": nodes(gpu)},
    })


def read_or_compute(b: int) -> float:
    """Weight part of an H20 decode step of b sequences (1.5B, tp 1): the slower of reading and multiplying."""
    return max(2 * MATMUL / H20_BW, 2 * MATMUL * b / H20_PEAK)


def test_decode_step_is_the_hbm_roofline_at_batch_one():
    cm = CostModel(fixed_job("H20", 256, 1000), use_profiles=False)
    # the bf16 weights and one sequence's KV at its average context 256 + 1000 / 2, read once
    expect = H20_STEP + (2 * MATMUL + 756 * KV_BYTES) / H20_BW
    assert cm.decode_point("H20", 1, 1).step_s == pytest.approx(expect, rel=1e-9)


def test_decode_reads_the_weights_once_and_multiplies_them_per_sequence():
    """The context-free part of a decode step: the weights read once (small batches), or 2 FLOPs
    a parameter per sequence (large batches), plus TP's all-reduces."""
    cm = CostModel(fixed_job("H20", 256, 1000), use_profiles=False)
    read = 2 * MATMUL / H20_BW  # bf16 weights, read once a step
    assert cm.decode_fixed_s("H20", 1, 1) == pytest.approx(H20_STEP + read, rel=1e-9)
    # 512 sequences: 2 FLOPs per parameter each, past the H20's 24.7 FLOPs a byte: compute-bound
    assert cm.decode_fixed_s("H20", 1, 512) == pytest.approx(H20_STEP + 2 * MATMUL * 512 / H20_PEAK, rel=1e-9)
    # TP 2 at 8 sequences: half the weights each; per layer 2 all-reduces of 8 x 1536 bf16
    # activations (a ring moves 2 (tp - 1) / tp of them over 450 GB/s NVLink), 8 us apiece
    allreduce = 8e-6 + 8 * 1536 * 2 * 2 * (1 / 2) / 450e9
    assert cm.decode_fixed_s("H20", 2, 8) == pytest.approx(H20_STEP + read / 2 + 2 * 28 * allreduce, rel=1e-9)


def test_decode_attention_reads_the_kv_cache():
    """The context part of a decode step: every running sequence's KV read once (GQA, 2 KV heads:
    6 FLOPs a byte, far under the GPU's ratio), split over TP ranks up to the KV head count."""
    cm = CostModel(fixed_job("H20", 256, 1000), use_profiles=False)
    for tp, kv_per_gpu in ((1, KV_BYTES), (2, KV_BYTES / 2), (4, KV_BYTES / 2)):  # tp 4: KV heads replicated
        assert cm.decode_coeffs("H20", tp, 1)[1] == pytest.approx(kv_per_gpu / H20_BW, rel=1e-9)
    # a whole step of 64 sequences, each reading a context of 256 + 1000 / 2 on average
    step = H20_STEP + read_or_compute(64) + 64 * 756 * KV_BYTES / H20_BW
    assert cm.decode_point("H20", 1, 64).step_s == pytest.approx(step, rel=1e-9)


def test_decode_attention_flops_bind_with_one_kv_head():
    """48 query heads of 32 on one KV head: 48 FLOPs per KV byte, past the H20's 24.7, so the
    attention FLOPs, not the KV bytes, set the step's context cost."""
    mqa = {**PRESETS["r1-distill-qwen-1.5b"], "num_attention_heads": 48, "num_key_value_heads": 1}
    cm = CostModel(fixed_job("H20", 256, 1000, model={"config": mqa}), use_profiles=False)
    flops = 4 * 48 * 32 * 28  # q.k and p.v per context position, 48 heads of 32, 28 layers
    kv = 2 * 28 * 1 * 32 * 2  # the KV bytes it reads: 3584, 2x faster to read than to multiply
    assert kv / H20_BW < flops / H20_PEAK
    assert cm.decode_coeffs("H20", 1, 1)[1] == pytest.approx(flops / H20_PEAK, rel=1e-9)
    # tp 2 splits the query heads but not the one KV head: each rank reads all of the KV, which binds again
    assert kv / H20_BW > flops / 2 / H20_PEAK
    assert cm.decode_coeffs("H20", 2, 1)[1] == pytest.approx(kv / H20_BW, rel=1e-9)


def test_prefill_prices_linears_and_causal_attention():
    """Prefill (and KV recompute): 2 FLOPs a parameter per token, and attention over the token's
    causal context, at prefill_mfu of the peak."""
    cm = CostModel(fixed_job("H20", 256, 1000), use_profiles=False)
    linears = 2 * MATMUL  # per token
    attention = 28 * ATTN * 1024  # per token at an average context of 1024 (prompts of 2048)
    assert cm.prefill_s("H20", 1, 4096, 1024) == pytest.approx(4096 * (linears + attention) / H20_PEAK, rel=1e-9)
    assert cm.prefill_s("H20", 4, 4096, 1024) == pytest.approx(4096 * (linears + attention) / 4 / H20_PEAK,
                                                               rel=1e-9)
    # the attention part alone: twice the context costs 28 x ATTN x 1024 more per token
    more = cm.prefill_s("H20", 1, 4096, 2048) - cm.prefill_s("H20", 1, 4096, 1024)
    assert more == pytest.approx(4096 * attention / H20_PEAK, rel=1e-9)
    # a running batch's recompute after a weight update: 64 sequences of 756 tokens on average, causal
    assert cm.decode_point("H20", 1, 64).recompute_s == pytest.approx(
        64 * 756 * (linears + 28 * ATTN * 756 / 2) / H20_PEAK, rel=1e-9)


def test_training_flops_and_time_by_hand():
    """One step's training: forward + backward (3 passes) and the decoupled objective's proximal
    forward (1), 2 FLOPs a parameter and causal attention per token; then the optimizer streams its
    state through HBM once per PPO minibatch. On one H20 at its train_mfu 0.23."""
    cm = CostModel(fixed_job("H20", 256, 1000), use_profiles=False)
    tokens = 8 * 4 * (256 + 1000)  # B x G sequences, prompt + output
    per_token = 28 * (2 * LAYER + ATTN * 1256 / 2) + 2 * HEAD  # layers (causal context: half the sequence), head
    flops = 4 * per_token * tokens  # fwd + bwd (3) + proximal log-prob forward (1)
    assert cm.train_flops() == pytest.approx(flops, rel=1e-9)
    optimizer = 4 * 2 * 16 * (28 * LAYER + 2 * HEAD) / 4e12  # 4 minibatches; read + write 16 B a parameter
    s = cm.stage_coeffs("H20", 1, 1, 1, 0, 1, None, False)
    assert s.per_layer * 28 + s.fixed == pytest.approx(flops / (148e12 * 0.23) + optimizer, rel=1e-9)
    r = cm.stage_coeffs("H20", 1, 1, 1, 0, 1, None, True)  # activation recompute: one forward more
    assert (r.per_layer - s.per_layer) * 28 + r.fixed - s.fixed == pytest.approx(flops / 4 / (148e12 * 0.23),
                                                                                 rel=1e-9)


def test_a_measured_train_overhead_adds_its_seconds_per_micro_batch_pass(tmp_path, monkeypatch):
    """A profile's train_overhead_s (per fwd+bwd of a micro-batch) and train_fwd_overhead_s (per
    forward-only pass) add exactly that per micro-batch to a stage's time, optimizer_overhead_s that
    per optimizer step (one per PPO minibatch, on every stage); without them, nothing.
    40192 tokens a step (8 x 4 x 1256), 4 PPO minibatches, micro-batches of 4096 tokens: per minibatch
    ceil(10048 / 4096) = 3 on one replica, ceil(5024 / 4096) = 2 on each of 2 DP replicas; each runs
    fwd+bwd and the proximal forward (and with recompute one forward more); pp 2 adds its bubble slot."""
    keys = {"train_overhead_s": 0.01, "train_fwd_overhead_s": 0.004, "optimizer_overhead_s": 0.003}
    (tmp_path / "H20.json").write_text(json.dumps(keys))
    monkeypatch.setenv("HEXRL_PROFILES", str(tmp_path))
    j = fixed_job("H20", 256, 1000)
    plain, measured = CostModel(j, use_profiles=False), CostModel(j)
    assert plain.gpus["H20"].train_overhead_s == 0 and measured.gpus["H20"].train_overhead_s == 0.01

    def extra(*layout) -> float:
        a, b = (cm.stage_coeffs("H20", *layout) for cm in (plain, measured))
        assert b.per_layer == a.per_layer and b.max_layers == a.max_layers
        return b.fixed - a.fixed

    opt = 4 * 0.003  # 4 optimizer steps
    assert extra(1, 1, 1, 0, 1, None, False) == pytest.approx(4 * 3 * (0.01 + 0.004) + opt, rel=1e-12)
    assert extra(1, 1, 1, 0, 1, None, True) == pytest.approx(4 * 3 * (0.01 + 2 * 0.004) + opt, rel=1e-12)
    assert extra(1, 2, 1, 0, 1, None, False) == pytest.approx(4 * 2 * (0.01 + 0.004) + opt, rel=1e-12)
    assert extra(1, 1, 2, 0, 1, 450.0, False) == pytest.approx(4 * (3 + 1) * (0.01 + 0.004) + opt, rel=1e-12)
    assert extra(1, 1, 2, 1, 1, None, False) == pytest.approx(4 * (3 + 1) * (0.01 + 0.004) + opt, rel=1e-12)
    # no proximal forward (decoupled off): fwd+bwd only
    naive, naive_measured = CostModel(fixed_job("H20", 256, 1000, decoupled=False), use_profiles=False), CostModel(
        fixed_job("H20", 256, 1000, decoupled=False))
    a, b = (cm.stage_coeffs("H20", 1, 1, 1, 0, 1, None, False) for cm in (naive, naive_measured))
    assert b.fixed - a.fixed == pytest.approx(4 * 3 * 0.01 + opt, rel=1e-12)


def test_profiles_without_a_train_overhead_price_training_as_before():
    """The shipped H100 profile has no train_overhead_s: the planner reads none, the GPU's is 0."""
    assert "train_overhead_s" not in read_profile("H100", SHIPPED_PROFILES)
    assert gpu("H100").train_overhead_s == gpu("H100").train_fwd_overhead_s == gpu("H100").optimizer_overhead_s == 0


def test_a_tied_model_on_one_stage_holds_one_matrix_for_embedding_and_head():
    """Qwen2.5-1.5B ties its embedding and output head: on one stage the decoder shares one matrix,
    so the optimizer streams it once; split over two stages each end holds its own copy."""
    tied = CostModel(fixed_job("H20", 256, 1000, model={"preset": "qwen2.5-1.5b"}), use_profiles=False)
    tokens = 8 * 4 * (256 + 1000)
    per_token = 28 * (2 * LAYER + ATTN * 1256 / 2) + 2 * HEAD  # the head still multiplies every token
    flops = 4 * per_token * tokens
    optimizer = 4 * 2 * 16 * (28 * LAYER + HEAD) / 4e12  # one vocab x hidden matrix, not two
    s = tied.stage_coeffs("H20", 1, 1, 1, 0, 1, None, False)
    assert s.per_layer * 28 + s.fixed == pytest.approx(flops / (148e12 * 0.23) + optimizer, rel=1e-9)
    first = tied.stage_coeffs("H20", 1, 1, 2, 0, 1, 450.0, False)  # pp 2: the embedding here ...
    last = tied.stage_coeffs("H20", 1, 1, 2, 1, 1, None, False)  # ... and the head here
    untied = CostModel(fixed_job("H20", 256, 1000), use_profiles=False)
    assert first.max_layers == untied.stage_coeffs("H20", 1, 1, 2, 0, 1, 450.0, False).max_layers
    assert last.max_layers == untied.stage_coeffs("H20", 1, 1, 2, 1, 1, None, False).max_layers
    assert s.max_layers > untied.stage_coeffs("H20", 1, 1, 1, 0, 1, None, False).max_layers


def test_weight_sync_spreads_over_the_sources_a_replica_can_split():
    """Every trainer rank of a stage sends its part (no gather); a rollout GPU's link carries the
    stage over min(sources, rollout TP), the replica's ranks share the rest over NVLink (H20: 450 GB/s),
    and the stage pays its ring's fill over the rollout nodes it passes once."""
    cm = CostModel(fixed_job("H20", 256, 1000), use_profiles=False)
    send = 3e9 / (450e9 * 0.8)  # same node: NVLink at NCCL's 80% efficiency
    assert cm.sync_s([(0, 3e9, 1)], {0}) == pytest.approx(send, rel=1e-12)
    assert cm.sync_s([(0, 3e9, 2)], {0}) == pytest.approx(send, rel=1e-12)  # TP 1 replicas take it all
    assert cm.sync_s([(0, 3e9, 2)], {0}, dp=2, split=4) == pytest.approx(send / 4 + 0.75 * 3e9 / 450e9, rel=1e-12)
    assert cm.sync_s([(0, 3e9, 1), (0, 1e9, 4)], {0}) == pytest.approx(4e9 / 360e9, rel=1e-12)
    job = fixed_job("H20", 256, 1000)
    job.cluster = load_job({"model": {"preset": "r1-distill-qwen-1.5b"}, "data": {"synthetic": {}},
                            "cluster": {"nodes": nodes("H20", "H20", "H20")}}).cluster
    three = CostModel(job, use_profiles=False)
    nic = 12.5e9 * 0.8  # the default inter-node link
    fill = 2 * (512 << 10) / nic  # one chunk over each of two hops, once: the buckets queue back to back
    assert three.sync_s([(0, 3e9, 1)], {1, 2}) == pytest.approx(3e9 / nic + fill, rel=1e-12)


def test_a_delta_sync_sends_a_bit_per_element_and_the_changed_values():
    def sync_s(**spec):
        job = fixed_job("H20", 256, 1000)
        job.sync = SyncSpec(**spec)
        return CostModel(job, use_profiles=False).sync_s([(0, 3e9, 1)], {0})

    dense = sync_s()
    assert sync_s(delta=True, changed_fraction=0.034) == pytest.approx(dense * (1 / 16 + 0.034), rel=1e-12)
    assert sync_s(delta="auto", changed_fraction=0.99) == pytest.approx(dense, rel=1e-12)  # dense is smaller: auto


def test_kv_capacity_fits_memory():
    """The decode batch is the largest whose KV fits beside the weights: b sequences fit, b + 1 do not."""
    cm = CostModel(fixed_job("H800", 1024, 12000), use_profiles=False)
    assert cm.tp_options("H800") == [1, 2, 4]  # 12 heads: 8 does not divide
    usable = 80e9 * 0.90 - 1.5e9  # H800's 80 GB at mem_util 0.9, less the workspace
    for tp in (1, 2, 4):
        room = usable - 2 * PARAMS / tp  # bf16 weights, split over TP
        seq = KV_BYTES / min(tp, 2) * (1024 + 12000 / 2)  # KV of an average sequence (2 KV heads: replicated past tp 2)
        b = cm.max_decode_batch("H800", tp)
        assert 0 < b < 1024 and b * seq <= room < (b + 1) * seq
    short = CostModel(fixed_job("H800", 256, 100), use_profiles=False)
    assert short.max_decode_batch("H800", 1) == MAX_DECODE_BATCH  # the engine's cap binds first


def test_the_rooms_share_the_memory_split_and_a_swapped_workload():
    """A colocated split (hexrl/plan/shared_gpu.py) caps both rooms, and a probe's workload
    (tools/bench/compare_cost_model.py swaps it before pricing) reaches every room."""
    cm = CostModel(fixed_job("H20", 256, 1000), use_profiles=False)
    alone = cm.stage_coeffs("H20", 1, 1, 1, 0, 1, None, False).max_layers
    cm.share_memory({"train": 0.5 * cm.usable_bytes("H20"), "rollout": 2 * cm.m.num_params + 1e9})
    assert cm.stage_coeffs("H20", 1, 1, 1, 0, 1, None, False).max_layers < alone
    assert cm.max_decode_batch("H20", 1) == 1e9 // (KV_BYTES * cm.w.ctx_decode)
    cm.w = replace(cm.w, micro_tokens=10 ** 9)
    assert cm.train.microbatches(1) == 1 and cm.rollout.w is cm.w and cm.sync.w is cm.w


def test_layer_assignment_matches_brute_force():
    rng = random.Random(0)
    for _ in range(40):
        p, n_layers = rng.randint(1, 4), rng.randint(4, 12)
        coeffs = [StageCoeffs(rng.uniform(0.5, 3), rng.uniform(0, 5), rng.randint(1, n_layers)) for _ in range(p)]
        best = None
        for split in itertools.product(range(1, n_layers + 1), repeat=p):
            if sum(split) == n_layers and all(l <= c.max_layers for l, c in zip(split, coeffs)):
                t = max(c.per_layer * l + c.fixed for l, c in zip(split, coeffs))
                best = t if best is None else min(best, t)
        got = assign_layers(coeffs, n_layers)
        if best is None:
            assert got is None
        else:
            assert max(c.per_layer * l + c.fixed for l, c in zip(got, coeffs)) == pytest.approx(best)


def brute_force_rollout(cm, classes, cols, rates, concurrency):
    """Best total token rate by trying every packing of every node (tiny cases only)."""
    per_class = []
    for ci, c in enumerate(classes):
        mine = [j for j, (cj, *_) in enumerate(cols) if cj == ci]
        options = []  # multisets of columns whose TP sizes fill one node exactly
        for k in range(c.free + 1):
            for combo in itertools.combinations_with_replacement(mine, k):
                if sum(cols[j][1].tp for j in combo) == c.free:
                    options.append(combo)
        per_class.append([sum((list(o) for o in pick), []) for pick in
                          itertools.combinations_with_replacement(options, len(c.nodes))])
    best = 0.0
    for choice in itertools.product(*per_class):
        used = [j for part in choice for j in part]
        if concurrency is None or sum(cols[j][1].batch for j in used) <= concurrency:
            best = max(best, sum(rates[j] for j in used))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_rollout_milp_matches_brute_force(seed):
    rng = random.Random(seed)
    cm = CostModel(job(nodes("H20", "L40S", gpus=4), batch_size=rng.choice([2, 4, 8]), eta=rng.choice([0, 1])),
                   use_profiles=False)
    classes = [FreeClass("H20", rng.choice([2, 3, 4]), (0,)), FreeClass("L40S", rng.choice([1, 2, 4]), (1,))]
    concurrency = (cm.w.eta + 1) * cm.w.samples
    cols, _ = _columns(cm, classes, concurrency)
    rates = [pt.tokens_per_s for _, pt, _ in cols]
    y, sol = _solve(cm, classes, cols, rates, concurrency)
    assert sol[-1] == pytest.approx(brute_force_rollout(cm, classes, cols, rates, concurrency), rel=1e-6)
    for ci, c in enumerate(classes):  # every rollout GPU is in a replica
        assert sum(cols[j][1].tp * y[j] for j in range(len(cols)) if cols[j][0] == ci) == c.free


def test_training_packs_nodes_and_rollout_takes_the_rest():
    c = job(nodes("H800", "H800", "H20", "H20")).cluster
    per_node = train_per_node(c, {"H800": 12, "H20": 2})
    assert per_node == (8, 4, 2, 0)
    assert [(f.gpu_type, f.free, f.nodes) for f in free_classes(c, per_node)] == \
        [("H800", 4, (1,)), ("H20", 6, (2,)), ("H20", 8, (3,))]


def test_memory_caps_hold_for_the_chosen_layout():
    cm = CostModel(job(nodes("L40S", "L40S"), model="r1-distill-qwen-7b"), use_profiles=False)
    cand = Evaluator(cm)(train_per_node(cm.cluster, {"L40S": 8}))
    assert cand is not None
    L = cm.m.num_hidden_layers
    for i, s in enumerate(cand.train.stages):  # weights + grads + Adam of the stage fit one GPU
        edge = cm.params.head * ((i == 0) + (i == cand.train.pp - 1))
        assert (s.layers * cm.layer_params + edge) * 18 / s.tp < cm.usable_bytes("L40S")
    assert sum(s.layers for s in cand.train.stages) == L


@pytest.mark.parametrize("spec", [("H800", "H20"), ("A100-80G", "L40S", "RTX4090"), ("H100", "H20")])
def test_lower_bounds_never_exceed_the_cost_model(spec):
    for eta in (0, 2):
        cm = CostModel(job(nodes(*spec, gpus=4), eta=eta), use_profiles=False)
        ev = Evaluator(cm)
        types = cm.cluster.types()
        grid = split_grid([cm.cluster.count(t) for t in types])
        lb = lower_bounds(ev, types, grid)
        checked = 0
        for n, bound in zip(grid, lb):
            cand = ev.counts({t: int(v) for t, v in zip(types, n)})
            if cand is not None:
                assert bound <= cand.step_s * (1 + 1e-9)
                checked += 1
        assert checked > 3


@pytest.mark.parametrize("spec", [("H800", "H20", "H100", "A100-80G"), ("L40S", "H20"), ("H100", "RTX4090", "H800")])
def test_the_training_search_prunes_only_layouts_that_cannot_win(spec):
    """search_train costs layouts in order of a lower bound and stops when the bound passes the best:
    every bound is at most its layout's time (with or without recompute), train_bound is at most the
    search's answer, and the answer equals costing every layout (ties: the first enumerated)."""
    rng = random.Random(len(spec))
    for model in ("r1-distill-qwen-1.5b", "r1-distill-qwen-7b"):
        cm = CostModel(job(nodes(*(spec * 3), gpus=8), model=model, ppo_minibatches=rng.choice([1, 4])),
                       use_profiles=False)
        for _ in range(12):  # random training GPUs per node, not only packed ones
            per_node = tuple(rng.choice([0, 0, 2, 4, 8]) for _ in cm.cluster.nodes)
            every = []  # (time, index) of each layout as the search prices it: no recompute if that fits
            for bound, index, tps, dp, order, spans in train_search._layouts(cm, per_node):
                stages, where = [(t, tps[t]) for t in order for _ in spans[t]], [x for t in order for x in spans[t]]
                times = []
                for recompute in (False, True):
                    fit = train_search._stage_times(cm, stages, where, dp, recompute)
                    if fit is not None:
                        times.append(max(c.per_layer * n + c.fixed for n, c in zip(*fit)))
                        assert bound <= times[-1]
                if times:
                    every.append((times[0], index))
            plan = train_search.search_train(cm, per_node)
            assert (plan is None) == (not every)
            if plan is not None:
                assert plan.time_s == pytest.approx(min(every)[0], rel=1e-12)
                assert train_search.train_bound(cm, per_node) <= plan.time_s


def test_more_rollout_gpus_never_slow_generation():
    cm = CostModel(job(nodes("H20", "H20")), use_profiles=False)
    ev = Evaluator(cm)
    gens = [ev.rollout(train_per_node(cm.cluster, {"H20": k})).gen_s for k in range(1, 15)]
    assert all(a >= b * (1 - 1e-6) for a, b in zip(gens[1:], gens))


def test_per_type_plans_combine_into_one_rollout():
    """The planner's sweep estimates a split with one small MILP per GPU type: combined, the
    replicas keep their types' token rates as shares, the makespan is the recompute fixed point
    of all of them, and on the H800 + H20 cluster the estimates pick the exhaustive optimum."""
    from hexrl.plan.partition import exhaustive
    from hexrl.plan.rollout_milp import combine, makespan, solve_rollout
    cm = CostModel(job(nodes("H800", "H20", gpus=4), eta=4), use_profiles=False)
    ev = Evaluator(cm)
    per_node = train_per_node(cm.cluster, {"H800": 2, "H20": 2})
    by_type = [[c] for c in free_classes(cm.cluster, per_node)]
    plans = [solve_rollout(cm, cs) for cs in by_type]
    both = combine(cm, plans)
    assert sum(r.share for r in both.replicas) == pytest.approx(1.0)
    h800 = sum(r.share for r in both.replicas if r.gpu_type == "H800")
    assert h800 == pytest.approx(plans[0].tokens_per_s / sum(p.tokens_per_s for p in plans))
    points = [cm.decode_point(r.gpu_type, r.tp, r.batch) for r in both.replicas]
    assert both.theta_s == pytest.approx(makespan(cm, points))
    assert both.theta_s < min(p.theta_s for p in plans)  # both types together are faster than either
    splits = [train_per_node(cm.cluster, {"H800": a, "H20": b}) for a in range(5) for b in range(5)]
    estimates = {s: ev.estimate(s, r) for s in splits if (r := ev.combined_rollout(s)) is not None}
    best, _ = exhaustive(Evaluator(cm))
    assert min(estimates, key=estimates.get) == best.per_node
