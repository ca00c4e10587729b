#!/usr/bin/env bash
# One-time set-up on a fresh CPU machine: a local virtualenv (.venv) with the pinned dependencies and ds4c
# installed in editable mode. Safe to run again (it only installs what is missing).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-cpu.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
echo "ds4c set up in $(pwd)/.venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
