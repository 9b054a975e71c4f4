"""Rewards: math answer checking, exact match for synthetic tasks, code tests run in a
namespace sandbox, and a process pool that runs any of them with a timeout.

Every reward has the signature `fn(completion: str, answer) -> float`.
"""

from hexrl.rewards.code import code_reward
from hexrl.rewards.math import math_reward
from hexrl.rewards.sandbox import SandboxUnavailable
from hexrl.rewards.synthetic import exact_match_reward
from hexrl.rewards.worker_pool import PoolStats, RewardPool, reward_fn_by_name

__all__ = ["math_reward", "exact_match_reward", "code_reward", "RewardPool", "PoolStats",
           "reward_fn_by_name", "SandboxUnavailable"]
