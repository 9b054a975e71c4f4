"""A rank on its own CPU cores: pin it from the plan, read the pinning back, measure its CPU use.

    pinning = pin(plan.job.cpu_affinity, local_rank)  # first thing a rank does (threads inherit it)
    ...                                               # the role's loop
    write_usage(run_dir, rank, role, pinning)         # run_dir/cpu/rank<R>.json: affinity + utilisation

The job's `cpu_affinity` section (hexrl/schema/affinity.py) gives each local rank its cores.
`pin` applies them to every thread that already exists (Linux affinity is per thread; threads
and processes started later inherit it), sets torch's thread count, and checks the kernel
reports exactly the requested set. Unpinned, a rank takes `fair_threads`: its share of the cores it
may run on that other work leaves free (on 2 cores at load 15, 2 threads made 100 warm-start steps
13x slower than 1 thread: each op waits for its descheduled thread). Utilisation is the process's
CPU seconds (its own and its waited-for children's, e.g. reward workers) from /proc/self/stat
over the wall time since `pin`: with one thread on one core, 1 - utilisation is the fraction of
the run the rank sat idle.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hexrl.schema.affinity import CpuAffinity


@dataclass
class Pinning:
    """What `pin` did: requested and read-back cores, threads, and the /proc counters at the start."""

    requested: list[int] | None  # None: the job does not pin
    actual: list[int]  # os.sched_getaffinity after pinning
    threads: int  # torch.get_num_threads()
    t0: float  # wall clock at pin time
    cpu0: tuple[float, float]  # (own, children) CPU seconds at pin time


def available_cores() -> set[int]:
    """The cores this process may run on (a launcher's cgroup or taskset may restrict them)."""
    return set(os.sched_getaffinity(0))


def busy_cores(loadavg: str | None = None) -> float:
    """Cores other work keeps busy now: runnable tasks (/proc/loadavg's running count, this process
    excluded), at most the 1-minute load average, so a momentary burst does not count."""
    fields = (Path("/proc/loadavg").read_text() if loadavg is None else loadavg).split()
    return max(0.0, min(float(fields[0]), int(fields[3].split("/")[0]) - 1))


def fair_threads(share: int = 1, cores: int | None = None, busy: float | None = None) -> int:
    """Torch threads for each of `share` processes of ours: the cores this process may run on
    (affinity) less those other work keeps busy (`busy_cores`), split evenly, at least 1."""
    cores = len(available_cores()) if cores is None else cores
    busy = busy_cores() if busy is None else busy
    return max(1, int((cores - busy) // max(1, share)))


def core_problems(spec: CpuAffinity | None, available: set[int] | None = None) -> list[str]:
    """Cores the job names that this machine does not let us use, each naming its field."""
    if spec is None:
        return []
    available = available_cores() if available is None else available
    out = []
    for i, cores in enumerate(spec.cores):
        missing = sorted(set(cores) - available)
        if missing:
            out.append(f"cpu_affinity.cores[{i}]: core(s) {missing} do not exist or are not available on this "
                       f"machine (this process may use cores {sorted(available)})")
    return out


def proc_cpu_seconds(pid: int | str = "self") -> tuple[float, float]:
    """(utime + stime, cutime + cstime) of a process in seconds, from /proc/<pid>/stat."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2:].split()  # the name in parentheses may hold spaces
    tick = os.sysconf("SC_CLK_TCK")
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])  # stat fields 14-17
    return (utime + stime) / tick, (cutime + cstime) / tick


def last_cpu(pid: int | str = "self") -> int:
    """The core the process last ran on (/proc/<pid>/stat field 39)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rindex(")") + 2:].split()[36])


def pin(spec: CpuAffinity | None, local_rank: int, local_world: int = 1) -> Pinning:
    """Pin this process's threads to the local rank's cores and set torch's thread count (the job's
    `cpu_affinity.threads`; unpinned: `fair_threads` for one of `local_world` ranks on this machine).

    Raises RuntimeError if the kernel reports a different core set than requested."""
    import torch

    requested = None
    if spec is None:
        torch.set_num_threads(fair_threads(local_world))
    if spec is not None:
        requested = sorted(set(spec.cores[local_rank]))
        for tid in os.listdir("/proc/self/task"):  # every thread that exists now (gloo, ZeroMQ come later)
            try:
                os.sched_setaffinity(int(tid), requested)
            except ProcessLookupError:  # the thread ended meanwhile
                pass
        torch.set_num_threads(spec.threads)
        actual = sorted(os.sched_getaffinity(0))
        if actual != requested:
            raise RuntimeError(f"cpu_affinity.cores[{local_rank}]: asked for cores {requested}, "
                               f"the kernel reports {actual}")
    return Pinning(requested, sorted(os.sched_getaffinity(0)), torch.get_num_threads(), time.time(),
                   proc_cpu_seconds())


def usage(p: Pinning) -> dict:
    """Affinity (requested, read back now) and CPU utilisation since `pin`."""
    own, children = proc_cpu_seconds()
    wall = max(time.time() - p.t0, 1e-9)
    own, children = own - p.cpu0[0], children - p.cpu0[1]
    cores = max(1, len(p.actual))
    return {**asdict(p), "affinity_now": sorted(os.sched_getaffinity(0)), "last_cpu": last_cpu(), "wall_s": wall,
            "cpu_s": own, "children_cpu_s": children,
            "utilisation": (own + children) / wall / cores}  # of the rank's cores


def describe(rank: int, role: str, p: Pinning) -> str:
    """The line each rank logs at start."""
    if p.requested is None:
        return f"[hexrl] rank {rank} ({role}): not pinned (may run on cores {p.actual}), {p.threads} torch threads"
    return f"[hexrl] rank {rank} ({role}): pinned to cores {p.actual} (read back), {p.threads} torch thread(s)"


def write_usage(run_dir: Path, rank: int, role: str, p: Pinning) -> dict:
    """Write run_dir/cpu/rank<R>.json; returns what was written."""
    out = {"rank": rank, "role": role, **usage(p)}
    path = Path(run_dir) / "cpu" / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    return out
