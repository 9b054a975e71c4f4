#!/usr/bin/env bash
# Download the wheels the GPU device lacks into .whl/ (git-ignored) for `carry`.
# The device image has torch 2.11 (CUDA 13), triton, msgpack, safetensors, tokenizers, einops,
# ninja, nvidia-ml-py; it lacks pyzmq, highspy and flashinfer. flashinfer-python 0.5.3 is a 7 MB
# JIT wheel (0.7.x is 62 MB, over the 64 MiB carry limit with the rest); it JIT-compiles its
# kernels with the device's nvcc. cudnn-frontend / cutlass-dsl are optional there and not carried.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
for pkg in pyzmq==27.3.0 highspy==1.15.1 flashinfer-python==0.5.3 "apache-tvm-ffi<0.2"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d .whl "$pkg"
done
du -sh .whl
# On the device, start each command with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
