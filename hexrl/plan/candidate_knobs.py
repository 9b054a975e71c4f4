"""The runtime knobs of a candidate, as the cost model assumed them (written into plan.json).

Trainer: activation recompute as the training search chose it, micro-batches of the longest
sequence (prompt + max_new_tokens) or 4096 tokens if more (`Workload.micro_tokens`), bf16 compute on GPUs (float32 on
the CPU stand-in), float32 gradient all-reduce. Each replica: its decode batch from the rollout
MILP as `max_running`, and a KV pool of the pages the cost model's memory budget holds, no more
than `max_running` longest sequences need. The job's `runtime` overrides win.
"""

import math
from dataclasses import replace

from hexrl.plan.cost import CostModel
from hexrl.plan.train_search import TrainPlan
from hexrl.schema.knobs import RolloutKnobs, TrainKnobs
from hexrl.schema.plan import default_dtype

ENGINE_BATCH_TOKENS = 8192  # tokens per forward pass unless max_running needs more


def train_knobs(cm: CostModel, train: TrainPlan) -> TrainKnobs:
    base = TrainKnobs(activation_checkpointing=train.recompute, micro_batch_tokens=cm.w.micro_tokens,
                      dtype=default_dtype([s.gpu_type for s in train.stages]), grad_reduce_dtype="float32")
    return replace(base, **cm.job.runtime.get("trainer", {}))


def replica_knobs(cm: CostModel, gpu_type: str, tp: int, batch: int, long_tail: bool = False) -> RolloutKnobs:
    """A replica's engine knobs; a long-tail replica keeps its batch cap under a larger override."""
    over = cm.job.runtime.get("rollout", {})
    running = over.get("max_running", batch)
    if long_tail:
        running = min(running, batch)
    page_size = over.get("page_size", RolloutKnobs.page_size)
    dtype = over.get("dtype", default_dtype([gpu_type]))
    elem = 4 if dtype == "float32" else 2
    page_bytes = cm.kv_bytes_per_token(tp) * elem / 2 * page_size  # the cost model counts 2-byte KV
    room = cm.usable_bytes(gpu_type, "rollout") - elem * cm.m.num_params / tp
    per_seq = math.ceil(cm.w.max_seq / page_size)
    pages = max(per_seq, min(int(room // page_bytes), running * per_seq))
    batch_tokens = over.get("max_batch_tokens", max(ENGINE_BATCH_TOKENS, running))
    return RolloutKnobs(max_running=running, max_batch_tokens=batch_tokens, kv_pages=over.get("kv_pages", pages),
                        page_size=page_size, dtype=dtype)
