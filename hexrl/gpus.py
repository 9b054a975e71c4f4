"""GPU catalogue: peak numbers per GPU type, overridable by measured profiles.

Numbers are datasheet values (dense bf16 tensor-core TFLOP/s, HBM size and bandwidth,
one-direction NVLink/PCIe bandwidth per GPU) plus a default rental price. H800 and H20
follow the AReaL-Hex paper (§3, §4.4): H800 756 TFLOP/s, 2 TB/s HBM (the paper's figure;
the SXM datasheet says 3.35 TB/s), 200 GB/s NVLink, $5.28/h; H20 148 TFLOP/s, 4 TB/s,
450 GB/s NVLink, $1.85/h. The efficiency factors are what a good stack reaches in
practice; `tools/bench/bench_kernels.py` measures them and writes `profiles/<gpu>.json`; the
project's measured profiles ship in hexrl/profiles/ (each records the date and versions it was measured with).
"""

import json
import math
import os
import platform
import re
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float  # dense peak
    hbm_GB: float
    hbm_TBps: float
    nvlink_GBps: float  # one direction, per GPU, inside a node
    price: float  # $/h per GPU
    train_mfu: float = 0.40  # fraction of peak a training matmul mix reaches
    prefill_mfu: float = 0.50  # prefill / KV recompute
    decode_mfu: float = 0.50  # compute-bound decode matmuls (large batches)
    hbm_efficiency: float = 0.75  # fraction of HBM bandwidth decode reaches
    decode_overhead_s: float = 2e-3  # per decode step: scheduler, launches, sampling
    # per finished sample, between decode steps: detokenize, hand to the reward workers, send the
    # trajectory (the rollout leader's host work; tools/bench/bench_kernels.py measures it)
    host_s_per_sample: float = 2e-4
    # fixed seconds of one training micro-batch, beside its FLOPs (launches, small-batch idle): the
    # intercept of fwd+bwd time vs tokens, and of a forward-only pass, fitted by bench_kernels. Optional
    # profile keys: absent -> 0, so the shipped H100.json and every plan priced without them are unchanged
    train_overhead_s: float = 0.0
    train_fwd_overhead_s: float = 0.0
    optimizer_overhead_s: float = 0.0  # fixed seconds of one optimizer step (the same: fitted, optional)
    mem_util: float = 0.90  # fraction of HBM the engines may use
    train_scale_loss: float = 0.0  # training efficiency lost per doubling of the trainer past one node

    @property
    def flops(self) -> float:
        return self.bf16_tflops * 1e12

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_GB * 1e9

    @property
    def hbm_Bps(self) -> float:
        return self.hbm_TBps * 1e12


H20_SCALE_LOSS = 0.4

CATALOGUE = {
    g.name: g
    for g in [
        GPU("H100", 989.0, 80.0, 3.35, 450.0, 2.99),
        GPU("H200", 989.0, 141.0, 4.8, 450.0, 3.79),
        GPU("H800", 756.0, 80.0, 2.0, 200.0, 5.28),
        # AReaL-Hex Table 1: per training token an H800 costs 3.12x less than an H20, i.e. it
        # trains 8.9x faster for 5.1x the peak: H20 training reaches ~57% of H800's MFU
        # Observation 2 of the paper: H20 training scales poorly (5 H20s, one H800's peak, do not
        # train like one H800). train_scale_loss is fitted to one number, the paper's 7B
        # hetero/H20 ratio 2.76 (section 4.5); the 1.5B and 14B ratios are then checks
        GPU("H20", 148.0, 96.0, 4.0, 450.0, 1.85, train_mfu=0.23, train_scale_loss=H20_SCALE_LOSS),
        GPU("A100-80G", 312.0, 80.0, 2.039, 300.0, 1.79),
        GPU("L40S", 362.0, 48.0, 0.864, 32.0, 1.03),  # PCIe only
        GPU("RTX4090", 165.0, 24.0, 1.008, 32.0, 0.39),  # PCIe only; bf16 with fp32 accumulate
        # one CPU worker process pretending to be a GPU: the CPU demo and tests
        GPU("cpu", 0.05, 4.0, 0.01, 5.0, 0.0, decode_overhead_s=5e-3),
    ]
}

