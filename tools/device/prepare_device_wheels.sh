#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with what the GPU device lacks, for `carry=[".whl"]`:
#   1. the wheels, each pinned to an exact version (the device image has torch 2.11 + CUDA 13, triton,
#      msgpack, safetensors, tokenizers, einops, ninja, nvidia-ml-py; it lacks pyzmq, highspy, flashinfer
#      and flashinfer's apache-tvm-ffi). flashinfer-python 0.5.3 is a 7 MB JIT wheel (0.7.x is 62 MB).
#   2. .whl/aot/<name>/<name>.so: FlashInfer's modules prebuilt for sm_90a (H100, H200) with pip's CUDA
#      compiler, exactly the ones tools/device/flashinfer_aot.py lists for the GPU checks, the 1.5B benchmarks
#      and the e2e run; gpu_check.sh copies them into the installed package's AOT directory, so nothing
#      compiles on the device. Compiling takes long on a small CPU machine (nice'd, 2 nvcc jobs):
#      SKIP_AOT=1 fetches the wheels only. The build's JIT directory is build/flashinfer-jit (ignored).
# Prints the carried size (the device's carry limit is 64 MiB) and the compile seconds it saves.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> "$(git rev-parse --git-path info/exclude)"
WHEELS=(pyzmq==27.3.0 highspy==1.15.1 flashinfer-python==0.5.3 apache-tvm-ffi==0.1.15.post2)
CUDA_PIP=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96
          nvidia-cuda-cccl==13.0.85)
HEADERS_ONLY=(nvidia-cublas==13.0.0.19 nvidia-curand==10.4.0.35)  # CUDA 13.0's; their headers only
PY=${PYTHON:-python3}
mkdir -p .whl build
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
for pkg in "${WHEELS[@]}"; do  # the device's python is 3.12
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d .whl "$pkg"
done
if [[ ${SKIP_AOT:-0} != 1 ]]; then
  # flashinfer and tvm-ffi for this machine's python (to generate and build the modules), in build/
  $PY -m pip install -q --no-deps --target build/fi-site flashinfer-python==0.5.3 apache-tvm-ffi==0.1.15.post2 \
    nvidia-ml-py requests urllib3 idna certifi charset-normalizer tabulate click tqdm einops
  if [[ -z ${CUDA_HOME:-} ]]; then  # pip's CUDA 13.0 compiler, headers and runtime, laid out as a CUDA_HOME
    $PY -m pip install -q --no-deps --target build/cuda-pip "${CUDA_PIP[@]}"
    CUDA_HOME=$PWD/build/cuda-pip/nvidia/cu13
  fi
  # FlashInfer links with -L$cuda_home/lib64 -L$cuda_home/lib64/stubs -lcudart -lcuda: pip has no driver
  # stub, so an empty libcuda.so (soname libcuda.so.1) stands in; the device's driver resolves it at load
  home=build/cuda-home
  if [[ ! -e $home/.complete ]]; then  # once: rebuilding it would make ninja recompile everything
    rm -rf "$home" && mkdir -p "$home/lib64/stubs"
    for d in bin nvvm; do ln -s "$CUDA_HOME/$d" "$home/$d"; done
    mkdir -p "$home/include" && ln -s "$CUDA_HOME"/include/* "$home/include/"
    # norm.cu includes trtllm's cudaUtils.h and reduceKernelUtils.cuh, which include cublasLt.h and
    # curand_kernel.h (types and inline device code): the headers of pip's cuBLAS and cuRAND wheels (a
    # 400 MB download, kept in build/dl); nothing of them is linked or carried
    for pkg in "${HEADERS_ONLY[@]}"; do
      name=${pkg%%==*}
      $PY -m pip download -q --no-deps --only-binary=:all: -d build/dl "$pkg"
      $PY -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[2])
for n in z.namelist():
      if n.startswith("nvidia/cu13/include/") and n.endswith(".h"):
          open(sys.argv[1] + "/" + n.rsplit("/", 1)[1], "wb").write(z.read(n))' "$home/include" \
        build/dl/"${name//-/_}"-"${pkg#*==}"-*.whl
    done
    ln -s "$CUDA_HOME"/lib/* "$home/lib64/"
    [[ -e $home/lib64/libcudart.so ]] || ln -s libcudart.so.13 "$home/lib64/libcudart.so"  # pip ships the soname only
    echo 'void hexrl_libcuda_stub(void) {}' > build/libcuda_stub.c
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$home/lib64/stubs/libcuda.so" build/libcuda_stub.c
    touch "$home/.complete"
  fi
  t0=$(date +%s)
  rm -rf .whl/aot
  CUDA_HOME=$PWD/$home FLASHINFER_WORKSPACE_BASE=$PWD/build/flashinfer-jit PYTHONPATH=$PWD/build/fi-site:$PWD \
    nice -n 10 "$PY" tools/device/flashinfer_aot.py build .whl/aot --jobs "${JOBS:-2}"
  echo "prepare_device_wheels: prebuilt FlashInfer modules in $(( $(date +%s) - t0 )) s here: that compiling no longer" \
       "happens on the device (the 2026-11-28 desk review: rope 199 s, norm 63 s, page 33 s, activation 19 s" \
       "single-threaded, plus the attention modules)"
fi
ls -l .whl
echo "carried: $(du -sm .whl | cut -f1) MiB in .whl (limit 64 MiB with the work tree)"
# On the device (tools/device/gpu_check.sh's wheels stage does this):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   cp -r .whl/aot/. /tmp/site/flashinfer/data/aot/ && export PYTHONPATH=/tmp/site:$PWD
