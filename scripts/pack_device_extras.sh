#!/usr/bin/env bash
# Builds .devsite_extras/extras.tar.xz: what the framework runs need on the GPU machine beyond the shared site
# (../shared/device/site.tar.xz: tilelang, fla, flash-qla, megatron-core, deepspeed): transformers and
# its hub stack for the DeepSpeed example and the HF bridge, and DeepSpeed's msgpack / ninja / py-cpuinfo /
# einops. numpy, psutil, tqdm and pydantic are already there (the image, or the shared site). hf-xet is
# left out (downloads only; nothing is downloaded there). Unpack next to the shared site:
#   tar xJf .devsite/site.tar.xz -C /tmp/s && tar xJf .devsite_extras/extras.tar.xz -C /tmp/s
set -euo pipefail
out=$(realpath "${1:-.devsite_extras}")
work=$(mktemp -d)
plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
python3 -m pip download -q $plat -d "$work/whl" transformers==5.23.0 msgpack ninja py-cpuinfo einops 2>&1 \
  | { grep -v "is ignored" || true; } >&2
rm -f "$work"/whl/{numpy,pydantic,pydantic_core,annotated_types,typing_inspection,hf_xet}-*.whl
mkdir -p "$work/site"
for w in "$work"/whl/*.whl; do (cd "$work/site" && unzip -q -o "$w"); done
rm -rf "$work"/site/*.data
tar cf - -C "$work" site | xz -T2 -6 > "$out/extras.tar.xz"
ls -la "$out/extras.tar.xz"
rm -rf "$work"