ALIASES = {
    "a100": "A100-80G",
    "a100-80g": "A100-80G",
    "a100-80gb": "A100-80G",
    "4090": "RTX4090",
    "rtx4090": "RTX4090",
    "rtx-4090": "RTX4090",
    "rtx 4090": "RTX4090",
    "l40s": "L40S",
}


def canonical_name(name: str) -> str | None:
    """The catalogue spelling of a GPU type name (case-insensitive), or None if unknown."""
    if not isinstance(name, str):
        return None
    low = name.strip().lower()
    for known in CATALOGUE:
        if known.lower() == low:
            return known
    return ALIASES.get(low)


def gpu_type_name(device_name: str) -> str:
    """Catalogue spelling of a device name ('NVIDIA H100 80GB HBM3' -> 'H100'), else a file-safe name."""
    low = device_name.lower()
    if low == "cpu":
        return "cpu"
    if re.search(r"a100", low):
        return "A100-80G" if "80" in low else "A100-40G"
    if re.search(r"(rtx\s*)?4090", low):
        return "RTX4090"
    for name in sorted(CATALOGUE, key=len, reverse=True):  # H200 before H20
        if re.search(rf"(?<![a-z0-9]){re.escape(name.lower())}(?![a-z0-9])", low):
            return name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", device_name.replace("NVIDIA ", "")).strip("-") or "gpu"

# Profiles measured for this project (tools/bench/bench_kernels.py on a lent GPU), shipped as package data
SHIPPED_PROFILES = Path(__file__).parent / "profiles"


def profile_dir() -> Path:
    """Where new measurements go and are looked up first: $HEXRL_PROFILES, else ./profiles."""
    return Path(os.environ.get("HEXRL_PROFILES", "profiles"))


def profile_path(name: str, directory: Path | None = None) -> Path | None:
    """The profile for GPU type `name`: in `directory` if given; else $HEXRL_PROFILES only, when set;
    else ./profiles (a fresh local measurement), then the shipped hexrl/profiles. None if none."""
    if directory is not None or "HEXRL_PROFILES" in os.environ:
        dirs = [directory or profile_dir()]
    else:
        dirs = [profile_dir(), SHIPPED_PROFILES]
    return next((d / f"{name}.json" for d in dirs if (d / f"{name}.json").is_file()), None)


def read_profile(name: str, directory: Path | None = None) -> dict:
    """Catalogue fields measured for this GPU type (see `profile_path`), or {} if none.

    Keys that are not catalogue fields (e.g. raw benchmark tables) are ignored.
    """
    path = profile_path(name, directory)
    if path is None:
        return {}
    with open(path) as f:
        data = json.load(f)
    known = {f.name for f in fields(GPU)} - {"name"}
    return {k: float(v) for k, v in data.items() if k in known and isinstance(v, (int, float))}


@dataclass(frozen=True)
class Host:
    """CPU costs of the host path around the GPUs, per unit of work (the defaults: this project's
    2-core build machine, 2026-11-29, CPU time of one thread; docs/fast-paths.md has the runs).
    A profile `host.json` beside the GPU profiles replaces them (`--write` of
    tools/bench/bench_host_path.py measures the controller's terms there, of
    bench_trainer_handoff.py the hand-off's), a job's `workload.host` replaces that."""

    # the controller process's CPU per trajectory and per generated token taken in, handing the batch
    # to the trainer included (tools/bench/bench_controller_scale.py --ingest; its receive path alone,
    # tools/bench/bench_host_path.py, is 30 us + 10.1 ns)
    controller_us_per_traj: float = 75.0
    controller_ns_per_token: float = 21.0
    # handing out one prompt group (message, seal, pick) and publishing a version to one replica
    # (tools/bench/bench_controller_scale.py)
    controller_us_per_group: float = 24.3
    publish_us_per_replica: float = 2.2
    # the trainer's batch hand-off per batch token, serial before the first forward: the controller
    # rank takes the batch from the controller process (8.5 ns, bench_controller_scale.py --ingest) and
    # packs every DP rank's share (21 ns), then each rank unpacks its own (tools/bench/bench_trainer_handoff.py)
    handoff_ns_per_token_rank0: float = 29.5
    handoff_ns_per_token_other: float = 3.0
    # the share of one core the controller process gets: 1 with a core to itself; below 1 where it
    # shares trainer rank 0's cores (as a thread beside the trainer's Python it measured 0.05-0.12)
    controller_core_share: float = 1.0


