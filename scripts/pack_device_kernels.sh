#!/usr/bin/env bash
# Builds .devkernels/kernels.tar.xz: the kernels dispatch can choose (DTYPES, default bf16,fp16), compiled
# here for sm_90a, as a TileLang cache tree of only those entries (about 0.4 MB per dtype compressed,
# against 16 MB for the whole .tilelang_cache with nvcc's intermediates), so a device call can carry it
# next to .devsite and .devsite_extras and spend its time running instead of compiling. The device scripts unpack it with
#   mkdir -p /tmp/tlc && tar xJf .devkernels/kernels.tar.xz -C /tmp/tlc && export TILELANG_CACHE_DIR=/tmp/tlc
set -euo pipefail
out=$(realpath -m "${1:-.devkernels}")
python=${PYTHON:-.venv/bin/python}
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-$PWD/.tilelang_cache}
work=$(mktemp -d)
# precompile prints one "<kernel>\t<compiled|cached>\t<time>\t<entry>" line per kernel on stdout
$python -m flashqla precompile --dtypes "${DTYPES:-bf16,fp16}" --no-progress 2>/dev/null | cut -f4 | while read -r entry; do
  relative=${entry#"$TILELANG_CACHE_DIR"/}
  mkdir -p "$work/$(dirname "$relative")"
  cp -r "$entry" "$work/$relative"
done
# flashqla's cache index (kernels/cache.py): the records that let a process load without building
for index in "$TILELANG_CACHE_DIR"/*/*/flashqla-index; do
  relative=${index#"$TILELANG_CACHE_DIR"/}
  mkdir -p "$work/$relative" && cp "$index"/*.json.gz "$work/$relative/"
done
mkdir -p "$out"
tar cf - -C "$work" . | xz -T2 -6 > "$out/kernels.tar.xz"
echo "$(find "$work" -mindepth 4 -maxdepth 4 -type d | wc -l) kernels -> $out/kernels.tar.xz ($(du -h "$out/kernels.tar.xz" | cut -f1))"
rm -rf "$work"
