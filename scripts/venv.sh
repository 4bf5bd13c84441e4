#!/usr/bin/env bash
# Makes .venv (Python 3.11+ with CPU torch, or whatever torch==2.13.0 resolves to) and installs flashqla
# editable with the extras named in $1 (e.g. "test", "examples"). Used by run_main.sh and test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 -e ".[${1:?extras}]" 2>&1 \
  | { grep -v "is ignored" || true; }
