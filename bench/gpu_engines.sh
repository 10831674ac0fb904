#!/usr/bin/env bash
# Kept: GPU tests + engine_bench.py, no server (no scenario can); docs/performance.md runs it.
# GPU run 1: export the default model with this machine's torch, run the engine tests (GPU
# parity included), then the engine benchmark. Writes logs and JSON under $OUT.
source bench/gpu_env.sh
nvidia-smi -L | tee "$OUT/gpu.txt"
python3 -c "import torch, ray, grpc; print('torch', torch.__version__, 'ray', ray.__version__, 'grpc', grpc.__version__)" | tee -a "$OUT/gpu.txt"
timeout 120 raystream export --repository models --if-missing 2>&1 | tail -3
timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/unit/test_engines.py tests/gpu/test_gpu_engines.py \
  tests/unit/test_buckets.py 2>&1 | tee "$OUT/gpu_tests.txt" | tail -15
timeout 420 python3 bench/engine_bench.py --repository models --json "$OUT/engine_bench.json" \
  2>&1 | grep -v Warning | tee "$OUT/engine_bench.txt"
