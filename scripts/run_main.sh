#!/usr/bin/env bash
# The main job: makes .venv with flashqla installed and runs examples/quickstart.py
# (GPU when one is present, else CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 -e . 2>&1 | { grep -v "is ignored" || true; }
.venv/bin/python examples/quickstart.py "$@"
