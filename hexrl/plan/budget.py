"""A $/h budget below the cluster's price: plan on the best subset of whole nodes that fits.

The subsets tried are the maximal ones (no further node fits the budget), taking the first k
nodes of each type in the job's order; the most expensive `limit` of them (the most hardware)
are planned and the one with the highest predicted tokens/s wins. Unused nodes are left out
of the plan's cluster, so torchrun starts only the nodes the plan uses.
"""

from dataclasses import replace
from itertools import product

from hexrl.schema import Job


def node_price(job: Job, gpu_type: str) -> float:
    return job.prices[gpu_type] * job.cluster.gpus_per_node


def affordable_subsets(job: Job, limit: int = 8) -> list[Job]:
    """Sub-jobs on maximal node subsets within the budget, most expensive first."""
    types = job.cluster.types()
    have = [sum(1 for n in job.cluster.nodes if n.gpu_type == t) for t in types]
    price = [node_price(job, t) for t in types]
    budget = job.budget + 1e-9
    picks = []
    for k in product(*[range(h + 1) for h in have]):
        cost = sum(a * p for a, p in zip(k, price))
        if sum(k) == 0 or cost > budget:
            continue
        if all(k[i] == have[i] or cost + price[i] > budget for i in range(len(types))):
            picks.append((cost, k))
    picks.sort(key=lambda x: -x[0])
    return [_subset(job, dict(zip(types, k))) for _, k in picks[:limit]]


def _subset(job: Job, count: dict[str, int]) -> Job:
    left = dict(count)
    nodes = []
    for n in job.cluster.nodes:
        if left[n.gpu_type] > 0:
            nodes.append(n)
            left[n.gpu_type] -= 1
    return replace(job, cluster=replace(job.cluster, nodes=nodes))
