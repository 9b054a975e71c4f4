"""The job's `cpu_affinity` section: which CPU cores each local rank may run on (torch-free).

    "cpu_affinity": {"cores": [[0], [1]], "disjoint": true, "threads": 1}

`cores[i]` is the core set of local rank i (the same on every node); `disjoint` (default true)
refuses a core shared by two local ranks; `threads` (default 1) is each rank's torch thread
count. On CPU a rank per core is the honest stand-in for a rank per GPU: ranks that share
cores compete for them and cannot show what overlap buys. Whether the cores exist is a
property of the machine the rank runs on, checked there (`hexrl.runtime.cpu_pinning.core_problems`).
"""

from dataclasses import dataclass

from hexrl.schema.fields import Reader


@dataclass
class CpuAffinity:
    cores: list[list[int]]  # per local rank
    disjoint: bool = True
    threads: int = 1

    def to_dict(self) -> dict:
        return {"cores": [list(c) for c in self.cores], "disjoint": self.disjoint, "threads": self.threads}


def read_affinity(r: Reader, d, ranks_per_node: int) -> CpuAffinity | None:
    """Parse `cpu_affinity` (None if absent); every problem goes to r, naming its field."""
    if d is None:
        return None
    d = r.section(d, "cpu_affinity", {"cores", "disjoint", "threads"})
    if not d:
        return None
    disjoint = r.boolean(d, "disjoint", "cpu_affinity", True)
    threads = r.num(d, "threads", "cpu_affinity", 1, integer=True, lo=1)
    cores = d.get("cores")
    if not isinstance(cores, list) or not all(_core_list(c) for c in cores):
        r.bad("cpu_affinity.cores", f"must be a list with one non-empty list of core numbers (integers >= 0) "
              f"per local rank, got {cores!r}")
        return None
    if ranks_per_node and len(cores) != ranks_per_node:
        r.bad("cpu_affinity.cores", f"{len(cores)} entries but every node runs {ranks_per_node} ranks "
              f"(cluster.nodes[*].gpus); give one core list per local rank")
    if disjoint:
        owner: dict[int, int] = {}
        for i, cs in enumerate(cores):
            for c in sorted(set(cs)):
                if c in owner:
                    r.bad(f"cpu_affinity.cores[{i}]", f"core {c} is also given to local rank {owner[c]}, but "
                          "cpu_affinity.disjoint is true (each rank its own cores)")
                owner.setdefault(c, i)
    return CpuAffinity([list(c) for c in cores], disjoint, threads)


def _core_list(c) -> bool:
    return isinstance(c, list) and bool(c) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                   for x in c)
