#!/bin/bash
# pack.sh CACHE_DIR OUT.tar.xz [TOP] : the TileLang kernel entries + the manifest (fqla_manifest.json /
# fla_manifest.json), without TileLang's nvcc output cache (cuda-binaries/, only used to skip nvcc when
# compiling again) and staging leftovers.
# The top folder in the tarball is TOP, default fqla_cache/ (scripts/device_*.sh unpack it as /tmp/fqla_cache);
# FLA's cache is packed with TOP=fla_cache.
set -euo pipefail
cache=$1; out=$2; top=${3:-fqla_cache}
base=$(basename "$cache")
tar -C "$(dirname "$cache")" -cf - --exclude=cuda-binaries --exclude=.staging \
    --transform="s,^$base/,$top/,;s,^$base\$,$top," "$base" | xz -9e -T0 > "$out"
ls -l "$out"
