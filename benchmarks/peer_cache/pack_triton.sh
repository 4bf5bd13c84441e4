#!/bin/bash
# pack_triton.sh CACHE_DIR OUT.tar.xz : a Triton disk cache made by fla_triton_precompile.py, binaries only.
# Kept: each entry's cubin, its metadata json and group file (__grp__*.json), and fla_triton_manifest.json.
# Left out: the IRs (.source/.ttir/.ttgir/.llir/.ptx; Triton's cache lookup skips a group's missing children,
# triton/runtime/cache.py FileCacheManager.get_group, and launching needs only the cubin and the metadata) and any
# autotune results (*.autotune.json: they would carry dummy timings). The top folder keeps CACHE_DIR's name: the
# group files hold absolute paths, so unpack it where it was built (/tmp/fla_triton_cache) or let
# fla_triton_check_gpu.py --relocate-only rewrite them.
set -euo pipefail
cache=$1; out=$2
tar -C "$(dirname "$cache")" -cf - --exclude='*.source' --exclude='*.ttir' --exclude='*.ttgir' \
    --exclude='*.llir' --exclude='*.ptx' --exclude='*.autotune.json' --exclude='*.tmp.pid_*' \
    "$(basename "$cache")" | xz -9e -T0 > "$out"
ls -l "$out"
