# Sourced by setup.sh, test.sh and demo.sh: sets PY, the project's Python.
# PYTHON when given; else python3 when it runs inside a virtual environment (venv, virtualenv or
# conda); else the project's own .venv, which setup.sh creates: a stock Debian python3 refuses to
# install packages outside one (PEP 668, "externally-managed-environment").
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -n "${CONDA_PREFIX:-}" ] || python3 -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' 2>/dev/null; then
  PY=python3
else
  PY=.venv/bin/python
fi
