#!/bin/bash
# pack.sh CACHE_DIR OUT.tar.xz : the TileLang kernel entries + fqla_manifest.json, without TileLang's nvcc
# output cache (cuda-binaries/, only used to skip nvcc when compiling again) and staging leftovers.
# The top folder in the tarball is always fqla_cache/ (scripts/device_*.sh unpack it as /tmp/fqla_cache).
set -euo pipefail
cache=$1; out=$2
base=$(basename "$cache")
tar -C "$(dirname "$cache")" -cf - --exclude=cuda-binaries --exclude=.staging \
    --transform="s,^$base/,fqla_cache/,;s,^$base\$,fqla_cache," "$base" | xz -9e -T0 > "$out"
ls -l "$out"
