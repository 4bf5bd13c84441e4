#!/usr/bin/env bash
# Create or update the Python 3.12 venv that runs tests/megatron (megatron-core 0.19.x needs
# Python >= 3.12). Idempotent: a venv that already imports everything is left alone.
#
#   bash scripts/megatron_venv.sh            # venv at .venv312 in the repo root
#   MEGATRON_VENV=/path bash scripts/megatron_venv.sh
#
# On PyPI torch for Python 3.12 is the CUDA build (~3 GB with its nvidia-* wheels); it runs on CPU.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MEGATRON_VENV:-$repo/.venv312}"
megatron_pin="megatron-core==0.19.2"
packages=(torch "$megatron_pin" triton pytest numpy psutil tqdm matplotlib)  # tqdm, matplotlib: train_megatron.py

find_python312() {
  if [[ -n "${PYTHON312:-}" ]]; then echo "$PYTHON312"; return; fi
  if command -v pyenv >/dev/null 2>&1 && PYENV_VERSION=3.12.1 python3 --version >/dev/null 2>&1; then
    echo "env PYENV_VERSION=3.12.1 python3"; return
  fi
  for candidate in python3.12 python3; do
    if command -v "$candidate" >/dev/null 2>&1 \
      && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 12))'; then
      echo "$candidate"; return
    fi
  done
  echo "megatron_venv.sh: no Python >= 3.12 found (set PYTHON312=/path/to/python3.12)" >&2
  exit 1
}

venv_is_ready() {
  [[ -x "$venv/bin/python" ]] && "$venv/bin/python" - <<'EOF' >/dev/null 2>&1
import importlib.metadata as md
import megatron.core, torch, triton, pytest, numpy, psutil, tqdm, matplotlib  # noqa: F401
assert md.version("megatron-core") == "0.19.2"
import flashqla  # the editable install below
EOF
}

if venv_is_ready; then
  echo "megatron venv ready: $venv"
  exit 0
fi

if [[ ! -x "$venv/bin/python" ]]; then
  $(find_python312) -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "${packages[@]}"
"$venv/bin/python" -m pip install --quiet --no-deps -e "$repo"
venv_is_ready || { echo "megatron_venv.sh: venv at $venv is still incomplete" >&2; exit 1; }
echo "megatron venv ready: $venv"
