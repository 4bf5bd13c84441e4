#!/usr/bin/env bash
# The main job: tiny Qwen3-Next-style pretraining (GDN layers on flashqla + gated softmax attention,
# MoE) with DeepSpeed on the embedded corpus (the Python standard library's own source). Makes .venv,
# installs what it needs, trains on the GPU when one is present (else CPU), writes checkpoints and
# runs/pretrain_qwen_next/loss_curve.png. Extra arguments go to train_deepspeed.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh examples
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
.venv/bin/python examples/pretrain_qwen_next/train_deepspeed.py --size tiny --steps 200 \
    --save-dir runs/pretrain_qwen_next "$@"
