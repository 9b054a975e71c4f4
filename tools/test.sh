#!/usr/bin/env bash
# Set up, lint and run the whole CPU test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
source tools/python.sh
echo "== ruff check"
"$PY" -m ruff check .
export TRITON_INTERPRET=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m pytest -q -p no:cacheprovider --timeout=900 "$@"
