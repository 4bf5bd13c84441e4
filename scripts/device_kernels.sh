#!/usr/bin/env bash
# One H200 session for the TileLang kernels: GPU tests, cold-compile time, forward and backward benchmarks.
# Run from the repo root on the device machine with `.devsite` and `.devkernels` (or `.tilelang_cache`)
# carried; logs go to $OUT. Usage: scripts/device_kernels.sh MODES [extra bench_gdn.py arguments...], MODES one of
# pending|tests|cold|bench|bwd|profile|layer|walks|ab|flacheck|all or several comma-separated (e.g. ab,tests; all leaves
# out ab and pending); they run in this order
#   pending: scripts/pending_variants.sh run, the docs/pending/ patches A/B'd against the committed kernel (carry
#          .devvar, built here with `scripts/pending_variants.sh build`; PENDING_CONFIGS to change the configs)
#   ab:    scripts/ab_kernel.py run $AB_ARGS: a kernel variant against the committed kernel, outputs and time side by
#          side; the variant's TileLang cache, built here with `ab_kernel.py compile ... --cache DIR` and carried
#          in .devvar (cache.tar.xz, or the folder cache/), is merged into the kernels' cache (device_setup.sh)
#   tests: tests/gpu, or the files / node ids in TESTS (e.g. TESTS="tests/gpu/test_tilelang_backward.py -k pair") (the
#          first-call latency test only with TESTS_FIRST_CALL=1: it JIT-compiles in fresh processes for minutes)
#   bench: bench_gdn.py (pass e.g. --cp-sweep 32,64,128,256 --flashqla-configs none)
#   profile: profile_gdn.py step (PROFILE_ARGS) and first-call in a fresh process on an empty cache
#   layer: megatron_gdn_layer.py, Megatron's FLA GDN layer vs flashqla's (parity and time, 1 GPU; LAYER_ARGS, e.g.
#          --profile 20), then flashqla's with the fused q/k L2 norm on, after its GPU test
#   bwd:   bench_bwd.py --graphs (BWD_ARGS, e.g. --quick), flashqla vs FLA; FlashQLA's backward JIT-compiles for
#          minutes per shape, so add it only with its cache carried in .devpeer and BWD_ARGS="--impls
#          flashqla_cp,flash_qla --refuse-peer-jit" (a shape the cache lacks then fails at once, noted in the report)
#   walks: bench_walks.py, the two serial walks at every V tile width (calibrates launch.block_v_for)
#   flacheck: with .devpeer/fla_triton.tar.xz carried, whether FLA's Triton kernels load from it or compile
set -uo pipefail
what=${1:-all}
shift || true
runs() { [[ ,$what, == *,$1,* || ($what == all && $1 != ab && $1 != pending) ]]; }
OUT=${OUT:-/tmp/out}
source scripts/device_setup.sh || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"

if runs pending; then
  # shellcheck disable=SC2086
  timeout -k 20 "${PENDING_TIMEOUT:-420}" bash scripts/pending_variants.sh run ${PENDING_CONFIGS:-} 2>&1 | tail -60
fi

if runs tests; then
  # the first-call latency test JIT-compiles from an empty cache (about 4 minutes): only with TESTS_FIRST_CALL=1
  skip=(--deselect tests/gpu/test_first_call_latency.py)
  [[ ${TESTS_FIRST_CALL:-0} == 1 ]] && skip=()
  # shellcheck disable=SC2086
  timeout -k 20 "${TESTS_TIMEOUT:-420}" python3 -m pytest -q -s -rA -o faulthandler_timeout=150 ${TESTS:-tests/gpu} \
    "${skip[@]}" 2>&1 | tee "$OUT/tests.log" | tail -30
fi

if runs cold; then
  # cold compile of the whole forward for one head configuration, empty cache, fresh process
  TILELANG_CACHE_DIR=/tmp/cold_cache timeout -k 20 200 python3 - <<'EOF' 2>&1 | tee "$OUT/cold_compile.log"
