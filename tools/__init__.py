"""The project's command-line tools: they import hexrl, never the other way round.

Run a script from the repository's root, as a module (`python -m tools.bench.bench_kernels`) or, when it
imports no other tool, as a file (`python tools/bench/bench_planner.py`). User tools sit here (setup, demo,
tests, warm start, tiny model, multi-node and one-GPU runs); bench/ measures, experiments/ runs the
studies, device/ is what a lent GPU machine runs (tools/device/gpu_check.sh).
"""
