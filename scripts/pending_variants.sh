#!/usr/bin/env bash
# The kernel changes kept as patches in docs/pending/ (docs/pending/README.md), A/B'd against the committed kernel.
#   here:       bash scripts/pending_variants.sh build     # each patch applied to a copy of its kernel in .devvar/,
#                                                          # compiled for sm_90a, packed as .devvar/cache.tar.xz
#   the device: bash scripts/pending_variants.sh run [CONFIGS]   # carry [".devsite", ".devkernels", ".devvar"]
# A patch names its kernel in its first line (--- a/kernels/hopper/<kernel>.py); every variant is built and run with
# that kernel's builder, `build_<kernel>`, for bfloat16 (BUILD_ARGS to change it). A chunk_bwd_local patch is A/B'd in
# each of the builds in PAIR_SUMS (build and run alike; default "none ordered": odd and even GQA groups), the launch
# recorded with FLASHQLA_GQA_PAIR_SUM set to match.
set -euo pipefail
shopt -s nullglob  # no patch waiting: nothing to do
mode=${1:?build or run}
configs=${2:-16:32:4096x8,16:32:32768x1,16:64:8192x4,4:8:8192x4,2:4:32768x1,2:4:8192x1,2:8:1000x3}
kernel_of() { sed -n '1s|^--- a/kernels/hopper/\(.*\)\.py$|\1|p' "$1"; }
# the launch the A/B records is the one with these build arguments (the public op's default for the kernel)
build_args_of() {  # KERNEL PAIR_SUM
  if [[ -n ${BUILD_ARGS:-} ]]; then echo "$BUILD_ARGS"
  elif [[ $1 == chunk_bwd_local ]]; then echo "bfloat16 $2"
  else echo "bfloat16"; fi
}
pair_sums_of() { if [[ $1 == chunk_bwd_local ]]; then echo "${PAIR_SUMS:-none ordered}"; else echo none; fi; }
case $mode in
  build)
    python=${PYTHON:-.venv/bin/python}
    cache=$(mktemp -d)/varcache
    mkdir -p .devvar "$cache"
    for patch in docs/pending/*.patch; do
      name=$(basename "$patch" .patch)
      kernel=$(kernel_of "$patch")
      cp "kernels/hopper/$kernel.py" ".devvar/$name.py"
      patch -s ".devvar/$name.py" "$patch"  # its relative imports resolve (kernel_resources.load_builder)
      for pair_sum in $(pair_sums_of "$kernel"); do
        # shellcheck disable=SC2086
        $python scripts/ab_kernel.py compile ".devvar/$name.py" "build_$kernel" $(build_args_of "$kernel" "$pair_sum") \
          --cache "$cache" 2>&1 | { grep -v Warning || true; } | tail -1 || true  # (a build a patch refuses)
      done
    done
    tar cJf .devvar/cache.tar.xz -C "$(dirname "$cache")" varcache
    ls -la .devvar/cache.tar.xz
    ;;
  run)
    set +e  # device_setup.sh is sourced; a variant that fails is reported and the next one runs
    export OUT=${OUT:-/tmp/out}
    if [[ ${FLASHQLA_DEVICE_SETUP:-} != done ]]; then
      source scripts/device_setup.sh >/dev/null 2>&1 || { echo "device_setup failed"; exit 1; }
    fi
    for patch in docs/pending/*.patch; do
      name=$(basename "$patch" .patch)
      kernel=$(kernel_of "$patch")
      for pair_sum in $(pair_sums_of "$kernel"); do
        echo "== $name (pair_sum $pair_sum)" | tee -a "$OUT/pending_ab.log"
        # shellcheck disable=SC2086
        FLASHQLA_GQA_PAIR_SUM=$([[ $pair_sum == none ]] && echo 0 || echo 1) timeout 300 python3 scripts/ab_kernel.py run "$kernel" ".devvar/$name.py" \
          "build_$kernel" $(build_args_of "$kernel" "$pair_sum") --configs "$configs" 2>&1 | grep -v Warning \
          | grep "x)" | tee -a "$OUT/pending_ab.log" || true
      done
    done
    ;;
  *) echo "usage: $0 build|run [CONFIGS]"; exit 1 ;;
esac
