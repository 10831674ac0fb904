# Sourced by the GPU scripts (bench/gpu_run.sh and others): puts Ray Serve and the project on
# a GPU host that has Python 3.12 and torch but no Ray and no registry access. It unpacks
# .gpu/site.tar.xz, which `bash bench/gpu_bundle.sh` builds on a machine that reaches PyPI
# (copy .gpu/ to the GPU host with the checkout), into /tmp/site once per bundle, and puts
# it, the project and its generated stubs on PYTHONPATH and a `raystream` command on PATH.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site
[ -f .gpu/site.tar.xz ] || { echo "no .gpu/site.tar.xz: run bash bench/gpu_bundle.sh first"; exit 3; }
stamp=$(stat -c %s-%Y .gpu/*.tar.xz | tr '\n' ' ')  # unpack again when a bundle changes
[ "$(cat /tmp/site/.unpacked 2>/dev/null)" = "$stamp" ] || {
  rm -rf /tmp/site && mkdir -p /tmp/site \
    && for bundle in .gpu/*.tar.xz; do tar xJf "$bundle" -C /tmp/site; done \
    && echo "$stamp" > /tmp/site/.unpacked; }
export PYTHONPATH=/tmp/site:$PWD:$PWD/protos PATH=/tmp/site/bin:$PATH
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0
# The GPU host sets PYTHONDONTWRITEBYTECODE, so every process compiled torch's modules again:
# 4.8 s of the 9.5 s a replica spent loading the torch.export program. Bytecode is cached
# here instead (outside the host's packages), as a pip-installed venv has it from install.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pycache
mkdir -p /tmp/site/bin
printf '#!/bin/sh\nexec python3 -m clients.cli "$@"\n' > /tmp/site/bin/raystream
chmod +x /tmp/site/bin/raystream
