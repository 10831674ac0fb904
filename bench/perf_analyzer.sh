#!/bin/sh
# Triton's perf_analyzer as `make perf-analyzer` installs it (.venv-perf-analyzer), with the
# libraries it links; every argument goes to perf_analyzer. Input data for raystream's model:
# bench/perf_analyzer_inputs.py. docs/benchmarking.md has the commands.
venv="$(cd "$(dirname "$0")/.." && pwd)/.venv-perf-analyzer"
LD_LIBRARY_PATH="$venv/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$venv/bin/perf_analyzer" "$@"
