#!/usr/bin/env bash
# Builds .gpu/nvimgcodec.tar.xz: nvImageCodec and nvJPEG (the `gpu` extra's wheels) for
# Python 3.12 x86_64, trimmed to what decoding JPEGs needs (the cp312 module, the nvJPEG
# extension, libnvjpeg), about 8 MB, so that it travels to the GPU machine beside the Ray
# bundle (../shared/gpu/make_ray_bundle.sh) under the 64 MiB upload limit. Needs a registry:
#   bash bench/make_nvimgcodec_bundle.sh
# bench/gpu_env.sh unpacks it into /tmp/site where it exists.
set -euo pipefail
out=${1:-.gpu}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$tmp/w" nvidia-nvimgcodec-cu13==0.9.0.20 \
  nvidia-nvjpeg==13.3.2.43
python3 -m pip install -q --no-deps --no-compile --target "$tmp/site" "$tmp"/w/*.whl
(cd "$tmp/site/nvidia/nvimgcodec" && rm -rf tools include \
  && find . -name 'nvimgcodec_impl.cpython-*.so' ! -name '*-312-*' -delete \
  && find extensions -name '*.so*' ! -name 'libnvjpeg_ext.so*' -delete)
mkdir -p "$out"
tar cJf "$out/nvimgcodec.tar.xz" -C "$tmp/site" .
du -sh "$out/nvimgcodec.tar.xz"
