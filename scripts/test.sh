#!/usr/bin/env bash
# Runs flashqla's CPU test suite on a fresh machine:
#   1. .venv (Python 3.11 + CPU torch) with flashqla and its test extras, editable; pytest tests/
#   2. .venv312 (Python 3.12, megatron-core 0.19.2; scripts/megatron_venv.sh); pytest tests/megatron
# GPU tests skip themselves without CUDA. Extra arguments go to the first pytest run (which then runs
# as one process).
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
trap 'kill "$megatron_venv" ${compile_suite:-} 2>/dev/null || true' EXIT  # a failing suite does not wait for them
phase "main suite starts (megatron venv in the background)"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# one TileLang cache for the kernel compile test and the precompile test: each kernel compiles once
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-$PWD/.tilelang_cache}
if (($#)); then
  .venv/bin/python -m pytest -q --ignore=tests/megatron "$@"
else
  # Two pytest processes side by side: the files that compile kernels (both cores while nvcc and TVM's
  # lowering run, in their own process pool) and the rest (mostly one core): about a quarter less wall
  # time on the 2-core CI machine than one after the other. The first one's log follows the second's.
  compile_tests=(tests/test_kernel_compile.py tests/test_fused_layer_ops.py tests/test_kernel_cache.py
                 tests/test_precompile.py tests/test_preload.py)
  compile_log=$(mktemp)
  .venv/bin/python -m pytest -q -p no:cacheprovider "${compile_tests[@]}" > "$compile_log" 2>&1 &
  compile_suite=$!
  rest_status=0 compile_status=0
  .venv/bin/python -m pytest -q --ignore=tests/megatron "${compile_tests[@]/#/--ignore=}" || rest_status=$?
  wait "$compile_suite" || compile_status=$?
  phase "the kernel-compiling tests (run beside the others):"
  cat "$compile_log"
  rm -f "$compile_log"
  ((rest_status == 0 && compile_status == 0)) || exit 1
fi
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
