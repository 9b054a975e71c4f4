"""job.json and plan.json: their dataclasses, loading, and checks that report every problem at once.

Torch-free, so the planner runs without torch. What it may import (the packages below it) is
LAYERS in tests/test_layout.py, the one statement of the package order.
"""
from hexrl.schema.fields import ConfigError
from hexrl.schema.job import (
                              PRESETS,
                              ClusterSpec,
                              DataSpec,
                              Job,
                              ModelSpec,
                              NodeSpec,
                              RewardSpec,
                              RLSpec,
                              WorkloadSpec,
                              load_job,
)
from hexrl.schema.layout import Stage, TrainerLayout
from hexrl.schema.plan import Plan, RankInfo, Replica, check_plan, load_plan, validate_plan_against_world

__all__ = [
    "PRESETS", "ClusterSpec", "ConfigError", "DataSpec", "Job", "ModelSpec", "NodeSpec", "Plan", "RLSpec",
    "RankInfo", "Replica", "RewardSpec", "Stage", "TrainerLayout", "WorkloadSpec", "check_plan", "load_job",
    "load_plan", "validate_plan_against_world",
]
