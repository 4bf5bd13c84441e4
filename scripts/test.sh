#!/usr/bin/env bash
# Runs flashqla's CPU test suite on a fresh machine:
#   1. .venv (Python 3.11 + CPU torch) with flashqla and its test extras, editable; pytest tests/
#   2. .venv312 (Python 3.12, megatron-core 0.19.2; scripts/megatron_venv.sh); pytest tests/megatron
# GPU tests skip themselves without CUDA. Extra arguments go to the first pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
phase() { echo "[test.sh] $1 at $((SECONDS / 60))m$((SECONDS % 60))s"; }
bash scripts/venv.sh test
# The megatron venv (a ~3 GB download, ~2 minutes, mostly waiting on the network and the disk) is made
# while the main suite runs; its log is printed once the suite is done.
# The other supported release, megatron-core 0.19.0 (pure Python), goes to a side directory ahead of the
# venv's 0.19.2.
side=.venv312/megatron-core-0.19.0
megatron_log=$(mktemp)
{
  bash scripts/megatron_venv.sh
  [[ -d $side/megatron ]] || .venv312/bin/python -m pip install -q --no-deps --target "$side" megatron-core==0.19.0
} > "$megatron_log" 2>&1 &
megatron_venv=$!
trap 'kill "$megatron_venv" 2>/dev/null || true' EXIT  # a failing main suite does not wait for the download
phase "main suite starts (megatron venv in the background)"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# one TileLang cache for the kernel compile test and the precompile test: each kernel compiles once
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-$PWD/.tilelang_cache}
.venv/bin/python -m pytest -q --ignore=tests/megatron "$@"
phase "main suite done, waiting for the megatron venv"
venv_status=0
wait "$megatron_venv" || venv_status=$?
grep -v "is ignored" "$megatron_log" || true
rm -f "$megatron_log"
[[ $venv_status == 0 ]] || { echo "scripts/megatron_venv.sh failed ($venv_status)"; exit "$venv_status"; }
phase "tests/megatron starts"
version='import megatron.core as m; print("tests/megatron on megatron-core", m.__version__)'
.venv312/bin/python -W ignore -c "$version" 2>/dev/null
.venv312/bin/python -m pytest -q tests/megatron
PYTHONPATH=$PWD/$side .venv312/bin/python -W ignore -c "$version" 2>/dev/null
# the tests that touch megatron-core's API (specs, the GDN module, the pretrain_gpt flags, TP / CP
# groups); the example-script runs and the 8-rank layouts run once, on 0.19.2 above, to keep the suite
# within its time (about two minutes)
phase "tests/megatron on 0.19.0 starts"
PYTHONPATH=$PWD/$side .venv312/bin/python -m pytest -q tests/megatron/test_specs.py tests/megatron/test_gdn_module.py \
  tests/megatron/test_pretrain_gpt.py tests/megatron/test_parallel.py
phase "done"
