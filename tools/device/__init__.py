"""What a lent GPU machine runs: gpu_check.sh (+ gpu_results.py), the carried wheels and prebuilt kernels."""
