"""Where a delta weight sync stops paying: bytes and encode/decode time against the dense send.

    python -m tools.bench.bench_weight_sync                       # 4 M bf16 elements, CPU
    python -m tools.bench.bench_weight_sync --elements 4000000 --dtype float32 --device cuda
    python -m tools.bench.bench_weight_sync --plans              # predicted sync of planned clusters, old vs new

For each changed fraction f, a flat tensor of `--elements` in `--dtype` with a random f of its
elements changed goes through hexrl/comm/delta.py: `encode` (the sender: compare bits, pack the
bitmap, gather the values) and `apply` (the receiver: unpack, scatter into its previous copy), each
timed as the thread's CPU time (time.thread_time: load on a shared machine inflates it less than
wall time) on the CPU, or by CUDA events on a GPU, median of `--repeats`. Beside them, the dense
path's own host work (a copy of the bucket, what the receiver does with a dense bucket). Printed:
- bytes: a delta's size over the dense size (the byte crossover is where it reaches 1);
- encode / decode ns per element, and their sum over the dense copy's;
- for each link rate, the fraction above which encode + delta bytes + decode take longer than the
  dense bytes (linear interpolation between measured fractions).

--plans plans tools/bench/bench_planner.py's clusters (four GPU types, links 5 / 1.5 GB/s, the
paper's 512 x 16 job) at 512 and 4,096 GPUs for each model and prices each plan's weight sync: the
former funnel as the cost model had it (one source per stage, TP gather, no fills), the funnel with
its rings' fills, the sharded sync (hexrl/plan/cost_sync.py, what the plan is chosen with), and the
sharded sync with a delta of `--changed` of the elements.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from hexrl.comm import delta

FRACTIONS = (0.0, 0.01, 0.034, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 0.95, 1.0)
LINKS_GBPS = (0.1, 0.5, 1.5, 5.0, 12.5, 50.0)


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of fn(): thread CPU time on the CPU, CUDA events on a GPU."""
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.thread_time()
            fn()
            out.append(time.thread_time() - t0)
    return statistics.median(out)


def measure(n: int, frac: float, dtype: torch.dtype, device: torch.device, repeats: int) -> dict:
    """One changed fraction: bytes ratio and seconds of encode, apply and the dense copy."""
    g = torch.Generator().manual_seed(0)
    old = torch.randn(n, generator=g).to(dtype)
    new = old.clone()
    hit = torch.rand(n, generator=g) < frac
    delta.bits_of(new)[hit] += 1  # the next representable value: a change in every hit element
    old, new = old.to(device), new.to(device)
    payload, count = delta.encode(new, old)
    out = old.clone()
    delta.apply(payload, out)
    assert torch.equal(delta.bits_of(out), delta.bits_of(new)), "delta is not exact"
    dense_bytes = n * new.element_size()
    scratch = torch.empty_like(new)
    return {"frac": count / n, "bytes": payload.numel() / dense_bytes, "dense_bytes": dense_bytes,
            "encode_s": timed(lambda: delta.encode(new, old), repeats, device),
            "apply_s": timed(lambda: delta.apply(payload, old.clone()), repeats, device),
            "copy_s": timed(lambda: scratch.copy_(new), repeats, device)}


def crossover(rows: list[dict], excess) -> float | None:
    """The changed fraction where excess(row) (a delta's cost over the dense one's) reaches 0, by
    linear interpolation; None if a delta never pays, 1.0 if it always does."""
    prev = None
    for r in rows:
        e = excess(r)
        if e > 0:
            if prev is None:
                return None
            pe = excess(prev)
            return prev["frac"] + (r["frac"] - prev["frac"]) * (-pe) / (e - pe)
        prev = r
    return 1.0


def at_link(link_Bps: float):
    """A delta's seconds (encode, its bytes at link_Bps, apply) over the dense bytes' seconds."""
    return lambda r: (r["encode_s"] + r["apply_s"] + (r["bytes"] - 1) * r["dense_bytes"] / link_Bps)


