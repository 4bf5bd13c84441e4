#!/usr/bin/env bash
# The GPU runs of the framework issues in one device call per machine kind; logs, summaries, loss curves
# and loss comparisons go to $OUT. Carry .devsite and .devsite_extras (scripts/pack_device_extras.sh);
# kernels JIT-compile on the device (the carry limit leaves no room for .tilelang_cache as well).
#
#   scripts/device_training.sh one   # nvidia-h200: `small` with Megatron --impl fla vs flashqla (tokens/s,
#                                    # MFU, loss curves) and DeepSpeed flashqla vs transformers' GDN (FLA)
#   scripts/device_training.sh two   # nvidia-h200-x2: `small` Megatron TP=2 vs one GPU, DeepSpeed SP=2 vs
#                                    # SP=1 (bf16 loss parity); long256k on DeepSpeed (SP=2, ZeRO-3)
#   DRY=1 scripts/device_training.sh one|two   # the same commands on the CPU, tiny size, 3 steps
#   RUNS="ds_small_sp1 ds_small_sp2" scripts/device_training.sh two   # a subset of the runs
set -uo pipefail
what=${1:?usage: device_training.sh one|two}
OUT=${OUT:-/tmp/out}
PY=${PY:-python3}
mkdir -p "$OUT"
EX=examples/pretrain_qwen_next
export PYTHONUNBUFFERED=1 FLA_FLASH_QLA=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [[ -z ${DRY:-} ]]; then
  mkdir -p /tmp/s
  tar xJf .devsite/site.tar.xz -C /tmp/s && tar xJf .devsite_extras/extras.tar.xz -C /tmp/s || exit 1
  export PYTHONPATH=/tmp/s/site:$PWD/$EX:$PWD
  if [[ -f .devkernels/kernels.tar.xz ]]; then
    mkdir -p /tmp/tlc && tar xJf .devkernels/kernels.tar.xz -C /tmp/tlc && export TILELANG_CACHE_DIR=/tmp/tlc
  fi
  $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
  nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv >"$OUT/gpu.txt"
  small=(--size small) long=(--size long256k) steps=120 short=${DS_STEPS:-20} smoke=${LONG_STEPS:-6} ds_gpu=$EX/ds_config_gpu.json
else  # CPU rehearsal of the same command lines
  small=(--size tiny --seq-len 128) long=(--size tiny --seq-len 256) steps=3 short=3 smoke=2 ds_gpu=$EX/ds_config.json
fi

run() {  # run NAME TIMEOUT_S COMMAND...: logs to $OUT/NAME.log, copies the run's summary, losses and curve
  local name=$1 limit=$2; shift 2
  if [[ -n ${RUNS:-} && " $RUNS " != *" $name "* ]]; then return; fi  # RUNS="a b": only those runs
  local start=$SECONDS
  timeout -k 20 "$limit" "$@" --save-dir "runs/$name" --save-every 100000 >"$OUT/$name.log" 2>&1
  echo "$name: rc=$? in $((SECONDS - start)) s; $(grep -h "throughput:\|loss: first" "$OUT/$name.log" | tr '\n' ' ')"
  for f in summary.json losses.json loss_curve.png; do cp "runs/$name/$f" "$OUT/$name.$f" 2>/dev/null; done
}
torchrun1=($PY -m torch.distributed.run --standalone --nproc-per-node 1)
torchrun2=($PY -m torch.distributed.run --standalone --nproc-per-node 2)

case $what in
one)
  run mg_small_fla 320 "${torchrun1[@]}" $EX/train_megatron.py "${small[@]}" --steps $steps --impl fla
  run mg_small_flashqla 150 "${torchrun1[@]}" $EX/train_megatron.py "${small[@]}" --steps $steps --impl flashqla
  runs=(mg_small_fla mg_small_flashqla)
  if [[ -n ${DS_PAIR:-} ]]; then
    run ds_small_flashqla 120 "${torchrun1[@]}" $EX/train_deepspeed.py "${small[@]}" --steps $short --config $ds_gpu --impl flashqla
    run ds_small_fla 120 "${torchrun1[@]}" $EX/train_deepspeed.py "${small[@]}" --steps $short --config $ds_gpu --impl fla
    runs+=(ds_small_flashqla ds_small_fla)
  fi
  $PY scripts/compare_runs.py "$OUT" "${runs[@]}" | tee "$OUT/compare.txt"
  ;;
two)
  # Megatron CP > 1 needs Transformer Engine for the softmax-attention layers (its local attention refuses
  # CP) and the H200 image has no TE: Megatron runs TP here, the 256K-token rows run on DeepSpeed (Ulysses
  # for attention, flashqla state passing for GDN)
  run mg_small_tp2 110 "${torchrun2[@]}" $EX/train_megatron.py "${small[@]}" --steps $steps --impl flashqla --tp 2
  run ds_small_sp1 100 "${torchrun1[@]}" $EX/train_deepspeed.py "${small[@]}" --steps $short --config $ds_gpu --sp 1
  run ds_small_sp2 130 "${torchrun2[@]}" $EX/train_deepspeed.py "${small[@]}" --steps $short --config $ds_gpu --sp 2
  run ds_long256k 180 "${torchrun2[@]}" $EX/train_deepspeed.py "${long[@]}" --steps $smoke --sp 2 \
    --checkpoint-activations --config $EX/ds_config_long256k.json
  $PY scripts/compare_runs.py "$OUT" ds_small_sp1 ds_small_sp2 ds_long256k | tee "$OUT/compare.txt"
  ;;
*) echo "usage: device_training.sh one|two"; exit 2 ;;
esac
