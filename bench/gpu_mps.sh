#!/usr/bin/env bash
# Kept: MPS by hand for README.md, deploy/, docs/operations.md (run.py has `mps: true`).
# Run a command with CUDA MPS, so kernels from several processes share the GPU instead of
# being time-sliced one process at a time:
#   bash bench/gpu_mps.sh raystream serve --config bench/configs/serve_config.gpu-direct.yaml
# The daemon is this command's own (its pipe and log folders under /tmp), started as the
# current user; it changes no GPU setting (compute mode stays as found) and is stopped on exit.
set -u
command -v nvidia-cuda-mps-control > /dev/null || { echo "no nvidia-cuda-mps-control here"; exit 3; }
export CUDA_MPS_PIPE_DIRECTORY=/tmp/raystream-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/raystream-mps/log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d || { echo "MPS daemon did not start"; exit 3; }
trap 'echo quit | nvidia-cuda-mps-control; sleep 1; tail -5 "$CUDA_MPS_LOG_DIRECTORY/control.log"' EXIT
"$@"
