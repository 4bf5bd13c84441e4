#!/usr/bin/env bash
# One nvidia-h200-x2 call for the multi-GPU checks: the GPU tests on GPU 1, inter-card CP parity against one
# GPU (exact and warmup, contiguous and zigzag), Megatron's GDN layer with flashqla (vs Megatron's FLA layer,
# TP 2, CP 2 both modes), then bench_cp (flashqla exact / warmup, FlashQLA dual CP when .devpeer holds its
# prebuilt kernels, then FLA CP where time is left). Carry .devsite and .devkernels
# (scripts/pack_device_kernels.sh), optionally .devpeer (benchmarks/peer_cache/); logs go to $OUT. About 9 minutes.
# The parity checks and bench_cp run on every GPU of the machine (x2, or x4/x8 for issue #11: there bench_cp
# takes 1M tokens at Hv 16, 32, 64); Megatron's layer stays at TP 2 x CP 2.
#   BUDGET_S=560 scripts/device_cp.sh        # stop starting new steps after BUDGET_S seconds
set -uo pipefail
OUT=${OUT:-/tmp/out}; BUDGET_S=${BUDGET_S:-560}
[[ -f .devkernels/kernels.tar.xz ]] || { echo "carry .devkernels (scripts/pack_device_kernels.sh)"; exit 1; }
source scripts/device_setup.sh || exit 1
peer=.devpeer/fqla_cache.tar.xz
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 FLA_FLASH_QLA=0
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
say() { echo "== $* at $SECONDS s"; }
left() { echo $(( BUDGET_S - SECONDS > 20 ? BUDGET_S - SECONDS : 20 )); }
tr2=(python3 -m torch.distributed.run --standalone --nproc-per-node 2)
NGPU=${NGPU:-$(nvidia-smi -L | wc -l)}
trN=(python3 -m torch.distributed.run --standalone --nproc-per-node "$NGPU")
cp_shapes=(--tokens 262144,1048576 --heads 8,32)
fla_shape=(--tokens 262144 --heads 8)  # FLA's CP last, on one shape, where time is left
(( NGPU >= 4 )) && cp_shapes=(--tokens 1048576 --heads 16,32,64) fla_shape=(--tokens 1048576 --heads 16)

CUDA_VISIBLE_DEVICES=1 timeout -k 20 120 python3 -m pytest -q -x -rf tests/gpu --ignore=tests/gpu/test_first_call_latency.py \
  -k "not layer_ops" 2>&1 | tee "$OUT/tests.log" | tail -3
say "GPU tests"
# a g = 0 head (exact M path) against the float64 recurrence too: two bf16 runs differ by their own rounding twice
for args in "--tokens 262144 --heads 2,8 --reference-intra-cp off --float64" "--tokens 262144 --heads 2,8 --cp-warmup -10 --no-zero-head" \
            "--tokens 65536 --heads 2,4 --layout zigzag --reference-intra-cp off --float64"; do
  timeout -k 20 120 "${trN[@]}" benchmarks/cp_nccl_parity.py $args 2>&1 | grep "^rank\|Error" | tee -a "$OUT/cp_parity.log"
done
say "CP parity"
timeout -k 20 220 "${tr2[@]}" benchmarks/megatron_gdn_layer.py 2>&1 | grep -v "Warning\|warn" | tee "$OUT/megatron_layer.log" \
  | grep "flashqla\|output\|  d \|speed-up\|parity"
say "Megatron layer"
timeout -k 20 "$(left)" "${trN[@]}" benchmarks/bench_cp.py "${cp_shapes[@]}" --reps 5 \
  --impls "flashqla exact,flashqla warmup" --out "$OUT/bench_cp.md" 2>&1 | tee "$OUT/bench_cp.log" | grep "^|\|^- "
say "bench_cp flashqla"
if [[ -f $peer ]]; then
  timeout -k 20 "$(left)" "${trN[@]}" benchmarks/bench_cp.py "${cp_shapes[@]}" --reps 5 \
    --impls "FlashQLA dual CP" --out "$OUT/bench_cp_fqla.md" 2>&1 | tee "$OUT/bench_cp_fqla.log" | grep "^|\|^- "
  say "bench_cp FlashQLA"
fi
timeout -k 20 "$(left)" "${trN[@]}" benchmarks/bench_cp.py "${fla_shape[@]}" --reps 5 --impls "FLA CP" \
  --out "$OUT/bench_cp_fla.md" 2>&1 | tee "$OUT/bench_cp_fla.log" | grep "^|\|^- "
say "bench_cp FLA"
