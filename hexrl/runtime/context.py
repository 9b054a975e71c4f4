"""RankContext: what a role's loop needs to know about its rank, built once by `hexrl.main`.

Everywhere in hexrl, `ctx` names one of these (and nothing else).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from hexrl.data.prompts import Prompts
from hexrl.runtime.watchdog import Watchdog
from hexrl.schema import Plan, TrainerLayout
from hexrl.schema.plan import RankInfo


@dataclass(kw_only=True)
class RankContext:
    """What a role's loop needs: the plan, who it is, and the groups it belongs to (built with keywords:
    a dozen fields in a row are too easy to misplace)."""

    plan: Plan
    rank: int
    local_rank: int
    device: torch.device
    run_dir: Path
    resume: Path | None
    store: dist.Store  # the job-wide torchrun store
    layout: TrainerLayout  # the plan's trainer grid, every slot's global rank filled in
    sync_groups: list[list[tuple]]  # per pipeline stage, per source: (src rank, group or None) of the weight sync
    replica_group: dist.ProcessGroup | None  # this rollout rank's TP group (None for TP 1 or trainer ranks)
    watchdog: Watchdog
    train_prompts: Prompts | None  # the checked, tokenized prompts (tokenized once, by hexrl.preflight)
    heldout_prompts: Prompts | None
    sync_ipc: bool = False  # the weight sync groups share this GPU: weights go by CUDA IPC (hexrl/comm/weights.py)
    groups: list[str] = field(default_factory=list)  # every group's name, in creation order (effective_config)
    secret: bytes = b""  # the job's channel secret (hexrl.comm.secret), never sent through the store
    restarts_left: int = 0  # torchrun restarts the launch still allows (--max-restarts less those used)

    @property
    def info(self) -> RankInfo:
        """This rank's entry in the plan: role, node, replica."""
        return self.plan.ranks[self.rank]

    @property
    def controller_rank(self) -> int:
        return self.layout.rank(0, 0, 0)  # trainer slot (stage 0, dp 0, tp 0) hosts the controller
