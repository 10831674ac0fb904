#!/usr/bin/env bash
# The benchmark runner on a GPU host, in one command (the bundle from bench/gpu_bundle.sh in
# .gpu/, the model exported with this host's torch if missing):
#   bash bench/gpu_run.sh SCENARIO [bench/run.py options]
#   bash bench/gpu_run.sh gpu.yaml --only gpu-direct        (a scenario name or a path)
# Results go under $OUT/bench when OUT is set (else bench/results/), the table last.
source bench/gpu_env.sh
scenario=${1:?usage: bash bench/gpu_run.sh SCENARIO [bench/run.py options]}
shift
[ -f "$scenario" ] || scenario=bench/scenarios/$scenario
nvidia-smi -L 2> /dev/null
timeout 300 python3 -m clients.cli export --repository models --if-missing 2>&1 | tail -1
exec python3 bench/run.py "$scenario" "$@"
