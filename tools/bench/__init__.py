"""Benchmarks: kernels, rollout, training and the planner; compare_cost_model sets a profile beside the cost model."""