import time, torch
t0 = time.perf_counter()
from flashqla.kernels.hopper import chunk_gdn_fwd
q = torch.randn(1, 4096, 2, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn(1, 4096, 8, 128, device="cuda", dtype=torch.bfloat16)
g = -torch.rand(1, 4096, 8, device="cuda")
beta = torch.rand(1, 4096, 8, device="cuda", dtype=torch.bfloat16)
chunk_gdn_fwd(q, q, v, g, beta, 128 ** -0.5, None, True, None)
torch.cuda.synchronize()
print(f"cold compile + first forward (Hqk=2, Hv=8, bf16): {time.perf_counter() - t0:.1f} s")
EOF
fi

if runs flacheck; then
  # FLA's Triton kernels: from the carried cache or compiled, per kernel (exit 1 if any compiled)
  # FLACHECK_ARGS="--group gdn" checks only what bench_gdn.py calls (the cp group runs bench_cp's 1M tokens)
  # shellcheck disable=SC2086
  timeout -k 20 "${FLACHECK_TIMEOUT:-300}" python3 benchmarks/peer_cache/fla_triton_check_gpu.py ${FLACHECK_ARGS:-} \
    --out "$OUT/fla_triton_check.json" 2>&1 | tee "$OUT/fla_triton_check.log" | tail -30
fi

if runs bench; then
  tag=${BENCH_TAG:-}
  timeout -k 20 "${BENCH_TIMEOUT:-540}" python3 benchmarks/bench_gdn.py --out "$OUT/benchmarks$tag.md" \
    --png "$OUT/benchmarks_fwd$tag.png" "$@" 2>&1 | tee "$OUT/bench$tag.log" | grep -v "^\s*$" | tail -40
fi

if runs bwd; then
  timeout -k 20 "${BWD_TIMEOUT:-300}" python3 benchmarks/bench_bwd.py --graphs --impls flashqla,fla ${BWD_ARGS:-} --out "$OUT/benchmarks_bwd.md" 2>&1 \
    | tee "$OUT/bench_bwd.log" | grep -v "^\s*$" | tail -40
fi

if runs profile; then
  timeout -k 20 120 python3 benchmarks/profile_gdn.py step ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/profile_step.log" | grep -v "^\s*$" | head -120
  FLASHQLA_PREBUILT_KERNELS=$TILELANG_CACHE_DIR TILELANG_CACHE_DIR=/tmp/first_call_cache timeout -k 20 120 \
    python3 benchmarks/profile_gdn.py first-call --top 45 2>&1 | tee "$OUT/profile_first_call.log" | head -80
fi

if runs layer; then
  # the fused q/k L2 norm is opt-in until its GPU test passes (flashqla/ops/qk_norm.py): test it, then time
  # the layer with it off (against Megatron + FLA) and on (flashqla's layer alone)
  timeout -k 20 120 python3 -m pytest -q -rA tests/gpu/test_tilelang_layer_ops.py -k l2norm 2>&1 | tail -5
  for l2 in 0 1; do
    extra=(); [[ $l2 == 1 ]] && extra=(--no-fla)
    FLASHQLA_FUSED_L2NORM=$l2 NCCL_NVLS_ENABLE=0 timeout -k 20 300 python3 -m torch.distributed.run --standalone \
      --nproc-per-node 1 benchmarks/megatron_gdn_layer.py "${extra[@]}" ${LAYER_ARGS:-} 2>&1 \
      | tee "$OUT/megatron_layer_l2norm$l2.log" | grep -v "Warning\|warn" | tail -30
  done
fi

if runs walks; then
  timeout -k 20 120 python3 benchmarks/bench_walks.py 2>&1 | tee "$OUT/bench_walks.log" | grep -v "TileLang" | tail -12
fi

if runs ab; then
  # AB_ARGS unquoted on purpose: it is the argument list of `ab_kernel.py run`
  # shellcheck disable=SC2086
  timeout -k 20 "${AB_TIMEOUT:-400}" python3 scripts/ab_kernel.py run ${AB_ARGS:?AB_ARGS: KERNEL VARIANT BUILDER ARGS... [--configs ...]} \
    2>&1 | tee "$OUT/ab.log" | grep -v "TileLang" | tail -40
fi
