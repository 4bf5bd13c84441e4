#!/usr/bin/env bash
# Runs flashqla's CPU test suite on a fresh machine:
#   1. .venv (Python 3.11 + CPU torch) with flashqla and its test extras, editable; pytest tests/
#   2. .venv312 (Python 3.12, megatron-core 0.19.2; scripts/megatron_venv.sh); pytest tests/megatron
# GPU tests skip themselves without CUDA. Extra arguments go to the first pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
phase() { echo "[test.sh] $1 at $((SECONDS / 60))m$((SECONDS % 60))s"; }
bash scripts/venv.sh test
phase "main suite starts"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# one TileLang cache for the kernel compile test and the precompile test: each kernel compiles once
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-$PWD/.tilelang_cache}
.venv/bin/python -m pytest -q --ignore=tests/megatron "$@"
phase "megatron venv starts"
bash scripts/megatron_venv.sh 2>&1 | { grep -v "is ignored" || true; }
phase "tests/megatron starts"
version='import megatron.core as m; print("tests/megatron on megatron-core", m.__version__)'
.venv312/bin/python -W ignore -c "$version" 2>/dev/null
.venv312/bin/python -m pytest -q tests/megatron
# the other supported release, megatron-core 0.19.0 (pure Python): a side directory ahead of the venv's 0.19.2
side=.venv312/megatron-core-0.19.0
[[ -d $side/megatron ]] || .venv312/bin/python -m pip install -q --no-deps --target "$side" megatron-core==0.19.0 2>&1 \
  | { grep -v "is ignored" || true; }
PYTHONPATH=$PWD/$side .venv312/bin/python -W ignore -c "$version" 2>/dev/null
# the tests that touch megatron-core's API (specs, the GDN module, the pretrain_gpt flags, TP / CP
# groups); the example-script runs and the 8-rank layouts run once, on 0.19.2 above, to keep the suite
# within its time (about two minutes)
phase "tests/megatron on 0.19.0 starts"
PYTHONPATH=$PWD/$side .venv312/bin/python -m pytest -q tests/megatron/test_specs.py tests/megatron/test_gdn_module.py \
  tests/megatron/test_pretrain_gpt.py tests/megatron/test_parallel.py
phase "done"
