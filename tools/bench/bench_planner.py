"""Planner time vs cluster size and GPU types: the scaling table, a profile of each cell, and
exhaustive search beside it where that is feasible.

    python tools/bench/bench_planner.py [--gpus 56,128,512,1024,2048,4096] [--types 2,3,4]
        [--cpu-limit 300] [--profile] [--wide] [--exhaustive-limit 5000] [--model r1-distill-qwen-7b]
        [--node-gpus 8]

Clusters: nodes of 8 GPUs (--node-gpus) dealt evenly to the first k of H800, H20, H100, A100-80G (the later
types get the extra nodes: 56 GPUs of two types is the paper's 24 H800 + 32 H20; 512 of four is
128 of each). Each cell plans in a fresh process (so one cell's caches do not help the next, and
a cell over --cpu-limit CPU seconds is cut off and shown as such) and reports wall time, peak memory
and CPU time (time.process_time; HiGHS runs single-threaded), so on a shared machine the CPU time is the
fair measure: it is what the planner would take on a quiet 2-core machine. The load average is
printed before and after. --profile prints, for each cell, where the CPU time goes (cProfile
on process_time, the planner's own functions by cumulative time; profiling slows it ~2x).
--wide also runs the slower, wider search (partition.wide_search) and prints how far the
planner's plan is from its best.
Targets (CPU time): 56 GPUs of two types <= 1 s, 512 of four <= 5 s, 4,096 of four <= 60 s.
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import resource
import subprocess
import sys
import time
from pathlib import Path

from hexrl.plan.candidate import Evaluator
from hexrl.plan.cost import CostModel
from hexrl.plan.partition import exhaustive, n_splits, two_phase
from hexrl.schema import load_job

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TYPES = ["H800", "H20", "H100", "A100-80G"]


def cluster_job(model: str, gpus: int, n_types: int, node_gpus: int = 8) -> dict:
    """The job of paper_7b_hetero.json on `gpus` GPUs (nodes of node_gpus) of the first n_types of TYPES."""
    base = json.loads((CONFIGS / "paper_7b_hetero.json").read_text())
    nodes_total = gpus // node_gpus
    per_type = [nodes_total // n_types + (i >= n_types - nodes_total % n_types) for i in range(n_types)]
    nodes = [{"name": f"{t.lower()}-{i}", "gpu_type": t, "gpus": node_gpus}
             for t, n in zip(TYPES, per_type) for i in range(n)]
    base.update(model={"preset": model}, cluster={"nodes": nodes, "inter_node_GBps": 5.0, "cross_type_GBps": 1.5},
                prices={})
    return base


def counts(cm: CostModel, cand) -> str:
    c = Evaluator(cm).counts_of(cand.per_node)
    return " + ".join(f"{n} {t}" for t, n in c.items())


def run_cell(model: str, gpus: int, n_types: int, profile: bool, wide: bool, exhaustive_limit: int,
             node_gpus: int = 8) -> dict:
    """Plan one cluster in this process; timings, the plan, and optionally the profile and yardsticks."""
    cm = CostModel(load_job(cluster_job(model, gpus, n_types, node_gpus), check_paths=False), use_profiles=False)
    ev = Evaluator(cm)
    prof = cProfile.Profile(time.process_time) if profile else None
    w0, c0 = time.perf_counter(), time.process_time()
    if prof:
        prof.enable()
    best, log = two_phase(ev)
    if prof:
        prof.disable()
    out = {"gpus": gpus, "types": n_types, "wall_s": time.perf_counter() - w0, "cpu_s": time.process_time() - c0,
           "step_s": best.step_s if best else None, "split": counts(cm, best) if best else None,
           "evaluations": log.evaluations, "splits": n_splits(ev),
           "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}  # Linux: kB
    if prof:
        out["profile"] = profile_lines(prof, out["cpu_s"])
    if wide:
        from hexrl.plan.partition import wide_search
        c0 = time.process_time()
        yard = wide_search(Evaluator(cm))
        out["wide"] = {"cpu_s": time.process_time() - c0, "step_s": yard.step_s, "split": counts(cm, yard)}
    if out["splits"] <= exhaustive_limit:
        c0 = time.process_time()
        yard, _ = exhaustive(Evaluator(cm))
        out["exhaustive"] = {"cpu_s": time.process_time() - c0, "step_s": yard.step_s, "split": counts(cm, yard)}
    return out


def profile_lines(prof: cProfile.Profile, total: float, top: int = 14) -> list[str]:
    """The planner's own functions (and HiGHS's run) by cumulative time."""
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    rows = []
    for (path, _, name), (_, calls, tot, cum, _) in st.stats.items():
        mine = "hexrl" in path or name in ("run", "passModel")
        if mine and name not in ("two_phase",):
            rows.append((cum, tot, calls, f"{Path(path).stem}.{name}" if "hexrl" in path else name))
    rows.sort(reverse=True)
    return [f"{cum:8.2f} s cum {cum / max(total, 1e-9):5.0%}  {tot:7.2f} s own  {calls:>8} calls  {name}"
            for cum, tot, calls, name in rows[:top]]


def cpu_limit(seconds: int):
    """A child's preexec_fn: the kernel stops it after `seconds` of CPU time (SIGXCPU)."""
    return lambda: resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 5))


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="r1-distill-qwen-7b")
    ap.add_argument("--gpus", default="56,128,512,1024,2048,4096")
    ap.add_argument("--types", default="2,3,4")
    ap.add_argument("--cpu-limit", type=int, default=300, help="CPU seconds before a cell is cut off")
    ap.add_argument("--profile", action="store_true", help="print where each cell's time goes (cProfile)")
    ap.add_argument("--wide", action="store_true", help="also run the slower, wider search as a yardstick")
    ap.add_argument("--exhaustive-limit", type=int, default=5000, help="largest split count to enumerate")
    ap.add_argument("--node-gpus", type=int, default=8, help="GPUs a node")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON")
    ap.add_argument("--cell", help=argparse.SUPPRESS)  # GPUS,TYPES: plan one cell, print its row as JSON
    args = ap.parse_args(argv)
    if args.cell:
        g, k = (int(x) for x in args.cell.split(","))
        print(json.dumps(run_cell(args.model, g, k, args.profile, args.wide, args.exhaustive_limit, args.node_gpus)))
        return 0
    print(f"before: {load()}", flush=True)
    rows = []
    for g in (int(x) for x in args.gpus.split(",")):
        for k in (int(x) for x in args.types.split(",")):
            cmd = [sys.executable, __file__, "--cell", f"{g},{k}", "--model", args.model, "--node-gpus",
                   str(args.node_gpus), "--exhaustive-limit", str(args.exhaustive_limit)] + \
                ["--profile"] * args.profile + ["--wide"] * args.wide
            res = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=cpu_limit(args.cpu_limit))
            if res.returncode == 0:
                row = json.loads(res.stdout.strip().splitlines()[-1])
            elif res.returncode in (-24, -9):  # SIGXCPU, SIGKILL: over the CPU limit
                row = {"gpus": g, "types": k, "cpu_limit_s": args.cpu_limit}
            else:
                row = {"gpus": g, "types": k, "error": res.stderr.strip().splitlines()[-1:]}
            rows.append(row)
            print(format_row(row), flush=True)
    print(f"after: {load()}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def format_row(r: dict) -> str:
    head = f"{r['gpus']:>5} GPUs {r['types']} types"
    if "cpu_limit_s" in r:
        return f"{head}  not done in {r['cpu_limit_s']} s of CPU time"
    if "error" in r:
        return f"{head}  error: {r['error']}"
    s = (f"{head}  cpu {r['cpu_s']:7.2f} s  wall {r['wall_s']:7.2f} s  {r['max_rss_gb']:.2f} GB  "
         f"step {r['step_s']:8.2f} s [{r['split']} train]  {r['evaluations']} splits costed of {r['splits']:,}")
    for name in ("wide", "exhaustive"):
        if name in r:
            y = r[name]
            s += (f"\n{'':<19}{name}: cpu {y['cpu_s']:.2f} s, step {y['step_s']:.2f} s [{y['split']} train]; "
                  f"ours / {name} {r['step_s'] / y['step_s']:.4f}")
    for line in r.get("profile", []):
        s += f"\n{'':<19}{line}"
    return s


if __name__ == "__main__":
    sys.exit(main())
