#!/usr/bin/env bash
# Runs flashqla's CPU test suite on a fresh machine: makes .venv (Python 3.11 + CPU torch), installs
# flashqla with its test extras in editable mode, and runs pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 -e '.[test]' 2>&1 | { grep -v "is ignored" || true; }
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
.venv/bin/python -m pytest -q --ignore=tests/megatron "$@"
