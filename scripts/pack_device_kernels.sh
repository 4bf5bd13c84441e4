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
# The precompile runs on a hard-linked copy of the cache without flashqla's index (kernels/cache.py), so the index
# it writes holds only the records of the kernels as they are now: the cache's own index keeps every record
# written since it was made (each kernel source change adds a set: 1,500 records, 28 MB, by the sixty-fourth
# session), and a record of other sources never matches a lookup.
scratch=$(mktemp -d)
trap 'rm -rf "$work" "$scratch"' EXIT
mkdir -p "$TILELANG_CACHE_DIR"
cp -al "$TILELANG_CACHE_DIR/." "$scratch/"
rm -rf "$scratch"/*/*/flashqla-index
# precompile prints one "<kernel>\t<compiled|cached>\t<time>\t<entry>" line per kernel on stdout
TILELANG_CACHE_DIR=$scratch $python -m flashqla precompile --dtypes "${DTYPES:-bf16,fp16}" --no-progress 2>/dev/null |
  cut -f4 | while read -r entry; do
  relative=${entry#"$scratch"/}
  mkdir -p "$work/$(dirname "$relative")"
  cp -r "$entry" "$work/$relative"
done
for index in "$scratch"/*/*/flashqla-index; do
  relative=${index#"$scratch"/}
  mkdir -p "$work/$relative" && cp "$index"/*.json.gz "$work/$relative/"
done
cp -an "$scratch/." "$TILELANG_CACHE_DIR/"  # what this run compiled, and its index records, kept for the next
mkdir -p "$out"
tar cf - -C "$work" . | xz -T2 -6 > "$out/kernels.tar.xz"
echo "$(find "$work" -mindepth 4 -maxdepth 4 -type d | wc -l) kernels -> $out/kernels.tar.xz ($(du -h "$out/kernels.tar.xz" | cut -f1))"
