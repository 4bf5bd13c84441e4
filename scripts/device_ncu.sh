#!/usr/bin/env bash
# Nsight Compute on one launch of one kernel of a fwd+bwd (benchmarks/profile_gdn.py plain), on the device
# machine from the repo root with .devsite and .devkernels carried. Writes to $OUT: <name>_details.csv (every
# section of `--set full`), <name>_sass.csv.xz (the SASS with its warp-stall samples per instruction) and the
# report itself when it is small enough to come back.
#   KERNEL=chunk_bwd_local_kernel NAME=cbl bash scripts/device_ncu.sh --heads 16,32 --tokens 32768 --seqs 8 --intra-cp auto
# SKIP (launches of the kernel to pass over first, default 1: the first call's) and NCU_ARGS add to ncu's options.
# Read the SASS region by region (between CTA barriers) here: python3 scripts/ncu_regions.py <name>_sass.csv.xz --ctas N
set -uo pipefail
source scripts/device_setup.sh >/dev/null 2>&1 || { echo "device_setup failed"; exit 1; }
kernel=${KERNEL:?KERNEL=<kernel name regex>}
name=${NAME:-ncu}
# --clock-control none: the device notes ask that the clocks be left alone
ncu --clock-control none --set full --import-source no -k "regex:$kernel" -s "${SKIP:-1}" -c 1 ${NCU_ARGS:-} \
  -o "$OUT/$name" -f python3 benchmarks/profile_gdn.py plain "$@" 2>&1 | tail -20
ncu -i "$OUT/$name.ncu-rep" --page details --csv > "$OUT/${name}_details.csv"
ncu -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass | xz -6 > "$OUT/${name}_sass.csv.xz"
ls -la "$OUT"
