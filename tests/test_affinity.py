"""cpu_affinity: the job option is validated naming its field, a rank pins itself and reads it back."""
import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hexrl.runtime import cpu_pinning
from hexrl.runtime.cpu_pinning import busy_cores, core_problems, fair_threads, proc_cpu_seconds
from hexrl.schema import ConfigError, load_job
from hexrl.schema.affinity import CpuAffinity

ROOT = Path(__file__).resolve().parents[1]


def job(affinity, gpus=2) -> dict:
    return {"model": {"preset": "tiny"}, "data": {"synthetic": {"task": "arithmetic", "n": 50}},
            "cluster": {"nodes": [{"name": "local", "gpu_type": "cpu", "gpus": gpus}]}, "cpu_affinity": affinity}


def problems(affinity, gpus=2) -> list[str]:
    try:
        load_job(job(affinity, gpus))
    except ConfigError as e:
        return e.problems
    return []


def test_valid_affinity_round_trips_through_the_job():
    j = load_job(job({"cores": [[0], [1]]}))
    assert j.cpu_affinity == CpuAffinity([[0], [1]], disjoint=True, threads=1)
    assert load_job(j.to_dict()).cpu_affinity == j.cpu_affinity  # what a plan file carries
    assert load_job({k: v for k, v in job(None).items() if k != "cpu_affinity"}).cpu_affinity is None


def test_two_ranks_on_one_core_is_refused_when_disjoint():
    p = problems({"cores": [[0], [0, 1]]})
    assert len(p) == 1 and p[0].startswith("cpu_affinity.cores[1]: core 0") and "disjoint" in p[0]
    assert problems({"cores": [[0], [0, 1]], "disjoint": False}) == []  # sharing allowed when asked for


def test_malformed_affinity_names_each_field():
    assert problems({"cores": [[0]]})[0].startswith("cpu_affinity.cores: 1 entries but every node runs 2 ranks")
    assert problems({"cores": [[0], []]})[0].startswith("cpu_affinity.cores: must be a list")
    assert problems({"cores": [[0], [-1]]})[0].startswith("cpu_affinity.cores: must be a list")
    p = problems({"cores": [[0], [1]], "threads": 0, "pin": True})
    assert sorted(x.split(":")[0] for x in p) == ["cpu_affinity.pin", "cpu_affinity.threads"]


def test_cores_the_machine_lacks_are_named():
    spec = CpuAffinity([[0], [1, 7]])
    assert core_problems(spec, available={0, 1, 2}) == [
        "cpu_affinity.cores[1]: core(s) [7] do not exist or are not available on this machine "
        "(this process may use cores [0, 1, 2])"]
    assert core_problems(spec, available=set(range(8))) == []
    assert core_problems(None) == []


def test_proc_cpu_seconds_agrees_with_getrusage():
    sum(i * i for i in range(300_000))  # some CPU time to measure
    own, _ = proc_cpu_seconds()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert abs(own - (ru.ru_utime + ru.ru_stime)) <= 3 * tick  # /proc counts whole ticks


PIN_SCRIPT = textwrap.dedent("""
    import json, os, sys, threading, time
    from hexrl.runtime.cpu_pinning import pin, write_usage
    from hexrl.schema.affinity import CpuAffinity
    core = int(sys.argv[1])
    stop = threading.Event()
    t = threading.Thread(target=stop.wait); t.start()  # a thread that exists before pinning
    p = pin(CpuAffinity([[core]], threads=1), 0)
    thread_cores = sorted(os.sched_getaffinity(t.native_id))
    stop.set(); t.join()
    sum(i * i for i in range(2_000_000))  # busy ...
    time.sleep(0.5)  # ... then idle
    out = write_usage(sys.argv[2], 3, "train", p)
    print(json.dumps({"thread_cores": thread_cores, **out}))
""")


def test_a_rank_pins_itself_and_reports_its_use(tmp_path):
    core = max(os.sched_getaffinity(0))  # a core that exists here
    res = subprocess.run([sys.executable, "-c", PIN_SCRIPT, str(core), str(tmp_path)], capture_output=True,
                         text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.splitlines()[-1])
    assert out["requested"] == out["actual"] == out["affinity_now"] == [core]
    assert out["thread_cores"] == [core]  # threads started before pin() are pinned too
    assert out["last_cpu"] == core and out["threads"] == 1
    assert out["cpu_s"] > 0 and 0 < out["utilisation"] < 1  # it slept 0.5 s of its wall time
    assert json.loads((tmp_path / "cpu" / "rank3.json").read_text())["rank"] == 3


def test_pinning_to_a_core_outside_the_allowed_set_fails_loudly():
    bad = max(os.sched_getaffinity(0)) + 1000
    script = ("from hexrl.runtime.cpu_pinning import pin; from hexrl.schema.affinity import CpuAffinity; "
              f"pin(CpuAffinity([[{bad}]]), 0)")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert res.returncode != 0 and "Invalid argument" in res.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_threads_are_the_free_cores_shared_out():
    """2 cores that other CPU-bound jobs keep busy: 1 thread, not 2 (2 make each op wait for a descheduled thread)."""
    assert fair_threads(cores=2, busy=0.0) == 2  # a quiet 2-core machine
    assert fair_threads(cores=2, busy=2.0) == 1 and fair_threads(cores=2, busy=7.5) == 1  # never 0
    assert fair_threads(share=3, cores=2, busy=0.0) == 1  # the CPU demo's 3 ranks
    assert fair_threads(share=2, cores=16, busy=3.2) == 6  # 12.8 free cores, 2 ranks
    # /proc/loadavg: 1-, 5-, 15-minute loads, running/total tasks, last pid. This process is one of the running.
    assert busy_cores("2.95 2.10 1.00 3/170 123") == 2  # two others running, for a while
    assert busy_cores("0.20 0.10 0.05 4/170 123") == 0.2  # a momentary burst: the load average caps it
    assert busy_cores("5.00 5.00 5.00 1/170 123") == 0  # only this process runs now
    assert busy_cores() >= 0


def test_an_unpinned_rank_takes_its_fair_share_of_threads(monkeypatch):
    import torch

    monkeypatch.setattr(cpu_pinning, "busy_cores", lambda: 0.0)
    cores = len(os.sched_getaffinity(0))
    p = cpu_pinning.pin(None, 0, local_world=1)
    assert p.requested is None and p.threads == torch.get_num_threads() == cores
    assert cpu_pinning.pin(None, 0, local_world=cores + 1).threads == 1
