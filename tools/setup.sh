#!/usr/bin/env bash
# Install hexrl and what its tests need, on a fresh CPU machine. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The CPU build of torch comes from the machine's local file; installing it first stops pip from
# resolving `torch` to the multi-GB CUDA build when it installs our requirements.
if ! $PY -c "import torch" 2>/dev/null; then
  $PY -m pip install -q "torch==2.13.0"
fi
$PY -m pip install -q -e ".[dev]"