def plan_rows(models: list[str], gpus: list[int], changed: float) -> list[dict]:
    """Plan each cluster and price its sync four ways (seconds per step)."""
    from hexrl.plan.candidate import Evaluator, stage_sync_bytes
    from hexrl.plan.cost import CostModel
    from hexrl.plan.cost_sync import funnel_stage_s, stage_links
    from hexrl.plan.partition import two_phase
    from hexrl.schema import load_job
    from hexrl.schema.job import SyncSpec
    from tools.bench.bench_planner import cluster_job

    rows = []
    for model in models:
        for n in gpus:
            cm = CostModel(load_job(cluster_job(model, n, 4), check_paths=False), use_profiles=False)
            best, _ = two_phase(Evaluator(cm))
            train, roll = best.train, best.rollout
            nodes, split = {r.node for r in roll.replicas}, min(r.tp for r in roll.replicas)
            stages = stage_sync_bytes(cm, train)
            old = fills = 0.0
            for node, nbytes, tp in stages:
                link, _, hops = stage_links(cm.cluster, node, nodes)
                intra = cm.cluster.intra_GBps(cm.cluster.nodes[node].gpu_type) * 1e9  # the leader gathered on its node
                old += funnel_stage_s(nbytes, tp, link, intra)
                fills += funnel_stage_s(nbytes, tp, link, intra, hops)
            cm.job.sync = SyncSpec(delta=True, changed_fraction=changed)
            rows.append({"model": model, "gpus": n, "step_s": best.step_s, "sync_s": best.C_sync,
                         "layout": f"dp {train.dp} x tp {'/'.join(str(s.tp) for s in train.stages)} x pp {train.pp}",
                         "split": split, "rollout_nodes": len(nodes), "old_s": old, "old_fills_s": fills,
                         "delta_s": cm.sync_s(stages, nodes, train.dp, split)})
    return rows


def print_plans(rows: list[dict], changed: float) -> None:
    print(f"| model | GPUs | trainer | min rollout TP | rollout nodes | step s | funnel (old model) s | "
          f"funnel + fills s | sharded s | sharded, delta {changed:.1%} s | sync / step old -> new |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        old_share = r["old_s"] / (r["step_s"] - r["sync_s"] + r["old_s"])
        print(f"| {r['model']} | {r['gpus']:,} | {r['layout']} | {r['split']} | {r['rollout_nodes']} | "
              f"{r['step_s']:.1f} | {r['old_s']:.2f} | {r['old_fills_s']:.2f} | {r['sync_s']:.2f} | "
              f"{r['delta_s']:.2f} | {old_share:.0%} -> {r['sync_s'] / r['step_s']:.0%} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elements", type=int, default=4_000_000, help="elements per bucket (4 M bf16: 8 MB)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--plans", action="store_true", help="the sync of planned clusters, old vs new, instead")
    p.add_argument("--models", default="r1-distill-qwen-1.5b,r1-distill-qwen-7b,r1-distill-qwen-14b")
    p.add_argument("--gpus", default="512,4096")
    p.add_argument("--changed", type=float, default=0.034, help="changed fraction for the delta column")
    a = p.parse_args(argv)
    if a.plans:
        print_plans(plan_rows(a.models.split(","), [int(x) for x in a.gpus.split(",")], a.changed), a.changed)
        return
    dtype, device = getattr(torch, a.dtype), torch.device(a.device)
    torch.set_num_threads(1)
    rows = [measure(a.elements, f, dtype, device, a.repeats) for f in FRACTIONS]
    print(f"{a.elements:,} x {a.dtype} on {device} ({torch.get_num_threads()} thread), median of {a.repeats}")
    print("| changed | delta bytes / dense | encode ns/elem | decode ns/elem | (enc+dec) / dense copy |")
    print("|---|---|---|---|---|")
    for r in rows:
        per = 1e9 / a.elements
        print(f"| {r['frac']:.3f} | {r['bytes']:.3f} | {r['encode_s'] * per:.2f} | {r['apply_s'] * per:.2f} | "
              f"{(r['encode_s'] + r['apply_s']) / r['copy_s']:.1f} |")
    print("\nchanged fraction above which a delta takes longer than the dense bytes:")
    for gbps in LINKS_GBPS:
        x = crossover(rows, at_link(gbps * 1e9))
        print(f"  link {gbps:5.1f} GB/s: " + ("never pays" if x is None else f"{x:.3f}"))
    x = crossover(rows, lambda r: r["bytes"] - 1)
    print("  bytes alone:          " + ("never pays" if x is None else f"{x:.3f}"))


if __name__ == "__main__":
    main()