HOST_FIELDS = tuple(f.name for f in fields(Host))


def read_host_profile(directory: Path | None = None) -> dict:
    """The measured host costs in `host.json` (looked up as a GPU profile is), or {} if none."""
    path = profile_path("host", directory)
    if path is None:
        return {}
    with open(path) as f:
        data = json.load(f)
    return {k: float(v) for k, v in data.items() if k in HOST_FIELDS and isinstance(v, (int, float))}


def write_host_profile(values: dict, tool: str, directory: Path | None = None) -> Path:
    """Merge measured Host fields into `host.json` in `directory` (default: profile_dir()), with
    where, when and by which `tool` each was measured; returns the file."""
    measured = {"machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs)",
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "tool": tool,
                "load_average": round(os.getloadavg()[0], 1)}
    path = (directory or profile_dir()) / "host.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.update({k: max(0.0, float(v)) for k, v in values.items() if k in HOST_FIELDS})  # a noisy fit may dip below
    data.setdefault("measured", {}).update({k: measured for k in values})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def host_costs(overrides: dict | None = None, use_profiles: bool = True) -> Host:
    """The host costs: the defaults, then a measured host.json (unless use_profiles=False), then
    `overrides` (a job's workload.host)."""
    h = replace(Host(), **read_host_profile()) if use_profiles else Host()
    return replace(h, **(overrides or {}))


# Decode/prefill efficiency factors fitted to the AReaL-Hex paper's Table 1 (rows "1.5B/7B/14B
# H800" and "... H20": generating a token runs at 0.27-0.30x the speed of training one on H800,
# 2.3-2.5x on H20) by `python -m hexrl.plan.paper_calibration`. They scale hbm_efficiency, decode_mfu
# and prefill_mfu (and divide decode_overhead_s): what a real serving stack loses to sampling,
# scheduling and launch gaps against the roofline. Types without measurements take the mean of
# the two (the same stack on other GPUs); a measured profile overrides all of it.
PAPER_DECODE_FACTOR = {"H800": 0.317, "H20": 0.400}
DEFAULT_DECODE_FACTOR = math.sqrt(PAPER_DECODE_FACTOR["H800"] * PAPER_DECODE_FACTOR["H20"])


def calibrated_entry(entry: GPU) -> GPU:
    """The catalogue entry with the paper-fitted decode/prefill efficiency applied (not "cpu")."""
    if entry.name == "cpu":
        return entry
    return scaled_entry(entry, decode=PAPER_DECODE_FACTOR.get(entry.name, DEFAULT_DECODE_FACTOR))


def scaled_entry(entry: GPU, decode: float = 1.0, train: float = 1.0) -> GPU:
    """The entry made `decode` times faster at decode and prefill and `train` times faster at
    training: every efficiency multiplied, every fixed overhead divided."""
    return replace(entry, hbm_efficiency=entry.hbm_efficiency * decode, decode_mfu=entry.decode_mfu * decode,
                   prefill_mfu=entry.prefill_mfu * decode, decode_overhead_s=entry.decode_overhead_s / decode,
                   train_mfu=entry.train_mfu * train, train_overhead_s=entry.train_overhead_s / train,
                   train_fwd_overhead_s=entry.train_fwd_overhead_s / train,
                   optimizer_overhead_s=entry.optimizer_overhead_s / train)


def gpu(name: str, price: float | None = None, use_profiles: bool = True, calibrated: bool = True) -> GPU:
    """The catalogue entry for `name`: paper-calibrated rollout efficiency (unless calibrated=False),
    then measured profile values, then a price override."""
    canon = canonical_name(name)
    if canon is None:
        raise KeyError(f"unknown GPU type {name!r} (known: {', '.join(CATALOGUE)})")
    entry = CATALOGUE[canon]
    if calibrated:
        entry = calibrated_entry(entry)
    if use_profiles:
        entry = replace(entry, **read_profile(canon))
    if price is not None:
        entry = replace(entry, price=float(price))
    return entry
