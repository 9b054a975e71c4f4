#!/usr/bin/env bash
# On the GPU machine: install the carried .whl/*.whl into SITE (default /tmp/site) and put the prebuilt
# FlashInfer modules (.whl/aot, tools/device/prepare_device_wheels.sh) where FlashInfer looks before compiling.
# gpu_check.sh's wheels stage and gpu_e2e.sh run it; then PYTHONPATH=$SITE:$PWD.
# Exit 1 (naming only what does not import here) when nothing is carried and something is missing.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-${PYTHON:-python3}}
SITE=${SITE:-/tmp/site}
missing=()
for m in flashinfer tvm_ffi zmq highspy; do PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} "$PY" -c "import $m" 2>/dev/null || missing+=("$m"); done
if ! ls .whl/*.whl >/dev/null 2>&1; then
  if (( ${#missing[@]} == 0 )); then
    echo "install_wheels: no .whl carried; flashinfer, tvm_ffi, zmq and highspy import here already"
    exit 0
  fi
  echo "install_wheels: no .whl/*.whl carried (run tools/device/prepare_device_wheels.sh first and carry .whl);" \
       "not importable here: ${missing[*]}"
  exit 1
fi
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
if [[ -d .whl/aot ]]; then  # FlashInfer loads <package>/data/aot/<name>/<name>.so instead of compiling it
  mkdir -p "$SITE/flashinfer/data/aot" && cp -r .whl/aot/. "$SITE/flashinfer/data/aot/"
  PYTHONPATH=$SITE:$PWD "$PY" tools/device/flashinfer_aot.py check "$SITE/flashinfer/data/aot"
else
  echo "install_wheels: no .whl/aot carried: FlashInfer will JIT-compile its modules on first use (minutes)"
fi
