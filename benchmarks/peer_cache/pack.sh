#!/bin/bash
# pack.sh CACHE_DIR OUT.tar.xz : the TileLang kernel entries + fqla_manifest.json, without TileLang's nvcc
# output cache (cuda-binaries/, only used to skip nvcc when compiling again) and staging leftovers.
set -euo pipefail
cache=$1; out=$2
tar -C "$(dirname "$cache")" -cf - --exclude=cuda-binaries --exclude=.staging "$(basename "$cache")" | xz -9e -T0 > "$out"
ls -l "$out"
