#!/usr/bin/env bash
# One-time set-up on a fresh CPU machine: a local virtualenv (.venv) with the pinned dependencies and ds4c
# installed in editable mode, and clang-19 + lld-19 (HIP kernels compile with them, no ROCm needed) when missing
# and running as root. Safe to run again (it only installs what is missing).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
quiet() {  # run a command; show its output only when it fails (then fail with its status)
  local log rc=0
  log=$(mktemp)
  "$@" >"$log" 2>&1 || rc=$?
  if [ "$rc" != 0 ]; then cat "$log" >&2; fi
  rm -f "$log"
  return "$rc"
}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
quiet .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-cpu.txt
quiet .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
if ! command -v clang-19 >/dev/null 2>&1 || ! command -v ld.lld-19 >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    if quiet apt-get update -qq && DEBIAN_FRONTEND=noninteractive quiet apt-get install -y -qq clang-19 lld-19; then
      echo "installed clang-19 and lld-19 (HIP kernel compiles)"
    else
      echo "note: could not install clang-19 lld-19 with apt-get (output above); HIP compile tests will be skipped" >&2
    fi
  else
    echo "note: clang-19 / lld-19 not found and not root: HIP compile tests will be skipped" \
         "(install them with: apt-get install clang-19 lld-19)" >&2
  fi
fi
echo "ds4c set up in $(pwd)/.venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
