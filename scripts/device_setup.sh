# Sourced by the device scripts (device_kernels.sh, device_cp.sh) from the repo root on the device machine:
# unpacks what the call carried and installs flashqla, then exports PYTHONPATH, TILELANG_CACHE_DIR (and
# TRITON_CACHE_DIR when FLA's Triton cache came along). Returns 1 when the site or the install fails.
#   .devsite/site.tar.xz         tilelang, fla-core, flash-qla, megatron-core, deepspeed (../shared/device/)
#   .devkernels/kernels.tar.xz   flashqla's kernels built on the CPU machine (scripts/pack_device_kernels.sh);
#                                without it a carried .tilelang_cache is used
#   .devpeer/*_cache.tar.xz      the peers' TileLang kernels (benchmarks/peer_cache/: FlashQLA 0.1.3's
#                                fqla_cache, FLA 0.6.0's fla_cache), merged into the same cache
#   .devpeer/fla_triton.tar.xz   FLA 0.6.0's Triton kernels (benchmarks/peer_cache/fla_triton_precompile.py),
#                                unpacked where they were built: their group files hold absolute paths
#   .devvar/cache.tar.xz         kernel variants built with `ab_kernel.py compile ... --cache DIR` and packed
#                                (tar cJf over DIR: its top folder is dropped), or .devvar/cache/ unpacked, merged
#                                into the same cache for `ab_kernel.py run`
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/s
tar xJf .devsite/site.tar.xz -C /tmp/s || return 1
export PYTHONPATH=/tmp/s/site:$PWD PYTHONUNBUFFERED=1
if [[ -f .devkernels/kernels.tar.xz ]]; then
  mkdir -p /tmp/tlc && tar xJf .devkernels/kernels.tar.xz -C /tmp/tlc || return 1
  export TILELANG_CACHE_DIR=/tmp/tlc FLASHQLA_TEST_PREBUILT=${FLASHQLA_TEST_PREBUILT:-/tmp/tlc}
else
  export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-$PWD/.tilelang_cache}
fi
for peer in .devpeer/*_cache.tar.xz; do
  [[ -f $peer ]] || continue
  name=$(basename "$peer" .tar.xz)
  tar xJf "$peer" -C /tmp && cp -r "/tmp/$name/." "$TILELANG_CACHE_DIR"/
done
if [[ -f .devvar/cache.tar.xz ]]; then
  tar xJf .devvar/cache.tar.xz -C "$TILELANG_CACHE_DIR" --strip-components=1 || return 1
elif [[ -d .devvar/cache ]]; then
  cp -r .devvar/cache/. "$TILELANG_CACHE_DIR"/
fi
if [[ -f .devpeer/fla_triton.tar.xz ]]; then
  tar xJf .devpeer/fla_triton.tar.xz -C /tmp && export TRITON_CACHE_DIR=/tmp/fla_triton_cache
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; return 1; }
export FLASHQLA_DEVICE_SETUP=done  # a script sourced by another that did the setup skips it
